"""kvspec's specification: one module per layer, each readable on its own.

Read in this order:

* ``spec.errors`` -- the typed errors and the "failed operations change nothing" rule.
* ``spec.invariants`` -- how invariants are named and registered; the rules every layer shares.
* ``spec.block_pool`` -- layer 1: physical blocks, reference counts, free queue, hash map, LRU/LFU.
* ``spec.block_manager`` -- layer 2: block tables, fork, copy-on-write, swap moves.
* ``spec.prefix_cache`` -- layer 3: chained block hashes and prefix-aware admission.
* ``spec.radix_cache`` -- layer 3, second form: RadixAttention and its agreement with the hashes.
* ``spec.scheduler`` -- layer 4: FCFS iteration-level scheduling, preemption, deadlock bound.
* ``spec.paged_attention`` -- layer 5: paged KV storage, blockwise attention, paged = contiguous logits.
* ``spec.implementation`` -- what an implementation under test provides.
"""
