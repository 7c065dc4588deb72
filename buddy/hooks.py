"""The saved-tensor hooks a session and a recorder share: what they take, once, and under which key.

CUDA graphs: while the current CUDA stream is being captured
(``torch.cuda.is_current_stream_capturing()``), the session keeps every
saved tensor as it is -- a compress reads its sizes back to the host, which
would break the capture; ``stats().captured`` counts them.

Interrupts: a ``KeyboardInterrupt`` (any ``BaseException`` that is not an
``Exception``) while packing is not caught: it leaves the block, which closes
the session; what it packed so far is freed with the partial graph, nothing
is left in the store, and the session object can be opened for the next
step.

Threads: saved-tensor hooks are per thread in PyTorch, so a session affects
only the thread that opened it; threads may share a tracker and a store (both
are locked) and may give their sessions distinct ``key_prefix``es.
A session object belongs to the thread that opened it: opening it again while
it is open (from any thread) raises, and only that thread may close it.
Nesting: the innermost open session packs; each session counts what it
packed.
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .errors import UnsupportedTensorError
from .keys import (
    _call_site, _outermost_call, _storages_of, _tensor_key, cast_source, is_parameter, module_name, node_sequence_now,
)
from .layout import dense_strides
from .saved import _AsIs, _compile_safe_hooks, _Recast, _View
from .stats import KeyRow, SessionStats
from .tensor import check_tensor

__all__ = ["DEFAULT_MIN_BYTES"]

#: tensors smaller than this are not worth a kernel launch and a key
DEFAULT_MIN_BYTES = 1 << 20


def _in_backward() -> bool:
    """Whether a backward pass is running on this thread: a tensor saved now belongs to a forward recomputed inside
    it (a checkpointed region's), which autograd uses at once and frees with the node that saved it."""
    return torch._C._current_graph_task_id() != -1


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (a compress would break it)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()

#: the tensor types whose saves are checked without check_tensor where they are small or a parameter
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _weak_pack(hooks: _SavedTensorHooks):
    """``hooks._pack``, holding the hooks' owner weakly.

    PyTorch keeps the pack hook in every saved tensor it packed, that is in the
    graph: held strongly, a session that refers back to the graph
    (``session.loss = loss``, a policy holding the trainer) would close a
    cycle through C++ that the collector cannot break (see _Compressed). The
    hook runs only while the session is open, and ``with`` keeps it alive.
    """
    ref = weakref.ref(hooks)

    def pack(t: torch.Tensor):
        owner = ref()
        return owner._pack(t) if owner is not None else _AsIs(t)

    return pack


class _SavedTensorHooks:
    """Saved-tensor hooks owned by one thread, with buddy's rules for what to take.

    The rules, shared by a compressing :class:`Session` and a :class:`Recorder`:
    skip what :meth:`_skip_reason` names; take a storage saved by several ops
    (same storage, offset, shape, strides, dtype and version) once; key each
    tensor taken ``"<prefix><index>:<dtype><shape>"``, the index counting the
    tensors taken in the block. Subclasses say what taking a tensor means
    (:meth:`_take`) and count into :attr:`_stats` (a :class:`SessionStats`).
    Keys: ``"<prefix><index>:<dtype><shape>"``, where the prefix is
    ``key_prefix`` when given, else ``"<model>/"`` (see "Keys" in the module
    doc) and the index counts the tensors taken under that prefix in the block.
    """

    def __init__(self, *, min_bytes: int, exclude, key_prefix: str, enabled: bool, rederive_casts: bool = True):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int (bytes), got {min_bytes!r}")
        if not isinstance(rederive_casts, bool):
            raise TypeError(f"rederive_casts must be True or False, got {rederive_casts!r}")
        self.rederive_casts = rederive_casts
        self._since = sys.maxsize  # autograd nodes numbered at least this were made in the block (node_sequence_now)
        self.min_bytes = min_bytes
        if not isinstance(key_prefix, str):
            raise TypeError(f"key_prefix must be a string, got {type(key_prefix).__name__}")
        self.key_prefix = key_prefix
        self._site = "session"  # where the block was opened (set on entering it)
        self.enabled = enabled
        self._excluded = _storages_of(exclude)
        self._lock = threading.RLock()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._thread: int | None = None  # the thread that opened it
        self._reset()

    # ---- context manager ---------------------------------------------------
    def __enter__(self):
        with self._lock:  # checked and set at once: two threads cannot both open it
            if self._hooks is not None:
                raise RuntimeError(
                    f"this {self._what} is already open (in this or another thread); open a new one per step "
                    f"and per thread"
                )
            self._reset()
            self._site = _call_site()
            self._since = node_sequence_now() if self.rederive_casts else sys.maxsize
            self._begin()
            hooks = torch.autograd.graph.saved_tensors_hooks(*_compile_safe_hooks(_weak_pack(self), self._unpack))
            hooks.__enter__()
            self._hooks, self._thread = hooks, threading.get_ident()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            if self._hooks is None:
                raise RuntimeError(f"this {self._what} is not open")
            if self._thread != threading.get_ident():  # saved-tensor hooks are per thread
                raise RuntimeError(f"a {self._what} must be closed by the thread that opened it")
            hooks, self._hooks = self._hooks, None
            self._calls.clear()  # (their frames, and the locals of those that returned, go)
        hooks.__exit__(*exc)

    _what = "saved-tensor hooks block"

    def _begin(self) -> None:
        """Called as the block opens."""

    def _reset(self) -> None:
        with self._lock:
            self._index: dict[str, int] = {}  # per key prefix: tensors taken under it
            self._names: dict[int, tuple[weakref.ref, str]] = {}  # id(module) -> (module, its name), this block
            self._calls: dict[FrameType, str] = {}  # the block's outermost module calls -> their prefixes
            self._last_prefix: str | None = None
            self._dedup: dict[tuple, tuple[StorageWeakRef, weakref.ref, KeyRow | None]] = {}
            self._storages: dict[int, list[int]] = {}  # storage -> [storage bytes, bytes of its views taken]
            self._stats = SessionStats()

    # ---- hooks -----------------------------------------------------------------
    def _skip_reason(self, t: torch.Tensor) -> str | None:
        if not self.enabled:
            return "disabled"
        if type(t) in _PLAIN and t.layout is torch.strided and not t.is_nested:  # most saves: without check_tensor
            parameter = is_parameter(t)
            if (
                not parameter and type(t) is torch.Tensor and not self._excluded
                and t.numel() * t.element_size() < self.min_bytes
            ):  # fmt: skip
                return "small"  # an LSTM's thousands: the checks below, which name it so or "unsupported"
            if parameter and not t.is_quantized and t.device.type != "meta":
                return "parameter"  # a weight (or a view of one) its op saves, an LSTM's at every time step: the same
        try:
            check_tensor(t)
        except UnsupportedTensorError:
            return "unsupported"
        if is_parameter(t) or t.untyped_storage()._cdata in self._excluded:
            return "parameter"
        if t.numel() * t.element_size() < self.min_bytes:
            return "small"
        if _capturing():  # one it would take: kept, and counted as such
            return "capturing"
        if _in_backward():  # a checkpoint's recomputation: autograd uses it at once, and frees it
            return "backward"
        return None

    def _pack(self, t: torch.Tensor):
        with self._lock:
            st = self._stats
            st.saves += 1
            reason = self._skip_reason(t)
            if reason is not None:
                st.skipped += 1
                st.skipped_bytes += t.numel() * t.element_size()
                st.captured += reason == "capturing"
                st.in_backward += reason == "backward"
                if reason not in ("parameter", "backward"):
                    st.kept_bytes += t.numel() * t.element_size()
                return _AsIs(t)  # never ``t`` itself: see "kept as it is" in the module doc
            recast = self._recast(t)
            if recast is not None:  # a parameter's copy in another dtype: made again in backward, nothing held
                st.rederived += 1
                st.rederived_bytes += t.numel() * t.element_size()
                return recast
            storage = t.untyped_storage()
            dedup_key = (storage._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
            # a dense view of the very bytes taken already (an attention output saved as (B, H, S, D) and as
            # (B * S, H * D)): the same compressed bytes, handed back in this view's shape and strides
            memory_key = (storage._cdata, t.storage_offset(), t.numel(), t.dtype, t._version)
            hit = self._dedup.get(dedup_key) or self._dedup.get(memory_key)
            if hit is not None:
                alive, ref, row = hit
                packed = ref()
                if packed is not None and not alive.expired():
                    st.deduplicated += 1
                    if row is not None:
                        row.saves += 1
                    if dedup_key in self._dedup:
                        return packed
                    return _View(packed, tuple(t.shape), t.stride())
            prefix = self._prefix()
            key = f"{prefix}{self._index.get(prefix, 0)}:{_tensor_key(t)}"
            taken = self._take(t, key)
            if taken is None:  # could not take it: keep the original
                return _AsIs(t)
            packed, row = taken
            self._index[prefix] = self._index.get(prefix, 0) + 1
            self._count_storage(storage, t.numel() * t.element_size())
            # A storage that died may be reused at the same address: the weak
            # reference tells the two apart, so a dedup hit is always the same data.
            self._dedup[dedup_key] = (StorageWeakRef(storage), weakref.ref(packed), row)
            if dense_strides(t.shape, t.stride()):
                self._dedup.setdefault(memory_key, self._dedup[dedup_key])
            return packed

    def _prefix(self) -> str:
        """The key prefix of a tensor being saved now: ``key_prefix``, else its model's name and ``/``."""
        if self.key_prefix:
            return self.key_prefix
        frame, prefix = _outermost_call(self._calls)
        if prefix is None:
            module = frame.f_locals.get("self") if frame is not None else None  # (nn.Module.__call__'s self)
            if frame is None or not isinstance(module, torch.nn.Module):  # outside any module's forward: the
                return self._last_prefix or f"{self._site}/"  # step's previous model, else the call site
            found = self._names.get(id(module))
            if found is None or found[0]() is not module:  # named once per block (a model's tree does not change)
                found = self._names[id(module)] = (weakref.ref(module), module_name(module))
            prefix = self._calls[frame] = f"{found[1]}/"  # the call's next tensors find it without a name
        self._last_prefix = prefix
        return prefix

    def _recast(self, t: torch.Tensor):
        """What autograd keeps for ``t`` where it is a parameter's copy made in the block, which backward makes
        again (:func:`buddy.keys.cast_source`; ``rederive_casts``); else ``None``: ``t`` is taken or kept."""
        source = cast_source(t, self._since)
        return None if source is None else self._rederived(t, source)

    def _rederived(self, t: torch.Tensor, source: torch.Tensor):
        """What autograd keeps for ``t``, a copy of ``source`` made in the block."""
        return _Recast(t, source)

    def _take(self, t: torch.Tensor, key: str) -> tuple[object, KeyRow | None] | None:
        """What autograd keeps for ``t`` (weakly referable) and its stats row; ``None``: keep ``t`` as it is."""
        raise NotImplementedError

    def _count_storage(self, storage, nbytes: int) -> None:
        """A storage holding several views taken counts once, at most its own size."""
        views = self._storages.setdefault(storage._cdata, [storage.nbytes(), 0])
        before = min(views)
        views[1] += nbytes
        self._stats.original_bytes += min(views) - before

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        return packed.unpack()
