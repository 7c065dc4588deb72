"""Slot + overflow layout of encoded entries, in batched torch ops.

These functions turn per-entry payloads into the three buffers of the format
(metadata, slots, overflow; see :mod:`buddy.spec`) and back. They know nothing
about codecs or memory ownership, so tests can feed them buffers cut to
exactly the reported sizes.
"""

from __future__ import annotations

import torch

from . import spec
from .errors import CorruptDataError

__all__ = [
    "encode_meta",
    "decode_meta",
    "overflow_mask",
    "split_payload",
    "join_payload",
]


def encode_meta(sectors: torch.Tensor, modes: torch.Tensor, entry_bytes: int) -> torch.Tensor:
    """Metadata bytes (``uint8``, ``n * META_BYTES``) for per-entry ``k`` and mode."""
    mb, k_bits, _ = spec.meta_fields(entry_bytes)
    word = sectors.to(torch.int32) | (modes.to(torch.int32) << k_bits)
    if mb == 1:
        return word.to(torch.uint8)
    lo = (word & 0xFF).to(torch.uint8)
    hi = (word >> 8).to(torch.uint8)
    return torch.stack([lo, hi], dim=1).reshape(-1)


def decode_meta(meta: torch.Tensor, entry_bytes: int, n_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-entry ``(k, mode)`` as int32 tensors from metadata bytes.

    Raises :class:`CorruptDataError` when the buffer has the wrong size or a
    ``k`` exceeds the sectors of an entry.
    """
    mb, k_bits, _ = spec.meta_fields(entry_bytes)
    if meta.dtype != torch.uint8 or meta.numel() != n_entries * mb:
        raise CorruptDataError(
            f"metadata must be {n_entries * mb} uint8 bytes for {n_entries} entries, got {meta.numel()} of {meta.dtype}"
        )
    if mb == 1:
        word = meta.to(torch.int32)
    else:
        pairs = meta.view(n_entries, 2).to(torch.int32)
        word = pairs[:, 0] | (pairs[:, 1] << 8)
    k = word & ((1 << k_bits) - 1)
    mode = word >> k_bits
    if n_entries and int(k.max()) > spec.sectors_per_entry(entry_bytes):
        raise CorruptDataError(
            f"metadata claims more than {spec.sectors_per_entry(entry_bytes)} sectors "
            f"for an entry of {entry_bytes} bytes"
        )
    return k, mode


def overflow_mask(sectors: torch.Tensor, slot_sectors: int, entry_bytes: int) -> torch.Tensor:
    """``(n, E/32)`` bool: which payload sectors of each entry go to overflow."""
    spe = spec.sectors_per_entry(entry_bytes)
    idx = torch.arange(slot_sectors, spe, device=sectors.device, dtype=sectors.dtype)
    mask = torch.zeros(sectors.numel(), spe, dtype=torch.bool, device=sectors.device)
    mask[:, slot_sectors:] = idx.unsqueeze(0) < sectors.unsqueeze(1)
    return mask


def split_payload(
    payload: torch.Tensor, sectors: torch.Tensor, slot_sectors: int, entry_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut ``(n, E)`` payloads into slots ``(n, s*32)`` and compacted overflow ``(m, 32)``.

    Payload bytes past ``k * 32`` must already be zero (codecs guarantee it),
    so slot padding is zeros and the result is deterministic.
    """
    n = payload.shape[0]
    slots = payload[:, : slot_sectors * spec.SECTOR_BYTES]
    if slot_sectors == spec.sectors_per_entry(entry_bytes):
        return slots, payload.new_empty((0, spec.SECTOR_BYTES))
    as_sectors = payload.view(n, -1, spec.SECTOR_BYTES)
    return slots, as_sectors[overflow_mask(sectors, slot_sectors, entry_bytes)]


def join_payload(
    slots: torch.Tensor, overflow: torch.Tensor, sectors: torch.Tensor, slot_sectors: int, entry_bytes: int
) -> torch.Tensor:
    """Inverse of :func:`split_payload`: ``(n, E)`` payloads from slots and overflow.

    ``overflow`` must hold exactly ``sum(max(k - s, 0))`` sectors in entry
    order; otherwise :class:`CorruptDataError`.
    """
    n = sectors.numel()
    payload = torch.zeros(n, entry_bytes, dtype=torch.uint8, device=slots.device)
    payload[:, : slot_sectors * spec.SECTOR_BYTES] = slots.view(n, slot_sectors * spec.SECTOR_BYTES)
    if slot_sectors == spec.sectors_per_entry(entry_bytes):
        if overflow.numel():
            raise CorruptDataError("overflow given for a tensor stored with full slots")
        return payload
    mask = overflow_mask(sectors, slot_sectors, entry_bytes)
    expected = int(mask.sum())
    ov = overflow.reshape(-1)
    if ov.numel() != expected * spec.SECTOR_BYTES:
        raise CorruptDataError(
            f"overflow holds {ov.numel()} bytes but the metadata needs "
            f"{expected * spec.SECTOR_BYTES} ({expected} sectors)"
        )
    payload.view(n, -1, spec.SECTOR_BYTES)[mask] = ov.view(-1, spec.SECTOR_BYTES).to(payload.device)
    return payload
