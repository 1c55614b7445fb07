"""``docs/engines.md``: each engine's findings come with what they mean in production.

No engine is needed: the adapters import their engines only when a factory is called.
"""

from __future__ import annotations

from kvspec.adapters import sglang, vllm
from kvspec.conformance import Verdict, Violation, in_production


def unlock_finding() -> Violation:
    return Violation(
        invariant="invariant_out_of_contract_call_rejected",
        tier="caller contract",
        operation="unlock",
        detail="the spec rejects the call with InvalidOperation, the implementation answers ok",
        machines=("radix cache",),
        steps=("radix = radix_cache()", "radix.unlock([0])"),
    )


def test_a_caller_contract_finding_takes_its_line_from_the_adapter() -> None:
    finding = in_production("kvspec.adapters.sglang:factory", unlock_finding())
    assert finding.in_production == sglang.IN_PRODUCTION["unlock"]
    assert in_production("kvspec.impl:reference", unlock_finding()).in_production == ""


def test_the_page_renders_each_finding_with_its_sequence_and_its_production_line() -> None:
    finding = in_production("kvspec.adapters.sglang:factory", unlock_finding())
    verdict = Verdict("SGLang", "kvspec.adapters.sglang:factory", "ci", sglang.conventions(), (), (finding,), ())
    section = verdict.markdown()
    line = f"in production: {sglang.IN_PRODUCTION['unlock']}"
    assert section.index(finding.heading) < section.index(line) < section.index("radix.unlock([0])")
    assert "lock by handle, page size 1, extra-key namespaces yes" in section
    assert f"in production: {sglang.IN_PRODUCTION['unlock']}" in str(verdict)


def test_every_adapter_says_what_each_operation_it_trusts_means_in_production() -> None:
    """The operations kvspec check finds each engine trusting its caller with (properties/test_adapters.py)."""
    assert set(vllm.IN_PRODUCTION) == {"allocate", "evict", "register", "release", "share"}
    assert set(sglang.IN_PRODUCTION) == {"evict", "insert", "unlock"}
