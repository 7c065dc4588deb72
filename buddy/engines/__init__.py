"""Engines: one implementation of the format operations over a whole tensor.

An engine runs a codec's three format operations on a tensor's bytes:

* :meth:`Engine.measure` -- every entry's ``k`` and mode, as the metadata
  buffer on the tensor's device, and the size histogram (the one
  device-to-host read a compress needs: the tracker decides from it);
* :meth:`Engine.pack` -- for a slot of ``s`` sectors chosen in between, the
  slots and the overflow compacted in entry order, both on the device;
  sizes are not computed again;
* :meth:`Engine.unpack` -- slots, overflow and metadata back to the bytes.

The engines:

* :mod:`buddy.engines.reference` -- :class:`~buddy.engines.reference.BlockEngine`,
  the torch reference: the format layer's functions (:mod:`buddy.format`) with
  the codec's torch code, in a loop over blocks of entries that bounds the
  temporaries on any device;
* :mod:`buddy.engines.kernel_engine` -- :class:`~buddy.engines.kernel_engine.KernelEngine`,
  the kernels of ``csrc/`` over the whole tensor, its launcher passed in:
  :mod:`buddy.engines.cuda`'s (CuPy and NVRTC) on CUDA devices,
  :mod:`buddy.engines.native`'s (the same sources built for the host) on the
  CPU; their sources (:mod:`buddy.engines.sources`), launch layout
  (:mod:`buddy.engines.launch`) and checked launches
  (:mod:`buddy.engines.kernels`) are shared;
* :mod:`buddy.engines.nvcomp` -- nvcomp's batched chunk compressors (through
  :mod:`buddy.engines._nvcomp_capi`).

Each lists the implementations it provides as :class:`Implementation` rows (its ``rows()``);
:mod:`buddy.dispatch` builds its one table from them and decides which engine
runs; a :class:`~buddy.BuddyTensor` records its backend.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..codecs.base import CodecLike
from ..errors import CorruptDataError
from ..layout import Layout, as_tensor

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "Engine", "Measurement", "Implementation", "DEVICES", "PLACE_WORDS", "decode", "raise_for_errors", "to_host",
    "host_reads",
]  # fmt: skip

#: the kinds of device an engine runs on
DEVICES = ("cpu", "cuda")
#: error bits of an unpack whose checks run on the device (csrc/buddy_format.h, BUDDY_ERR_*; nvcomp's engine sets
#: the same): a mode the codec never writes, k past the entry, a bad stream, the overflow's size
ERR_K, ERR_STREAM, ERR_MODE, ERR_WORD, ERR_OVERFLOW = 1, 2, 4, 8, 16
#: int64 words of a tensor's placement, which a pack ahead's sizes kernel writes before its histogram
#: (csrc/buddy_kernels.cu, BUDDY_PLACE_*): the overflow's first ``cap`` sectors in buddy memory, the next ``r`` in the
#: step's reserve on the device at sector ``offset``, the rest in buddy memory again; then the kernel's blocks done
PLACE_WORDS = 4


class _Reads(threading.local):
    count = 0


_reads = _Reads()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: the one place buddy waits for a device to read something back, counted per thread
    (:func:`host_reads`) on every device alike -- on the CPU a read costs nothing, and is counted all the same, so
    what the CPU counts of a step is what a GPU pays.

    Allowed under ``torch.cuda.set_sync_debug_mode`` (which then flags every other wait: the GPU tests and the
    runbook's step run so).
    """
    _reads.count += 1
    mode = torch.cuda.get_sync_debug_mode() if t.device.type == "cuda" else 0
    if not mode:
        return t.cpu()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return t.cpu()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def host_reads() -> int:
    """Reads :func:`to_host` made on this thread so far: take it before and after a piece of work."""
    return _reads.count


