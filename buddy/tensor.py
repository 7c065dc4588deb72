"""BuddyTensor: a tensor held as fixed-size slots on its device plus overflow in buddy memory.

Also what a tensor must be to be compressed (:func:`check_tensor`); how its
bytes are read (in memory order for any dense layout, so decompression
restores the strides) is :mod:`buddy.layout`'s.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from . import dispatch, integrity, spec, streams
from . import engines
from .engines import PLACE_WORDS
from .codecs import CodecLike
from .errors import FreedTensorError, UnsupportedTensorError
from .integrity import Checksum
from .layout import Layout
from .ledger import DeviceLedger, Hold
from .store import BuddyAllocation, BuddyStore

__all__ = ["BuddyTensor", "check_tensor"]


def check_tensor(tensor) -> None:
    """Raise a specific error for anything :func:`compress` cannot take."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"buddy.compress expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested:
        raise UnsupportedTensorError("nested tensors are not supported; compress each component tensor")
    if tensor.layout != torch.strided:
        raise UnsupportedTensorError(
            f"{tensor.layout} tensors are not supported; call .to_dense() first (or compress the "
            f"index and value tensors separately)"
        )
    if tensor.is_quantized:
        raise UnsupportedTensorError(
            "quantized tensors are not supported; compress tensor.int_repr() and keep the scale/zero point"
        )
    if tensor.device.type == "meta":
        raise UnsupportedTensorError("meta tensors hold no data to compress")
    wrapper = _wrapper_kind(tensor)
    if wrapper is not None:
        raise UnsupportedTensorError(wrapper)
    try:
        spec.word_bytes(tensor.dtype)
    except ValueError as exc:
        raise UnsupportedTensorError(f"dtype {tensor.dtype} is not supported: {exc}") from None


