"""The kernels of one codec, launched through the launcher passed in, every argument checked first.

:class:`Kernels` is the launch glue every device shares: it checks each
buffer (device, dtype, shape, contiguity, alignment of data pointers) before
anything is launched -- a bad one raises ``ValueError``, never an
out-of-bounds access on the device -- lays the arguments out as the kernels'
parameters (``csrc/buddy_kernels.cu``) and hands them to its launcher: CuPy's
on a GPU (:data:`buddy.engines.cuda.LAUNCHER`), the native build's on the CPU
(:data:`buddy.engines.native.LAUNCHER`), the block emulator's in the tests. A
:class:`Launcher` says what the device's kernels can reach of host memory
where it is, which is all the engine (:mod:`buddy.engines.kernel_engine`)
needs to know of the device beyond its type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import spec
from ..codecs.fpe import n_symbols
from ..codecs.fpe_device import DEVICE_TABLE_BYTES, FIT_SERIAL_BYTES, FIT_WORK_BYTES
from ..errors import CorruptDataError
from ..layout import Layout
from . import PLACE_WORDS
from .sources import TABLED_KERNELS
from .tuning import Tuning, current

__all__ = [
    "ALIGN_BYTES", "NO_BOUND", "Launcher", "Kernels", "check_tensor", "constant_zeros", "reads_in_place",
]  # fmt: skip

#: alignment (bytes) the kernels need of the tensor's data (every other buffer is allocated here)
ALIGN_BYTES = 16
#: the sizes kernel's ``room`` when nothing bounds the step's overflow
NO_BOUND = 1 << 62


def _reaches_none(host: torch.Tensor, device: torch.device) -> bool:
    return False


class Launcher(NamedTuple):
    """What runs the kernels on one kind of device, looked up where it lives at each use: an engine kept from call
    to call (:mod:`buddy.dispatch`) launches through what is there then, a test's stand-in included.

    ``of()`` returns the launch function (:class:`Kernels`' ``launch``); ``reaches(host, device)`` says whether
    the kernels on ``device`` load and store ``host`` (a tensor in host memory) where it is, over the bus (default:
    never, the buffers are copied to the device first).
    """

    of: Callable[[], Callable]
    reaches: Callable[[torch.Tensor, torch.device], bool] = _reaches_none


def reads_in_place(
    overflow: torch.Tensor, device: torch.device, tuning: Tuning, reaches: Callable[[torch.Tensor, torch.device], bool]
) -> bool:
    """Whether an unpack on ``device`` reads ``overflow`` in pinned host memory, over the bus, as its kernel runs
    (``reaches``: whether the device's kernels can, :attr:`Launcher.reaches`).

    By default the overflow is first copied to the device whole (on the compute stream, before the kernel):
    its time adds to the kernel's. Read in place, the copy is the kernel's own loads, overlapped with its
    decoding. Opt-in (:attr:`Tuning.zero_copy`) until a GPU run says which is faster; it needs the overflow
    pinned and a device that takes registered host pointers as they are.
    """
    if not tuning.zero_copy:
        return False
    return bool(overflow.numel()) and reaches(overflow, device)


def check_tensor(
    what: str, t, *, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...] | None = None
) -> None:
    """``ValueError`` unless ``t`` is a dense, aligned tensor of this device, dtype and shape."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{what} is on {t.device}, expected {device} (all buffers on the same CUDA device)")
    if t.dtype != dtype:
        raise ValueError(f"{what} must be {dtype}, got {t.dtype}")
    if shape is not None and t.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {tuple(t.shape)}")
    if t.layout != torch.strided or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous (dense) tensor")
    if t.numel():
        ptr = t.data_ptr()
        if ptr == 0:
            raise ValueError(f"{what} has a null data pointer")
        if ptr % ALIGN_BYTES:
            raise ValueError(
                f"{what}'s data pointer {ptr:#x} is not {ALIGN_BYTES}-byte aligned (a view at an odd "
                f"offset?); pass a copy (.clone())"
            )


def _i64(v: int):
    import numpy

    return numpy.int64(v)


def _i32(v: int):
    import numpy

    return numpy.int32(v)


_CONSTANT_ZEROS: dict[tuple[torch.device, int], torch.Tensor] = {}


def constant_zeros(device: torch.device, nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes on ``device``, made once per process and never written (a read-only input)."""
    found = _CONSTANT_ZEROS.get((device, nbytes))
    if found is None:
        found = _CONSTANT_ZEROS.setdefault((device, nbytes), torch.zeros(nbytes, dtype=torch.uint8, device=device))
    return found


def _placement(place, reserve, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack's and unpack's ``place`` and ``reserve`` arguments: the given ones, else null pointers (no placement:
    every overflow sector in the overflow buffer, in order)."""
    if place is None:
        return constant_zeros(device, 0).view(torch.int64), constant_zeros(device, 0)
    return place, reserve


class Kernels:
    """The kernels of codec ``name`` (``buddy_<name>_<op>``), arguments checked, launched by ``launch``.

    ``launch``: a :class:`Launcher` (asked at each launch), or a function
    ``launch(codec, op, entry_bytes, device, n_entries, args, tuning)`` that
    runs a kernel (a test's recorder or emulator), laid out as :attr:`tuning`
    says (given, else the current one when made: :mod:`buddy.engines.tuning`);
    ``device_type`` is the device the tensors must live on.
    Buffers: ``data`` the tensor's ``n_full`` whole entries (16-byte
    aligned), ``tail`` the last entry zero-padded (``E`` bytes), ``meta``
    ``n * META_BYTES`` bytes, ``ends`` ``(n,)`` int64 (see csrc/buddy_ops.h);
    ``table`` the codec's device table for the codecs that code with one
    (:data:`~buddy.engines.sources.TABLED_KERNELS`), else ``None``.
    """

    def __init__(
        self, name: str, *, launch: Launcher | Callable, device_type: str = "cuda", tuning: Tuning | None = None
    ):
        self.name = name
        self._launch = launch
        self.device_type = device_type
        self.tuning = current() if tuning is None else tuning

    @property
    def launcher(self) -> Callable:
        """What runs a kernel now (see the class doc)."""
        given = self._launch
        return given.of() if isinstance(given, Launcher) else given

    def reaches(self, host: torch.Tensor, device: torch.device) -> bool:
        """Whether the kernels on ``device`` load and store ``host`` (host memory) where it is: the launcher's
        :attr:`Launcher.reaches` (a launch function's: never)."""
        given = self._launch
        return isinstance(given, Launcher) and given.reaches(host, device)

    def launch(self, codec: str, op: str, entry_bytes: int, device: torch.device, n_entries: int, args: tuple) -> None:
        self.launcher(codec, op, entry_bytes, device, n_entries, args, self.tuning)

    def _check(self, layout: Layout, entries: tuple = (), **buffers) -> torch.device:
        """The buffers' common device; ``ValueError`` for any that is not what the kernels need.

        ``entries``: ``(data, tail)``, the tensor's whole entries and its last one (``E`` bytes, zero-padded).
        """
        if entries:
            data, tail = entries
            whole = (data, torch.uint8, layout.n_full * layout.entry_bytes)
            buffers = dict(data=whole, tail=(tail, torch.uint8, layout.entry_bytes), **buffers)
        device: torch.device | None = None
        for what, (t, dtype, numel) in buffers.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != self.device_type:
                raise ValueError(f"{what} must be on a CUDA device for the CUDA kernels, got one on {t.device}")
            device = device or t.device
            check_tensor(what, t, device=device, dtype=dtype, shape=(numel,))
        if device is None:
            raise ValueError("no buffers to check")
        return device

    def _table(self, table, device: torch.device) -> torch.Tensor:
        """The kernels' ``table`` argument: the codec's device table
        (:func:`~buddy.codecs.fpe_device.device_table`), checked; for a codec without one, nothing (an empty tensor:
        a null pointer)."""
        want = DEVICE_TABLE_BYTES if self.name in TABLED_KERNELS else 0
        if table is None:
            if want:
                raise ValueError(f"codec {self.name!r} codes with a table: pass its device table (device_table)")
            table = torch.empty(0, dtype=torch.uint8, device=device)
        check_tensor("table", table, device=device, dtype=torch.uint8, shape=(want,))
        return table

    def measure(self, layout: Layout, data, tail, meta, histogram, table=None) -> None:
        """Every entry's metadata word into ``meta``; entries of ``k`` sectors added to ``histogram[k]``."""
        device = self._check(
            layout, (data, tail), meta=(meta, torch.uint8, layout.meta_bytes),
            histogram=(histogram, torch.int64, layout.bins),
        )  # fmt: skip
        table = self._table(table, device)
        n_full, n, word = _i64(layout.n_full), _i64(layout.n_entries), _i32(layout.word_bytes)
        args = (data, tail, n_full, n, meta, histogram, table, word)
        self.launch(self.name, "measure", layout.entry_bytes, device, layout.n_entries, args)

    def count(self, layout: Layout, data, tail, counts) -> None:
        """A table codec's symbol counts of the tensor's whole words added to ``counts`` (``S + 2`` int64): the
        8-byte units of ``data`` and the whole words of the tail's :attr:`~Layout.tail_bytes`. A warp's lanes of
        equal keys add their number once, or its zero words are counted by ballots and the other words added one by
        one (:meth:`Tuning.count_matches`: 2-byte words by default): the same counts."""
        self._tabled()
        word = layout.word_bytes
        device = self._check(layout, (data, tail), counts=(counts, torch.int64, n_symbols(word)))
        n_units, tail_words = layout.n_full * layout.entry_bytes // 8, layout.tail_bytes // word
        aggregate = _i32(int(self.tuning.count_matches(word)))
        args = (data, _i64(n_units), tail, _i32(tail_words), counts, aggregate, _i32(word))
        self.launch(self.name, "count", layout.entry_bytes, device, n_units, args)

    def fit(self, layout: Layout, counts, work, table, serial, weighted: bool = False) -> None:
        """The table fitted to ``counts`` (:meth:`Table.from_counts`): the device table into ``table``
        (:data:`DEVICE_TABLE_BYTES`), the serialized one into ``serial`` (:data:`FIT_SERIAL_BYTES`, zeros
        after it); ``work``: :data:`FIT_WORK_BYTES` of scratch. ``weighted``: ``counts`` are the weights
        :func:`~buddy.codecs.fpe.fit_weights` makes of counts or frequencies, fitted as they are."""
        self._tabled()
        device = self._check(
            layout, counts=(counts, torch.int64, n_symbols(layout.word_bytes)),
            work=(work, torch.uint8, FIT_WORK_BYTES), table=(table, torch.uint8, DEVICE_TABLE_BYTES),
            serial=(serial, torch.uint8, FIT_SERIAL_BYTES),
        )  # fmt: skip
        args = (counts, work, table, serial, _i32(int(weighted)), _i32(layout.word_bytes))
        self.launch(self.name, "fit", layout.entry_bytes, device, 1, args)

    def sizes(
        self, layout: Layout, data, tail, meta, histogram, slot: int, ends, place, *, room: int | None = None,
        step=None, reserve_sectors: int = 0, table=None,
    ) -> None:  # fmt: skip
        """:meth:`measure` and :meth:`ends` in one launch, for slots of ``slot`` sectors chosen before the sizes are
        known, and where the overflow goes: every entry's metadata word into ``meta``, entries of ``k`` sectors
        added to ``histogram[k]``, the overflow's prefix sums into ``ends`` (``n`` int64), and its placement into
        ``place`` (:data:`PLACE_WORDS` int64, zero: ``cap``, ``r``, ``offset``, then the kernel's count of its
        blocks done), all of it but measure's by the launch's last block.

        The placement: the first ``cap`` overflow sectors to buddy memory, as many as ``room`` (the sectors the
        step's bound allows its tensors so far, this one's included; None: no bound) less what the step sent there
        before (``step[0]``); the next ``r`` to the step's reserve on the device at sector ``offset``, as many as
        are left of its ``reserve_sectors`` (``step[1]`` used); any others to buddy memory. ``step``: 2 int64 on
        the device, zero at the step's start, which it adds to (None: no step, no reserve)."""
        n = layout.n_entries
        buffers = dict(
            meta=(meta, torch.uint8, layout.meta_bytes), histogram=(histogram, torch.int64, layout.bins),
            ends=(ends, torch.int64, n), place=(place, torch.int64, PLACE_WORDS),
        )  # fmt: skip
        if step is not None:
            buffers["step"] = (step, torch.int64, 2)
        device = self._check(layout, (data, tail), **buffers)
        if reserve_sectors < 0 or (reserve_sectors and step is None):
            raise ValueError(f"a reserve of {reserve_sectors} sectors needs a step's state (step=) and is >= 0")
        table = self._table(table, device)
        step = constant_zeros(device, 0).view(torch.int64) if step is None else step
        room = _i64(NO_BOUND if room is None else max(0, min(int(room), NO_BOUND)))
        n_full, word = _i64(layout.n_full), _i32(layout.word_bytes)
        args = (data, tail, n_full, _i64(n), meta, histogram, table, _i32(slot), ends, place, room, step,
                _i64(reserve_sectors), word)  # fmt: skip
        self.launch(self.name, "sizes", layout.entry_bytes, device, n, args)

    def ends(self, layout: Layout, meta, slot: int, ends) -> None:
        """Per entry into ``ends`` (``n`` int64), the overflow sectors of entries ``0..i`` with slots of ``slot``
        sectors: ``max(k - slot, 0)`` summed, ``k`` from ``meta``."""
        n = layout.n_entries
        device = self._check(layout, meta=(meta, torch.uint8, layout.meta_bytes), ends=(ends, torch.int64, n))
        args = (meta, _i64(n), _i32(slot), ends, _i32(layout.word_bytes))
        self.launch(self.name, "ends", layout.entry_bytes, device, n, args)

    def _tabled(self) -> None:
        if self.name not in TABLED_KERNELS:
            raise ValueError(f"codec {self.name!r} codes without a table: it has no count or fit kernel")

    def _host_or_checked(self, what: str, t) -> tuple[dict, bool]:
        """``t``'s entry for :meth:`_check` (uint8, any size), none where it is in host memory, which the CUDA kernels
        reach where it is (then checked apart: :func:`_check_host_overflow`); and whether it is."""
        in_place = self.device_type == "cuda" and isinstance(t, torch.Tensor) and t.device.type == "cpu"
        return ({} if in_place else {what: (t, torch.uint8, t.numel())}), in_place

    def _overflow_buffers(self, overflow, place, reserve) -> tuple[dict, bool]:
        """Pack's and unpack's overflow and placement buffers for :meth:`_check`, and whether the overflow is in
        host memory, which the CUDA kernels reach where it is (then checked apart: :func:`_check_host_overflow`). A
        placement (:meth:`sizes`'s) and the step's reserve go together."""
        if (place is None) != (reserve is None):
            raise ValueError("a placement and a reserve go together: pass both or neither")
        buffers, in_place = self._host_or_checked("overflow", overflow)
        if place is not None:
            buffers.update(place=(place, torch.int64, PLACE_WORDS), reserve=(reserve, torch.uint8, reserve.numel()))
        return buffers, in_place

    def pack(
        self, layout: Layout, data, tail, meta, ends, slot: int, slots, overflow, table=None, place=None,
        reserve=None,
    ) -> None:  # fmt: skip
        """Every entry's slot (``slot`` sectors) into ``slots``, its overflow into ``overflow`` at its place.

        ``overflow`` is on the device, or (CUDA kernels) in pinned host memory mapped into the device's address
        space, written where it is over the bus
        (:meth:`buddy.engines.kernel_engine.KernelEngine.writes_overflow_at`). With ``place`` (the :meth:`sizes`
        kernel's) and ``reserve`` (the step's, on the device: whole sectors), the overflow's
        sectors go where the placement says, some of them into the reserve."""
        n = layout.n_entries
        buffers, in_place = self._overflow_buffers(overflow, place, reserve)
        device = self._check(
            layout, (data, tail), meta=(meta, torch.uint8, layout.meta_bytes), ends=(ends, torch.int64, n),
            slots=(slots, torch.uint8, layout.slots_bytes(slot)), **buffers,
        )  # fmt: skip
        if in_place:
            _check_host_overflow(overflow, "write")
        table = self._table(table, device)
        place, reserve = _placement(place, reserve, device)
        n_full, word = _i64(layout.n_full), _i32(layout.word_bytes)
        args = (data, tail, n_full, _i64(n), meta, ends, _i32(slot), slots, overflow, place, reserve, table, word)
        self.launch(self.name, "pack", layout.entry_bytes, device, n, args)

    def unpack(
        self, layout: Layout, meta, ends, slot: int, slots, overflow, out, error, table=None, place=None,
        reserve=None,
    ) -> None:  # fmt: skip
        """The entries into ``out`` (``n * E`` bytes); ``error`` (one int32) ORed with what was flagged.

        ``overflow`` is on the device, or (CUDA kernels) in pinned host memory, read where it is over the bus
        (:func:`reads_in_place`). With ``place`` and ``reserve`` (as :meth:`pack`'s), the overflow's
        sectors are where the placement says, ``overflow`` holding those not in the reserve; a placement that
        would read outside either is flagged."""
        if overflow.numel() % spec.SECTOR_BYTES:
            raise CorruptDataError(f"overflow holds {overflow.numel()} bytes, not a whole number of sectors")
        n = layout.n_entries
        if reserve is not None and reserve.numel() % spec.SECTOR_BYTES:
            raise CorruptDataError(f"the reserve holds {reserve.numel()} bytes, not a whole number of sectors")
        buffers, in_place = self._overflow_buffers(overflow, place, reserve)
        device = self._check(
            layout, meta=(meta, torch.uint8, layout.meta_bytes), ends=(ends, torch.int64, n),
            slots=(slots, torch.uint8, layout.slots_bytes(slot)), out=(out, torch.uint8, n * layout.entry_bytes),
            error=(error, torch.int32, 1), **buffers,
        )  # fmt: skip
        if in_place:
            _check_host_overflow(overflow, "read")
        m = overflow.numel() // spec.SECTOR_BYTES
        table = self._table(table, device)
        word = _i32(layout.word_bytes)
        reserved = 0 if reserve is None else reserve.numel() // spec.SECTOR_BYTES
        place, reserve = _placement(place, reserve, device)
        args = (meta, ends, _i32(slot), slots, overflow, _i64(m), place, reserve, _i64(reserved), out, error, _i64(n),
                table, word)  # fmt: skip
        self.launch(self.name, "unpack", layout.entry_bytes, device, n, args)

    def drain(self, layout: Layout, staged, ends, place, buddy) -> None:
        """A tensor's overflow, packed (:meth:`pack`) into ``staged`` on the device with ``ends`` and the sizes
        kernel's ``place``, copied to ``buddy``: its sectors less those the placement put in the step's reserve
        (``ends[-1] - place[1]``, never read here), at most as many as both hold. ``buddy`` is on the device, or
        (CUDA kernels) in pinned host memory mapped into the device's address space, written over the bus (an
        overflow ring's drain, :mod:`buddy.ring`)."""
        n = layout.n_entries
        buffers, in_place = self._host_or_checked("buddy", buddy)
        device = self._check(
            layout, staged=(staged, torch.uint8, staged.numel()), ends=(ends, torch.int64, n),
            place=(place, torch.int64, PLACE_WORDS), **buffers,
        )  # fmt: skip
        if in_place:
            _check_host_overflow(buddy, "write")
        capacity = min(staged.numel(), buddy.numel()) // spec.SECTOR_BYTES
        args = (staged, _i64(capacity), ends, _i64(n), place, buddy, _i32(layout.word_bytes))
        self.launch(self.name, "drain", layout.entry_bytes, device, n, args)


def _check_host_overflow(overflow: torch.Tensor, verb: str) -> None:
    """``ValueError`` unless an overflow in host memory is what the CUDA kernels can ``verb`` where it is: pinned
    (when it holds anything), dense and aligned."""
    if overflow.numel() and not overflow.is_pinned():
        raise ValueError(f"an overflow in host memory must be pinned for the CUDA kernels to {verb} it")
    check_tensor("overflow", overflow, device=overflow.device, dtype=torch.uint8, shape=(overflow.numel(),))
