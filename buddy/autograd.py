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
  (``"<index>:<dtype><shape>"``, the index counting such tensors in the
  step), and only the compressed form is kept: the original's memory is
  released as soon as nothing else refers to it. When the tracker chooses
  the raw slot (1x), the tensor is kept as it is instead (a raw slot would
  hold the same bytes plus metadata); its row says ``kept``;
* if compressing fails for any reason, the original tensor is kept and a
  warning is given once per cause: training never breaks or changes because
  of buddy.

Unpacking (during backward, after the block) decompresses onto the original
device, bit-exact. The compressed form is freed when autograd drops the saved
tensor (after backward, unless ``retain_graph=True``).

Threads: saved-tensor hooks are per thread in PyTorch, so a session affects
only the thread that opened it; threads may share a tracker and a store (both
are locked) and should then give their sessions distinct ``key_prefix``es.
Nesting: the innermost open session packs; each session counts what it
packed. A session object cannot be entered again while it is open.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import config, spec
from .errors import UnsupportedTensorError
from .stats import KeyRow, SessionStats
from .store import BuddyStore, default_store
from .tensor import BuddyTensor, check_tensor, pack
from .tracker import Policy, Tracker, default_tracker

__all__ = ["compressed_activations", "Session", "DEFAULT_MIN_BYTES", "wrap"]

