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
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from . import format, spec
from .errors import CorruptDataError

if TYPE_CHECKING:  # the codec registry imports this module
    from .codecs.base import Codec

__all__ = ["Engine", "Measurement", "BlockEngine"]


class Measurement(NamedTuple):
    """What :meth:`Engine.measure` found: enough to decide a slot and to pack without sizing again."""

    #: ``n_entries * META_BYTES`` bytes on the tensor's device: every entry's ``k`` and mode
    meta: torch.Tensor
    #: ``histogram[k]`` entries compress to ``k`` sectors (on the host)
    histogram: tuple[int, ...]
    #: what pack may reuse (engine-specific; ``None``: nothing)
    reuse: Any = None


class Engine(abc.ABC):
    """A codec's format operations over whole tensors, on one kind of device."""

    #: what runs the codec: "reference", "cuda", "nvcomp" (recorded in every BuddyTensor)
    backend: str = ""
    #: whether :meth:`fit_measure` fits the codec's table itself (else :meth:`Codec.fit` does, then :meth:`measure`)
    fits_tables: bool = False

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
    def measure(self, flat: torch.Tensor, entry_bytes: int, word_bytes: int) -> Measurement:
        """Sizes of the entries of ``flat`` (a 1-D ``uint8`` tensor, the tensor's bytes in memory order)."""

    def fit_measure(
        self, flat: torch.Tensor, entry_bytes: int, word_bytes: int, prior=None, keep=None
    ) -> tuple[Codec, Measurement]:
        """The codec fitted to ``flat`` (see :meth:`Codec.fit`) and its :meth:`measure`, by an engine that
        :attr:`fits_tables`: it counts and fits where the tensor is, reading back only what measure reads."""
        raise NotImplementedError(f"{type(self).__name__} does not fit tables (fits_tables is False)")

    @abc.abstractmethod
    def pack(
        self, flat: torch.Tensor, measured: Measurement, slot: int, entry_bytes: int, word_bytes: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, overflow)`` on ``flat``'s device: ``N * s * 32`` bytes, and the compacted overflow."""

    @abc.abstractmethod
    def unpack(
        self,
        meta: torch.Tensor,
        slots: torch.Tensor,
        overflow: torch.Tensor,
        slot: int,
        entry_bytes: int,
        word_bytes: int,
        nbytes: int,
        *,
        check: bool = True,
        error_flag: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The ``nbytes`` bytes back, on ``slots``' device (``overflow`` may live on the host).

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
    def measure(self, flat, entry_bytes, word_bytes):
        n = -(-flat.numel() // entry_bytes)
        mb, spe = spec.meta_bytes(entry_bytes), spec.sectors_per_entry(entry_bytes)
        meta = torch.empty(n * mb, dtype=torch.uint8, device=flat.device)
        histogram = torch.zeros(spe + 1, dtype=torch.int64, device=flat.device)
        ranges = format.blocks(n, entry_bytes)
        reuse = None
        for a, b in ranges:
            k, modes, block_reuse = self.measure_block(format.entry_rows(flat, a, b, entry_bytes), word_bytes)
            meta[a * mb : b * mb] = format.encode_meta(k, modes, entry_bytes)
            histogram += torch.bincount(k.to(torch.int64), minlength=spe + 1)
            if len(ranges) == 1:  # one block: pack writes its streams from this analysis
                reuse = (k, modes, block_reuse)
        return Measurement(meta, tuple(histogram.tolist()), reuse)

    def pack(self, flat, measured, slot, entry_bytes, word_bytes):
        n = -(-flat.numel() // entry_bytes)
        mb, slot_bytes = spec.meta_bytes(entry_bytes), slot * spec.SECTOR_BYTES
        slots = torch.empty(n * slot_bytes, dtype=torch.uint8, device=flat.device)
        pieces = []
        for a, b in format.blocks(n, entry_bytes):
            if measured.reuse is not None:
                k, modes, reuse = measured.reuse
            else:
                k, modes = format.decode_meta(measured.meta[a * mb : b * mb], entry_bytes, b - a, check=False)
                reuse = None
            payload = self.encode_block(format.entry_rows(flat, a, b, entry_bytes), word_bytes, k, modes, reuse)
            slot_part, overflow = format.split_payload(payload, k, slot, entry_bytes)
            slots[a * slot_bytes : b * slot_bytes].view(b - a, slot_bytes).copy_(slot_part)
            pieces.append(overflow.reshape(-1))
        overflow = torch.cat(pieces) if len(pieces) > 1 else (pieces[0] if pieces else slots.new_empty(0))
        return slots, overflow

    def unpack(self, meta, slots, overflow, slot, entry_bytes, word_bytes, nbytes, *, check=True, error_flag=None):
        n = -(-nbytes // entry_bytes)
        slot_bytes = slot * spec.SECTOR_BYTES
        k_all, modes_all = format.decode_meta(meta, entry_bytes, n)
        ranges = format.blocks(n, entry_bytes)
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
            payload = format.join_payload(slots[a * slot_bytes : b * slot_bytes], ov, k_all[a:b], slot, entry_bytes)
            entries = self.decode_block(payload, k_all[a:b], modes_all[a:b], word_bytes)
            lo, hi = a * entry_bytes, min(b * entry_bytes, nbytes)
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
