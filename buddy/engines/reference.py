"""The torch reference engine: the format layer and a codec's torch code, a block of entries at a time.

:class:`BlockEngine` runs every codec registered with ``reference=True``
(:func:`buddy.codecs.register_codec`), on the CPU and on CUDA devices: :func:`rows`
gives its implementations of a codec, which :mod:`buddy.dispatch` registers
as the default on both kinds of device.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import format, spec
from ..codecs.base import Codec
from ..errors import CorruptDataError
from . import DEVICES, Engine, Implementation, Measurement

__all__ = ["BlockEngine", "rows"]


def rows(name: str) -> tuple[Implementation, ...]:
    """The reference implementations of codec ``name``: the default on every kind of device."""
    return tuple(Implementation(name, device, "reference", BlockEngine, default=True) for device in DEVICES)


class BlockEngine(Engine):
    """The torch reference: the format layer and the codec's torch code, a block of entries at a time.

    Subclasses that run the per-block operations elsewhere (kernels per
    block) override :meth:`measure_block`, :meth:`encode_block` and
    :meth:`decode_block` and keep the loop.
    """

    backend = "reference"
    codec: Codec

    # ---- per block -------------------------------------------------------------
    def measure_block(self, entries: torch.Tensor, word_bytes: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``(k, modes, reuse)`` of a block of entries."""
        return format.measure_entries(self.codec, entries, word_bytes)

    def encode_block(self, entries, word_bytes, k, modes, reuse) -> torch.Tensor:
        """Payloads ``(n, E)`` of a measured block (``reuse``: what its measure left, or ``None``)."""
        payload = format.encode_entries(self.codec, entries, word_bytes, k, modes, reuse)
        _check_stream_lengths(self.codec, payload, k)
        return payload

    def decode_block(self, payload, k, modes, word_bytes) -> torch.Tensor:
        """Entries ``(n, E)`` of a block from their payloads, ``k`` and modes."""
        return format.decode_entries(self.codec, payload, k, modes, word_bytes)

    # ---- over the tensor --------------------------------------------------------
    def measure(self, flat, layout):
        n, mb, e = layout.n_entries, layout.entry_meta_bytes, layout.entry_bytes
        meta = torch.empty(layout.meta_bytes, dtype=torch.uint8, device=flat.device)
        histogram = torch.zeros(layout.bins, dtype=torch.int64, device=flat.device)
        ranges = format.blocks(n, e)
        reuse = None
        for a, b in ranges:
            k, modes, block_reuse = self.measure_block(format.entry_rows(flat, a, b, e), layout.word_bytes)
            meta[a * mb : b * mb] = format.encode_meta(k, modes, e)
            histogram += torch.bincount(k.to(torch.int64), minlength=layout.bins)
            if len(ranges) == 1:  # one block: pack writes its streams from this analysis
                reuse = (k, modes, block_reuse)
        return Measurement(meta, tuple(histogram.tolist()), reuse)

    def pack(self, flat, measured, slot, layout, into=None):
        self._refuse_into(into, "where the tensor is")
        mb, e, slot_bytes = layout.entry_meta_bytes, layout.entry_bytes, slot * spec.SECTOR_BYTES
        slots = torch.empty(layout.slots_bytes(slot), dtype=torch.uint8, device=flat.device)
        pieces = []
        for a, b in format.blocks(layout.n_entries, e):
            if measured.reuse is not None:
                k, modes, reuse = measured.reuse
            else:
                k, modes = format.decode_meta(measured.meta[a * mb : b * mb], e, b - a, check=False)
                reuse = None
            payload = self.encode_block(format.entry_rows(flat, a, b, e), layout.word_bytes, k, modes, reuse)
            slot_part, overflow = format.split_payload(payload, k, slot, e)
            slots[a * slot_bytes : b * slot_bytes].view(b - a, slot_bytes).copy_(slot_part)
            pieces.append(overflow.reshape(-1))
        overflow = torch.cat(pieces) if len(pieces) > 1 else (pieces[0] if pieces else slots.new_empty(0))
        return slots, overflow

    def unpack(self, meta, slots, overflow, slot, layout, *, check=True, error_flag=None):
        n, e, nbytes = layout.n_entries, layout.entry_bytes, layout.nbytes
        slot_bytes = slot * spec.SECTOR_BYTES
        k_all, modes_all = format.decode_meta(meta, e, n)
        ranges = format.blocks(n, e)
        # where each block's overflow starts, in one host transfer
        spill = torch.clamp(k_all - slot, min=0).to(torch.int64)
        ends = torch.cumsum(spill, 0)[[b - 1 for _, b in ranges]].tolist() if ranges else []
        needed = (ends[-1] if ends else 0) * spec.SECTOR_BYTES
        if needed != overflow.numel():
            raise CorruptDataError(f"overflow holds {overflow.numel()} bytes but the metadata needs {needed}")
        overflow = overflow.to(slots.device, non_blocking=True)  # H2D from pinned memory, on the current stream
        out = torch.empty(nbytes, dtype=torch.uint8, device=slots.device)
        start = 0
        for (a, b), end in zip(ranges, ends):
            ov = overflow[start * spec.SECTOR_BYTES : end * spec.SECTOR_BYTES]
            payload = format.join_payload(slots[a * slot_bytes : b * slot_bytes], ov, k_all[a:b], slot, e)
            entries = self.decode_block(payload, k_all[a:b], modes_all[a:b], layout.word_bytes)
            lo, hi = a * e, min(b * e, nbytes)
            out[lo:hi] = entries.view(-1)[: hi - lo]
            start = end
        return out



def _check_stream_lengths(codec: Codec, payload: torch.Tensor, k: torch.Tensor) -> None:
    """A stream that runs past its ``k`` sectors would lose its end in the split: refuse it."""
    n, entry_bytes = payload.shape
    used = payload.view(n, -1, spec.SECTOR_BYTES).ne(0).any(2)
    past = torch.arange(used.shape[1], device=payload.device) >= k.unsqueeze(1)
    if bool((used & past).any()):
        raise RuntimeError(
            f"codec {codec.name!r}: a stream runs past the sectors its analysis gave (its sizes and its "
            f"streams disagree); nothing was stored"
        )