#: tensors smaller than this are not worth a kernel launch and a key
DEFAULT_MIN_BYTES = 1 << 20

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(cause: str, message: str) -> None:
    with _warned_lock:
        if cause in _warned:
            return
        _warned.add(cause)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def _tensor_key(t: torch.Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{dtype}{list(t.shape)}"


class _Compressed:
    """What autograd keeps for a compressed saved tensor."""

    __slots__ = ("bt", "session", "row", "cache", "__weakref__")

    def __init__(self, bt: BuddyTensor, session: Session, row: KeyRow):
        self.bt = bt
        self.session = session
        self.row = row  # the session's stats row, counting deduplicated saves
        self.cache = None  # weakref to the last decompressed tensor, shared by deduplicated saves

    def unpack(self) -> torch.Tensor:
        t = self.cache() if self.cache is not None else None
        if t is not None:
            return t
        start = time.perf_counter()
        t = self.bt.decompress()
        self.session._count_unpack(time.perf_counter() - start)
        self.cache = weakref.ref(t)
        return t


class Session:
    """One step of compressed activations; see :func:`compressed_activations`."""

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
    ):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int (bytes), got {min_bytes!r}")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be a buddy Policy (FixedRatio, BuddyThreshold, DeviceBudget), got {policy!r}")
        self.policy = policy
        self.tracker = tracker if tracker is not None else default_tracker()
        self.store = store if store is not None else default_store()
        self.min_bytes = min_bytes
        self.codec = codec
        self.entry_bytes = spec.check_entry_bytes(entry_bytes) if entry_bytes is not None else None
        self.key_prefix = key_prefix
        self.enabled = enabled
        self._excluded = self._storages_of(exclude)
        self._lock = threading.RLock()
        self._hooks = None
        self._reset()

    # ---- context manager ---------------------------------------------------
    def __enter__(self) -> Session:
        if self._hooks is not None:
            raise RuntimeError("this compressed_activations session is already open; open a new one per step")
        self._reset()
        self.tracker.begin_step(self.policy)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)

    def _reset(self) -> None:
        with self._lock:
            self._index = 0
            self._dedup: dict[tuple, tuple[StorageWeakRef, weakref.ref]] = {}
            self._storages: dict[int, list[int]] = {}  # storage -> [storage bytes, bytes of its compressed views]
            self._stats = SessionStats()

    @staticmethod
    def _storages_of(exclude) -> frozenset[int]:
        if exclude is None:
            return frozenset()
        items = exclude if isinstance(exclude, (list, tuple, set)) else [exclude]
        tensors = []
        for item in items:
            if isinstance(item, torch.nn.Module):
                tensors += list(item.parameters()) + list(item.buffers())
            elif isinstance(item, torch.Tensor):
                tensors.append(item)
            else:
                raise TypeError(f"exclude takes modules and tensors, got {type(item).__name__}")
        return frozenset(t.untyped_storage()._cdata for t in tensors)

    # ---- hooks -----------------------------------------------------------------
    def _skip_reason(self, t: torch.Tensor) -> str | None:
        if not self.enabled:
            return "disabled"
        try:
            check_tensor(t)
        except UnsupportedTensorError:
            return "unsupported"
        if _is_parameter(t) or t.untyped_storage()._cdata in self._excluded:
            return "parameter"
        if t.numel() * t.element_size() < self.min_bytes:
            return "small"
        return None

    def _pack(self, t: torch.Tensor):
        with self._lock:
            self._stats.saves += 1
            reason = self._skip_reason(t)
            if reason is not None:
                self._stats.skipped += 1
                self._stats.skipped_bytes += t.numel() * t.element_size()
                if reason != "parameter":
                    self._stats.kept_bytes += t.numel() * t.element_size()
                return t
            storage = t.untyped_storage()
            dedup_key = (storage._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
            hit = self._dedup.get(dedup_key)
            if hit is not None:
                alive, ref, row = hit
                packed = ref() if ref is not None else t  # None: it was kept as it is
                if packed is not None and not alive.expired():
                    self._stats.deduplicated += 1
                    row.saves += 1
                    return packed
            key = f"{self.key_prefix}{self._index}:{_tensor_key(t)}"
            start = time.perf_counter()
            try:
                result = self._compress(t, key)
            except Exception as exc:  # never let buddy break training: keep the original
                self._stats.failed += 1
                self._stats.kept_bytes += t.numel() * t.element_size()
                _warn_once(
                    f"{type(exc).__name__}: {exc}"[:200],
                    f"buddy could not compress a saved activation ({type(exc).__name__}: {exc}); "
                    f"keeping it uncompressed. Training is unaffected. This warning is shown once per cause.",
                )
                return t
            elapsed = time.perf_counter() - start
            self._index += 1
            row = self._account(t, storage, result, key, elapsed)
            # A storage that died may be reused at the same address: the weak
            # reference tells the two apart, so a dedup hit is always the same data.
            if result.bt is None:
                self._dedup[dedup_key] = (StorageWeakRef(storage), None, row)
                return t
            packed = _Compressed(result.bt, self, row)
            self._dedup[dedup_key] = (StorageWeakRef(storage), weakref.ref(packed), row)
            return packed

    def _compress(self, t: torch.Tensor, key: str) -> _Packed:
        return _tracked_pack(
            t,
            key,
            tracker=self.tracker,
            policy=self.policy,
            store=self.store,
            codec=self.codec,
            entry_bytes=self.entry_bytes,
            on_full="device",  # a full store must not cost the training step: keep it on the device
            keep_full_slot=True,  # a raw slot holds the same bytes plus metadata: keep the tensor instead
        )

    def _account(self, t, storage, result: _Packed, key: str, elapsed: float) -> KeyRow:
        st = self._stats
        nbytes = t.numel() * t.element_size()
        views = self._storages.setdefault(storage._cdata, [storage.nbytes(), 0])
        before = min(views)
        views[1] += nbytes
        st.original_bytes += min(views) - before
        bt = result.bt
        row = KeyRow(
            key=key,
            shape=tuple(t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            codec=bt.codec if bt is not None else "kept",
            target_ratio=bt.target_ratio if bt is not None else 1.0,
            original_bytes=nbytes,
            device_bytes=bt.device_bytes if bt is not None else nbytes,
            buddy_bytes=bt.buddy_bytes if bt is not None else 0,
            ideal_bytes=sum(k * n for k, n in enumerate(result.histogram)) * spec.SECTOR_BYTES,
            predicted_overflow_bytes=result.predicted,
            compress_seconds=elapsed,
        )
        st.device_bytes += row.device_bytes
        st.buddy_bytes += row.buddy_bytes
        st.ideal_bytes += row.ideal_bytes
        st.compress_seconds += elapsed
        st.rows.append(row)
        return row

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        return packed.unpack()

    def _count_unpack(self, seconds: float) -> None:
        with self._lock:
            self._stats.decompress_seconds += seconds
            self._stats.decompressions += 1

    # ---- reporting ---------------------------------------------------------------
    def stats(self) -> SessionStats:
        """A snapshot of what this step compressed (printing it shows a table)."""
        with self._lock:
            st = self._stats
            return SessionStats(
                rows=[KeyRow(**vars(r)) for r in st.rows],
                **{k: v for k, v in vars(st).items() if k != "rows"},
            )

    def __repr__(self) -> str:
        state = "open" if self._hooks is not None else "closed"
        return f"<buddy Session {state}: policy={self.policy or self.tracker.policy!r}, min_bytes={self.min_bytes}>"


class _Packed(NamedTuple):
    bt: BuddyTensor | None  # None: kept as it is (the tracker chose the raw slot)
    histogram: list[int]
    predicted: int | None  # overflow bytes the tracker predicted; None for a new key


class _KeepAsIs(Exception):
    """Raised from the slot choice to stop packing a tensor that would only gain metadata."""


def _tracked_pack(t, key, *, tracker: Tracker, policy, store, codec, entry_bytes, on_full: str, keep_full_slot=False):
    """Compress ``t`` under ``key`` with the tracker's slot and record the outcome in the tracker.

    With ``keep_full_slot``, a tensor the tracker gives the raw slot is not
    packed at all (``bt`` is ``None``): the raw slot would hold the same bytes
    plus metadata.
    """
    codec = codec or config.defaults().codec
    entry_bytes = entry_bytes or config.defaults().entry_bytes
    nbytes = t.numel() * t.element_size()
    decided = {}

    def choose(histogram):
        slot, predicted = tracker.choose(key, histogram, entry_bytes=entry_bytes, original_bytes=nbytes, policy=policy)
        decided.update(histogram=histogram, slot=slot, predicted=predicted)
        if keep_full_slot and slot == spec.sectors_per_entry(entry_bytes):
            raise _KeepAsIs
        return slot

    try:
        bt = pack(t, codec=codec, entry_bytes=entry_bytes, choose_slot=choose, store=store, on_full=on_full)
    except _KeepAsIs:
        bt = None
    tracker.record(
        key,
        decided["histogram"],
        slot=bt.slot_sectors if bt is not None else decided["slot"],
        entry_bytes=entry_bytes,
        original_bytes=nbytes,
        predicted_overflow_bytes=decided["predicted"],
    )
    # what stays on the device counts against budgets until it is freed
    if bt is not None:
        tracker._hold(bt.device_bytes)
        bt._on_free.append(lambda n=bt.device_bytes: tracker._hold(-n))
    else:
        tracker._hold(nbytes)
        weakref.finalize(t, tracker._hold, -nbytes)
    return _Packed(bt, decided["histogram"], decided["predicted"])


def wrap(
    tensor: torch.Tensor,
    key: str,
    *,
    policy: Policy | None = None,
    tracker: Tracker | None = None,
    store: BuddyStore | None = None,
    codec: str | None = None,
    entry_bytes: int | None = None,
    on_full: str = "raise",
) -> BuddyTensor:
    """Compress a tensor kept outside autograd under a user-given ``key``.

    The slot comes from the tracker (default: the process-wide one, with its
    policy unless ``policy`` is given), which learns the key's history across
    calls exactly as for saved activations. ``on_full`` is as in
    :func:`buddy.compress`.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string, got {key!r}")
    check_tensor(tensor)
    return _tracked_pack(
        tensor,
        key,
        tracker=tracker if tracker is not None else default_tracker(),
        policy=policy,
        store=store if store is not None else default_store(),
        codec=codec,
        entry_bytes=spec.check_entry_bytes(entry_bytes) if entry_bytes is not None else None,
        on_full=on_full,
    ).bt


def compressed_activations(policy: Policy | None = None, **kwargs) -> Session:
    """A context manager that compresses the activations autograd saves in it.

    Args:
        policy: how slots are chosen (:class:`~buddy.FixedRatio`,
            :class:`~buddy.BuddyThreshold`, :class:`~buddy.DeviceBudget`);
            default: the tracker's own (``BuddyThreshold(0.10)``).
        tracker: a :class:`~buddy.Tracker` (default: process-wide, so history
            persists across blocks -- one block is one step).
        store: a :class:`~buddy.BuddyStore` (default: process-wide).
        min_bytes: tensors smaller than this stay as they are (default 1 MiB).
        codec, entry_bytes: override the defaults of :func:`buddy.set_defaults`.
        exclude: modules or tensors whose storages are never compressed
            (parameters are skipped anyway; use this for large buffers).
        key_prefix: prepended to every key (distinct per thread or model when
            they share a tracker).
        enabled: ``False`` makes the block a no-op (for A/B runs).

    Returns:
        A :class:`Session`; ``session.stats()`` reports what it held.
    """
    return Session(policy, **kwargs)