def _wrapper_kind(tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s storage is not its data (a vmap batch, a FakeTensor, a wrapper subclass), or ``None``."""
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is not None and functorch.is_batchedtensor(tensor):
        return (
            "tensors batched by torch.func.vmap are not supported: compress outside vmap, or the whole "
            "batch before vmap"
        )
    detectors = _detectors()
    if detectors is None:  # pragma: no cover - older torch: nothing more to detect
        return None
    is_fake, is_traceable_wrapper_subclass = detectors
    if is_fake(tensor):
        return "FakeTensors (torch.compile tracing, FakeTensorMode) hold no data to compress"
    if is_traceable_wrapper_subclass(tensor):
        return (
            f"{type(tensor).__name__} is a tensor subclass that wraps other tensors; compress its inner "
            f"tensors, or a plain tensor made from it"
        )
    return None


@functools.cache
def _detectors():
    """torch's ``is_fake`` and ``is_traceable_wrapper_subclass`` (imported once), or ``None`` where it has none."""
    try:
        from torch._subclasses.fake_tensor import is_fake
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    except ImportError:  # pragma: no cover - older torch
        return None
    return is_fake, is_traceable_wrapper_subclass


def _release(store: BuddyStore, alloc: BuddyAllocation, hold: Hold) -> None:
    store.release(alloc)
    hold.release()


class BuddyTensor:
    """A compressed tensor: slots and metadata on its device, overflow in buddy memory.

    Made by :func:`compress`; not constructed directly. The original tensor can
    be dropped once this exists. :meth:`decompress` returns a bit-identical
    tensor (same dtype, shape, device and, for dense layouts, strides). :meth:`free` returns the
    slots and the buddy memory at once; a BuddyTensor that is garbage-collected
    frees itself, and ``with compress(t) as bt:`` frees at the end of the block.

    Attributes (bytes unless said otherwise):
        original_bytes: bytes of the tensor's data.
        device_bytes: slots + metadata (+ the codec table, format version 2) on the device.
        buddy_bytes: overflow held in buddy memory.
        reserve_bytes: overflow held on the device instead, in its step's reserve (packed ahead in a session
            whose step's bound left no room for it in buddy memory); counted with the reserve, not here.
        compressed_bytes: ``sum(k) * 32``, the size if entries were compacted.
        target_ratio: ``E / (32 * slot_sectors)``, the ratio of the slot used; ``inf`` for the zero slot.
        requested_ratio: the ``target_ratio`` :func:`compress` was given (the slot grid may round it:
            see there), or ``None`` when the slot came from an overflow bound or a policy.
        codec: codec name.
        backend: ``"reference"``, ``"cuda"`` or ``"nvcomp"``: what ran the
            codec at compress time (see :mod:`buddy.dispatch`), and what
            :meth:`decompress` uses unless told otherwise.
        ledger: the :class:`~buddy.ledger.DeviceLedger` its device bytes are held
            on until it is freed.
        checksum: a :class:`~buddy.integrity.Checksum` -- one 64-bit checksum
            per buffer (metadata, slots, overflow) -- when compressed with
            ``checksum=True``, else ``None``. :meth:`decompress` checks it
            before decoding and :meth:`verify` checks it on demand; a buffer
            changed since compression raises
            :class:`~buddy.errors.CorruptDataError` naming the buffer.
    """

    def __init__(
        self,
        *,
        shape: torch.Size,
        stride: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        codec: CodecLike,
        layout: Layout,
        slot_sectors: int,
        histogram: Sequence[int] | torch.Tensor,
        slots: torch.Tensor,
        meta: torch.Tensor,
        overflow: BuddyAllocation,
        store: BuddyStore,
        ledger: DeviceLedger,
        backend: str = "reference",
        checksum: Checksum | None = None,
        table: torch.Tensor | None = None,
        ends: torch.Tensor | None = None,
        reserve: torch.Tensor | None = None,
    ):
        self.shape = torch.Size(shape)
        #: strides the decompressed tensor gets (the original's when it was dense, else contiguous)
        self.stride = tuple(stride)
        self.dtype = dtype
        self.device = device
        self._codec = codec
        self.backend = backend
        #: entry size, word size and bytes of the tensor's data (see :class:`~buddy.layout.Layout`)
        self.layout = layout
        self.entry_bytes = layout.entry_bytes
        self.slot_sectors = slot_sectors
        self.original_bytes = layout.nbytes
        self.n_entries = layout.n_entries
        self._sizes(histogram, reserve)
        self.format_version = codec.format_version
        self.requested_ratio: float | None = None  # set by compress() when it was given a target ratio
        #: per-buffer checksums taken at compress time, or ``None`` (see :mod:`buddy.integrity`)
        self.checksum = checksum
        self._slots = slots
        self._meta = meta
        self._overflow = overflow
        self._table = table
        self._ends = ends  # the overflow's prefix sums a pack ahead made, kept for unpack (or None: made again)
        # (overflow on the device, the event of its arrival) from prefetch()
        self._prefetched: tuple[torch.Tensor, Any] | None = None
        self.store = store
        self.ledger = ledger
        self.device_bytes = slots.numel() + meta.numel() + sum(0 if b is None else b.nbytes for b in (table, ends))
        #: overflow held in buddy memory (packed ahead: the range reserved, the worst case, until settled)
        self.buddy_bytes = overflow.nbytes
        hold = ledger.hold(self.device_bytes)
        self._finalizer = weakref.finalize(self, _release, store, overflow, hold)

    def _sizes(self, histogram: Sequence[int] | torch.Tensor, reserve: torch.Tensor | None) -> None:
        """The sizes, as known when it is made: the histogram, or, packed ahead (:func:`buddy.pipeline.pack_ahead`),
        the sizes kernel's words on the device -- its placement of the overflow (``PLACE_WORDS``), then the
        histogram --, read when it is settled; and, with its step's ``reserve``, where its overflow may be."""
        self._histogram: tuple[int, ...] | None = None
        self._counting: torch.Tensor | None = None
        if isinstance(histogram, torch.Tensor):
            self._counting = histogram
        else:
            self._histogram = tuple(map(int, histogram))
        # packed ahead with its step's reserve: (its placement on the device, the reserve); kept once settled where
        # some of the overflow is in the reserve, else dropped (every sector in buddy memory, in order)
        self._placed: tuple[torch.Tensor, torch.Tensor] | None = None
        if reserve is not None:
            assert self._counting is not None, "a reserve goes with a tensor packed ahead"
            self._placed = (self._counting[:PLACE_WORDS], reserve)
        #: (cap, r, offset): where the overflow's sectors are (see csrc/buddy_ops.h, BuddyOverflowMap), once settled
        self.placement: tuple[int, int, int] | None = None
        self.reserve_bytes = 0

    # ---- properties -------------------------------------------------------
    @property
    def histogram(self) -> tuple[int, ...]:
        """Entries per size: ``histogram[k]`` entries compress to ``k`` sectors (packed ahead: settled first)."""
        if self._histogram is None:
            self.settle()
        assert self._histogram is not None
        return self._histogram

    def written_by(self, ops, event) -> None:
        """Its pack, which wrote the overflow straight into buddy memory, completes with ``event`` of a stream
        other than the one that holds the tensor (packed beside forward: :mod:`buddy.overlap`): readers of the
        range wait for it, and the store hands the range to no one else before it, even if the tensor is freed at
        once. Where the range's write is recorded already -- an overflow ring's drain (:mod:`buddy.ring`), which
        waits for the pack -- that one stands."""
        if self._overflow.written is None:
            self._overflow.written_by(ops, event)

    @property
    def settled(self) -> bool:
        """Whether the sizes are known on the host (always, but for a tensor packed ahead not yet settled)."""
        return self._histogram is not None

    def settle(self, sizes: Sequence[int] | None = None) -> None:
        """Learn the sizes of a tensor packed ahead (:func:`buddy.pipeline.pack_ahead`): the sizes kernel's words
        (its placement, then the histogram) as read with its step's (else read now, one read), and give back the
        buddy memory past the overflow it holds. Nothing for a tensor whose sizes are known."""
        if self._histogram is not None:
            return
        if sizes is None:
            assert self._counting is not None
            sizes = engines.to_host(self._counting).tolist()
        cap, r, offset = (int(v) for v in sizes[:3])
        self._histogram = tuple(map(int, sizes[PLACE_WORDS:]))
        self._counting = None
        spilled = self.layout.overflow_bytes(self._histogram, self.slot_sectors)
        if self._placed is None:
            r = 0  # (no reserve: every sector in buddy memory, whatever its cap)
        held = spilled - r * spec.SECTOR_BYTES
        if held > self._overflow.nbytes or r < 0 or (r and not 0 <= cap <= held // spec.SECTOR_BYTES):
            raise RuntimeError(
                f"the sizes say {spilled} overflow bytes placed at (cap {cap}, r {r}), which the {self._overflow.nbytes} "
                f"reserved in buddy memory do not hold"
            )  # fmt: skip
        if self._finalizer.alive:
            self.store.shrink(self._overflow, held)  # the pack's writes are done: its stream was read
        self.buddy_bytes = held
        self.placement = (cap, r, offset)
        self.reserve_bytes = r * spec.SECTOR_BYTES
        if not r:
            self._placed = None

    @property
    def codec(self) -> str:
        return self._codec.name

    @property
    def codec_object(self) -> CodecLike:
        """The codec it was compressed with (fitted: with its table), as :func:`buddy.unpack` takes it."""
        return self._codec

    @property
    def table(self) -> torch.Tensor | None:
        """The codec table on the device (format version 2: ``fpe``, ``auto2``), else ``None``. Do not write to it."""
        return self._table

    @property
    def target_ratio(self) -> float:
        return self.layout.ratio(self.slot_sectors)

    @property
    def compressed_bytes(self) -> int:
        return self.layout.compacted_bytes(self.histogram)

    @property
    def effective_ratio(self) -> float:
        """original bytes / device bytes (``inf`` when nothing stays on the device)."""
        return self.original_bytes / self.device_bytes if self.device_bytes else math.inf

    @property
    def word_bytes(self) -> int:
        return self.layout.word_bytes

    @property
    def freed(self) -> bool:
        return not self._finalizer.alive

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(metadata, slots, overflow)``: the three buffers of the format, exactly sized.

        They are the tensor's own memory, not copies: do not write to them.
        The overflow's copy to buddy memory has landed by the time this returns.
        (A tensor with some of its overflow in its step's reserve on the device
        -- :attr:`reserve_bytes` -- gives its overflow whole, on the host: a copy.)
        """
        self._check_alive("read the buffers of")
        self.settle()
        self._overflow_ready_on_host()
        return self._meta, self._slots, self._whole(self._overflow.data)

    def _whole(self, overflow: torch.Tensor) -> torch.Tensor:
        """The overflow's sectors in order in one buffer on ``overflow``'s device: ``overflow`` (those in buddy
        memory, or their copy), with those in the step's reserve put back between them."""
        if self._placed is None or self.placement is None:
            return overflow
        cap, r, offset = self.placement
        b = spec.SECTOR_BYTES
        held = self._placed[1][offset * b : (offset + r) * b].to(overflow.device)
        return torch.cat((overflow[: cap * b], held, overflow[cap * b :]))

    def verify(self) -> None:
        """Check the three buffers against :attr:`checksum` without decoding anything.

        Raises :class:`~buddy.errors.CorruptDataError` naming the buffer(s) whose
        bytes changed since compression, and ``ValueError`` for a tensor
        compressed without a checksum (there is nothing to check it against).
        Costs one read of every buffer (the overflow is read where it lives,
        in host memory).
        """
        self._check_alive("verify")
        if self.checksum is None:
            raise ValueError(
                "this BuddyTensor was compressed without a checksum; pass checksum=True to buddy.compress "
                "(or call buddy.set_defaults(checksum=True)) to be able to verify it"
            )
        self._overflow_ready_on_host()
        integrity.verify(self._meta, self._slots, self._overflow.data, self.checksum, self._table)

    def _overflow_ready_on_host(self) -> None:
        # the host is about to read the overflow: its copy there must have landed
        self._overflow.synchronize_written()

    def prefetch(self) -> int:
        """Start bringing the overflow back to the device, on the device's copy stream; returns its bytes.

        Does nothing (returns 0) for a tensor with no overflow, one already
        prefetched, or one whose device is the host. :meth:`decompress` then
        uses the device copy instead of reading buddy memory on the critical
        path; a prefetch never used costs the copy and its device bytes until
        the tensor is freed, nothing else.
        """
        self._check_alive("prefetch")
        self.settle()
        ops = streams.for_device(self.device)
        if self._prefetched is not None or not self.buddy_bytes or isinstance(ops, streams.HostStreams):
            return 0
        copy = ops.copy_stream(self.device)
        with ops.activate(copy):
            self._overflow.wait_written(copy)  # the overflow is in buddy memory before it is read back
            on_device = self._overflow.data.to(self.device, non_blocking=True, copy=True)
            self._overflow.used_on(ops, copy)  # the store must not reuse the range before this copy has read it
            self._prefetched = (on_device, ops.record(copy))
        return self.buddy_bytes

    def drop_prefetch(self) -> int:
        """Give back the device copy :meth:`prefetch` made, unused; returns its bytes."""
        if self._prefetched is None:
            return 0
        self._prefetched = None  # made and only read on the copy stream: its memory is reused in that order
        return self.buddy_bytes

    @property
    def prefetched(self) -> bool:
        """Whether the overflow has been brought back to the device ahead of :meth:`decompress`."""
        return self._prefetched is not None

    # ---- lifecycle ----------------------------------------------------------
    def decompress(
        self, *, backend: str | None = None, check: bool = False, error_flag: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A new tensor bit-identical to the one compressed (same device; same strides if it was dense).

        ``backend``: see :mod:`buddy.dispatch`; default: :attr:`backend`, the
        one that compressed it. With a :attr:`checksum`, the buffers are
        checked first: :class:`~buddy.errors.CorruptDataError` if any changed
        (see :meth:`verify`), and nothing is decoded. The CUDA kernels check
        the format on the device and read the verdict back only with
        ``check=True`` (a host sync; a decompress otherwise makes none);
        without it, ``error_flag`` (one ``int32`` on the tensor's device)
        receives their error bits (ORed in; nonzero: an entry failed its
        check and decoded to zeros) for the caller to read when it syncs
        anyway -- the training session reads one per backward. The torch
        reference always checks, and raises.
        """
        self._check_alive("decompress")
        self.settle()  # the overflow's size (packed ahead: one read, unless its step's read settled it)
        engine = dispatch.engine(self._codec, self.device, self.backend if backend is None else backend)
        if self.checksum is not None:
            self._overflow_ready_on_host()
            integrity.verify(
                self._meta, self._slots, self._overflow.data, self.checksum, self._table
            )  # before decoding
        ops = streams.for_device(self.device)
        stream = ops.current(self.device)
        overflow = self._overflow_for(ops, stream)
        placed = self._placed if engine.packs_ahead else None  # (any other engine reads the overflow whole)
        buffers = (self._meta, self._slots, overflow if placed is not None else self._whole(overflow))
        out = engines.decode(
            engine, buffers, self.slot_sectors, self.layout, self.shape, self.dtype, self.stride,
            check=check, error_flag=error_flag, ends=self._ends, placed=placed,
        )  # fmt: skip
        if overflow is self._overflow.data:
            self._overflow.used_on(ops, stream)  # read (copied to the device) on this stream: busy until it ends
        # (the error flag too: a slice of a step's buffer, which another stream may have allocated)
        for buffer in (*buffers, *(b for b in (self._ends, error_flag, *(placed or ())) if b is not None)):
            ops.keep_for(buffer, stream)  # read on this stream: their memory outlives that work
        return out

    def _overflow_for(self, ops, stream) -> torch.Tensor:
        """The overflow, ready for ``stream`` to read: the prefetched device copy, or buddy memory."""
        if self._prefetched is not None:
            on_device, arrived = self._prefetched
            self._prefetched = None  # used once: a second decompress reads buddy memory again
            ops.wait(stream, arrived)  # the copy back to the device has landed before the decode reads it
            return on_device
        self._overflow.wait_written(stream)  # the overflow's copy to buddy memory may still be in flight
        return self._overflow.data

    def free(self) -> None:
        """Return the slots and buddy memory now. A second call raises."""
        self._check_alive("free")
        self._finalizer()
        self._slots = self._meta = self._ends = self._counting = self._placed = None  # type: ignore[assignment]
        self._prefetched = None

    def _check_alive(self, action: str) -> None:
        if self.freed:
            raise FreedTensorError(f"cannot {action} a BuddyTensor that was already freed")

    def __enter__(self) -> BuddyTensor:
        return self

    def __exit__(self, *exc) -> None:
        if not self.freed:
            self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"device_bytes={self.device_bytes:,}, buddy_bytes={self.buddy_bytes:,}"
        return (
            f"BuddyTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"codec={self.codec!r}, entry_bytes={self.entry_bytes}, target_ratio={self.target_ratio:.2f}, "
            f"original_bytes={self.original_bytes:,}, {state})"
        )
