"""Adapters that put real serving engines under kvspec's conformance suite.

Each module wraps one engine's own data structure, one engine call per kvspec
operation and no validation the engine lacks, and declares the engine's
conventions (``kvspec.spec.conventions``) as read from its code:

* ``kvspec.adapters.vllm:factory`` -- vLLM's v1 ``BlockPool`` (tested: vLLM 0.33.0).
* ``kvspec.adapters.sglang:factory`` -- SGLang's ``RadixCache`` with a simulated
  allocator (tested: SGLang 0.5.23); ``sglang_page_size(n)`` for other page sizes.

The engines are imported lazily, when a factory is called: importing kvspec
never needs them.  Install them apart from kvspec's core install, with the
pinned lists next to this file (``requirements-vllm.txt``,
``requirements-sglang.txt``) and ``install-engines.sh``; the README gives the
commands.  ``kvspec engines kvspec.adapters.vllm:factory kvspec.adapters.sglang:factory``
runs the verdicts and writes ``docs/engines.md``.
"""

from __future__ import annotations

ADAPTERS: tuple[tuple[str, str, str], ...] = (
    # (engine, pinned version, module:factory)
    ("vLLM", "0.33.0", "kvspec.adapters.vllm:factory"),
    ("SGLang", "0.5.23", "kvspec.adapters.sglang:factory"),
)


def importable(module: str) -> bool:
    """Whether ``module`` (an engine) can be found, without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
