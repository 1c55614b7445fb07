"""A tiny decoder-only model in numpy (float64, seeded weights) with a ragged batched forward.

Embeddings plus sinusoidal positions, ``layers`` pre-norm blocks of grouped-
query attention and a SiLU MLP, a final norm and an unembedding.  ``forward``
takes a batch that mixes prefill chunks and single decode tokens of sequences
of any length; all it asks of the cache is ``length`` / ``write`` / ``read``
(``kvspec.spec.paged_attention.KVCache``), so the paged cache and the contiguous twin
run the very same arithmetic outside attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np

from kvspec.impl.attention import attend_ragged
from kvspec.spec.block_manager import SeqId
from kvspec.spec.errors import InvalidOperation
from kvspec.spec.paged_attention import KVCache, KVShape, SequenceStore

Batch = Sequence[tuple[SeqId, Sequence[int]]]


@attrs.frozen
class ModelConfig:
    vocab: int = 32
    d_model: int = 16
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    mlp: int = 32
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(num_layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim)


def _rms_norm(x: np.ndarray) -> np.ndarray:
    # np.mean's own arithmetic (a sum, then a division by the count) without its Python wrapper: a forward
    # of a few tokens spends more in the wrapper than in the sum
    return x / np.sqrt(np.add.reduce(x * x, axis=-1, keepdims=True) / x.shape[-1] + 1e-6)


def _frequencies(width: int) -> np.ndarray:
    return 1.0 / 10000.0 ** (np.arange(0, width, 2) / width)


def _positions(positions: np.ndarray, frequencies: np.ndarray) -> np.ndarray:
    angles = positions[:, None] * frequencies[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)


class TinyModel:
    """Seeded random weights; the same config gives the same logits on any cache."""

    def __init__(self, config: ModelConfig = ModelConfig()) -> None:  # noqa: B008 -- frozen, shared safely
        if config.d_model % config.heads or config.heads % config.kv_heads or config.head_dim % 2:
            raise InvalidOperation(f"heads must divide d_model and kv_heads divide heads: {config}")
        self.config = config
        rng = np.random.default_rng(config.seed)
        d, kv_width = config.d_model, config.kv_heads * config.head_dim

        def weight(rows: int, cols: int) -> np.ndarray:
            return rng.standard_normal((rows, cols)) / np.sqrt(rows)

        self.embedding = rng.standard_normal((config.vocab, d))
        self.layers = [
            {
                "q": weight(d, d),
                "k": weight(d, kv_width),
                "v": weight(d, kv_width),
                "o": weight(d, d),
                "up": weight(d, config.mlp),
                "down": weight(config.mlp, d),
            }
            for _ in range(config.layers)
        ]
        self.unembedding = weight(d, config.vocab)
        self.frequencies = _frequencies(d)  # of the sinusoidal positions, computed once

    def forward(self, cache: KVCache, batch: Batch) -> list[np.ndarray]:
        """Logits ``[len(tokens), vocab]`` for each ``(seq, tokens)``: the sequence's last positions.

        The tokens must already be in the cache (``add_sequence`` / ``append``); their K and V are
        written here, layer by layer, before attention reads them.
        """
        config = self.config
        sizes = [len(tokens) for _, tokens in batch]
        starts = [cache.length(seq) - size for (seq, _), size in zip(batch, sizes, strict=True)]
        if any(start < 0 for start in starts) or not all(sizes):
            raise InvalidOperation(
                f"batch {[(s, n) for (s, _), n in zip(batch, sizes, strict=True)]} is empty or longer than its cache"
            )
        tokens = np.concatenate([np.asarray(t, dtype=np.int64) for _, t in batch])
        if tokens.min() < 0 or tokens.max() >= config.vocab:
            raise InvalidOperation(f"token ids must lie in 0..{config.vocab - 1}")
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, sizes, strict=True)])
        bounds = np.cumsum([0] + sizes)
        x = self.embedding[tokens] + _positions(positions.astype(np.float64), self.frequencies)
        head_dim = config.head_dim
        for layer, weights in enumerate(self.layers):
            h = _rms_norm(x)
            queries = (h @ weights["q"]).reshape(len(h), config.heads, head_dim)
            keys = (h @ weights["k"]).reshape(len(h), config.kv_heads, head_dim)
            values = (h @ weights["v"]).reshape(len(h), config.kv_heads, head_dim)
            views = []
            for (seq, _), lo, hi in zip(batch, bounds[:-1], bounds[1:], strict=True):
                cache.write(seq, layer, keys[lo:hi], values[lo:hi])
                views.append(cache.read(seq, layer))
            attended = attend_ragged(
                views, [queries[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)], starts
            )
            x = x + np.concatenate(attended).reshape(len(h), config.d_model) @ weights["o"]
            up = _rms_norm(x) @ weights["up"]
            x = x + (up / (1.0 + np.exp(-up))) @ weights["down"]
        logits = _rms_norm(x) @ self.unembedding
        return [logits[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


class Cache(KVCache, SequenceStore, Protocol):
    """A cache the model can both fill and run on."""


def step(model: TinyModel, cache: Cache, batch: Batch) -> list[np.ndarray]:
    """Admit or extend each sequence of the batch, then run the forward on what is not cached yet.

    Not atomic across the batch: a caller that may run out of blocks admits entries one by one.
    """
    computed = []
    for seq, tokens in batch:
        if seq in cache.sequences():
            cache.append(seq, tokens)
            computed.append((seq, tokens))
        else:
            cached = cache.add_sequence(seq, tokens)
            computed.append((seq, tokens[cached:]))
    return model.forward(cache, computed)
