"""Compressed activations: autograd's saved tensors, packed into buddy memory.

``with buddy.compressed_activations() as session:`` installs
``torch.autograd.graph.saved_tensors_hooks`` (the mechanism behind
``save_on_cpu``). While the block is open, every tensor autograd saves for
backward goes through :meth:`Session._pack`:

* parameters (and views of them), tensors of excluded modules, tensors under
  ``min_bytes`` and layouts buddy cannot compress are kept as they are;
* a storage saved by several ops (same storage, offset, shape, strides, dtype
  and version) is compressed once and shared;
* everything else is compressed with the slot the tracker chooses for its key
  (``"<model>/<index>:<dtype><shape>"``, see :mod:`buddy.keys`), and only the
  compressed form is kept: the original's memory is
  released as soon as nothing else refers to it. When the tracker chooses
  the raw slot (1x), the tensor is kept as it is instead (a raw slot would
  hold the same bytes plus metadata); its row says ``kept``;
* if compressing fails for any reason (an ``Exception``: a codec error, the
  device out of memory, ...), the original tensor is kept and a warning is
  given once per cause: training never breaks or changes because of buddy.

What the session keeps for each tensor and how it comes back: :mod:`buddy.saved`; the hooks it shares with the
recorder (what is taken, once, under which key; CUDA graphs, interrupts, threads): :mod:`buddy.hooks`; keys:
:mod:`buddy.keys`; recording without compressing: :mod:`buddy.recording`.
"""

from __future__ import annotations

import contextlib
import time

import torch

from . import config, engines, spec, streams
from .engines import PLACE_WORDS
from .hooks import DEFAULT_MIN_BYTES, _SavedTensorHooks
from .keyed import _tracked, wrap
from .keys import is_parameter, module_name
from .layout import Layout, memory_bytes
from .overlap import Overlap, Stash, as_overlap
from .peak import Saved, StepProfile
from .pipeline import kept_ends_bytes, pack_ahead, resolve
from .prefetch import Prefetch, PrefetchStats, Schedule, as_prefetch
from .recording import RecordedTensor, Recorder, record_activations
from .ring import OverflowRing, check_ring_bytes
from .saved import _Compressed, _Kept, _look_ahead, _warn_once
from .stats import KeyRow, SessionStats
from .step import AheadStep, Checks, Pending, past_bound, past_bound_warning
from .store import BuddyStore, default_store
from .tensor import BuddyTensor
from .tracker import Policy, Tracker, default_tracker, group_of

__all__ = [
    "compressed_activations",
    "Session",
    "record_activations",
    "Recorder",
    "RecordedTensor",
    "DEFAULT_MIN_BYTES",
    "wrap",
    "is_parameter",
    "module_name",
]


