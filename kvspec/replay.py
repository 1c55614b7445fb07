"""``kvspec replay TOKEN``: run again the one example a verdict printed for a finding.

A token is what ``kvspec check`` prints on a finding's ``replay:`` line:
URL-safe base64 of a JSON object naming the implementation, the machine, the
rules already known and the out-of-contract calls spared when it was found,
and the shrunk example as Hypothesis encodes it (``version:choices``), with a
checksum over all of it.  A token is checked before anything runs: damaged
(a character changed, cut short), naming a machine or a rule this kvspec does
not have, or printed under another Hypothesis, it is a ``UsageError`` in one
line.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import sys
from collections.abc import Sequence

import attrs
import hypothesis
from hypothesis.core import decode_failure
from hypothesis.errors import InvalidArgument

from kvspec.properties import findings, harness, profiles, running, suite
from kvspec.properties.loading import UsageError, exits_are_the_adapters, load_implementation
from kvspec.properties.running import ConformanceTest
from kvspec.spec.invariants import REGISTRY, Invariant

FIELDS = ("impl", "machine", "known", "spared", "blob")
COPY = "copy the whole token that follows 'kvspec replay' on a finding's replay line"


def checksum(payload: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@attrs.frozen
class ReplayContext:
    """How a machine was bound when it found something: what ``kvspec replay`` needs to run that example again."""

    machine: str
    known: frozenset[Invariant]
    spared: frozenset[harness.Variant]

    def token(self, path: str, blob: str) -> str:
        if not blob:
            return ""
        payload: dict[str, object] = {
            "impl": path,
            "machine": self.machine,
            "known": sorted(rule.name for rule in self.known),
            "spared": sorted(map(list, self.spared)),
            "blob": blob,
        }
        signed = {**payload, "check": checksum(payload)}
        return base64.urlsafe_b64encode(json.dumps(signed).encode()).decode()


@attrs.frozen
class ReplayToken:
    """What a replay token holds (``ReplayContext.token``), read back and checked."""

    impl: str
    machine: str
    known: tuple[str, ...]
    spared: frozenset[harness.Variant]
    blob: str


def read_token(token: str) -> ReplayToken:
    """The fields of a token ``kvspec check`` printed; ``UsageError`` saying what is wrong with a damaged one."""
    damaged = f"replay token: damaged, not one kvspec check printed ({COPY})"
    try:
        signed = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (ValueError, RecursionError):  # not base64, not JSON, not text
        raise UsageError(damaged) from None
    if not isinstance(signed, dict) or sorted(signed) != sorted((*FIELDS, "check")):
        raise UsageError(damaged)
    payload = {field: signed[field] for field in FIELDS}
    if signed["check"] != checksum(payload):
        raise UsageError(f"replay token: damaged: its checksum does not match what it holds ({COPY})")
    impl, machine, known, spared, blob = (payload[field] for field in FIELDS)
    pairs = isinstance(spared, list) and all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(text, str) for text in pair) for pair in spared
    )
    names = isinstance(known, list) and all(isinstance(name, str) for name in known)
    if not (isinstance(impl, str) and isinstance(machine, str) and isinstance(blob, str) and names and pairs):
        raise UsageError(damaged)
    version, colon, choices = blob.partition(":")
    if not colon:
        raise UsageError(damaged)
    if version != hypothesis.__version__:
        raise UsageError(
            f"replay token: printed under Hypothesis {version}, this is {hypothesis.__version__}: "
            "an example replays only under the Hypothesis that found it"
        )
    try:
        decode_failure(choices.encode())
    except InvalidArgument:
        raise UsageError(f"replay token: its example is damaged: it does not decode ({COPY})") from None
    variants = frozenset((operation, variant) for operation, variant in spared)
    return ReplayToken(impl, machine, tuple(known), variants, blob)


def replay(token: str, machines: Sequence[ConformanceTest] = ()) -> tuple[str, findings.Finding | None]:
    """Run the example a verdict printed (``Violation.replay``) again: the implementation it names, and its
    finding now (None: it no longer fails)."""
    read = read_token(token)
    everything = {d.title: d.machine for d in (*suite.declarations(), *machines)}
    machine = everything.get(read.machine)  # every machine imported: the registry is whole
    if machine is None:
        raise UsageError(f"replay token: no machine titled {read.machine!r} in this kvspec")
    unknown = [name for name in read.known if name not in REGISTRY]
    if unknown:
        raise UsageError(f"replay token: no invariant {unknown[0]!r} in this kvspec")
    rules = frozenset(REGISTRY[name] for name in read.known)
    path = read.impl
    with profiles.hypothesis_files_in_cache(), contextlib.redirect_stdout(sys.stderr):
        implementation = load_implementation(path)
        with exits_are_the_adapters(path, f"replaying an example of machine {read.machine!r}"):
            finding = running.replay(machine, implementation, read.blob, known=rules, spared=read.spared)
    return path, finding
