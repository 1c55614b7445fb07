"""``docs/engines.md``: readable, and judged under the rules kvspec has now.

No engine is needed: a verdict is rendered from findings made by hand, and the page is read as written.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from kvspec.adapters import PUBLISHED, REPRODUCED, WITHHELD, sglang
from kvspec.verdict import NOT_OFFERED, RuleVerdict, Verdict, Violation, registry_digest


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
    assert "lock_by=handle, page_size=1, extra_key_namespaces=yes" in section
    assert leads_to in str(verdict) and "trusts caller: " + finding.heading in str(verdict)


PAGE = Path(__file__).resolve().parents[2] / "docs" / "engines.md"


def test_the_findings_come_first_and_rules_no_machine_reached_take_one_line() -> None:
    unreached = tuple(RuleVerdict(f"invariant_unreached_{i}", "block_pool", "safety", NOT_OFFERED, 0) for i in range(5))
    verdict = Verdict("SGLang", "p:f", "ci", sglang.conventions(), unreached, (unlock_finding(),), ())
    section = verdict.markdown()
    assert section.index(unlock_finding().heading) < section.index("### safety")
    assert section.count("invariant_unreached_") == 5 and "Not offered (5): `invariant_unreached_0`, " in section
    assert "/site-packages/" not in section and "/work/" not in section


def test_every_section_of_the_page_was_judged_under_the_rules_kvspec_has_now() -> None:
    """A section written under an older registry (rules added, renamed or moved between tiers) is stale:
    regenerate the page (``kvspec engines``, README "Real engines")."""
    page = PAGE.read_text()
    sections = re.findall(r"^## (.+)$", page, flags=re.M)
    registries = dict(re.findall(r"^## (.+?)\n(?:.*\n)*?.*rule registry `([0-9a-f]+)`", page, flags=re.M))
    assert sections, f"{PAGE} lists no implementation"
    stale = [name for name in sections if registries.get(name) != registry_digest()]
    assert not stale, f"written under another rule registry than {registry_digest()}: {stale}"
    assert not re.search(r"/(?:work|home|root|tmp)/\S+", page), "the page names a path of the machine it ran on"


README = PAGE.parents[1] / "README.md"


def test_every_adapter_the_readme_lists_is_published_on_the_page() -> None:
    """README's table names each adapter (and in parentheses its other factories); the page has a section of each."""
    rows = re.findall(r"^\| `(kvspec\.adapters\.\w+):(\w+)`(?: \(([^)|]*)\))? \|", README.read_text(), flags=re.M)
    listed = {
        f"{module}:{factory}" for module, first, others in rows for factory in [first, *re.findall(r"`:(\w+)`", others)]
    }
    assert len(rows) >= 10, "README's table of adapters was not found"
    checked = set(PUBLISHED) | set(WITHHELD)
    assert listed == checked, f"README lists {sorted(listed ^ checked)} otherwise than PUBLISHED and WITHHELD"
    page = PAGE.read_text()
    judged = re.findall(r"^`([\w.]+:\w+)`, profile `", page, flags=re.M)
    assert judged == list(PUBLISHED), f"docs/engines.md has sections {judged}; kvspec engines writes {PUBLISHED}"
    assert all(f"* Withheld: `{path}` -- {why}." in page for path, why in WITHHELD.items())


def test_a_safety_finding_links_the_script_that_shows_it_with_the_engine_alone() -> None:
    (path, rule), script = next(iter(REPRODUCED.items()))
    finding = attrs.evolve(unlock_finding(), invariant=rule, tier="safety", operation="", variant="", leads_to="")
    shown = Verdict("LMCache", path, "ci", sglang.conventions(), (), (finding,), ()).markdown()
    assert f"reproduced with the engine alone: [`docs/findings/{script}`](findings/{script})" in shown
    unproven = Verdict("X", "some.adapter:factory", "ci", sglang.conventions(), (), (finding,), ()).markdown()
    assert "not reproduced without kvspec" in unproven and "reproduced with the engine alone" not in unproven


def test_every_safety_finding_on_the_page_is_reproduced_with_the_engine_alone() -> None:
    findings = re.split(r"^- \*\*\[", PAGE.read_text(), flags=re.M)[1:]
    for finding in (f for f in findings if f.startswith("safety]")):
        linked = re.search(r"reproduced with the engine alone: \[`docs/findings/([\w.]+)`\]", finding)
        assert linked, f"a safety finding on the page is not reproduced without kvspec: {finding[:300]}"
        assert (PAGE.parent / "findings" / linked.group(1)).exists(), linked.group(1)
