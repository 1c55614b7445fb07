"""Every broken paged KV cache of the zoo is caught by the logits machine, by the invariant named here."""

from __future__ import annotations

import pytest

from kvspec.properties.meta.teeth import assert_caught
from kvspec.properties.test_paged_attention import PagedAttentionMachine

ATTENTION_ZOO = {
    "kvspec.impl.broken.attention:cow_skips_kv_copy": "invariant_paged_equals_contiguous",
    "kvspec.impl.broken.attention:reads_stale_block_table": "invariant_paged_equals_contiguous",
    "kvspec.impl.broken.attention:softmax_without_rescale": "invariant_paged_equals_contiguous",
}
# Each is found within a few examples and shrunk (run_machine always shrinks) to a handful of steps: the
# machine's sequences sit in fixed slots, so deleting a step leaves the others' meaning alone.


@pytest.mark.parametrize(("factory", "invariant"), sorted(ATTENTION_ZOO.items()))
def test_broken_attention_is_caught(factory: str, invariant: str) -> None:
    assert_caught(PagedAttentionMachine, factory, invariant)
