"""``docs/engines.md``: each caller-contract finding comes with what it leads to, measured.

No engine is needed: a verdict is rendered from findings made by hand.
"""

from __future__ import annotations

from kvspec.adapters import sglang
from kvspec.conformance import Verdict, Violation


def unlock_finding() -> Violation:
    return Violation(
        invariant="invariant_out_of_contract_call_rejected",
        tier="caller contract",
        operation="unlock",
        detail="the spec rejects the call with InvalidOperation, the implementation answers ok",
        machines=("radix cache",),
        steps=("radix = radix_cache()", "radix.unlock([0])"),
        variant="cannot unlock (n): it holds no lock",
        leads_to="invariant_radix_locked_never_evicted breaks 2 calls later: evicted locked tokens [(0,)]",
        leads_to_steps=("radix = radix_cache()", "radix.unlock([0])", "radix.lock([0])", "radix.evict(1)"),
    )


def test_the_page_renders_each_finding_with_its_sequence_and_what_it_leads_to() -> None:
    finding = unlock_finding()
    verdict = Verdict("SGLang", "kvspec.adapters.sglang:factory", "ci", sglang.conventions(), (), (finding,), ())
    section = verdict.markdown()
    leads_to = f"what it leads to (measured): {finding.leads_to}"
    assert section.index(finding.heading) < section.index("radix.unlock([0])") < section.index(leads_to)
    assert section.index(leads_to) < section.index("radix.evict(1)")
    assert "lock by handle, page size 1, extra-key namespaces yes" in section
    assert leads_to in str(verdict) and "trusts caller: " + finding.heading in str(verdict)
