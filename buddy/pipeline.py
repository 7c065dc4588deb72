"""The compress pipeline, one straight line: measure, decide, pack -- and unpack back.

::

    measured = buddy.measure(t, "auto", entry_bytes=512)   # every entry's size: metadata + histogram
    slot = ...                                              # the caller decides (a ratio, an overflow bound, the tracker)
    bt = buddy.pack(measured, slot, store=store)            # slots + metadata on the device, overflow to buddy memory
    t2 = bt.decompress()                                    # bit-identical

:func:`compress` is exactly these three steps with the slot from
``target_ratio`` or from ``max_overflow``; the training session
(:mod:`buddy.autograd`) and :func:`buddy.wrap` decide with the tracker.
Sizes are computed once (by :func:`measure`); :func:`pack` writes from them.
Every argument is checked before anything is allocated: wrong types raise
``TypeError``, wrong values ``ValueError``, each saying what is accepted.

Arguments shared by the functions here:

* ``codec``: name or :class:`~buddy.codecs.Codec` (default ``"auto2"``, or
  what :func:`buddy.set_defaults` set; see :func:`buddy.available_codecs`);
* ``entry_bytes``: ``E``, a power of two in [32, 65536] (default 512);
* ``backend``: who runs the codec: ``"reference"`` (torch ops), ``"cuda"``
  (its CUDA kernels; off by default), ``"nvcomp"``, or ``"auto"``/``None``
  (the default for the codec and device); see :mod:`buddy.dispatch`;
* ``store``: the :class:`~buddy.BuddyStore` taking the overflow (default
  :func:`buddy.default_store`);
* ``on_full``: when the store cannot take the overflow: ``"raise"``
  :class:`~buddy.errors.HostStoreFull` (default) before anything is written,
  or ``"device"``: the smallest slot with no overflow, the tensor whole on
  the device;
* ``checksum``: ``True`` stores a 64-bit checksum of each buffer, checked
  before decoding (:mod:`buddy.integrity`); ``None``: the process default;
* ``ledger``: the :class:`~buddy.ledger.DeviceLedger` the device bytes are held on
  (default :func:`buddy.ledger.default_ledger`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import config, dispatch, engines, integrity, spec, streams
from .codecs import CodecLike, get_codec
from .engines import PLACE_WORDS, Engine, Measurement
from .errors import CorruptDataError, HostStoreFull, Moved
from .integrity import Checksum
from .layout import LaidOut, Layout, dense_strides, memory_bytes
from .ledger import DeviceLedger, default_ledger
from .ring import OverflowRing
from .slots import DEFAULT_MAX_OVERFLOW, check_max_overflow, slot_for_overflow, tightest_slot
from .store import BuddyStore, default_store
from .tensor import BuddyTensor, check_tensor

__all__ = ["MeasuredTensor", "measure", "pack", "pack_ahead", "resolve", "compress", "unpack", "size_histogram"]

_ON_FULL = ("raise", "device")


@dataclass(frozen=True, eq=False)
class MeasuredTensor(LaidOut):
    """A tensor whose entries have been sized (made by :func:`measure`): all :func:`pack` needs.

    ``histogram[k]`` entries compress to ``k`` sectors; :meth:`overflow_bytes`
    gives the buddy bytes of any slot, which is all a slot choice needs.
    """

    tensor: torch.Tensor
    flat: torch.Tensor  # the tensor's bytes in memory order (uint8, 1-D)
    stride: tuple[int, ...]  # strides the decompressed tensor gets
    codec: CodecLike  # the codec fitted to the tensor (a codec with a table), else the one asked for
    engine: Engine
    layout: Layout  # entry size, word size, bytes: built once, here
    measurement: Measurement

    @property
    def histogram(self) -> tuple[int, ...]:
        return self.measurement.histogram

    @property
    def backend(self) -> str:
        return self.engine.backend

    @property
    def table(self) -> torch.Tensor | None:
        """The table the codec fitted to the tensor (format version 2), or ``None``."""
        return self.codec.table

    @property
    def statistics(self) -> torch.Tensor | None:
        """The tensor's symbol statistics, for a tracker to learn the key's table from (codecs with a table)."""
        return self.codec.statistics

    def overflow_bytes(self, slot: int) -> int:
        """Buddy bytes with a slot of ``slot`` sectors."""
        return self.layout.overflow_bytes(self.histogram, slot)

    def __repr__(self) -> str:
        return (
            f"MeasuredTensor({tuple(self.tensor.shape)} {self.tensor.dtype}, codec={self.codec.name!r}, "
            f"entry_bytes={self.entry_bytes}, backend={self.backend!r}, histogram={list(self.histogram)})"
        )


class _PackOptions(NamedTuple):
    store: BuddyStore
    on_full: str
    checksum: bool
    ledger: DeviceLedger


def _resolve(tensor, codec, entry_bytes, backend) -> tuple[Engine, Layout]:
    """The tensor checked; its engine (codec and backend) and its layout from the arguments and defaults."""
    check_tensor(tensor)
    codec = get_codec(config.defaults().codec if codec is None else codec)
    layout = Layout.of(tensor, config.defaults().entry_bytes if entry_bytes is None else entry_bytes)
    return dispatch.engine(codec, tensor.device, backend), layout


def resolve(tensor, codec=None, entry_bytes=None, backend=None) -> tuple[Engine, Layout]:
    """The engine that would compress ``tensor`` (its codec and backend, or the defaults) and its layout: what a
    caller choosing the slot before the sizes are known (:func:`pack_ahead`) plans with. Arguments checked."""
    return _resolve(tensor, codec, entry_bytes, backend)


def pack_ahead(
    tensor: torch.Tensor, engine: Engine, layout: Layout, slot: int, sizes: torch.Tensor, *, store: BuddyStore,
    ledger: DeviceLedger, prior: torch.Tensor | None = None, keep: CodecLike | None = None, count: bool = True,
    room: int | None = None, step: torch.Tensor | None = None, reserve: torch.Tensor | None = None,
    ring: OverflowRing | None = None,
) -> BuddyTensor | None:  # fmt: skip
    """Compress ``tensor`` with a slot chosen before its sizes are known: measure and pack with nothing read back.

    What a training step does with the tracker's plan (:mod:`buddy.autograd`, ``strict=False``): ``engine`` and
    ``layout`` from :func:`resolve`, ``slot`` from the plan, ``sizes`` ``PLACE_WORDS + layout.bins`` zero int64 on
    the tensor's device: where the sizes kernel places the overflow, then the histogram the sizes are added to -- a
    slice of a buffer the step reads once for all its tensors. The overflow goes where the pack kernel writes it,
    into a range of ``store`` reserved at its worst case (every entry raw), which :meth:`BuddyTensor.settle` trims
    to what it holds once the sizes are read; with a ``reserve`` (the step's, whole sectors on the device), its
    sectors past the ``room`` the step's bound leaves go there instead (``room``, ``step``:
    :meth:`buddy.engines.kernels.Kernels.sizes`). With a ``ring`` (the tensor's device's, :mod:`buddy.ring`) the
    pack writes the overflow into a region of it instead, and the copy stream drains it into that range (a worst
    case larger than the ring: as without one). ``prior``, ``keep``, ``count``: as in :func:`measure` (a codec with
    a table needs a ``prior``).

    Returns a :class:`BuddyTensor` not yet settled, or ``None`` where it cannot be packed so (an engine that
    does not pack ahead, a codec with a table and no prior, checksums on by default, a store without room for
    the worst case, buddy memory the device cannot write): the caller then measures and packs (one read).
    """
    _check_sizes(sizes, layout)
    if not engine.packs_ahead or (prior is None and engine.codec.format_version >= 2) or config.defaults().checksum:
        # (a codec with a table and no prior: its table is fitted to the tensor's counts, read back; checksums: of
        # buffers the host reads, every one of them)
        return None
    worst = layout.slots_bytes(layout.sectors_per_entry) - layout.slots_bytes(slot)
    try:
        overflow = store.allocate(worst)
    except HostStoreFull:
        return None
    try:
        if not engine.writes_overflow_at(overflow.data, tensor.device):
            store.release(overflow)
            return None
        flat, stride = memory_bytes(tensor)
        codec, meta, slots, ends = _pack_into(
            ring, overflow, worst, engine, flat, layout, slot, sizes, prior=prior, keep=keep, count=count, room=room,
            step=step, reserve=reserve,
        )  # fmt: skip
        table = engine.stored_table(tensor.device)
        return BuddyTensor(
            shape=tensor.shape, stride=stride, dtype=tensor.dtype, device=tensor.device, codec=codec, layout=layout,
            slot_sectors=slot, histogram=sizes, slots=slots, meta=meta, overflow=overflow, store=store,
            ledger=ledger, backend=engine.backend, table=table, ends=ends if kept_ends_bytes(layout) else None,
            reserve=reserve,
        )  # fmt: skip
    except BaseException:
        store.release(overflow)  # nothing half-written survives, KeyboardInterrupt included
        raise


def _pack_into(ring: OverflowRing | None, overflow, worst: int, engine: Engine, flat, layout: Layout, slot: int,
               sizes: torch.Tensor, **kwargs):  # fmt: skip
    """``engine.pack_ahead`` with the overflow going into ``overflow`` (a :class:`~buddy.store.BuddyAllocation`
    reserved at the ``worst`` case): written there by the pack (no ``ring``, or a worst case larger than it), else
    packed into a region of the ring and drained into it on the copy stream (a failure frees the region once the
    work issued before it is done)."""
    region = None if ring is None else ring.stage(worst)
    if region is None:
        return engine.pack_ahead(flat, layout, slot, sizes, overflow.data, **kwargs)
    assert ring is not None
    try:
        packed = engine.pack_ahead(flat, layout, slot, sizes, region.data, **kwargs)
        ring.drain(region, engine, layout, packed[3], sizes[:PLACE_WORDS], overflow)
    except BaseException:
        ring.abandon(region)
        raise
    return packed


#: the smallest entry size at which a tensor packed ahead keeps its overflow's prefix sums for unpack (8 bytes an
#: entry: 0.8 % of its bytes at 1 KiB entries, 6.25 % at 128 B); below it, unpack makes them again (one more launch)
ENDS_KEPT_FROM = 1024


def kept_ends_bytes(layout: Layout) -> int:
    """Device bytes a tensor of ``layout`` packed ahead keeps of its overflow's prefix sums (see ENDS_KEPT_FROM)."""
    return 8 * layout.n_entries if layout.entry_bytes >= ENDS_KEPT_FROM else 0


