"""What a component is, and what it may offer, is declared once: by its chapter's Protocol.

A kind's methods are its protocol's (``component_kind(name, Protocol, ...)``); each optional operation's
methods are written in a protocol of the chapter that introduces it (``TransferringScheduler``,
``EngineChoicesStore``, ``SpeculativeBlockManager``, ...).  An optional operation is still named by a
string where it is used -- a rule's ``needs``, a machine's ``requires`` and ``offers`` -- and a name its
kind does not declare is refused where it is used, never read as "not offered".
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import ClassVar, Protocol

import pytest

import kvspec.spec
from kvspec.properties import suite
from kvspec.properties.loading import REFERENCE, load_implementation
from kvspec.properties.test_block_pool import BlockPoolMachine
from kvspec.spec.components import KINDS, check_operation, methods_of
from kvspec.spec.invariants import REGISTRY


def spec_protocols() -> list[type]:
    """Every protocol kvspec's chapters write."""
    found = []
    for module_info in pkgutil.iter_modules(kvspec.spec.__path__):
        module = importlib.import_module(f"kvspec.spec.{module_info.name}")
        found += [
            value
            for value in vars(module).values()
            if isinstance(value, type) and getattr(value, "_is_protocol", False) and value.__module__ == module.__name__
        ]
    return found


@pytest.mark.parametrize("kind", sorted(KINDS), ids=str)
def test_a_kinds_methods_are_its_protocols_and_each_optional_method_is_written_in_one(kind: str) -> None:
    declared = KINDS[kind]
    if declared.protocol is None:  # a bare function (the attention kernel)
        assert declared.methods == () and not declared.optional
        return
    optional = {method for needs in declared.optional.values() for method in needs}
    assert set(declared.methods) == set(methods_of(declared.protocol)) - optional
    # a protocol extending the kind's, or one it extends (a manager's rollback is written for every manager)
    bases = [base for base in declared.protocol.__mro__ if getattr(base, "_is_protocol", False)]
    extending = [p for p in spec_protocols() if any(base in p.__mro__ for base in bases if base is not Protocol)]
    unwritten = sorted(m for m in optional if not any(m in methods_of(p) for p in extending))
    assert not unwritten, f"{kind}: the optional methods {unwritten} are in no protocol of kvspec's spec"


def test_every_rule_and_every_machine_names_operations_their_kinds_declare() -> None:
    for rule in REGISTRY.values():
        for need in rule.needs:
            check_operation(*need.split(".", 1))
    for declaration in suite.declarations():
        for kind, operations in declaration.machine.requires.items():
            for operation in operations:
                check_operation(kind, operation)


class MisspeltRequirement(BlockPoolMachine):
    requires: ClassVar = {"block_pool": frozenset({"register_block"})}


def test_a_misspelt_operation_is_refused_where_it_is_used_never_read_as_not_offered() -> None:
    reference = load_implementation(REFERENCE)
    with pytest.raises(ValueError, match="block_pool declares no optional operation 'register_block'"):
        MisspeltRequirement.bind(reference)
    machine = BlockPoolMachine.bind(reference)()
    assert machine.offers("block_pool", "register_blocks")
    with pytest.raises(ValueError, match="no optional operation 'register_block'"):
        machine.offers("block_pool", "register_block")
