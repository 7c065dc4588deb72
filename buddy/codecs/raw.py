"""``raw``: the identity codec. Every entry is stored raw (``E/32`` sectors), all-zero ones included."""

from __future__ import annotations

import torch

from .base import Analysis, Codec

__all__ = ["RawCodec"]


class _Whole(Analysis):
    def __init__(self, entries: torch.Tensor):
        n, entry_bytes = entries.shape
        self.sectors = torch.full((n,), entry_bytes // 32, dtype=torch.int32, device=entries.device)
        self.modes = torch.zeros_like(self.sectors)

    def streams(self, rows=None):
        raise AssertionError("raw codes no entry: every one is stored whole")


class RawCodec(Codec):
    """Stores entries unchanged; the worst case and the baseline for tests."""

    name = "raw"
    coded_modes = frozenset()
    zero_escape = False

    def analyse(self, entries: torch.Tensor, word_bytes: int) -> Analysis:
        return _Whole(entries)

    def decode(self, payload, sectors, modes, word_bytes):
        raise AssertionError("raw codes no entry: the format layer copies raw entries")