def _check_sizes(sizes, layout: Layout) -> None:
    """``ValueError`` unless ``sizes`` is what :func:`pack_ahead` takes: ``PLACE_WORDS + layout.bins`` int64."""
    want = PLACE_WORDS + layout.bins
    if not isinstance(sizes, torch.Tensor) or sizes.dtype != torch.int64 or sizes.shape != (want,):
        got = tuple(sizes.shape) if isinstance(sizes, torch.Tensor) else type(sizes).__name__
        raise ValueError(f"sizes must be {want} zero int64 (PLACE_WORDS + layout.bins), got {got}")


def _pack_options(store, on_full, checksum, ledger) -> _PackOptions:
    if store is not None and not isinstance(store, BuddyStore):
        raise TypeError(f"store must be a buddy.BuddyStore (or None for the default), got {type(store).__name__}")
    if not isinstance(on_full, str) or on_full not in _ON_FULL:
        raise ValueError(f"on_full must be one of {_ON_FULL}, got {on_full!r}")
    if ledger is not None and not isinstance(ledger, DeviceLedger):
        raise TypeError(
            f"ledger must be a buddy.ledger.DeviceLedger (or None for the default), got {type(ledger).__name__}"
        )
    checksum = config.defaults().checksum if checksum is None else config.check_checksum(checksum)
    return _PackOptions(store or default_store(), on_full, checksum, ledger or default_ledger())


