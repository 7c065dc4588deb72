"""The format layer: the rules every codec shares, written once (see :mod:`buddy.spec` for the format).

* **entries**: a tensor's bytes cut into rows of ``E`` bytes, the last one
  zero-padded (:func:`entry_rows`), processed in blocks of about
  :data:`BLOCK_BYTES` (:func:`blocks`) so temporaries stay small;
* **sizes**: an all-zero entry is ``k = 0`` (for codecs with
  :attr:`~buddy.codecs.Codec.zero_escape`), an entry that does not shrink
  is stored raw with ``k = E/32``, anything else takes the codec's size;
  the metadata mode follows (:func:`measure_entries`);
* **payloads** of the zero, raw and coded entries (:func:`encode_entries`)
  and back, with every mode and size checked before a codec reads a byte
  (:func:`decode_entries`);
* **metadata words** (:func:`encode_meta`, :func:`decode_meta`) and the
  **slot + overflow split** of payloads (:func:`split_payload`,
  :func:`join_payload`), also as device-side pieces that never read back to
  the host (:func:`overflow_starts`, :func:`scatter_overflow`,
  :func:`gather_overflow`: prefix sums, scatters and gathers, a block of
  entries at a time).

A codec (:class:`~buddy.codecs.Codec`) only codes the entries that are
neither zero nor raw. The torch reference engine (:mod:`buddy.engines`) is
these functions in a loop over blocks; the CUDA kernels implement the same
rules in ``csrc/buddy_entry.h``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import spec
from .errors import CorruptDataError

if TYPE_CHECKING:  # the codec registry imports the engines, which import this module
    from .codecs.base import Analysis, Codec

__all__ = [
    "BLOCK_BYTES",
    "blocks",
    "entry_rows",
    "nonzero_rows",
    "measure_entries",
    "encode_entries",
    "decode_entries",
    "encode",
    "check_modes",
    "encode_meta",
    "decode_meta",
    "overflow_mask",
    "split_payload",
    "join_payload",
    "overflow_starts",
    "scatter_overflow",
    "gather_overflow",
]

#: entries are processed in blocks of about this many bytes, so temporaries stay in cache
BLOCK_BYTES = 2 << 20

#: byte alignment of the entries handed to a codec (the widest word a codec views them as, with room)
_ALIGN = 16


def blocks(n_entries: int, entry_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges covering ``n_entries`` entries, about :data:`BLOCK_BYTES` each."""
    step = max(1, BLOCK_BYTES // entry_bytes)
    return [(a, min(a + step, n_entries)) for a in range(0, n_entries, step)]


def entry_rows(flat: torch.Tensor, start: int, stop: int, entry_bytes: int) -> torch.Tensor:
    """Entries ``[start, stop)`` of flat ``uint8`` bytes as a contiguous, aligned ``(n, E)``; pads the last one."""
    lo, hi = start * entry_bytes, stop * entry_bytes
    if hi <= flat.numel():
        rows = flat[lo:hi].view(stop - start, entry_bytes)
        # codecs view entries as wider words (up to 8 bytes), which needs a storage offset
        # aligned to them; a view such as x[1:] is not: copy the block then
        return rows if rows.storage_offset() % _ALIGN == 0 else rows.clone()
    padded = torch.zeros(hi - lo, dtype=torch.uint8, device=flat.device)
    padded[: flat.numel() - lo] = flat[lo:]
    return padded.view(stop - start, entry_bytes)


def nonzero_rows(entries: torch.Tensor) -> torch.Tensor:
    """``(n,)`` bool: which entries hold a non-zero byte."""
    return (entries.view(torch.int64) != 0).any(1)


def measure_entries(
    codec: Codec, entries: torch.Tensor, word_bytes: int
) -> tuple[torch.Tensor, torch.Tensor, Analysis]:
    """``(k, modes, analysis)`` of contiguous entries: sizes in sectors and metadata modes (int32), format rules applied."""
    raw = entries.shape[1] // spec.SECTOR_BYTES
    analysis = codec.analyse(entries, word_bytes)
    k = torch.clamp(analysis.sectors, max=raw).to(torch.int32)
    if codec.zero_escape:
        k = torch.where(nonzero_rows(entries), k, 0)
    modes = torch.where(k == 0, codec.zero_mode, torch.where(k == raw, codec.raw_mode, analysis.modes))
    return k, modes.to(torch.int32), analysis


def _rows(mask: torch.Tensor) -> torch.Tensor | None:
    """Indices of a row mask, ``None`` when every row is set (no gather needed)."""
    return None if bool(mask.all()) else mask.nonzero().view(-1)


def encode_entries(
    codec: Codec,
    entries: torch.Tensor,
    word_bytes: int,
    k: torch.Tensor,
    modes: torch.Tensor,
    analysis: Analysis | None = None,
) -> torch.Tensor:
    """Payloads ``(n, E)`` of measured entries: zeros, the raw entries themselves, the coded streams.

    With the block's ``analysis`` the streams are taken from it; without, the
    codec writes them for the coded entries only (never sizing the others).
    """
    raw = entries.shape[1] // spec.SECTOR_BYTES
    coded = (k > 0) & (k < raw)
    payload = torch.zeros_like(entries)
    if bool(coded.any()):
        rows = _rows(coded)
        if analysis is not None:
            streams = analysis.streams(rows)
        else:
            streams = codec.encode(_take(entries, rows), word_bytes, _take(modes, rows))
        _put(payload, rows, streams)
    _copy_rows(payload, k == raw, entries)
    return payload


def encode(codec: Codec, entries: torch.Tensor, word_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(payload, k, modes)`` of ``(n, E)`` entries: measure and encode in one call (tests, tools)."""
    entries = entries.contiguous()
    k, modes, analysis = measure_entries(codec, entries, word_bytes)
    return encode_entries(codec, entries, word_bytes, k, modes, analysis), k, modes


def check_modes(codec: Codec, k: torch.Tensor, modes: torch.Tensor, entry_bytes: int) -> None:
    """Raise :class:`CorruptDataError` unless every entry's mode is one the codec writes for its ``k``."""
    if k.numel() == 0:
        return
    raw = entry_bytes // spec.SECTOR_BYTES
    known = torch.tensor(sorted(codec.modes), dtype=modes.dtype, device=modes.device)
    if not bool(torch.isin(modes, known).all()):
        raise CorruptDataError(f"metadata holds modes that codec {codec.name!r} never writes")
    coded = torch.tensor(sorted(codec.coded_modes), dtype=modes.dtype, device=modes.device)
    zero_ok = (modes == codec.zero_mode) if codec.zero_escape else torch.zeros_like(k, dtype=torch.bool)
    fits = torch.where(k == 0, zero_ok, torch.where(k == raw, modes == codec.raw_mode, torch.isin(modes, coded)))
    if not bool(fits.all()):
        raise CorruptDataError(
            f"codec {codec.name!r}: a metadata mode disagrees with its entry's size (zero, raw or coded)"
        )


def decode_entries(
    codec: Codec, payload: torch.Tensor, k: torch.Tensor, modes: torch.Tensor, word_bytes: int
) -> torch.Tensor:
    """Entries ``(n, E)`` from their payloads (bytes past ``k`` sectors must be zero), ``k`` and modes.

    Modes and sizes are checked before the codec reads anything; a codec
    error on bytes it never writes is a :class:`CorruptDataError` too.
    """
    entry_bytes = payload.shape[1]
    raw = entry_bytes // spec.SECTOR_BYTES
    check_modes(codec, k, modes, entry_bytes)
    out = torch.zeros_like(payload)
    coded = (k > 0) & (k < raw)
    if bool(coded.any()):
        rows = _rows(coded)
        try:
            decoded = codec.decode(_take(payload, rows), _take(k, rows), _take(modes, rows), word_bytes)
        except torch.cuda.OutOfMemoryError:  # a RuntimeError, but not the data's fault
            raise
        except (IndexError, RuntimeError) as exc:
            # The sizes agreed, so the codec met bytes it never writes. Codecs validate what
            # they read; this is the net under them, so hostile bytes stay a CorruptDataError.
            raise CorruptDataError(
                f"codec {codec.name!r} could not decode its entries: the buffers are damaged or were not "
                f"written by this codec ({type(exc).__name__}: {exc})"
            ) from exc
        if decoded.shape != (rows.numel() if rows is not None else payload.shape[0], entry_bytes):
            raise RuntimeError(f"codec {codec.name!r}: decode() returned {tuple(decoded.shape)} for coded entries")
        _put(out, rows, decoded)
    _copy_rows(out, k == raw, payload)
    return out


def _take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t.index_select(0, rows)


def _put(dst: torch.Tensor, rows: torch.Tensor | None, src: torch.Tensor) -> None:
    if rows is None:
        dst.copy_(src)
    else:
        dst.index_copy_(0, rows, src)


def _copy_rows(dst: torch.Tensor, mask: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[mask] = src[mask]`` for a bool row mask, by the cheaper of a masked pass and a gather."""
    count = int(mask.sum())
    if count == 0:
        return
    if count * 4 >= mask.numel():  # many rows: one masked pass beats gathering rows
        torch.where(mask.unsqueeze(1), src, dst, out=dst)
    else:
        index = mask.nonzero().view(-1)
        dst.index_copy_(0, index, src.index_select(0, index))


# ---------------------------------------------------------------------------
# metadata words
# ---------------------------------------------------------------------------
def encode_meta(sectors: torch.Tensor, modes: torch.Tensor, entry_bytes: int) -> torch.Tensor:
    """Metadata bytes (``uint8``, ``n * META_BYTES``) for per-entry ``k`` and mode."""
    mb, k_bits, _ = spec.meta_fields(entry_bytes)
    word = sectors.to(torch.int32) | (modes.to(torch.int32) << k_bits)
    if mb == 1:
        return word.to(torch.uint8)
    lo = (word & 0xFF).to(torch.uint8)
    hi = (word >> 8).to(torch.uint8)
    return torch.stack([lo, hi], dim=1).reshape(-1)


def decode_meta(
    meta: torch.Tensor, entry_bytes: int, n_entries: int, *, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-entry ``(k, mode)`` as int32 tensors from metadata bytes.

    Raises :class:`CorruptDataError` when the buffer has the wrong size or
    (with ``check``, one device-to-host read) a ``k`` exceeds the sectors of
    an entry. Metadata buddy just wrote needs no ``check``.
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
    if check and n_entries and int(k.max()) > spec.sectors_per_entry(entry_bytes):
        raise CorruptDataError(
            f"metadata claims more than {spec.sectors_per_entry(entry_bytes)} sectors "
            f"for an entry of {entry_bytes} bytes"
        )
    return k, mode


# ---------------------------------------------------------------------------
# slots and overflow
# ---------------------------------------------------------------------------
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
    slot_bytes = slot_sectors * spec.SECTOR_BYTES
    payload = torch.zeros(n, entry_bytes, dtype=torch.uint8, device=slots.device)
    payload[:, :slot_bytes] = slots.view(n, slot_bytes)
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


# ---------------------------------------------------------------------------
# slots and overflow on the device: no host reads, any block of entries
# ---------------------------------------------------------------------------
def overflow_starts(sectors: torch.Tensor, slot_sectors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, total)``: the sector at which each entry's overflow begins, and the overflow's size.

    The exclusive prefix sum of ``max(k - s, 0)`` (``int64``) and its total
    (a 0-dim tensor), on ``sectors``' device: nothing is read back.
    """
    spill = (sectors.to(torch.int64) - slot_sectors).clamp_(min=0)
    ends = torch.cumsum(spill, 0)
    total = ends[-1] if ends.numel() else ends.new_zeros(())
    return ends - spill, total


def _overflow_index(sectors: torch.Tensor, slot_sectors: int, starts: torch.Tensor, spe: int, spare: int):
    """``(n, spe - s)`` int64: the overflow sector of each payload sector past the slot; ``spare`` where it has none."""
    j = torch.arange(slot_sectors, spe, dtype=torch.int64, device=sectors.device)
    index = starts.to(torch.int64).unsqueeze(1) + (j - slot_sectors).unsqueeze(0)
    index = torch.where(j.unsqueeze(0) < sectors.to(torch.int64).unsqueeze(1), index, spare)
    return index.clamp_(0, spare)  # damaged sizes read or write the wrong sector, never out of bounds


def scatter_overflow(
    payload: torch.Tensor, sectors: torch.Tensor, slot_sectors: int, starts: torch.Tensor, overflow: torch.Tensor
) -> None:
    """The device side of :func:`split_payload`: payload sectors past the slot written into ``overflow``.

    ``payload``: ``(n, E)`` rows, any block of a tensor's entries (zero past
    ``k`` sectors); ``sectors`` and ``starts`` (:func:`overflow_starts` of
    the whole tensor) the same rows'. ``overflow``: ``(m + 1) * 32`` bytes,
    the tensor's ``m`` overflow sectors and a spare one after them that
    takes every write belonging nowhere. One scatter, no host read.
    """
    n, entry_bytes = payload.shape
    spe = spec.sectors_per_entry(entry_bytes)
    if n == 0 or slot_sectors >= spe:
        return
    out = overflow.view(-1, spec.SECTOR_BYTES)
    index = _overflow_index(sectors, slot_sectors, starts, spe, out.shape[0] - 1)
    past = payload.reshape(n, spe, spec.SECTOR_BYTES)[:, slot_sectors:]
    out.index_copy_(0, index.reshape(-1), past.reshape(-1, spec.SECTOR_BYTES))


def gather_overflow(
    overflow: torch.Tensor, sectors: torch.Tensor, slot_sectors: int, starts: torch.Tensor, entry_bytes: int
) -> torch.Tensor:
    """The device side of :func:`join_payload`: ``(n, E - s*32)`` payload bytes past the slot, from ``overflow``.

    ``overflow``: ``(m + 1) * 32`` bytes, the ``m`` overflow sectors and a
    spare sector of zeros after them, which every sector past an entry's
    ``k`` reads. One gather, no host read; sizes that do not add up to ``m``
    (damaged metadata) read wrong sectors, never out of bounds -- check
    :func:`overflow_starts`' total against ``m``.
    """
    n, spe = sectors.numel(), spec.sectors_per_entry(entry_bytes)
    src = overflow.view(-1, spec.SECTOR_BYTES)
    if n == 0 or slot_sectors >= spe:
        return src.new_zeros((n, max(spe - slot_sectors, 0) * spec.SECTOR_BYTES))
    index = _overflow_index(sectors, slot_sectors, starts, spe, src.shape[0] - 1)
    return src[index].view(n, (spe - slot_sectors) * spec.SECTOR_BYTES)