class Session(_SavedTensorHooks):
    """One step of compressed activations; see :func:`compressed_activations`."""

    _what = "compressed_activations session"

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        tracker: Tracker | None = None,
        store: BuddyStore | None = None,
        min_bytes: int = DEFAULT_MIN_BYTES,
        codec: str | None = None,
        entry_bytes: int | None = None,
        exclude=None,
        key_prefix: str = "",
        enabled: bool = True,
        prefetch: Prefetch | bool = True,
        strict: bool = False,
        overlap: Overlap | bool = False,
        overflow_ring: int = 0,
        rederive_casts: bool = True,
    ):
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(
                f"policy must be a buddy Policy (FixedRatio, BuddyThreshold, OverflowBudget, DeviceBudget, CompressedOffload), "
                f"got {policy!r}"
            )
        self.policy = policy
        self.tracker = tracker if tracker is not None else default_tracker()
        self.store = store if store is not None else default_store()
        self.codec = codec
        self.entry_bytes = spec.check_entry_bytes(entry_bytes) if entry_bytes is not None else None
        self.prefetch = as_prefetch(prefetch)
        self.strict = strict
        self.overlap = as_overlap(overlap)
        self.overflow_ring = check_ring_bytes(overflow_ring)
        self._rings: dict[torch.device, OverflowRing] = {}  # per device, the step's overflow ring (overflow_ring)
        self._stashes: dict[torch.device, Stash] = {}  # per device, the originals of packs in flight (overlap)
        self._schedule = Schedule(self.prefetch)
        self._checks = Checks()
        self._ahead = AheadStep()  # the step's tensors packed ahead of their sizes, and its reserve
        self._reads_at = 0
        self._profile = StepProfile()  # the step's saves, uses and memory (buddy.peak), kept on the tracker
        self._known: dict[str, int] = {}  # per key, its device bytes when it was last compressed
        super().__init__(
            min_bytes=min_bytes, exclude=exclude, key_prefix=key_prefix, enabled=enabled, rederive_casts=rederive_casts
        )

    def _begin(self) -> None:
        previous = self.tracker.last_profile
        if previous is not None:
            previous.finish()
        self.tracker.begin_step(self.policy)  # (a budget policy plans from the step before's profile)
        self._profile = StepProfile()
        self._known = {} if previous is None else {
            s.key: s.device_bytes for s in previous.saved if s.device_bytes is not None
        }  # fmt: skip
        self.tracker.last_profile = self._profile
        self._stats.plan = (self.policy or self.tracker.policy).describe()
        self._stats.overflow_bound = getattr(self.policy or self.tracker.policy, "overflow_bound", None)
        self._schedule = Schedule(self.prefetch)  # one per step: the old one lives on with the old graph
        self._checks = Checks()  # likewise
        self._ahead.next_step()
        self._reads_at = engines.host_reads()
        self._stashes = {}
        self._rings = {}
        # device bytes held beside the saved tensors: the stash's, and an overflow ring's per device
        self._profile.stash_bytes = (self.overlap.stash_bytes if self.overlap is not None else 0) + self.overflow_ring

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._profile.end_forward()
        self._drain()
        st = self._stats
        for ring in self._rings.values():  # (their drains go on: every reader of a range waits for its own)
            st.ring_bytes += ring.held_bytes
            st.ring_drained += ring.drained
            st.ring_waits += ring.waits
            st.ring_too_large += ring.too_large
        with self._lock:
            pending = self._ahead.take_pending()
        self._ahead.settle(pending, self._stats, self.tracker)
        self._stats.host_reads = engines.host_reads() - self._reads_at  # forward's; backward's: its checks
        with self._lock:
            past = past_bound(self._stats)
        if past is not None:
            _warn_once(*past_bound_warning(self._stats, self.policy or self.tracker.policy, self.strict, *past))
        if exc[0] is None:  # forward is done: backward will first ask for what was packed last
            _look_ahead(self._schedule, len(self._schedule))

    def _drain(self) -> None:
        """Where forward ends: forward's stream waits for the last pack on each device, the stashes let go."""
        with self._lock:
            stashes, self._stashes = self._stashes, {}
        st = self._stats
        for device, stash in stashes.items():
            stash.drain(stash.ops.record(stash.ops.pack_stream(device)))
            st.stash_peak_bytes = max(st.stash_peak_bytes, stash.peak_bytes)
            st.stash_waits += stash.waits

    def _stash(self, device: torch.device) -> Stash | None:
        """The step's stash on ``device`` where its packs overlap forward (``overlap`` on, an asynchronous
        device); else ``None``."""
        if self.overlap is None:
            return None
        stash = self._stashes.get(device)
        if stash is None:
            ops = streams.for_device(device)
            if ops.synchronous:
                return None
            stash = self._stashes[device] = Stash(ops, ops.current(device), self.overlap.stash_bytes)
        return stash

    def _ring(self, device: torch.device) -> OverflowRing | None:
        """The step's overflow ring on ``device`` (``overflow_ring`` bytes, :mod:`buddy.ring`); ``None`` without."""
        if not self.overflow_ring:
            return None
        ring = self._rings.get(device)
        if ring is None:
            ring = self._rings[device] = OverflowRing(device, self.overflow_ring, ledger=self.tracker.ledger)
        return ring

    def _take(self, t: torch.Tensor, key: str):
        start = time.perf_counter()
        why = (self.policy or self.tracker.policy).leaves(key)
        if why is not None:
            return self._leave(t, key, why)
        try:
            if not self.strict:
                taken = self._take_ahead(t, key, start)
                if taken is not None:
                    return taken
            result = _tracked(t, key, self.tracker, self.policy, self.store, self.codec, self.entry_bytes, keep=True)
        except Exception as exc:  # never let buddy break training: keep the original
            self._stats.failed += 1
            self._stats.kept_bytes += t.numel() * t.element_size()
            _warn_once(
                f"{type(exc).__name__}: {exc}"[:200],
                f"buddy could not compress a saved activation ({type(exc).__name__}: {exc}); "
                f"keeping it uncompressed. Training is unaffected. This warning is shown once per cause.",
            )
            return None
        elapsed = time.perf_counter() - start
        row = self._row(t, key, elapsed, result.bt, result.histogram, result.predicted, result.corrected)
        return self._packed(t, result.bt, row), row

    def _take_ahead(self, t: torch.Tensor, key: str, start: float):
        """:meth:`_take` with the slot from the key's history, nothing read back (``strict=False``); ``None``
        where that cannot be (a key the policy has no plan for, an engine without kernels, a codec with a table
        and nothing learned, a store without room for the worst case): the tensor is then sized first."""
        engine, layout = resolve(t, self.codec, self.entry_bytes)
        if not engine.packs_ahead:
            return None
        tracker, fitted = self.tracker, self.tracker.fitted(key)
        prior, count = tracker.prior(key), tracker.counts(key)
        if prior is None and engine.codec.format_version >= 2:
            return None
        # what the tensor carries on the device beside its slots and metadata: its table, and the overflow's
        # prefix sums kept for unpack (8 bytes an entry, at entries of 1 KiB and more)
        carried = (0 if fitted is None else fitted.table_bytes) + kept_ends_bytes(layout)
        place = tracker.plan_ahead(key, layout, policy=self.policy, table_bytes=carried)
        if place is None:
            return None
        # the step's running bound, in overflow sectors, with this tensor's bytes: what the sizes kernel sends to
        # buddy memory past it (less what the step's tensors sent there before) goes to the reserve on the device
        bound, bounded = self._stats.overflow_bound, False
        step = reserve = room = None
        if bound is not None and not place.keep:
            step, reserve = self._ahead.reserve(t.device, group_of(key), bound, tracker, self._stats)
            room, bounded = self._ahead.room(bound, t.numel() * t.element_size()), True
        at, sizes = self._ahead.sizes(PLACE_WORDS + layout.bins, t.device)  # the placement, then the histogram
        bt = stash = None
        if place.keep:  # the raw slot: kept as it is, its sizes counted all the same (the key goes on learning)
            codec = engine.measure_ahead(memory_bytes(t)[0], layout, sizes, prior=prior, keep=fitted, count=count)
        else:
            stash = self._stash(t.device)  # (with one: on the pack stream, see buddy.overlap)
            with contextlib.nullcontext() if stash is None else stash.beside(t.device):
                bt = pack_ahead(
                    t, engine, layout, place.slot, sizes, store=self.store, ledger=tracker.ledger, prior=prior,
                    keep=fitted, count=count, room=room, step=step, reserve=reserve, ring=self._ring(t.device),
                )  # fmt: skip
            if bt is None:
                return None
            codec = bt.codec_object
        elapsed = time.perf_counter() - start
        row = self._row(t, key, elapsed, bt, None, place.predicted_overflow_bytes, place.corrected)
        self._ahead.pending.append(Pending(row, layout, t.device, bt, codec, bounded, at))
        packed = self._packed(t, bt, row)
        if stash is not None and bt is not None and isinstance(packed, _Compressed):
            packed_event = stash.ops.record(stash.ops.pack_stream(t.device))  # (nothing issued there since)
            bt.written_by(stash.ops, packed_event)  # its range busy until the pack is done (or its drain)
            packed.packed = (stash.ops, packed_event)  # backward's decompression waits for it
            stash.add(t, packed_event, packed)
            self._stats.overlapped += 1
        return packed, row

    def _packed(self, t: torch.Tensor, bt: BuddyTensor | None, row: KeyRow):
        """What autograd keeps for ``t`` (``bt``: its compressed form, ``None`` where it is kept as it is), its
        save recorded in the step's profile."""
        codec = row.codec if bt is not None else (self.codec or config.defaults().codec)
        known = row.device_bytes if bt is not None or row.codec == "kept" else self._known.get(row.key)
        item = Saved(row.key, row.original_bytes, known, bt is not None, t.dtype, t.device, codec, saved_at=0)
        profiled = (self._profile, self._profile.save(item))
        self._profile.measured_seconds += row.compress_seconds
        if bt is None:
            return _Kept(t, self.tracker, profiled)
        return _Compressed(bt, self, row, self._schedule, self._checks, profiled)

    def _leave(self, t: torch.Tensor, key: str, why: str):
        """Keep ``t`` as it is because the policy says ``why`` (:meth:`Policy.leaves`): a row of its own, outside
        the overflow bound's bytes, its save and use in the step's profile all the same."""
        nbytes = t.numel() * t.element_size()
        row = KeyRow(
            key=key, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."), codec="left", target_ratio=1.0,
            original_bytes=nbytes, device_bytes=nbytes, buddy_bytes=0, ideal_bytes=0, predicted_overflow_bytes=None,
            left=why,
        )  # fmt: skip
        st = self._stats
        st.device_bytes += nbytes
        st.left_bytes += nbytes
        st.rows.append(row)
        return self._packed(t, None, row), row

    def _row(
        self, t, key: str, elapsed: float, bt: BuddyTensor | None, histogram, predicted: int | None, corrected: bool
    ) -> KeyRow:
        """The stats row of a tensor taken (``bt``: ``None`` where it is kept as it is), counted in the totals.
        ``histogram``: its sizes, or ``None`` where they are read later (packed ahead): its buddy and ideal bytes
        are filled in then (:meth:`_settle`)."""
        st = self._stats
        nbytes = t.numel() * t.element_size()
        sized = histogram is not None
        row = KeyRow(
            key=key,
            shape=tuple(t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            codec=bt.codec if bt is not None else "kept",
            target_ratio=bt.target_ratio if bt is not None else 1.0,
            original_bytes=nbytes,
            device_bytes=bt.device_bytes if bt is not None else nbytes,
            buddy_bytes=bt.buddy_bytes if bt is not None and sized else 0,
            ideal_bytes=Layout.compacted_bytes(histogram) if sized else 0,
            predicted_overflow_bytes=predicted,
            compress_seconds=elapsed,
            corrected=corrected,
        )
        st.corrected += corrected
        self._ahead.taken(nbytes, row.buddy_bytes)  # (a tensor packed ahead: none yet, its overflow is the device's)
        st.device_bytes += row.device_bytes
        st.buddy_bytes += row.buddy_bytes
        st.ideal_bytes += row.ideal_bytes
        st.compress_seconds += elapsed
        st.rows.append(row)
        return row

    def _count_unpack(self, seconds: float) -> None:
        with self._lock:
            self._stats.decompress_seconds += seconds
            self._stats.decompressions += 1

    # ---- reporting ---------------------------------------------------------------
    def stats(self) -> SessionStats:
        """A snapshot of what this step compressed (printing it shows a table)."""
        with self._lock:
            st = self._stats
            forward = engines.host_reads() - self._reads_at if self._hooks is not None else st.host_reads
            return SessionStats(
                rows=[KeyRow(**vars(r)) for r in st.rows],
                **{k: v for k, v in vars(st).items() if k not in ("rows", "prefetch", "host_reads")},
                prefetch=PrefetchStats(**vars(self._schedule.stats)),
                host_reads=forward + self._checks.reads,
            )

    def __repr__(self) -> str:
        state = "open" if self._hooks is not None else "closed"
        return (
            f"<buddy Session {state}: policy={self.policy or self.tracker.policy!r}, min_bytes={self.min_bytes}, "
            f"prefetch={self.prefetch}>"
        )


def compressed_activations(policy: Policy | None = None, **kwargs) -> Session:
    """A context manager that compresses the activations autograd saves in it.

    Args:
        policy: how slots are chosen (:class:`~buddy.FixedRatio`,
            :class:`~buddy.BuddyThreshold`, :class:`~buddy.DeviceBudget`);
            default: the tracker's own (``OverflowBudget(0.10)``).
        tracker: a :class:`~buddy.Tracker` (default: process-wide, so history
            persists across blocks -- one block is one step). Device bytes
            are held on its ledger.
        store: a :class:`~buddy.BuddyStore` (default: process-wide).
        min_bytes: tensors smaller than this stay as they are (default 1 MiB).
        codec, entry_bytes: override the defaults of :func:`buddy.set_defaults`.
        exclude: modules or tensors whose storages are never compressed
            (parameters are skipped anyway; use this for large buffers).
        key_prefix: prepended to every key (distinct per thread or model when
            they share a tracker).
        enabled: ``False`` makes the block a no-op (for A/B runs).
        prefetch: how far backward looks ahead (:class:`~buddy.Prefetch`):
            while autograd unpacks one tensor, the next ones' overflow is
            copied back to the device on a side stream (and, within
            ``unpack_bytes``, decompressed there). ``True`` (default): the
            defaults; ``False``: no look-ahead. Nothing to do on the host.
        strict: how each slot is chosen. ``False`` (default): from the
            tracker's plan before the tensor is sized, nothing read back but
            once where forward ends and once where backward ends (a new key,
            or one the policy has no plan for, is sized first). The bound is
            kept where the data is: each tensor's overflow past the step's
            running bound goes to a reserve on the device, which the tracker
            sizes from the model's recent steps
            (``Tracker.reserve_sectors``); only what finds no room there
            passes the bound, and ``session.stats()`` says so (the next
            step's plan and reserve learn from it). ``True``: from the
            tensor's own sizes, read back from its device before it is
            packed (a read a tensor, the GPU idle while the host decides),
            so the policy's bound holds on every tensor's real sizes.
        overlap: pack beside forward (:class:`~buddy.Overlap`, see
            :mod:`buddy.overlap`): each pack runs on a side stream while
            forward's next kernels compute, its original held in a stash
            of at most ``stash_bytes`` until the pack has read it (bytes
            a :class:`~buddy.MemoryTarget` counts). ``True``: the defaults;
            ``False`` (default): packs run in forward's stream. With
            ``strict=False`` only (a strict pack waits on its sizes
            anyway); nothing changes on the host.
        overflow_ring: bytes of an overflow ring per device (0, the
            default: none; :mod:`buddy.ring`): a tensor packed ahead writes
            its overflow there, and a drain kernel on the copy stream copies
            it to buddy memory while forward goes on. Device bytes that count
            against capacity; off until a GPU run measures which is faster.
        rederive_casts: ``True`` (default): a parameter's copy in another
            dtype made in the block (autocast's bf16 weight) is made again
            in backward, bit-exact, not held (``stats().rederived``); a
            parameter changed in place before backward then raises, as
            for an fp32 weight (docs/training.md). ``False``: compressed.

    Returns:
        A :class:`Session`; ``session.stats()`` reports what it held.
    """
    return Session(policy, **kwargs)