def _measure(tensor: torch.Tensor, engine: Engine, layout: Layout, prior=None, keep=None, count=True) -> MeasuredTensor:
    flat, stride = memory_bytes(tensor)
    fitted, measurement = engine.fit_measure(flat, layout, prior, keep, count)  # a codec with a table fits it
    return MeasuredTensor(tensor, flat, stride, fitted, engine, layout, measurement)


def measure(
    tensor: torch.Tensor,
    codec: str | CodecLike | None = None,
    *,
    entry_bytes: int | None = None,
    backend: str | None = None,
    prior: torch.Tensor | None = None,
    keep: CodecLike | None = None,
    count: bool = True,
) -> MeasuredTensor:
    """Size every entry of ``tensor`` (nothing is stored): the first step of :func:`compress`.

    ``tensor``: any dense tensor on any device (see :func:`compress`). The
    result holds the metadata on the tensor's device and the size histogram
    on the host (one device-to-host read), and keeps ``tensor`` alive until
    it is packed or dropped. A codec with a table (``fpe``, ``auto2``) fits
    it to the tensor's own statistics, or to ``prior`` -- statistics learned
    over earlier steps (:meth:`buddy.Tracker.prior`) -- when given; then
    ``keep``, the codec measured for the same key before (:meth:`buddy.Tracker.fitted`),
    lends its table while the prior still fits it, and nothing is fitted.
    With a ``prior``, ``count=False`` skips counting the tensor's symbols
    (:attr:`MeasuredTensor.statistics` is then ``None``): a pass over the tensor
    a tracker that has learned the key does only every few steps
    (:meth:`buddy.Tracker.counts`).
    """
    engine, layout = _resolve(tensor, codec, entry_bytes, backend)
    return _measure(tensor, engine, layout, prior=prior, keep=keep, count=count)


