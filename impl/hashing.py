"""Chained block hashes: stable across processes and runs, collision-resistant.

``hash_block(parent, tokens, extra_key)`` is BLAKE2b-128 over a canonical,
length-prefixed encoding of the parent hash, the block's token ids and the
extra key, so no two different inputs share an encoding.  Python's ``hash()``
is salted per process and only 64 bits wide: a cache shared between processes
(or a long-lived one) would silently merge prefixes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvspec.spec.prefix_cache import ExtraKey, check_extra_key

BlockHash = bytes
ROOT: BlockHash = hashlib.blake2b(b"kvspec prefix cache root", digest_size=16).digest()


def encode(value: ExtraKey) -> bytes:
    """A canonical, self-delimiting encoding of an extra key (or token ids)."""
    if value is None:
        return b"N"
    if isinstance(value, int):
        text = str(value).encode()
        return b"I" + len(text).to_bytes(2, "big") + text
    if isinstance(value, str):
        value = value.encode()
        return b"S" + len(value).to_bytes(8, "big") + value
    if isinstance(value, bytes):
        return b"B" + len(value).to_bytes(8, "big") + value
    if isinstance(value, tuple):
        return b"T" + len(value).to_bytes(8, "big") + b"".join(encode(part) for part in value)
    raise TypeError(f"cannot encode {value!r}: check_extra_key admits None, int, str, bytes and tuples of them")


VOCABULARY = 1 << 20  # token ids below this have their encoding kept: more than any model's vocabulary


class _TokenCodes(dict[int, bytes]):
    """``encode(token)`` by token id, kept for the ids a vocabulary holds: a block of plain ints then encodes
    as one join of lookups, where ``encode`` formats every token anew (~0.3 us a token)."""

    def __missing__(self, token: int) -> bytes:
        code = encode(token)
        if 0 <= token < VOCABULARY:
            self[token] = code
        return code


_TOKEN_CODES = _TokenCodes()
_INT = {int}
_NO_EXTRA_KEY = encode(None)  # most blocks have none: no need to check and encode it each time


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """``encode(tuple(tokens))``: a bool equals 0 or 1 as a key, so only a block of plain ints takes the codes."""
    if set(map(type, tokens)) <= _INT:
        return b"T" + len(tokens).to_bytes(8, "big") + b"".join(map(_TOKEN_CODES.__getitem__, tokens))
    return encode(tuple(tokens))


def hash_block(parent: BlockHash, tokens: Sequence[int], extra_key: ExtraKey = None) -> BlockHash:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(encode_tokens(tokens))
    digest.update(_NO_EXTRA_KEY if extra_key is None else encode(check_extra_key(extra_key)))
    return digest.digest()


def chain(tokens: Sequence[int], block_size: int, extra_key: ExtraKey = None) -> tuple[BlockHash, ...]:
    """The hash of every full block of ``tokens``, each chained on the one before."""
    hashes, parent = [], ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size], extra_key)
        hashes.append(parent)
    return tuple(hashes)
