"""What a component is, and what it may offer, is declared once: by its chapter's Protocols.

A kind's methods are its protocol's (``component_kind(name, Protocol, ...)``); each optional operation is a
typed constant declared in the chapter that introduces it (``optional_operation(name, Protocol, *methods,
kinds=...)``), its methods written in that chapter's protocol.  Rules, machines and offers name the constant:
a misspelt operation is a ``NameError`` and a mypy error, and an operation asked of a kind that cannot offer
it is refused where it is asked, never read as "not offered".
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

import kvspec.spec
from kvspec.properties import suite
from kvspec.properties.loading import REFERENCE, load_implementation
from kvspec.properties.test_block_pool import BlockPoolMachine
from kvspec.spec import batch_pool, kv_transfer
from kvspec.spec.components import KINDS, OPERATIONS, check_operation, methods_of
from kvspec.spec.invariants import REGISTRY


def spec_modules() -> None:
    """Import every chapter: each declares its kinds and optional operations on import."""
    for module_info in pkgutil.iter_modules(kvspec.spec.__path__):
        importlib.import_module(f"kvspec.spec.{module_info.name}")


@pytest.mark.parametrize("kind", sorted(KINDS), ids=str)
def test_a_kinds_methods_are_its_protocols_and_each_operations_are_written_in_a_protocol_extending_it(
    kind: str,
) -> None:
    spec_modules()
    declared = KINDS[kind]
    if declared.protocol is None:  # a bare function (the attention kernel)
        assert declared.methods == () and not declared.optional
        return
    optional = {method for operation in declared.optional.values() for method in operation.methods}
    assert set(declared.methods) == set(methods_of(declared.protocol)) - optional
    for operation in declared.optional.values():
        assert set(operation.methods) <= set(methods_of(operation.protocol))
        # written for this kind, or for every kind it extends (a manager's rollback is written for every manager)
        related = set(declared.protocol.__mro__) & set(operation.protocol.__mro__)
        assert related - {object} and operation.protocol.__doc__, f"{kind}.{operation}"


def test_every_operation_names_kinds_that_exist_and_every_rule_and_machine_asks_a_kind_that_may_offer_it() -> None:
    spec_modules()
    assert set(OPERATIONS) <= set(KINDS)
    for rule in REGISTRY.values():
        assert all(need.kinds for need in rule.needs)
    for declaration in suite.declarations():
        for kind, operations in declaration.machine.requires.items():
            for operation in operations:
                check_operation(kind, operation)


class AnotherKindsRequirement(BlockPoolMachine):
    requires: ClassVar = {"block_pool": frozenset({kv_transfer.KV_TRANSFER})}


def test_an_operation_asked_of_a_kind_that_cannot_offer_it_is_refused_never_read_as_not_offered() -> None:
    reference = load_implementation(REFERENCE)
    with pytest.raises(ValueError, match="block_pool cannot offer kv_transfer: an optional operation of scheduler"):
        AnotherKindsRequirement.bind(reference)
    machine = BlockPoolMachine.bind(reference)()
    assert machine.offers("block_pool", batch_pool.REGISTER_BLOCKS)
    with pytest.raises(ValueError, match="cannot offer kv_transfer"):
        machine.offers("block_pool", kv_transfer.KV_TRANSFER)


MISSPELT = """
from kvspec.properties.test_block_pool import BlockPoolMachine
from kvspec.spec import batch_pool


class Misspelt(BlockPoolMachine):
    def batched(self) -> bool:
        return self.offers("block_pool", batch_pool.REGISTER_BLOCK)
"""


MISBUILT = """
from kvspec.properties.test_block_pool import BlockPoolMachine


class Misbuilt(BlockPoolMachine):
    def build(self) -> None:
        self.implementation.block_pool(4)
"""


@pytest.mark.parametrize(
    ("source", "error"),
    [
        (MISSPELT, 'Module has no attribute "REGISTER_BLOCK"'),
        (MISBUILT, "Too few arguments"),  # a component built otherwise than its kind declares
    ],
    ids=["a misspelt operation", "a component built with the wrong arguments"],
)
def test_mypy_catches_a_misspelt_operation_and_a_misbuilt_component(tmp_path: Path, source: str, error: str) -> None:
    pytest.importorskip("mypy")
    path = tmp_path / "machine.py"
    path.write_text(source)
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", str(path)],
        capture_output=True,
        text=True,
        cwd=Path(kvspec.__file__).parents[1],  # the repository: mypy follows no import hook of an editable install
    )
    assert checked.returncode == 1, checked.stdout
    assert error in checked.stdout, checked.stdout