def size_histogram(
    tensor: torch.Tensor, codec: str | CodecLike | None = None, *, entry_bytes: int | None = None, backend=None
) -> list[int]:
    """How compressible ``tensor`` is: ``h[k]`` of its entries compress to ``k`` sectors (see :func:`measure`).

    ``sum(k * h[k]) * 32`` is the compacted size; :func:`buddy.slots.overflow_sectors`
    gives the overflow of any slot.
    """
    return list(measure(tensor, codec, entry_bytes=entry_bytes, backend=backend).histogram)


def pack(
    measured: MeasuredTensor,
    slot: int,
    *,
    store: BuddyStore | None = None,
    on_full: str = "raise",
    checksum: bool | None = None,
    ledger: DeviceLedger | None = None,
) -> BuddyTensor:
    """Store a measured tensor with slots of ``slot`` sectors: the last step of :func:`compress`.

    ``slot`` is ``0 .. E/32`` (``E / (32 * slot)`` is the target ratio). The
    other arguments are described in the module doc. Nothing is sized again.
    """
    if not isinstance(measured, MeasuredTensor):
        raise TypeError(f"pack takes what buddy.measure returns, got {type(measured).__name__}")
    options = _pack_options(store, on_full, checksum, ledger)
    return _pack(measured, measured.layout.check_slot(slot), options)


def _pack(measured: MeasuredTensor, slot: int, options: _PackOptions) -> BuddyTensor:
    store = options.store
    try:  # buddy memory for the overflow, before anything is written
        overflow = store.allocate(measured.overflow_bytes(slot))
    except HostStoreFull:
        if options.on_full == "raise":
            raise
        slot = tightest_slot(measured.histogram)
        overflow = store.allocate(0)
    try:
        engine, t = measured.engine, measured.tensor
        # an engine of the host's tensors writes the overflow where it is kept (buddy memory is the host's):
        # no staging buffer, no copy -- where the host's streams are the synchronous ones (not a test's stand-in).
        # `into` is passed only then: an engine a user registered before it existed packs without it
        direct = engine.packs_into_host and streams.for_device(t.device).synchronous
        into = overflow.data if direct and overflow.nbytes else None
        args = (measured.flat, measured.measurement, slot, measured.layout)
        slots, staged = engine.pack(*args) if into is None else engine.pack(*args, into=into)
        if staged.numel() != overflow.nbytes:
            raise RuntimeError(
                f"{engine!r} wrote {staged.numel()} overflow bytes where its sizes said {overflow.nbytes}"
            )
        if into is None:
            _offload(staged, overflow, t.device)
        meta = measured.measurement.meta
        table = _to_device(measured.table, t.device)  # decoding reads it there
        sums = integrity.checksums(meta, slots, staged, table) if options.checksum else None
        # built inside the try: an interrupt as the tensor counts itself in must not strand its overflow
        return BuddyTensor(
            shape=t.shape, stride=measured.stride, dtype=t.dtype, device=t.device, codec=measured.codec,
            layout=measured.layout, slot_sectors=slot, histogram=measured.histogram, slots=slots, meta=meta,
            overflow=overflow, store=store, ledger=options.ledger, backend=engine.backend, checksum=sums, table=table,
        )  # fmt: skip
    except BaseException:
        store.release(overflow)  # nothing half-written survives, KeyboardInterrupt included
        raise


