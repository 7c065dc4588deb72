"""What a training step keeps on the device for the host to read once: counters a tensor gets a slice of.

A step that reads nothing back per tensor (:mod:`buddy.autograd`, ``strict=False``) still needs, from the device,
every compressed tensor's entry-size histogram (its overflow's size, the tracker's learning, the stats) and every
decompressed tensor's error bits. Each tensor is given a slice of a buffer made once for the step, and the host
reads a buffer whole where the step ends: one read where forward ends, one where backward ends.

:class:`Checks` holds a step's error flags of decompressions, read where each backward ends. :class:`AheadStep` is
a session's step packed that way: the slices of its tensors' sizes, its running bound and
device reserve, and where forward ends the settling of every tensor with its sizes.

:class:`Counters` hands out the slices, zeroed, on any device; :meth:`Counters.read` brings what was handed out to
the host in one read per device (:func:`buddy.engines.to_host`, which counts it).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import engines, spec
from .eager import eager_only
from .engines import PLACE_WORDS
from .errors import CorruptDataError
from .layout import Layout
from .tracker import group_of

if TYPE_CHECKING:
    from .codecs import CodecLike
    from .stats import KeyRow, SessionStats
    from .tensor import BuddyTensor
    from .tracker import Policy, Tracker

__all__ = ["Counters", "Checks", "AheadStep", "Pending", "past_bound", "past_bound_warning"]


class Counters:
    """Zeroed ``dtype`` slices of buffers made a chunk at a time, per device, read back together.

    ``chunk``: the elements a buffer starts with; a step that needs more makes a larger one (at least the last
    step's total), so a steady step makes one buffer and reads it once. Every slice starts 16-byte aligned (the
    kernels' arguments are).
    """

    def __init__(self, dtype: torch.dtype, chunk: int):
        if chunk < 1:
            raise ValueError(f"chunk must be at least one element, got {chunk}")
        self.dtype = dtype
        self._align = max(1, _ALIGN_BYTES // dtype.itemsize)
        self._chunk = chunk
        self._lock = threading.Lock()
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}
        self._used: dict[torch.device, int] = {}  # elements of the device's last buffer handed out (padded)
        self._taken: dict[torch.device, list[tuple[int, int, int]]] = {}  # per slice: (buffer, start, elements)

    def taken(self, device: torch.device) -> int:
        """Slices handed out on ``device`` this step: the place in :meth:`read`'s list of the next one taken."""
        with self._lock:
            return len(self._taken.get(device, ()))

    def take(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` zero elements on ``device``, a slice of the step's buffer (no allocation but a buffer's)."""
        padded = -(-n // self._align) * self._align
        with self._lock:
            buffers = self._buffers.setdefault(device, [])
            used = self._used.get(device, 0)
            if not buffers or used + padded > buffers[-1].numel():
                size = max(self._chunk, padded, sum(b.numel() for b in buffers))
                buffers.append(torch.zeros(size, dtype=self.dtype, device=device))
                used = 0
            self._used[device] = used + padded
            self._taken.setdefault(device, []).append((len(buffers) - 1, used, n))
            return buffers[-1][used : used + n]

    def read(self, device: torch.device) -> list[list[int]]:
        """Every slice handed out on ``device``, in order, on the host: one read."""
        with self._lock:
            buffers = self._buffers.get(device, [])
            taken = list(self._taken.get(device, []))
            used = self._used.get(device, 0)
        if not buffers:
            return []
        parts = buffers[:-1] + [buffers[-1][:used]]
        values = engines.to_host(parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        starts = [0]
        for part in parts[:-1]:
            starts.append(starts[-1] + part.numel())
        return [values[starts[b] + at : starts[b] + at + n] for b, at, n in taken]

    @property
    def devices(self) -> list[torch.device]:
        with self._lock:
            return list(self._buffers)

    def next_step(self) -> None:
        """Start over for the next step: its first buffer holds what this step used (it never holds a slice
        handed out before: the old buffers live on with whoever holds them)."""
        with self._lock:
            used = max((sum(b.numel() for b in bs[:-1]) + self._used[d] for d, bs in self._buffers.items()), default=0)
            self._chunk = max(self._chunk, used)
            self._buffers, self._used, self._taken = {}, {}, {}


#: where a slice starts (bytes): the kernels load their arguments 16 bytes at a time
_ALIGN_BYTES = 16


class Checks:
    """The error flags of one step's decompressions on the device, read once at the end of each backward.

    An engine whose checks run on the device (the CUDA kernels, nvcomp) ORs
    an entry's failed check into the tensor's flag instead of reading it
    back. The first flag of a backward queues :meth:`check` to run when that
    backward ends (autograd's final callback), which reads every flag there
    at once (one read per device) and raises :class:`CorruptDataError`
    naming the keys that failed. Outside a backward (a saved tensor read
    directly) a flag is checked at once.
    """

    __slots__ = ("pending", "lock", "flags", "reads")

    def __init__(self):
        self.pending: list[tuple[str, torch.Tensor]] = []
        self.lock = threading.Lock()
        self.reads = 0  # reads of the flags made (one per device a check)
        self.flags = Counters(torch.int32, 1024)  # a flag a decompression: slices of a buffer made per 1024

    def flag(self, bt: BuddyTensor) -> torch.Tensor | None:
        """A zeroed flag for ``bt``'s decompression, or ``None`` where its backend checks on the host."""
        return None if bt.backend == "reference" else self.flags.take(1, bt.device)

    def add(self, key: str, flag: torch.Tensor) -> None:
        with self.lock:
            first = not self.pending
            self.pending.append((key, flag))
        if first:
            try:
                # (run by autograd where backward ends, maybe inside a compiled frame: never traced)
                torch.autograd.Variable._execution_engine.queue_callback(eager_only(self.check))
            except RuntimeError:  # not inside a backward pass: nothing to wait for
                self.check()

    def check(self) -> None:
        """Read the pending flags (one read per device); :class:`CorruptDataError` naming the keys that failed."""
        with self.lock:
            pending, self.pending = self.pending, []
        failed = []
        for device in {flag.device for _, flag in pending}:
            mine = [(key, flag) for key, flag in pending if flag.device == device]
            bits = engines.to_host(torch.cat([flag for _, flag in mine])).tolist()
            self.reads += 1
            failed += [f"{key!r} (error bits {b:#x})" for (key, _), b in zip(mine, bits) if b]
        if failed:
            raise CorruptDataError(
                f"buddy: {len(failed)} saved activation(s) failed the format's checks when decompressed for this "
                f"backward pass: {', '.join(failed)}. Their entries decoded to zeros, so this backward's gradients "
                f"are not valid: drop them and the graph, and run the step again."
            )


# ---- a step packed ahead of its sizes ----------------------------------------------------------
#: bytes a device reserve is a whole number of
_RESERVE_ROUND = 4096

#: elements of the buffer a step's histograms are slices of (int64; 254 tensors of 4 KiB entries): made when the
#: step packs its first tensor ahead, and larger when a step needs more
_HISTOGRAMS_CHUNK = 1 << 15


class Pending(NamedTuple):
    """A tensor packed ahead whose sizes the step reads where forward ends."""

    row: KeyRow
    layout: Layout
    device: torch.device
    bt: BuddyTensor | None  # None: kept as it is (the raw slot), only measured
    codec: CodecLike  # what it was measured with (the tracker keeps its table)
    bounded: bool  # packed within the step's running bound (its sectors past it: the reserve's)
    at: int  # its words' place among the step's slices on its device (Counters.taken)


class AheadStep:
    """A session's step with slots from the tracker's plan, nothing read per tensor (``strict=False``).

    It hands each tensor packed ahead the slice its sizes come back in (:meth:`sizes`), the step's running bound
    in overflow sectors (:meth:`room`) and its device reserve (:meth:`reserve`); where forward ends,
    :meth:`settle` reads every slice in one read per device and settles each tensor with its sizes. The caller
    holds its session's lock around everything but :meth:`settle`.
    """

    def __init__(self) -> None:
        self.histograms = Counters(torch.int64, _HISTOGRAMS_CHUNK)
        self.next_step()

    def next_step(self) -> None:
        self.histograms.next_step()
        self.pending: list[Pending] = []
        # per device, the step's reserve: (its state on the device, its buffer). The step before's lives on with
        # the tensors that hold some of it.
        self.reserves: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.seen = self.sized_spent = 0  # the step's bytes taken so far, and the overflow of those sized

    def taken(self, nbytes: int, buddy_bytes: int) -> None:
        """A tensor of ``nbytes`` was taken, ``buddy_bytes`` of it known to be in buddy memory (0: not yet)."""
        self.seen += nbytes
        self.sized_spent += buddy_bytes

    def room(self, bound: float, nbytes: int) -> int:
        """The overflow sectors a tensor of ``nbytes`` may send to buddy memory within the step's running bound
        (with its bytes), less what the step's sized tensors sent there: the rest goes to the reserve."""
        return int(bound * (self.seen + nbytes)) // spec.SECTOR_BYTES - self.sized_spent // spec.SECTOR_BYTES

    def sizes(self, n: int, device: torch.device) -> tuple[int, torch.Tensor]:
        """``n`` zeroed words on ``device`` for a tensor's placement and histogram, and their place in the read."""
        return self.histograms.taken(device), self.histograms.take(n, device)

    def reserve(
        self, device: torch.device, group: str, bound: float, tracker: Tracker, stats: SessionStats
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's reserve on ``device``: its state (2 int64 of the step's buffer: the overflow sectors the
        step's tensors sent to buddy memory, and those they took of the reserve) and its buffer, as large as the
        tracker says from the model's (``group``'s) recent steps (None: they sent nothing past their bound), made
        at its first tensor. Its bytes are held on the tracker's ledger while any tensor holds a part of it."""
        found = self.reserves.get(device)
        if found is None:
            state = self.histograms.take(2, device)
            sectors = tracker.reserve_sectors(group, bound)
            nbytes = -(-sectors * spec.SECTOR_BYTES // _RESERVE_ROUND) * _RESERVE_ROUND
            reserve = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None
            if reserve is not None:
                tracker.ledger.hold(nbytes).release_when_collected(reserve)
                stats.reserve_bytes += nbytes
            found = self.reserves[device] = (state, reserve)
        return found

    def take_pending(self) -> list[Pending]:
        """The tensors to settle; the reserves go (the tensors with overflow in one hold it, and its hold)."""
        pending, self.pending, self.reserves = self.pending, [], {}
        return pending

    def settle(self, pending: list[Pending], stats: SessionStats, tracker: Tracker) -> None:
        """Where forward ends: the sizes of every tensor in ``pending`` in one read (per device), each tensor's
        buddy memory trimmed to its overflow, the tracker taught, the stats filled in."""
        if not pending:
            return
        read = {device: self.histograms.read(device) for device in self.histograms.devices}
        excess = 0  # overflow sectors past the step's running bound: the reserve's, or passing it
        for p in pending:
            words = read[p.device][p.at]
            histogram = words[PLACE_WORDS:]
            if p.bt is not None:
                p.bt.settle(words)
                if p.bounded:  # its overflow (settled: what buddy memory holds, and the reserve) past its cap
                    total = (p.bt.buddy_bytes + p.bt.reserve_bytes) // spec.SECTOR_BYTES
                    excess += max(0, total - words[0])
                    stats.reserved_bytes += p.bt.reserve_bytes
            row = p.row
            row.buddy_bytes = 0 if p.bt is None else p.bt.buddy_bytes
            row.reserve_bytes = 0 if p.bt is None else p.bt.reserve_bytes
            row.ideal_bytes = Layout.compacted_bytes(histogram)
            stats.buddy_bytes += row.buddy_bytes
            stats.ideal_bytes += row.ideal_bytes
            slot = p.layout.sectors_per_entry if p.bt is None else p.bt.slot_sectors
            tracker.record(
                row.key, histogram, slot=slot, layout=p.layout,
                predicted_overflow_bytes=row.predicted_overflow_bytes, statistics=p.codec.statistics, fitted=p.codec,
            )  # fmt: skip
        bounded = [p for p in pending if p.bounded]
        if bounded:  # what the next steps' reserve is sized from
            tracker.record_excess(group_of(bounded[0].row.key), excess)
            stats.reserve_short_bytes = excess * spec.SECTOR_BYTES - stats.reserved_bytes


def past_bound(stats: SessionStats) -> tuple[KeyRow, int, int] | None:
    """Where the step's running overflow first passed its policy's bound: the row, and the overflow and original
    bytes up to it (over the tensors the policy placed); ``None``: it never did, or the policy states none."""
    bound, spent, seen = stats.overflow_bound, 0, 0
    if bound is None:
        return None
    for row in stats.rows:
        if row.left is not None:  # (outside the bound's bytes: the policy placed none of it)
            continue
        spent, seen = spent + row.buddy_bytes, seen + row.original_bytes
        if spent > bound * seen:
            return row, spent, seen
    return None


def past_bound_warning(stats: SessionStats, policy: Policy, strict: bool, row: KeyRow, spent: int, seen: int):
    """The cause (once per process and policy) and the text of the warning for a step past its bound.

    The policies that state a bound keep it whatever the history (see :mod:`buddy.tracker`); what can still push
    a step past it is a slot the policy did not choose, or a reserve too small (``strict=False``). The warning
    names the tensor with which the step's running overflow first passed the bound, and the figures.
    """
    why = (
        "A slot the policy did not choose (a custom policy, or a store that could not take the overflow) does "
        "this." if strict else
        "With strict=False slots come from the tracker's plan before the tensors are sized; what tensors that "
        "compress worse than their history spill past the bound goes to a device reserve sized from recent "
        "steps, and this step's had no room for some of it (the next step's plan and reserve learn from this "
        "one); strict=True keeps the bound on every tensor's own sizes, at a read per tensor."
    )  # fmt: skip
    bound = stats.overflow_bound or 0.0
    return (
        f"bound {type(policy).__name__} {bound} {strict}",
        f"buddy: this step's overflow passed its policy's bound ({policy!r}): with {row.key!r} the step's "
        f"tensors so far spilled {spent:,} of {seen:,} bytes ({spent / seen:.1%} > {bound:.1%}); the step "
        f"ended at {stats.overflow_fraction:.1%}. {why} This warning is shown once.",
    )
