"""kvspec's specification: one module per concern, each readable on its own.

A chapter (a layer) opens in the module named after it -- its records, protocol, component kind, model and
rules -- and a concern it outgrows, or an optional operation a later section introduces, continues in a module
of its own that names the chapter it extends and declares its operations there (``batch_pool`` extends the
pool, ``preemption`` and ``admission`` the scheduler, ``kv_store_placement`` the store).

Read in this order:

* ``kvspec.spec.errors`` -- the typed errors and the "failed operations change nothing" rule.
* ``kvspec.spec.invariants`` -- how invariants are named and registered; the rules every layer shares.
* ``kvspec.spec.block_pool`` -- layer 1: physical blocks, reference counts, free queue, hash map, LRU/LFU.
* ``kvspec.spec.batch_pool`` -- layer 1: a request's prefix looked up, and its blocks registered, in one call each.
* ``kvspec.spec.block_manager`` -- layer 2: block tables, fork, copy-on-write, swap moves.
* ``kvspec.spec.speculative`` -- layers 2 and 3: speculative tokens rolled back, never written into a cached block.
* ``kvspec.spec.sliding_window`` -- layer 2, windows: slid-out entries hold nothing (or a ring reuses them).
* ``kvspec.spec.prefix_cache`` -- layer 3: chained block hashes and prefix-aware admission.
* ``kvspec.spec.radix_cache`` -- layer 3, second form: RadixAttention and its agreement with the hashes.
* ``kvspec.spec.radix_conventions`` -- layer 3, SGLang's choices (whole leaves, recency per node, handle locks).
* ``kvspec.spec.radix_pages`` -- layer 3, over pages: SGLang's page pool under a radix cache, a request's life.
* ``kvspec.spec.hierarchical_radix`` -- layer 3 over two tiers: SGLang's HiCache, device and host copies in flight.
* ``kvspec.spec.scheduler`` -- layer 4: requests, sequence groups, where they live (the location table), the
  spec's scheduler and its lifecycle, the rules over memory.
* ``kvspec.spec.preemption`` -- layer 4, the decode phase: grants, swap or recompute, deadlock bound.
* ``kvspec.spec.admission`` -- layer 4, the admission phase: cache hits, requests not ready, priorities.
* ``kvspec.spec.sample_groups`` -- layer 4: the samples of a group finish apart; a finished one holds nothing.
* ``kvspec.spec.kv_transfer`` -- layer 4: asynchronous KV loads and sends, whose blocks are held like any other.
* ``kvspec.spec.scheduler_v1`` (with ``scheduler_v1_model``) -- layer 4, vLLM v1's shape: a token budget,
  chunked prefill, recompute-only preemption.
* ``kvspec.spec.paged_attention`` -- layer 5: paged KV storage, blockwise attention, paged = contiguous logits.
* ``kvspec.spec.contiguous`` -- layer 6: contiguous allocators (reserve-max, reserve-exact, buddy), the fragmentation ledger.
* ``kvspec.spec.kv_store`` -- layer 7: the tiered KV store across nodes; node faults; Mooncake's pool (its
  state, model and policies in ``kv_store_state``, ``kv_store_model``, ``kv_store_policies``).
* ``kvspec.spec.kv_store_placement`` -- layer 7: replicated puts on distinct nodes, each tier's eviction order.
* ``kvspec.spec.tiered_swap`` -- layers 2 and 7: partial swap-in from a tier of larger blocks.
* ``kvspec.spec.components`` and ``kvspec.spec.implementation`` -- what an implementation under test
  declares: its components, the optional operations each offers, what its adapter emulates.
"""
