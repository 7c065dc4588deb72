"""The one kernel engine of every device: the format operations as kernels over the whole tensor.

:class:`KernelEngine` runs a codec's kernels through the launcher passed in
(:class:`~buddy.engines.kernels.Launcher`): CuPy's on a CUDA device
(:func:`buddy.engines.cuda.CudaEngine`), the native build's on the CPU
(:func:`buddy.engines.native.NativeEngine`), the block emulator's in the
tests. So what the host does per tensor -- argument checks, allocations, the
launches, reads -- is one code on every device, and what the CPU counts of
it is what a GPU pays.

One kernel per format operation over the whole tensor, the codec a template
parameter (``csrc/buddy_kernels.cu``): ``measure`` (metadata + size
histogram), ``ends`` (the overflow's prefix sums, one block), ``sizes``
(measure, then the ends in whichever block is done last: a slot chosen
before the sizes compresses in two launches), ``pack`` (slots + overflow
compacted in entry order, written directly) and ``unpack``. A compress sized
first reads one small thing back to the host -- the histogram, which the
slot choice needs --, a compress packed ahead
(:meth:`KernelEngine.pack_ahead`) nothing, and a decompress nothing
(:meth:`KernelEngine.unpack` reads the kernel's error flag only when asked to
check).

Codecs with a table (format version 2: ``fpe``, and ``auto2`` through its
``fpe`` member) code with the fitted codec's :class:`~buddy.codecs.fpe.Table`:
:func:`~buddy.codecs.fpe_device.device_table` lays out its lookups as the
kernels read them (``BuddyFpeTable`` in ``csrc/codec_fpe.h``), and every
kernel takes it by pointer (null for the other codecs). Their engine fits the
table itself (:meth:`KernelEngine.fit_measure`): a ``count`` kernel gives the
tensor's symbol counts, and a ``fit`` kernel -- one warp,
:meth:`~buddy.codecs.fpe.Table.from_counts` byte for byte
(``csrc/codec_fpe_fit.h``) -- fits a table to them, or to learned statistics
(a prior) when the table fitted to the prior before no longer codes it well,
and writes the device table and the serialized table, which comes back in the
histogram's read. So a compress reads the device once with or without a
prior, and the host lays out no table it fitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import spec
from ..codecs.auto import AutoCodec, member_kinds
from ..codecs.base import Codec, CodecLike
from ..codecs.fpe import MAX_CODED, Table, fit_weights, n_symbols, refits
from ..codecs.fpe_device import (
    DEVICE_TABLE_BYTES,
    FIT_SERIAL_BYTES,
    FIT_WORK_BYTES,
    kernel_table,
    remember_device_table,
    stored_table,
)  # fmt: skip
from ..errors import CorruptDataError
from ..layout import Layout
from . import PLACE_WORDS, Engine, Measurement, raise_for_errors
from .kernels import ALIGN_BYTES, Kernels, Launcher, check_tensor, constant_zeros, reads_in_place
from .sources import KERNEL_CODECS, TABLED_KERNELS
from .tuning import Tuning

if TYPE_CHECKING:
    from collections.abc import Callable

    from typing_extensions import Self

__all__ = ["KernelEngine"]

#: what a bad stream (ERR_STREAM) means for the kernels' unpack
_BAD_STREAM = (
    "a payload (its bitmap or stream) does not match the entry sizes in the metadata "
    "(or, for a codec with a table, holds codes the table does not give)"
)


class KernelEngine(Engine):
    """The format operations as kernels over the whole tensor: the same bytes as the reference.

    ``launch``: the launcher (a :class:`~buddy.engines.kernels.Launcher`, or a launch function: see
    :class:`~buddy.engines.kernels.Kernels`), ``device_type`` the device the tensors live on, ``tuning`` the launch
    settings (default: the current ones when made). The host's work per tensor -- argument checks, allocations, the
    count, fit, measure, sizes, ends, pack and unpack launches, reads -- is the same whatever the launcher.
    :attr:`readbacks` counts the device-to-host reads made (per compress sized first one: the histogram, with a
    table codec's table when it fits one; none per decompress unless ``check=True``; none by :meth:`pack_ahead`).
    """

    backend = "cuda"
    codec: Codec

    def __init__(
        self, codec: CodecLike, *, launch: Launcher | Callable, device_type: str = "cuda", tuning: Tuning | None = None
    ):
        # the kernels reproduce exactly buddy's class of that name (an auto codec: with its own members, in order)
        kinds = tuple((m, type(c)) for m, c in codec.members) if isinstance(codec, AutoCodec) else None
        exact = type(codec) is KERNEL_CODECS.get(codec.name)
        if not exact or (kinds is not None and kinds != member_kinds(codec.name)):
            have = ", ".join(sorted(KERNEL_CODECS))
            raise ValueError(
                f"codec {codec.name!r} ({type(codec).__name__}) has no CUDA kernels (codecs with them: {have})"
            )
        super().__init__(codec)
        self.kernels = Kernels(codec.name, launch=launch, device_type=device_type, tuning=tuning)
        self._tables: dict[tuple[torch.device, int], torch.Tensor | None] = {}

    def for_tensor(self) -> Self:
        """:meth:`Engine.for_tensor`: the kernels shared; the device tables of the copy's codec its own (a fit
        puts the fitted table's there)."""
        made = super().for_tensor()
        made._tables = {}
        return made

    def _table(self, device: torch.device, word_bytes: int) -> torch.Tensor | None:
        """The codec's device table for the kernels (:func:`~buddy.codecs.fpe_device.kernel_table`: copied to a
        device once per table, from pinned memory, non-blocking, on the current stream, which the kernels reading
        it follow); ``None`` for a codec without one."""
        key = (device, word_bytes)
        if key not in self._tables:
            self._tables[key] = kernel_table(self.codec, word_bytes, device)
        return self._tables[key]

    @staticmethod
    def _entries(flat: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, tail)``: the whole entries in place (aligned), the last one zero-padded (``E`` bytes).

        A tensor of whole entries (most activations) has no last entry to pad: its ``tail`` is a buffer of zeros
        kept per device and entry size, which the kernels never write (the glue makes one per tensor otherwise)."""
        whole = layout.n_full * layout.entry_bytes
        if flat.numel() and flat.data_ptr() % ALIGN_BYTES:
            flat = flat.clone()  # a view at an odd offset: the kernels load 16 bytes at a time
        if not layout.tail_bytes:
            return flat[:whole], constant_zeros(flat.device, layout.entry_bytes)
        tail = torch.zeros(layout.entry_bytes, dtype=torch.uint8, device=flat.device)
        tail[: layout.tail_bytes] = flat[whole:]
        return flat[:whole], tail

    def _ends(self, meta: torch.Tensor, slot: int, layout: Layout) -> torch.Tensor:
        """Per entry, the overflow sectors of entries 0..i: the prefix sums that place each entry's overflow (the
        ends kernel, on every device: one launch, one allocation)."""
        ends = torch.empty(layout.n_entries, dtype=torch.int64, device=meta.device)
        if layout.n_entries:
            self.kernels.ends(layout, meta, slot, ends)
        return ends

    def _measure(self, flat, entries, layout: Layout, histogram) -> torch.Tensor:
        """The metadata of ``entries`` (:meth:`_entries`); sizes added to the device ``histogram``."""
        meta = torch.empty(layout.meta_bytes, dtype=torch.uint8, device=flat.device)
        if layout.n_entries:
            table = self._table(flat.device, layout.word_bytes)
            data, tail = entries
            self.kernels.measure(layout, data, tail, meta, histogram, table)
        return meta

    def measure(self, flat, layout):
        return self._measure_read(flat, self._entries(flat, layout), layout)

    def _measure_read(self, flat, entries, layout: Layout) -> Measurement:
        """:meth:`measure` of entries already made: the histogram is the one read."""
        histogram = torch.zeros(layout.bins, dtype=torch.int64, device=flat.device)
        meta = self._measure(flat, entries, layout, histogram)
        return Measurement(meta, tuple(self.read(histogram).tolist()), reuse=entries)

    def fit_measure(self, flat, layout, prior=None, keep=None, count=True):
        """The codec fitted to ``flat`` and its sizes, with one read of the device (see the module doc).

        A codec with a table (:data:`TABLED_KERNELS`) is counted and fitted
        on the device: the ``count`` kernel gives the tensor's symbol counts
        (the fitted codec's :attr:`~buddy.codecs.base.Codec.statistics`, left
        on the device). The ``fit`` kernel fits the table to them, or, with a
        ``prior``, to the weights the host's fit makes of it
        (:func:`~buddy.codecs.fpe.fit_weights`: the table
        :meth:`~buddy.codecs.fpe.Table.from_counts` would make of the prior)
        -- unless ``keep``'s table still codes the prior well
        (:func:`~buddy.codecs.fpe.refits`), which is then kept (nothing
        fitted, nothing more read). A fitted table's serialized bytes come
        back with the histogram, from which the host rebuilds the same
        :class:`~buddy.codecs.fpe.Table`
        (:meth:`~buddy.codecs.fpe.Table.from_bytes`); on the CPU its laid-out
        bytes are kept for the engines of later steps
        (:func:`remember_device_table`). With a prior and without ``count``
        nothing is counted (the fitted codec's statistics are ``None``). Any
        other codec has nothing to fit.
        """
        if self.codec.name not in TABLED_KERNELS:
            return super().fit_measure(flat, layout, prior, keep, count)
        device, codec, word = flat.device, self.codec, layout.word_bytes
        entries = self._entries(flat, layout)
        counts = self._count(layout, entries, device) if prior is None or count else None
        kept = codec.kept_table(keep)
        if prior is not None and kept is not None and not refits(prior, word, kept):
            self.codec = codec.with_table(kept, counts)  # keep's table, still good: what codec.fit(prior) returns
            self._tables.clear()  # the fitted table, not the unfitted codec's
            return self.codec, self._measure_read(flat, entries, layout)
        # fitted here: to the tensor's counts, or to the prior's weights (the host's fit of them, byte for byte)
        if prior is None and counts is not None:
            fit_to = counts
        else:
            weights = fit_weights(prior, word)
            fit_to = (weights.pin_memory() if device.type == "cuda" else weights).to(device, non_blocking=True)
        # one buffer for what comes back: the histogram, then (16-byte aligned) the serialized table
        at = -(-layout.bins // 2) * 2
        readout = torch.zeros(at + -(-FIT_SERIAL_BYTES // 8), dtype=torch.int64, device=device)
        serial = readout[at:].view(torch.uint8)[:FIT_SERIAL_BYTES]
        table = torch.empty(DEVICE_TABLE_BYTES, dtype=torch.uint8, device=device)
        work = torch.empty(FIT_WORK_BYTES, dtype=torch.uint8, device=device)
        self.kernels.fit(layout, fit_to, work, table, serial, weighted=prior is not None)
        self._tables[(device, word)] = table
        meta = self._measure(flat, entries, layout, readout[: layout.bins])
        host = self.read(readout)
        raw = host[at:].view(torch.uint8)[:FIT_SERIAL_BYTES]
        n = int(raw[2]) | int(raw[3]) << 8
        if n > MAX_CODED + 2:
            raise RuntimeError(f"the fit kernel wrote a table of {n} codes (at most {MAX_CODED + 2})")
        fitted = Table.from_bytes(raw[: 4 + 3 * n].clone(), word)
        if prior is not None:
            fitted.fit_slack = fitted.slack(prior)  # as Table.from_counts sets it: the next step may keep the table
        if device.type == "cpu":
            remember_device_table(fitted, table)  # its decompress, and the next step's engine, need not lay it out
        self.codec = codec.with_table(fitted, counts)
        return self.codec, Measurement(meta, tuple(host[: layout.bins].tolist()), reuse=entries)

    def _count(self, layout: Layout, entries: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> torch.Tensor:
        """The count kernel's symbol counts of the tensor's ``entries`` (:meth:`_entries`), on its device."""
        counts = torch.zeros(n_symbols(layout.word_bytes), dtype=torch.int64, device=device)
        self.kernels.count(layout, *entries, counts)
        return counts

    def pack(self, flat, measured, slot, layout, into=None):
        self._refuse_into(into, f"on {flat.device}")
        data, tail = measured.reuse or self._entries(flat, layout)
        spilled = layout.overflow_bytes(measured.histogram, slot)  # known on the host: no read
        slots = torch.empty(layout.slots_bytes(slot), dtype=torch.uint8, device=flat.device)
        overflow = torch.empty(spilled, dtype=torch.uint8, device=flat.device) if into is None else into
        if layout.n_entries:
            ends = self._ends(measured.meta, slot, layout)
            table = self._table(flat.device, layout.word_bytes)
            self.kernels.pack(layout, data, tail, measured.meta, ends, slot, slots, overflow, table)
        return slots, overflow

    #: whether :meth:`pack_ahead` can compress a tensor with a slot chosen before its sizes are known
    packs_ahead = True

    @property
    def packs_into_host(self) -> bool:  # type: ignore[override]  # a property over the class attribute
        """Kernels launched on the host's tensors (the native build, the emulator) write the overflow where it is
        kept, buddy memory being the host's."""
        return self.kernels.device_type == "cpu"

    def writes_overflow_at(self, into: torch.Tensor, device: torch.device) -> bool:
        """Whether the pack kernel on ``device`` can write an overflow into ``into`` (buddy memory) where it is:
        the host's memory, for tensors of the host; for another device's, host memory its kernels reach
        (:meth:`Kernels.reaches`: on a GPU, pinned memory mapped into the device's address space, on a device that
        takes a registered host pointer as it is; each write then crosses the bus as the kernel runs)."""
        if into.device.type != "cpu" or into.data_ptr() % ALIGN_BYTES:
            return False
        if self.kernels.device_type == "cpu":
            return device.type == "cpu"
        return not into.numel() or self.kernels.reaches(into, device)

    def pack_ahead(
        self, flat, layout, slot, sizes, into, *, prior=None, keep=None, count=True, room=None, step=None,
        reserve=None,
    ):  # fmt: skip
        """Compress ``flat`` with a slot chosen before its sizes are known: nothing is read back.

        ``sizes``: :data:`PLACE_WORDS` ``+ layout.bins`` int64 on the tensor's device, zero: the sizes kernel's
        placement words (:meth:`Kernels.sizes`), then the histogram the entries' sizes are added to (a slice of
        a step's buffer, read once for all its tensors). ``room``, ``step``: the step's bound and its state on the
        device (:meth:`Kernels.sizes`); ``reserve``: the step's reserve, whole sectors on the device, which takes
        the overflow sectors past the tensor's room (None: none, they go to buddy memory); ``into``: the overflow's
        place in buddy memory, at least ``layout.slots_bytes(E / 32) - layout.slots_bytes(slot)`` bytes (the worst case: every
        entry stored raw), where the pack kernel writes it (:meth:`writes_overflow_at`), or as many on the tensor's
        device (a region of an overflow ring, which :meth:`drain` then copies to buddy memory); the bytes it holds are
        ``32 * ends[-1]``, known once ``histogram`` is read. A codec with a table fits it on the host to
        ``prior`` (``keep``'s while it still codes the prior well) and counts the tensor's symbols on the device
        where ``count`` says so; it needs a ``prior`` (without one its table is fitted to the tensor's counts,
        which are read back). Returns ``(codec, meta, slots, ends)``: the fitted codec, the metadata and slots on
        the device, and per entry the overflow sectors of entries ``0..i`` (int64 on the device; kept for
        unpack). Two launches (the count a third, where asked): sizes -- the metadata, the histogram and the
        prefix sums --, then pack.
        """
        device = flat.device
        worst = layout.slots_bytes(layout.sectors_per_entry) - layout.slots_bytes(slot)
        if into.numel() < worst or not (into.device == device or self.writes_overflow_at(into, device)):
            raise ValueError(
                f"pack_ahead writes the overflow into {worst} bytes of buddy memory it can reach, or of the device"
            )
        entries = self._fit_ahead(flat, layout, prior, keep, count)
        meta = torch.empty(layout.meta_bytes, dtype=torch.uint8, device=device)
        slots = torch.empty(layout.slots_bytes(slot), dtype=torch.uint8, device=device)
        ends = torch.empty(layout.n_entries, dtype=torch.int64, device=device)
        if layout.n_entries:
            table = self._table(device, layout.word_bytes)
            place, histogram = sizes[:PLACE_WORDS], sizes[PLACE_WORDS:]
            reserved = 0 if reserve is None else reserve.numel() // spec.SECTOR_BYTES
            self.kernels.sizes(
                layout, *entries, meta, histogram, slot, ends, place, room=room, step=step, reserve_sectors=reserved,
                table=table,
            )  # fmt: skip
            placed = {} if reserve is None else {"place": place, "reserve": reserve}
            self.kernels.pack(layout, *entries, meta, ends, slot, slots, into, table, **placed)
        return self.codec, meta, slots, ends

    def drain(self, layout, staged, ends, place, into) -> None:
        """:meth:`Engine.drain`: one launch (:meth:`Kernels.drain`), on the current stream; ``staged`` and ``into``
        as :meth:`pack_ahead`'s ``into`` (the worst case, ``into`` where its kernels write it:
        :meth:`writes_overflow_at`), ``ends`` and ``place`` its prefix sums and the sizes kernel's placement words
        (``sizes[:PLACE_WORDS]``), read by the kernel alone."""
        if into.device != staged.device and not self.writes_overflow_at(into, staged.device):
            raise ValueError("drain writes the overflow into buddy memory its kernels reach")
        if layout.n_entries:
            self.kernels.drain(layout, staged, ends, place, into)

    def stored_table(self, device: torch.device) -> torch.Tensor | None:
        """The table a tensor coded with the engine's codec carries (:attr:`CodecLike.table`) on ``device``: one
        copy per table and device, shared by every tensor coded with it (none writes it); ``None`` without one."""
        return stored_table(self.codec, device)

    def measure_ahead(self, flat, layout, sizes, *, prior=None, keep=None, count=True):
        """:meth:`pack_ahead`'s fit and sizes alone, nothing packed (a tensor kept as it is, whose key goes on
        learning): the fitted codec; the sizes are added to ``sizes``' histogram (as :meth:`pack_ahead`'s)."""
        entries = self._fit_ahead(flat, layout, prior, keep, count)
        self._measure(flat, entries, layout, sizes[PLACE_WORDS:])
        return self.codec

    def _fit_ahead(self, flat, layout: Layout, prior, keep, count: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensor's entries (:meth:`_entries`), the engine's codec fitted with nothing read back: a codec with
        a table fits it on the host to ``prior`` (counting the tensor's symbols on the device where ``count``
        says so); any other is itself."""
        entries = self._entries(flat, layout)
        if self.codec.name in TABLED_KERNELS:
            if prior is None:
                raise ValueError(f"codec {self.codec.name!r} fits its table to the tensor without a prior: a read")
            counts = self._count(layout, entries, flat.device) if count else None
            self.codec = self.codec.fit(flat, layout.word_bytes, prior, None, keep, counts=counts, count=count)
            self._tables.clear()  # the fitted table, not the unfitted codec's
        return entries

    def unpack(
        self, meta, slots, overflow, slot, layout, *, check=True, error_flag=None, ends=None, place=None, reserve=None
    ):  # fmt: skip
        """:meth:`Engine.unpack`; ``ends``: the overflow's prefix sums :meth:`pack_ahead` made, kept with the tensor
        (else made again here from the metadata); ``place``, ``reserve``: where it put the overflow's sectors, some
        of them in the step's reserve (``overflow`` then holds the others)."""
        n, e = layout.n_entries, layout.entry_bytes
        if meta.numel() != layout.meta_bytes:
            raise CorruptDataError(f"metadata holds {meta.numel()} bytes, expected {layout.meta_bytes}")
        out = torch.empty(n * e, dtype=torch.uint8, device=slots.device)
        if n:
            meta = meta if meta.data_ptr() % 2 == 0 else meta.clone()  # 2-byte words are read aligned
            if not reads_in_place(overflow, slots.device, self.kernels.tuning, self.kernels.reaches):
                overflow = overflow.to(slots.device, non_blocking=True)  # H2D from pinned memory, on the current stream
            error = _error_flag(error_flag, slots.device)
            ends = self._ends(meta, slot, layout) if ends is None else ends
            table = self._table(slots.device, layout.word_bytes)
            self.kernels.unpack(layout, meta, ends, slot, slots, overflow, out, error, table, place, reserve)
            if check:
                raise_for_errors(self.codec.name, int(self.read(error)[0]), _BAD_STREAM)
        return out[: layout.nbytes]


def _error_flag(given: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The int32 an unpack ORs its error bits into: ``given`` (checked), else a fresh zero."""
    if given is None:
        return torch.zeros(1, dtype=torch.int32, device=device)
    check_tensor("error_flag", given, device=device, dtype=torch.int32, shape=(1,))
    return given
