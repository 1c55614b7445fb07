"""HF transformers' continuous batching (``kvspec.adapters.transformers``).

Skipped unless transformers (and torch) import.  Pins the adapter's numbering, the engine's fork
(full blocks shared, the partial one copied: the declared ``fork_partial_block="copy"``), its
prefix sharing (hashes after the forward, duplicates adopted), the sliding window's ring read
back through the allocator's own indices, and paged = contiguous on the real engine:
``generate_batch`` against plain ``generate`` on tiny random models built here (nothing
downloaded), full attention and a sliding window.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (kvspec/adapters/install-engines.sh)")
pytest.importorskip("transformers", reason="transformers is not installed (kvspec/adapters/install-engines.sh)")

from kvspec.adapters import transformers as hf  # noqa: E402
from kvspec.impl.block_pool import BlockPool  # noqa: E402
from kvspec.spec import block_manager, block_pool, sliding_window  # noqa: E402
from kvspec.spec.conventions import WindowConventions  # noqa: E402
from kvspec.spec.errors import InvalidOperation, OutOfBlocks  # noqa: E402


def test_block_zero_is_handed_out_first_and_trash_sectors_are_hidden() -> None:
    manager = hf.HfBlockManager(BlockPool(4, "lru"), 2)
    assert manager.cache.pool.free_sectors == [2, 3, 4, 5]  # sectors 0 and 1 are the trash
    plan = manager.add_sequence(0, [7, 8, 9])
    assert plan.slots == ((0, 0), (0, 1), (1, 0)) and manager.allocator.block_table["0"] == [5, 4]
    assert manager.snapshot().pool.free_queue == (2, 3)


def test_freed_blocks_are_handed_out_again_last_freed_first() -> None:
    """``unhashed_free_position="head"``: the table goes back in order, the sectors are a stack."""
    manager = hf.HfBlockManager(BlockPool(4, "lru"), 1)
    manager.add_sequence(0, [1, 2, 3])
    manager.free(0)
    assert manager.snapshot().pool.free_queue == (2, 1, 0, 3)


def test_fork_shares_the_full_blocks_and_copies_the_partial_one() -> None:
    manager = hf.HfBlockManager(BlockPool(6, "lru"), 3)
    manager.add_sequence(0, [1, 2, 3, 4, 5])
    manager.fork(0, 1)
    assert manager.block_table(0) == (0, 1) and manager.block_table(1) == (0, 2)
    assert manager.snapshot().pool.refcounts[:3] == (2, 1, 1)
    assert manager.append(1, [6]).copies == ()  # the copy was made at the fork
    assert manager.read(0) == (1, 2, 3, 4, 5) and manager.read(1) == (1, 2, 3, 4, 5, 6)
    assert not [rule for rule, args in block_manager.STATE.evaluations(manager.snapshot()) if rule(*args)]


def test_the_fork_is_the_model_of_its_declared_copy() -> None:
    """``fork_partial_block="copy"``: the model of HF's declared conventions forks into HF's own state."""
    manager = hf.HfBlockManager(BlockPool(6, "lru"), 3)
    model = block_manager.new_manager(block_pool.new_pool(6, "lru", hf.CONVENTIONS.pool), 3, hf.CONVENTIONS.manager)
    manager.add_sequence(0, [1, 2, 3, 4, 5])
    model, _ = block_manager.add_sequence(model, 0, [1, 2, 3, 4, 5])
    manager.fork(0, 1)
    assert manager.snapshot() == block_manager.abstract(block_manager.fork(model, 0, 1))


def test_a_fork_that_does_not_fit_is_out_of_blocks() -> None:
    manager = hf.HfBlockManager(BlockPool(2, "lru"), 2)
    manager.add_sequence(0, [1, 2, 3])
    with pytest.raises(OutOfBlocks):
        manager.fork(0, 1)
    assert manager.sequences() == (0,)


def test_prefix_blocks_are_hashed_after_the_forward_and_duplicates_adopted() -> None:
    cache = hf.HfPrefixCachingManager(BlockPool(8, "lru"), 2, commit="after_forward")
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    assert cache.snapshot().pool.cached == {}  # the forward has not been committed
    cache.add_sequence(1, [1, 2, 3, 4, 6])  # so it hits nothing
    cache.commit(0)
    assert cache.add_sequence(2, [1, 2, 3, 4, 7]).cached_tokens == 4
    table = cache.block_table(1)
    cache.commit(1)  # its two full blocks duplicate sequence 0's: adopted, its own freed
    assert cache.block_table(1)[:2] == cache.block_table(0)[:2] != table[:2]
    assert cache.read(1) == (1, 2, 3, 4, 6)


def test_prefix_sharing_takes_no_extra_key() -> None:
    cache = hf.HfPrefixCachingManager(BlockPool(4, "lru"), 2)
    with pytest.raises(InvalidOperation):
        cache.add_sequence(0, [1, 2, 3], extra_key="tenant")


def test_evict_forgets_every_cached_block() -> None:
    cache = hf.HfPrefixCachingManager(BlockPool(6, "lru"), 2)
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    cache.free(0)
    assert sorted(cache.evict(1)) == [0, 1] and cache.snapshot().pool.cached == {}


@pytest.mark.parametrize(("window", "block_size"), [(5, 2), (4, 2), (3, 4), (1, 1)])
def test_the_sliding_window_is_a_ring_read_back_through_the_allocators_indices(window: int, block_size: int) -> None:
    ring = hf.HfSlidingWindow(BlockPool(6, "lru"), block_size, window)
    ring.add_sequence(0, 3)
    for _ in range(4):
        ring.append(0, 2)
        length = ring.snapshot().lengths[0]
        assert len(ring.block_table(0)) == sliding_window.ring_blocks(length, block_size, window)
        assert ring.read(0) == tuple(range(max(0, length - window + 1), length))  # the next token's window
    assert sliding_window.invariant_window_blocks_exact(ring.snapshot(), WindowConventions(slid_out="ring")) is None


# -- paged = contiguous on the real engine ---------------------------------------------------


def tiny_model(window: int | None) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if window is None:
        return LlamaForCausalLM(LlamaConfig(**shape)).eval()
    return MistralForCausalLM(MistralConfig(sliding_window=window, **shape)).eval()


@pytest.mark.parametrize("window", [None, 6], ids=["full attention", "sliding window 6"])
def test_generate_batch_logits_equal_plain_generate(window: int | None) -> None:
    """Greedy tokens and the log-probability of each equal plain ``generate``'s, for prompts that share blocks."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = tiny_model(window)
    prompts = [[1, *range(10, 10 + n)] for n in (5, 9, 17)]
    prompts.append(prompts[2][:12] + [200, 201, 202, 203, 204])  # shares three blocks of 4 with the third
    new_tokens = 10
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=-1,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
            tokens = out.sequences[0, len(prompt) :].tolist()
            expected.append((tokens, [float(lp[t]) for lp, t in zip(logprobs, tokens, strict=True)]))
    batching = ContinuousBatchingConfig(
        page_size=4,
        num_blocks=64,
        max_batch_tokens=64,
        max_memory_percent=0.5,
        allow_block_sharing=True,
        use_cuda_graph=False,
        return_logprobs=True,
    )
    generation = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    results = model.generate_batch(inputs=prompts, generation_config=generation, continuous_batching_config=batching)
    outputs = [result for _, result in sorted(results.items(), key=lambda item: int(item[0].split("_")[-1]))]
    for (tokens, logprobs), output in zip(expected, outputs, strict=True):
        assert output.generated_tokens == tokens
        assert output.logprobs == pytest.approx(logprobs, abs=1e-4)