@dataclass(frozen=True)
class Implementation:
    """One way to run one codec on one kind of device: a row of :mod:`buddy.dispatch`'s table."""

    #: the codec's registry name
    codec: str
    #: ``"cpu"`` or ``"cuda"``
    device: str
    #: ``"reference"``, ``"cuda"``, ``"nvcomp"`` (what ``backend=`` names)
    backend: str
    #: ``factory(codec) -> Engine``; raises ``ValueError`` for a codec object it does not reproduce
    factory: Callable[[Any], Engine]
    #: what ``backend="auto"`` runs for this codec and device
    default: bool = False
    #: ``requires() -> None`` when it can run here, else the reason (and how to fix it)
    requires: Callable[[], str | None] | None = None

    def why_unusable(self) -> str | None:
        """Why this implementation cannot run here, or ``None``."""
        return None if self.requires is None else self.requires()


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

    def __init__(self, codec: CodecLike):
        self.codec = codec
        #: device-to-host reads this engine made (the compress and decompress it ran, and codec fits)
        self.readbacks = 0

    def for_tensor(self) -> Self:
        """A copy of this engine for one compress or decompress: what it was made with shared, its own codec (a fit
        replaces it) and :attr:`readbacks` (zero). :mod:`buddy.dispatch` keeps the engines it makes and hands out
        such copies, so that nothing one tensor does to its engine reaches another's. A subclass that keeps more
        per tensor (a cache of its codec's) gives the copy its own."""
        made = object.__new__(type(self))
        made.__dict__.update(self.__dict__)
        made.readbacks = 0
        return made

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """A small tensor on the host: the one place an engine waits for the device (:func:`to_host`; counted
        here per engine too)."""
        self.readbacks += 1
        return to_host(t)

    @abc.abstractmethod
    def measure(self, flat: torch.Tensor, layout: Layout) -> Measurement:
        """Sizes of the entries of ``flat`` (a 1-D ``uint8`` tensor, the tensor's bytes in memory order)."""

    def fit_measure(
        self, flat: torch.Tensor, layout: Layout, prior=None, keep=None, count: bool = True
    ) -> tuple[CodecLike, Measurement]:
        """The codec fitted to ``flat`` (see :meth:`Codec.fit`: a codec with a table fits it to the tensor, or to
        ``prior``, counting the tensor's symbols where ``count`` says so; any other codec is itself) and its
        :meth:`measure`; the engine runs the fitted codec from then on. What a compress calls: an engine that
        can count and fit where the tensor is overrides it, so that it reads back only what measure reads."""
        self.codec = self.codec.fit(flat, layout.word_bytes, prior, self.read, keep, count=count)
        return self.codec, self.measure(flat, layout)

    #: whether the engine compresses with a slot chosen before the sizes are known, reading nothing back
    #: (``pack_ahead``, :func:`buddy.pipeline.pack_ahead`): the engines of the kernels
    packs_ahead = False

    def writes_overflow_at(self, into: torch.Tensor, device: torch.device) -> bool:
        """Whether :meth:`pack_ahead` on ``device`` can write an overflow into ``into`` (buddy memory) where it is."""
        return False

    def pack_ahead(
        self, flat: torch.Tensor, layout: Layout, slot: int, sizes: torch.Tensor, into: torch.Tensor, *,
        prior=None, keep=None, count: bool = True, room: int | None = None, step: torch.Tensor | None = None,
        reserve: torch.Tensor | None = None,
    ) -> tuple[CodecLike, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Compress with a slot chosen before the sizes are known, reading nothing back: ``(codec, meta, slots,
        ends)`` (an engine that :attr:`packs_ahead`; see
        :meth:`buddy.engines.kernel_engine.KernelEngine.pack_ahead`)."""
        raise NotImplementedError(f"{self!r} does not pack ahead")

    def drain(
        self, layout: Layout, staged: torch.Tensor, ends: torch.Tensor, place: torch.Tensor, into: torch.Tensor
    ) -> None:
        """An overflow :meth:`pack_ahead` wrote into ``staged`` on the device (a region of an overflow ring) copied
        into ``into`` (buddy memory), on the current stream, its size never read (an engine that
        :attr:`packs_ahead`; see :meth:`buddy.engines.kernel_engine.KernelEngine.drain`)."""
        raise NotImplementedError(f"{self!r} does not pack ahead")

    def measure_ahead(
        self, flat: torch.Tensor, layout: Layout, sizes: torch.Tensor, *, prior=None, keep=None, count: bool = True
    ) -> CodecLike:
        """:meth:`pack_ahead`'s fit and sizes alone (an engine that :attr:`packs_ahead`): the fitted codec."""
        raise NotImplementedError(f"{self!r} does not pack ahead")

    def stored_table(self, device: torch.device) -> torch.Tensor | None:
        """The table a tensor coded with the engine's codec carries, on ``device`` (:attr:`CodecLike.table`)."""
        table = self.codec.table
        return None if table is None else table.to(device)

    #: whether :meth:`pack` writes the overflow into an ``into`` buffer of the host's (buddy memory) where it is
    #: given: an engine whose tensors live on the host writes its overflow once, where it is kept
    packs_into_host = False

    def _refuse_into(self, into: torch.Tensor | None, where: str) -> None:
        """``ValueError`` for an ``into`` given to an engine that writes its overflow ``where`` it does (one that
        does not :attr:`packs_into_host`)."""
        if into is not None and not self.packs_into_host:
            raise ValueError(f"{self!r} writes its overflow {where}: it takes no `into`")

    @abc.abstractmethod
    def pack(
        self, flat: torch.Tensor, measured: Measurement, slot: int, layout: Layout, into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, overflow)`` on ``flat``'s device: ``N * s * 32`` bytes, and the compacted overflow.

        ``into`` (only where :attr:`packs_into_host`): the overflow's place, ``uint8`` host memory of exactly
        its bytes, 16-byte aligned; the overflow returned is ``into``, written."""

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
    ends: torch.Tensor | None = None,
    placed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The one decode of :func:`buddy.unpack` and :meth:`BuddyTensor.decompress`, their arguments checked.

    ``buffers``: ``(meta, slots, overflow)``, flat ``uint8``; the slots must
    be as large as ``layout`` and ``slot`` say (:class:`CorruptDataError`).
    ``engine`` decodes them (``check`` and ``error_flag``: see
    :meth:`Engine.unpack`), and the bytes come back as the tensor of
    ``shape`` and ``dtype``, laid out with ``stride`` (or contiguous).
    ``ends``: the overflow's prefix sums a pack made ahead kept (for an
    engine that :attr:`~Engine.packs_ahead`; the others size it again).
    ``placed``: ``(place, reserve)``, where a pack ahead put the overflow's
    sectors, some in its step's reserve on the device (``overflow`` holding
    the others): only an engine that packs ahead reads that (the caller
    gives the others the overflow whole).
    """
    meta, slots, overflow = buffers
    if slots.numel() != layout.slots_bytes(slot):
        raise CorruptDataError(f"slots hold {slots.numel()} bytes, expected {layout.slots_bytes(slot)}")
    kept = {"ends": ends} if ends is not None and engine.packs_ahead else {}
    if placed is not None:
        if not engine.packs_ahead:
            raise ValueError(f"{engine!r} cannot read an overflow placed partly in a step's reserve")
        kept.update(place=placed[0], reserve=placed[1])
    flat = engine.unpack(meta, slots, overflow, slot, layout, check=check, error_flag=error_flag, **kept)
    return as_tensor(flat, shape, dtype, stride)


def raise_for_errors(codec: str, bits: int, stream: str) -> None:
    """:class:`~buddy.errors.CorruptDataError` for an unpack's error bits (nothing for 0); ``stream``: what a bad
    stream (:data:`ERR_STREAM`) means for the engine that flagged it."""
    if not bits:
        return
    if bits & ERR_MODE:
        raise CorruptDataError(f"metadata holds modes that codec {codec!r} never writes for such entries")
    if bits & ERR_K:
        raise CorruptDataError(f"{codec}: metadata claims more sectors than an entry has")
    if bits & ERR_OVERFLOW:
        raise CorruptDataError(f"{codec}: the overflow is not the size the metadata needs")
    if bits & ERR_STREAM:
        raise CorruptDataError(f"{codec}: {stream}")
    raise CorruptDataError(f"{codec}: the unpack failed (error bits {bits:#x})")
