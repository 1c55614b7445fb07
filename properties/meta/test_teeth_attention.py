"""Every broken paged KV cache of the zoo is caught by the logits machine, by the invariant named here."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings

from properties.meta.teeth import assert_caught
from properties.test_paged_attention import PagedAttentionMachine

ATTENTION_ZOO = {
    "impl.broken.attention:cow_skips_kv_copy": "invariant_paged_equals_contiguous",
    "impl.broken.attention:reads_stale_block_table": "invariant_paged_equals_contiguous",
    "impl.broken.attention:softmax_without_rescale": "invariant_paged_equals_contiguous",
}
# The verdict needs only the first failing run: shrinking and explaining replay the logits
# machine hundreds of times (about 20 s per broken cache), and the machine's own test shrinks.
VERDICT_ONLY = settings(phases=[Phase.explicit, Phase.reuse, Phase.generate])


@pytest.mark.parametrize(("factory", "invariant"), sorted(ATTENTION_ZOO.items()))
def test_broken_attention_is_caught(factory: str, invariant: str) -> None:
    assert_caught(PagedAttentionMachine, factory, invariant, VERDICT_ONLY)
