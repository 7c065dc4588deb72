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
from .base import Analysis, Codec

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
    """Sectors of an entry with ``nnz`` non-zero words (0 for none), before the raw clamp."""
    _, _, padded = bitmap_geometry(entry_bytes, word_bytes)
    k = ((padded + nnz * word_bytes + 31) // 32).to(torch.int32)
    return torch.where(nnz == 0, 0, k)


def _pack_bits(mask: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``(n, W)`` bool -> ``(n, nbytes)`` uint8, LSB first."""
    n, w = mask.shape
    if w < nbytes * 8:
        mask = torch.nn.functional.pad(mask, (0, nbytes * 8 - w))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (mask.reshape(n, nbytes, 8).view(torch.uint8) << shifts).sum(-1, dtype=torch.uint8)


def _unpack_bits(bitmap: torch.Tensor, words: int) -> torch.Tensor:
    """Inverse of :func:`_pack_bits`."""
    n = bitmap.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    bits = (bitmap.unsqueeze(-1) >> shifts) & 1
    return bits.view(n, -1)[:, :words].view(torch.bool)


class _Counted(Analysis):
    """zvc's analysis: the non-zero words of each entry; streams are written from the entries."""

    def __init__(self, entries: torch.Tensor, word_bytes: int):
        self.entries, self.word_bytes = entries, word_bytes
        nnz = (entries.view(_WORD_DTYPE[word_bytes]) != 0).sum(1, dtype=torch.int32)
        self.sectors = _sectors(nnz, entries.shape[1], word_bytes)
        self.modes = torch.zeros_like(self.sectors)

    def streams(self, rows=None):
        return _encode(self.entries if rows is None else self.entries.index_select(0, rows), self.word_bytes)


def _encode(entries: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """The zvc payloads of ``(n, E)`` entries (zero past the stream)."""
    n, entry_bytes = entries.shape
    n_words, n_bitmap, padded = bitmap_geometry(entry_bytes, word_bytes)
    words = entries.view(_WORD_DTYPE[word_bytes])
    nz = words != 0
    # Word j goes to position (non-zero words before and at j) - 1; zero words
    # all go to a spare column n_words that is cut off, so the packed words
    # land in order and everything after them stays zero.
    dest = torch.cumsum(nz, 1)
    dest.sub_(1).masked_fill_(~nz, n_words)
    payload = torch.zeros(n, padded + entry_bytes + word_bytes, dtype=torch.uint8, device=entries.device)
    payload[:, padded:].view(_WORD_DTYPE[word_bytes]).scatter_(1, dest, words)
    payload[:, :n_bitmap] = _pack_bits(nz, n_bitmap)
    return payload[:, :entry_bytes].contiguous()


class ZVCCodec(Codec):
    """Bitmap of non-zero words followed by the non-zero words."""

    name = "zvc"

    def analyse(self, entries: torch.Tensor, word_bytes: int) -> Analysis:
        return _Counted(entries, word_bytes)

    def encode(self, entries: torch.Tensor, word_bytes: int, modes: torch.Tensor) -> torch.Tensor:
        return _encode(entries, word_bytes)  # no sizing needed to write the stream

    def decode(self, payload, sectors, modes, word_bytes):
        n, entry_bytes = payload.shape
        n_words, n_bitmap, padded = bitmap_geometry(entry_bytes, word_bytes)
        nz = _unpack_bits(payload[:, :n_bitmap], n_words)
        source = torch.cumsum(nz, 1)
        nnz = source[:, -1].to(torch.int32)
        # A coded entry's bitmap must agree with its k: catches damaged
        # metadata or slots before any word is read from the wrong place.
        if bool((_sectors(nnz, entry_bytes, word_bytes) != sectors).any()):
            raise CorruptDataError("zvc: bitmap population does not match the entry sizes in the metadata")
        body = torch.nn.functional.pad(payload[:, padded:], (0, padded))
        words = body.view(_WORD_DTYPE[word_bytes]).gather(1, source.sub_(1).clamp_(min=0))
        words.masked_fill_(~nz, 0)
        return words.view(torch.uint8)
