"""Engines: one implementation of the format operations over a whole tensor.

An engine runs a codec's three format operations on a tensor's bytes:

* :meth:`Engine.measure` -- every entry's ``k`` and mode, as the metadata
  buffer on the tensor's device, and the size histogram (the one
  device-to-host read a compress needs: the tracker decides from it);
* :meth:`Engine.pack` -- for a slot of ``s`` sectors chosen in between, the
  slots and the overflow compacted in entry order, both on the device;
  sizes are not computed again;
* :meth:`Engine.unpack` -- slots, overflow and metadata back to the bytes.

:class:`BlockEngine` is the torch reference: the format layer's functions
(:mod:`buddy.format`) with the codec's torch code, in a loop over blocks of
entries that bounds the temporaries on any device. The CUDA kernels
(:mod:`buddy.cuda`) and nvcomp (:mod:`buddy.codecs.nvcomp`) provide
engines of their own. Which engine runs is decided in one place,
:mod:`buddy.dispatch`; a :class:`~buddy.BuddyTensor` records its backend.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from . import format, spec
from .codecs.base import Codec
from .errors import CorruptDataError
from .layout import Layout, as_tensor

__all__ = ["Engine", "Measurement", "BlockEngine", "decode"]


class Measurement(NamedTuple):
    """What :meth:`Engine.measure` found: enough to decide a slot and to pack without sizing again."""

    #: ``n_entries * META_BYTES`` bytes on the tensor's device: every entry's ``k`` and mode
    meta: torch.Tensor
    #: ``histogram[k]`` entries compress to ``k`` sectors (on the host)
    histogram: tuple[int, ...]
    #: what pack may reuse (engine-specific; ``None``: nothing)
    reuse: Any = None


class Engine(abc.ABC):
    """A codec's format operations over whole tensors, on one kind of device.

    Every operation takes the tensor's :class:`~buddy.layout.Layout` (entry
    size, word size, bytes: built once, where the tensor is measured).
    """

    #: what runs the codec: "reference", "cuda", "nvcomp" (recorded in every BuddyTensor)
    backend: str = ""

    def __init__(self, codec: Codec):
        self.codec = codec
        #: device-to-host reads this engine made (the compress and decompress it ran, and codec fits)
        self.readbacks = 0

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """A small tensor on the host: the one place an engine waits for the device (counted).

        Allowed under ``torch.cuda.set_sync_debug_mode`` (which then flags
        every other wait: the GPU tests run compress and decompress so).
        """
        self.readbacks += 1
        mode = torch.cuda.get_sync_debug_mode() if t.device.type == "cuda" else 0
        if not mode:
            return t.cpu()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return t.cpu()
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    @abc.abstractmethod
    def measure(self, flat: torch.Tensor, layout: Layout) -> Measurement:
        """Sizes of the entries of ``flat`` (a 1-D ``uint8`` tensor, the tensor's bytes in memory order)."""

    def fit_measure(self, flat: torch.Tensor, layout: Layout, prior=None, keep=None) -> tuple[Codec, Measurement]:
        """The codec fitted to ``flat`` (see :meth:`Codec.fit`: a codec with a table fits it to the tensor, or to
        ``prior``; any other codec is itself) and its :meth:`measure`; the engine runs the fitted codec from
        then on. What a compress calls: an engine that can count and fit where the tensor is overrides it, so
        that it reads back only what measure reads."""
        self.codec = self.codec.fit(flat, layout.word_bytes, prior, self.read, keep)
        return self.codec, self.measure(flat, layout)

    @abc.abstractmethod
    def pack(
        self, flat: torch.Tensor, measured: Measurement, slot: int, layout: Layout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, overflow)`` on ``flat``'s device: ``N * s * 32`` bytes, and the compacted overflow."""

    @abc.abstractmethod
    def unpack(
        self,
        meta: torch.Tensor,
        slots: torch.Tensor,
        overflow: torch.Tensor,
        slot: int,
        layout: Layout,
        *,
        check: bool = True,
        error_flag: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The ``layout.nbytes`` bytes back, on ``slots``' device (``overflow`` may live on the host).

        Raises :class:`~buddy.errors.CorruptDataError` for buffers the
        format cannot have produced (the overflow's size included). An engine
        whose checks run on the device (the CUDA kernels, nvcomp) reads their
        verdict back -- a host sync -- only with ``check``; without it,
        entries that failed a check decode to zeros, and their error bits are
        ORed into ``error_flag`` when given (one ``int32`` on ``slots``'
        device, for the caller to read when it syncs anyway). The torch
        reference always checks on the host and raises.
        """

    def __repr__(self) -> str:
        return f"<buddy {self.backend} engine of {self.codec!r}>"


class BlockEngine(Engine):
    """The torch reference: the format layer and the codec's torch code, a block of entries at a time.

    Subclasses that run the per-block operations elsewhere (kernels per
    block) override :meth:`measure_block`, :meth:`encode_block` and
    :meth:`decode_block` and keep the loop.
    """

    backend = "reference"

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

    def pack(self, flat, measured, slot, layout):
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


def decode(
    engine: Engine,
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slot: int,
    layout: Layout,
    shape: Sequence[int],
    dtype: torch.dtype,
    stride: Sequence[int] | None,
    *,
    check: bool = True,
    error_flag: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one decode of :func:`buddy.unpack` and :meth:`BuddyTensor.decompress`, their arguments checked.

    ``buffers``: ``(meta, slots, overflow)``, flat ``uint8``; the slots must
    be as large as ``layout`` and ``slot`` say (:class:`CorruptDataError`).
    ``engine`` decodes them (``check`` and ``error_flag``: see
    :meth:`Engine.unpack`), and the bytes come back as the tensor of
    ``shape`` and ``dtype``, laid out with ``stride`` (or contiguous).
    """
    meta, slots, overflow = buffers
    if slots.numel() != layout.slots_bytes(slot):
        raise CorruptDataError(f"slots hold {slots.numel()} bytes, expected {layout.slots_bytes(slot)}")
    flat = engine.unpack(meta, slots, overflow, slot, layout, check=check, error_flag=error_flag)
    return as_tensor(flat, shape, dtype, stride)


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
