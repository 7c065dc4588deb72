"""``raw``: the identity codec. Every entry is stored raw (``E/32`` sectors)."""

from __future__ import annotations

import torch

from ..errors import CorruptDataError
from .base import Codec, Encoded

__all__ = ["RawCodec"]


class RawCodec(Codec):
    """Stores entries unchanged; the worst case and the baseline for tests."""

    name = "raw"

    def sizes(self, entries: torch.Tensor, word_bytes: int) -> torch.Tensor:
        return torch.full((entries.shape[0],), self.raw_sectors(entries), dtype=torch.int32, device=entries.device)

    def encode(self, entries: torch.Tensor, word_bytes: int) -> Encoded:
        zeros = torch.zeros(entries.shape[0], dtype=torch.int32, device=entries.device)
        return Encoded(entries, self.sizes(entries, word_bytes), zeros)

    def decode(self, payload, sectors, modes, word_bytes):
        self.check_modes(modes)
        if sectors.numel() and not bool((sectors == self.raw_sectors(payload)).all()):
            raise CorruptDataError("raw codec: every entry must be stored raw")
        return payload
