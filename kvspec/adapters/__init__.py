"""Adapters that put real serving engines under kvspec's conformance suite.

Each module wraps one engine's own data structure, one engine call per kvspec
operation and no validation the engine lacks, and declares the engine's
conventions (``kvspec.spec.conventions``) as read from its code; README's
"Real engines" table lists them with the versions they were tested against.

The engines are imported lazily, when a factory is called: importing kvspec
never needs them.  Install them apart from kvspec's core install, with the
pinned lists next to this file and ``install-engines.sh``; the README gives
the commands.  ``PUBLISHED`` is what ``docs/engines.md`` publishes, in its
order: ``kvspec engines`` without a MODULE:FACTORY writes every one of them.
"""

from __future__ import annotations

PUBLISHED: tuple[str, ...] = (  # one component per section where an adapter brings several (HF's: minutes each)
    "kvspec.adapters.vllm:factory",
    "kvspec.adapters.vllm_kv_cache_manager:full",
    "kvspec.adapters.vllm_kv_cache_manager:sliding",
    "kvspec.adapters.vllm_scheduler:factory",
    "kvspec.adapters.vllm_offload:factory",
    "kvspec.adapters.sglang:factory",
    "kvspec.adapters.sglang_pages:factory",
    "kvspec.adapters.sglang_pages:thin_factory",
    "kvspec.adapters.transformers:block_manager_factory",
    "kvspec.adapters.transformers:sliding_window_factory",
    "kvspec.adapters.lmcache:factory",
    "kvspec.adapters.mooncake:factory",
    "kvspec.adapters.lmdeploy:factory",
)


# Adapters checked but not published, and why: a verdict whose safety findings are not all true is withheld, never
# published as safety (the page names each one).
WITHHELD: dict[str, str] = {
    "kvspec.adapters.transformers:prefix_caching_factory": (
        "its verdict files three findings under safety that are not HF's to answer for: one is what kvspec's "
        "reference scheduler does on top of HF's allocator refusing a block its free count promised (that "
        "refusal is filed as a convention finding), one is the consequence of an out-of-contract token kvspec "
        "sent after its model had parted, and one is HF's block hash overflowing (an untyped error) on a token "
        "id of 2^32, beyond any vocabulary; until kvspec's scheduler absorbs a manager's refusal and its machines "
        "send nothing out of contract past a parting, this verdict is not published"
    ),
}

# Each safety finding published against an engine, and the script in docs/findings/ that shows its damage with the
# engine's own calls alone (the published page links it; a safety finding without one is not published as true).
REPRODUCED: dict[tuple[str, str], str] = {
    ("kvspec.adapters.lmcache:factory", "invariant_demotion_keeps_the_block"): "lmcache_disk_accounting.py",
}


def importable(module: str) -> bool:
    """Whether ``module`` (an engine) can be found, without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
