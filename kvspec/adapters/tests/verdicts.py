"""What the engines' verdict tests read off a verdict."""

from __future__ import annotations

from kvspec.conformance import Verdict


def caller_contract_operations(verdict: Verdict) -> set[str]:
    return {v.operation for v in verdict.violations if v.tier == "caller contract"}


def held_safety_rules(verdict: Verdict, layer: str) -> set[str]:
    return {r.invariant for r in verdict.rules if r.tier == "safety" and r.layer == layer and r.verdict == "held"}
