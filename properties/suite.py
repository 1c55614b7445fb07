"""The conformance suite: every machine, by layer, in the order a verdict lists them.

The suite is the ``ConformanceTest`` declarations of its test modules, in
``MODULES``' order and each module's own: the list pytest collects is the list
``kvspec.run_conformance`` walks, each declaration with its title and its
settings (``properties/meta/test_routes.py`` holds the two to it).  Under
pytest a module's name holds the class bound from its declaration, which
knows it (``declaration_of``).
"""

from __future__ import annotations

import functools
import importlib

from kvspec.properties.harness import LockstepMachine
from kvspec.properties.running import ConformanceTest, declaration_of

MODULES: tuple[str, ...] = tuple(
    f"kvspec.properties.{name}"
    for name in (
        "test_block_pool",
        "test_block_manager",
        "test_prefix_cache",
        "test_radix_cache",
        "test_sliding_window",
        "test_radix_pages",
        "test_paged_attention",
        "test_paged_attention_lifecycle",
        "test_scheduler",
        "test_scheduler_logits",
        "test_scheduler_v1",
        "test_contiguous",
        "test_kv_store",
        "test_tiered_swap",
        "test_hierarchical_radix",
    )
)


@functools.cache
def declarations() -> tuple[ConformanceTest, ...]:
    """Every machine of the suite, as its module declares it."""
    found: dict[int, ConformanceTest] = {}
    for name in MODULES:
        for value in vars(importlib.import_module(name)).values():
            declaration = declaration_of(value)
            if declaration is not None:
                found.setdefault(id(declaration), declaration)
    return tuple(found.values())


def declaration_titled(title: str) -> ConformanceTest:
    """The declaration of the machine titled ``title``."""
    for declaration in declarations():
        if declaration.title == title:
            return declaration
    raise KeyError(f"no machine titled {title!r}; the suite has {sorted(d.title for d in declarations())}")


def machine_titled(title: str) -> type[LockstepMachine]:
    """The machine titled ``title``."""
    return declaration_titled(title).machine
