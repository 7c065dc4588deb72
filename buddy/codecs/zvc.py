"""``zvc``: zero-value compression (cDMA, Rhu et al., HPCA 2018).

Payload of one entry of ``W = E / w`` words of ``w`` bytes (``w`` from
:func:`buddy.spec.word_bytes`)::

    bytes [0, B)       bitmap, B = ceil(W / 8); bit j of byte b (LSB first)
                       is set iff word 8*b + j is non-zero
    bytes [B, P)       zero padding, P = B rounded up to a multiple of w, so
                       the words below are w-aligned
    bytes [P, P+n*w)   the n non-zero words, in order
    rest               zero up to the sector boundary

``k = ceil((P + n*w) / 32)``, except ``k = 0`` for an all-zero entry and
``k = E/32`` (raw escape) when that would not be smaller than the entry.
"""

from __future__ import annotations

import torch

from ..errors import CorruptDataError
from .base import Codec, Encoded

__all__ = ["ZVCCodec", "bitmap_geometry"]

_WORD_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitmap_geometry(entry_bytes: int, word_bytes: int) -> tuple[int, int, int]:
    """``(words per entry W, bitmap bytes B, padded bitmap bytes P)``."""
    if word_bytes not in _WORD_DTYPE:
        raise ValueError(f"zvc word size must be 1, 2, 4 or 8 bytes, got {word_bytes}")
    words = entry_bytes // word_bytes
    bitmap = -(-words // 8)
    padded = -(-bitmap // word_bytes) * word_bytes
    return words, bitmap, padded


def _sectors(nnz: torch.Tensor, entry_bytes: int, word_bytes: int) -> torch.Tensor:
    _, _, padded = bitmap_geometry(entry_bytes, word_bytes)
    raw = entry_bytes // 32
    k = torch.clamp((padded + nnz * word_bytes + 31) // 32, max=raw)
    return torch.where(nnz == 0, torch.zeros_like(k), k)


def _pack_bits(mask: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``(n, W)`` bool -> ``(n, nbytes)`` uint8, LSB first."""
    n, w = mask.shape
    if w < nbytes * 8:
        mask = torch.nn.functional.pad(mask, (0, nbytes * 8 - w))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (mask.view(n, nbytes, 8).to(torch.uint8) << shifts).sum(-1, dtype=torch.uint8)


def _unpack_bits(bitmap: torch.Tensor, words: int) -> torch.Tensor:
    """Inverse of :func:`_pack_bits`."""
    n = bitmap.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    bits = (bitmap.unsqueeze(-1) >> shifts) & 1
    return bits.view(n, -1)[:, :words].bool()


class ZVCCodec(Codec):
    """Bitmap of non-zero words followed by the non-zero words."""

    name = "zvc"

    def sizes(self, entries: torch.Tensor, word_bytes: int) -> torch.Tensor:
        nnz = (entries.view(_WORD_DTYPE[word_bytes]) != 0).sum(1, dtype=torch.int32)
        return _sectors(nnz, entries.shape[1], word_bytes)

    def encode(self, entries: torch.Tensor, word_bytes: int) -> Encoded:
        n, entry_bytes = entries.shape
        n_words, n_bitmap, padded = bitmap_geometry(entry_bytes, word_bytes)
        words = entries.view(_WORD_DTYPE[word_bytes])
        nz = words != 0
        # Stable partition of each entry's words: non-zero words first (in
        # order), zero words after them. It is a permutation, so one scatter
        # places every word and the tail of the payload comes out zero.
        before = torch.cumsum(nz, 1, dtype=torch.int32)
        nnz = before[:, -1:] if n_words else before
        position = torch.arange(1, n_words + 1, dtype=torch.int32, device=entries.device)
        dest = torch.where(nz, before - 1, nnz + (position - before) - 1)
        packed = torch.empty_like(words).scatter_(1, dest.long(), words)

        payload = torch.zeros(n, padded + entry_bytes, dtype=torch.uint8, device=entries.device)
        payload[:, :n_bitmap] = _pack_bits(nz, n_bitmap)
        payload[:, padded:] = packed.view(torch.uint8)
        payload = payload[:, :entry_bytes]

        sectors = _sectors(nnz.view(-1), entry_bytes, word_bytes)
        raw = (sectors == entry_bytes // 32).unsqueeze(1)
        payload = torch.where(raw, entries, payload)
        return Encoded(payload, sectors, torch.zeros_like(sectors))

    def decode(self, payload, sectors, modes, word_bytes):
        self.check_modes(modes)
        n, entry_bytes = payload.shape
        n_words, n_bitmap, padded = bitmap_geometry(entry_bytes, word_bytes)
        nz = _unpack_bits(payload[:, :n_bitmap], n_words)
        before = torch.cumsum(nz, 1, dtype=torch.int32)
        nnz = before[:, -1] if n_words else before.view(-1)
        raw = sectors == entry_bytes // 32
        coded = (sectors > 0) & ~raw
        # A coded entry's bitmap must agree with its k: catches damaged
        # metadata or slots before any word is read from the wrong place.
        if bool((coded & (_sectors(nnz, entry_bytes, word_bytes) != sectors)).any()):
            raise CorruptDataError("zvc: bitmap population does not match the entry sizes in the metadata")

        body = torch.nn.functional.pad(payload[:, padded:], (0, padded))
        packed = body.contiguous().view(_WORD_DTYPE[word_bytes])
        words = packed.gather(1, (before - 1).clamp_(min=0).long())
        words = torch.where(nz & coded.unsqueeze(1), words, torch.zeros_like(words))
        return torch.where(raw.unsqueeze(1), payload, words.view(torch.uint8))
