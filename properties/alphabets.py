"""Input alphabets biased towards near-collisions: rich extra keys and token ids at the edges of their range.

A hash encoding is only as good as the inputs it is shown.  Extra keys are
drawn from a recursive strategy (None, int, str, bytes and nested tuples of
them, ``spec.prefix_cache.check_extra_key``'s whole domain), and a key is
often followed by one of its ``near_misses``: the same fields reordered or
missing, a field of another type with the same text, adjacent fields run
together, a nesting level added or removed -- the pairs a careless encoding
(``str()`` of the fields, no length prefixes, no type tags) maps to the same
bytes.  Token ids reach the edges of the 16-, 32- and 64-bit ranges, and a
token's ``TOKEN_WRAPS`` are the offsets at which a too-narrow encoding wraps.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvspec.spec.prefix_cache import ExtraKey

ATOMS = st.one_of(
    st.none(),
    st.sampled_from([0, 1, 7, 10, -1, 2**64]),
    st.sampled_from(["", "1", "a", "a1", "10", "None"]),
    st.sampled_from([b"", b"1", b"a", b"a1"]),
)
RICH_KEYS = st.recursive(ATOMS, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6)
EDGE_TOKENS = st.sampled_from([2**15 - 1, 2**16 - 1, 2**16, 2**16 + 1, 2**31 - 1, 2**32, 2**32 + 2, 2**63 - 1])
TOKEN_WRAPS = (2**16, 2**32)  # a token id plus one of these is another token that a narrow encoding confuses


def text(atom: ExtraKey) -> str:
    """How ``str()``-minded code spells a field."""
    return atom.decode("latin-1") if isinstance(atom, bytes) else str(atom)


def retyped(atom: ExtraKey) -> list[ExtraKey]:
    """Values of other types with the same text as ``atom``."""
    spelled = text(atom)
    others: list[ExtraKey] = [spelled, spelled.encode("latin-1")]
    if spelled.lstrip("-").isdigit():
        others.append(int(spelled))
    if atom is None or atom in ("", b""):
        others += [None, "", ()]
    return others


def near_misses(key: ExtraKey) -> tuple[ExtraKey, ...]:
    """Keys unequal to ``key`` that an encoding without type tags and length prefixes confuses with it."""
    misses: list[ExtraKey] = [(key,)]
    if not isinstance(key, tuple):
        misses += retyped(key)
    else:
        misses += [
            key[::-1],
            tuple(part for inner in key for part in (inner if isinstance(inner, tuple) else (inner,))),
        ]
        for i, field in enumerate(key):
            misses.append(key[:i] + key[i + 1 :])
            if not isinstance(field, tuple):
                misses += [key[:i] + (other,) + key[i + 1 :] for other in retyped(field)]
            if i + 1 < len(key) and not isinstance(field, tuple) and not isinstance(key[i + 1], tuple):
                misses.append(key[:i] + (text(field) + text(key[i + 1]),) + key[i + 2 :])
    return tuple(
        dict.fromkeys(miss for miss in misses if miss != key)
    )  # None, int, str, bytes: never equal across types