def _to_device(table: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A codec's table (host bytes) on the tensor's device; to a GPU from pinned memory, without waiting for it
    (a blocking copy would wait for everything queued on the stream)."""
    if table is None or table.device == device:
        return table
    if device.type == "cuda" and table.device.type == "cpu":
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def _offload(staged: torch.Tensor, overflow, device: torch.device) -> None:
    """Copy the packed overflow into buddy memory on the device's copy stream; the compute stream never waits."""
    if not overflow.nbytes:
        return
    ops = streams.for_device(device)
    compute, copy = ops.current(device), ops.copy_stream(device)
    packed = ops.record(compute)  # the pack wrote `staged` on the compute stream
    with ops.activate(copy):
        ops.wait(copy, packed)  # the copy reads `staged` only after the pack has written it
        overflow.data.copy_(staged, non_blocking=True)  # device -> pinned host memory
        overflow.written_on(ops, copy)  # readers wait for it; the store reuses the range only after it
    ops.keep_for(staged, copy)  # allocated on the compute stream: not reused before the copy has read it


def compress(
    tensor: torch.Tensor,
    target_ratio: float | None = None,
    codec: str | CodecLike | None = None,
    *,
    entry_bytes: int | None = None,
    max_overflow: float | None = None,
    store: BuddyStore | None = None,
    on_full: str = "raise",
    backend: str | None = None,
    checksum: bool | None = None,
    ledger: DeviceLedger | None = None,
) -> BuddyTensor:
    """Compress ``tensor`` into slots on its device and overflow in buddy memory: measure, decide, pack.

    ``tensor``: any dense (strided) tensor on any device, read in memory
    order (copied to contiguous only if it has gaps); it is not modified and
    may be dropped afterwards. One that requires grad is compressed as its
    detached data (for what autograd saves, use
    :func:`buddy.compressed_activations`). Sparse, quantized, nested, meta,
    fake and vmap-batched tensors raise :class:`~buddy.errors.UnsupportedTensorError`.

    Give the slot one way, never both (both: ``ValueError``):

    * ``target_ratio``: ``E / (32 s)`` for a slot of ``s`` sectors (E = 4096:
      128/128 ... 128/1, and ``inf`` for the zero slot). A ratio the sector
      grid cannot give exactly takes the nearest slot when that is within 1 %
      of it (``4/3`` and ``1.33`` alike give ``s = 3`` at E = 128), else the
      next larger slot, which gives a lower ratio than asked for (``3.0`` at
      E = 4096: ``s = 43``, 2.977x): :func:`buddy.spec.slot_for_ratio`. The
      ratio used is ``bt.target_ratio``; the one asked for, ``bt.requested_ratio``.
      The overflow is whatever the data makes it.
    * ``max_overflow`` (default 0.10): the most aggressive slot whose
      overflow stays within this fraction (in [0, 1]) of the tensor's bytes,
      on the tensor's own size pass.

    Other arguments: see the module doc. Returns a :class:`BuddyTensor`; the
    size pass needs one device-to-host read.
    """
    engine, layout = _resolve(tensor, codec, entry_bytes, backend)
    if max_overflow is not None:
        max_overflow = check_max_overflow(max_overflow)
        if target_ratio is not None:
            raise ValueError(
                f"give either target_ratio ({target_ratio!r}: a fixed slot, whatever it spills) or max_overflow "
                f"({max_overflow!r}: the slot from the tensor's sizes), not both"
            )
    max_overflow = DEFAULT_MAX_OVERFLOW if max_overflow is None else max_overflow
    fixed = None if target_ratio is None else spec.slot_for_ratio(target_ratio, layout.entry_bytes)
    options = _pack_options(store, on_full, checksum, ledger)
    measured = _measure(tensor, engine, layout)
    slot = fixed if fixed is not None else slot_for_overflow(measured.histogram, max_overflow, measured.nbytes)
    bt = _pack(measured, slot, options)
    bt.requested_ratio = None if target_ratio is None else _as_float(target_ratio)
    return bt


def unpack(
    meta: torch.Tensor,
    slots: torch.Tensor,
    overflow: torch.Tensor,
    *,
    codec: str | CodecLike,
    entry_bytes: int,
    slot_sectors: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    stride: Sequence[int] | None = None,
    backend: str | None = None,
    checksum: Checksum | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode the buffers of the format into a tensor on ``slots``' device.

    The bytes are laid out in memory order with ``stride`` (a dense layout;
    default contiguous). ``meta`` and ``slots`` live on the same device;
    ``overflow`` may live on any device (host buddy memory); all three are
    ``uint8`` tensors of any shape, read in C order.

    Damaged or hostile buffers never crash the process, read or write out of
    bounds or hang: every buffer must be exactly as large as the format says,
    and anything inconsistent raises :class:`~buddy.errors.CorruptDataError`.
    Without a ``checksum``, damage the format cannot see (a changed mantissa
    bit) decodes to a tensor of the right shape with wrong values; with one
    (:attr:`BuddyTensor.checksum`), the buffers are checked before anything
    is decoded. The exception: nvcomp's Zstd, GDeflate, Cascaded and Bitcomp
    decompressors are undefined on a damaged stream (their documentation), so
    for ``nvcomp-zstd``, ``-gdeflate``, ``-cascaded`` and ``-bitcomp`` only a
    checksum keeps such damage from them (:mod:`buddy.engines.nvcomp`).
    ``table``: the codec table of a format version 2 tensor
    (:attr:`BuddyTensor.table`); codecs without one refuse it.
    """
    codec = get_codec(codec)
    shape = _check_shape(shape)
    word = spec.word_bytes(dtype)  # TypeError / ValueError for anything that is not a dtype buddy stores
    layout = Layout(entry_bytes, math.prod(shape) * torch.empty((), dtype=dtype).element_size(), word)
    slot_sectors = layout.check_slot(slot_sectors)
    stride = None if stride is None else _check_stride(stride, shape)
    meta, slots, overflow = (_byte_buffer(n, b) for n, b in (("meta", meta), ("slots", slots), ("overflow", overflow)))
    if meta.device != slots.device:
        raise ValueError(f"meta and slots must be on the same device, got {meta.device} and {slots.device}")
    table = None if table is None else _byte_buffer("table", table)
    if checksum is not None:
        integrity.verify(meta, slots, overflow, checksum, table)  # before anything is decoded
    codec = codec.bind(table, word)  # CorruptDataError for a damaged table, or one the codec does not take
    engine = dispatch.engine(codec, slots.device, backend)
    return engines.decode(engine, (meta, slots, overflow), slot_sectors, layout, shape, dtype, stride)


def _byte_buffer(name: str, buffer) -> torch.Tensor:
    """A buffer given to :func:`unpack`, checked and flattened."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of uint8 bytes, got {type(buffer).__name__}")
    if buffer.dtype != torch.uint8:
        raise CorruptDataError(f"{name} must be a buffer of uint8 bytes, got a tensor of {buffer.dtype}")
    if buffer.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it holds no bytes to decode")
    return buffer.reshape(-1)


def _check_shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (``TypeError``/``ValueError`` otherwise)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"shape must be a sequence of ints (a torch.Size), got {type(shape).__name__}")
    if any(isinstance(n, bool) or not isinstance(n, int) for n in shape):
        raise TypeError(f"shape must hold ints, got {tuple(shape)!r}")
    if any(n < 0 for n in shape):
        raise ValueError(f"shape must not have negative sizes, got {tuple(shape)}")
    return tuple(shape)


def _check_stride(stride, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``stride`` as a tuple of ints forming a dense layout of ``shape`` (``ValueError`` otherwise)."""
    if isinstance(stride, (str, bytes)) or not isinstance(stride, Sequence):
        raise TypeError(f"stride must be a sequence of ints, got {type(stride).__name__}")
    stride = tuple(stride)
    if len(stride) != len(shape) or any(isinstance(n, bool) or not isinstance(n, int) for n in stride):
        raise ValueError(f"stride {stride!r} does not fit shape {shape}: one int per dimension")
    if not dense_strides(shape, stride):
        raise ValueError(f"stride {stride} is not a dense layout of shape {shape}")
    return stride


def _as_float(ratio: float) -> float:
    """``ratio`` as a float; an integer too large for one (``2**2000``, accepted as a ratio) is ``inf``."""
    try:
        return float(ratio)
    except OverflowError:
        return math.inf


if not TYPE_CHECKING:  # hidden from mypy, which would otherwise accept any attribute of this module
    __getattr__ = Moved(__name__, {"Measured": (__name__, "MeasuredTensor")})  # engines.Measurement is the engine's
