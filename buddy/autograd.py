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
  (``"<model>/<index>:<dtype><shape>"``, see "Keys" below), and only the
  compressed form is kept: the original's memory is
  released as soon as nothing else refers to it. When the tracker chooses
  the raw slot (1x), the tensor is kept as it is instead (a raw slot would
  hold the same bytes plus metadata); its row says ``kept``;
* if compressing fails for any reason (an ``Exception``: a codec error, the
  device out of memory, ...), the original tensor is kept and a warning is
  given once per cause: training never breaks or changes because of buddy.

What is kept as it is goes to autograd as ``t.detach()`` (the same memory,
no ``grad_fn``) with its version when saved (:class:`_AsIs`), never as ``t``: a saved output returned as itself refers to
its own ``grad_fn``, a cycle through C++ that the garbage collector cannot
see, which would keep the whole graph -- and every compressed tensor in it --
alive for good whenever backward does not run (an exception in the block, a
forward without backward, ``retain_graph=True``).

Unpacking (during backward, after the block) decompresses onto the original
device, bit-exact. The compressed form is freed when autograd drops the saved
tensor (after backward, unless ``retain_graph=True``), or with the graph.
If decompressing fails, backward raises that very exception (an
out-of-memory error stays one) with a note naming the key: no data is
returned, the compressed copy stays intact until the graph is dropped, and
the step has to be run again.

Every entry decompressed for backward is checked, never decoded to silent
zeros: the torch reference checks on the host and raises at once; the CUDA
kernels (and nvcomp) check on the device and OR what they found into an
error flag per tensor, which is read back once, at the end of the backward
pass (one read per device: ``queue_callback`` of autograd's engine), not per
tensor. Either way a failed check raises :class:`~buddy.errors.CorruptDataError`
naming the keys; the gradients of that backward must not be used.

CUDA graphs: while the current CUDA stream is being captured
(``torch.cuda.is_current_stream_capturing()``), the session keeps every
saved tensor as it is -- a compress reads its sizes back to the host, which
would break the capture; ``stats().captured`` counts them.

Interrupts: a ``KeyboardInterrupt`` (any ``BaseException`` that is not an
``Exception``) while packing is not caught: it leaves the block, which closes
the session; what it packed so far is freed with the partial graph, nothing
is left in the store, and the session object can be opened for the next
step.

Keys: a saved tensor's key names the model that saved it, then the tensor:
``"<model>/<index>:<dtype><shape>"``, the index counting the model's tensors
in the step. ``<model>`` is derived from what the session sees, never from a
name the user must remember: the outermost ``nn.Module`` whose forward is
running when the tensor is saved, as its class name and a fingerprint of its
module tree (every submodule's name and class, every parameter's name, shape
and dtype) -- ``"ResNet-1a2b3c4d"``; a tensor saved outside any module's
forward (the loss, after the model returned) takes the model of the step's
previous tensor, and a step with no module at all takes the place in the
code that opened the session (``"train.py:42"``). So the same model gets the
same keys step after step -- its history is shared on purpose -- while two
different models (a teacher and a student, a GAN's two nets, two models of
a sweep), or the same class built with other sizes or parameter dtypes,
never share a key, even on one tracker; an activation dtype or shape that
changes (autocast on, another batch size) is another key too. The tracker
plans each model from its own keys (a key's group is its model: see
:mod:`buddy.tracker`). ``key_prefix="name/"`` replaces the derived model
name (``"name/<index>:..."``) for explicit control: sessions that give the
same prefix share history.

Threads: saved-tensor hooks are per thread in PyTorch, so a session affects
only the thread that opened it; threads may share a tracker and a store (both
are locked) and may give their sessions distinct ``key_prefix``es.
A session object belongs to the thread that opened it: opening it again while
it is open (from any thread) raises, and only that thread may close it.
Nesting: the innermost open session packs; each session counts what it
packed.

:func:`record_activations` opens the same hooks with the same skip, dedup
and key rules, but only records a copy of each tensor a session would
compress and changes nothing (the capacity experiments measure on what it
records).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import engines, spec, streams
from .errors import CorruptDataError, UnsupportedTensorError
from .codecs import CodecLike
from .pipeline import measure, pack, pack_ahead, resolve
from .prefetch import Ahead, Prefetch, PrefetchStats, Schedule, as_prefetch
from .stats import KeyRow, SessionStats
from .step import Counters
from .store import BuddyStore, default_store
from .layout import Layout, dense_strides, memory_bytes
from .tensor import BuddyTensor, check_tensor
from .tracker import Policy, Tracker, default_tracker

__all__ = [
    "compressed_activations",
    "Session",
    "record_activations",
    "Recorder",
    "RecordedTensor",
    "DEFAULT_MIN_BYTES",
    "wrap",
    "is_parameter",
]

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


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (a compress would break it)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


#: the tensor types whose saves are checked without check_tensor where they are small or a parameter
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter, a view of one, or a leaf that requires grad (never compressed)."""
    base = t._base
    base = t if base is None else base
    if base.is_leaf and base.requires_grad:
        return True
    if type(base) is torch.Tensor:  # what isinstance(base, Parameter) says of a plain tensor (torch's _ParameterMeta:
        return bool(getattr(base, "_is_param", False))  # its _is_param flag), without the metaclass's Python call
    return isinstance(base, torch.nn.Parameter)


def _tensor_key(t: torch.Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{dtype}{list(t.shape)}"


#: the code objects of ``nn.Module.__call__``'s frames, whose ``self`` is the module being called
_CALL_CODES = frozenset(
    fn.__code__
    for fn in (getattr(torch.nn.Module, "_call_impl", None), getattr(torch.nn.Module, "_wrapped_call_impl", None))
    if fn is not None
)


def _outermost_module() -> torch.nn.Module | None:
    """The outermost module whose forward is running on this thread's stack, or ``None``.

    The stack is walked by code objects alone; only the outermost call frames' locals are read (a frame's
    ``f_locals`` makes a snapshot of them: reading every call frame's cost a deep model most of the walk).
    """
    frame: FrameType | None = sys._getframe(1)
    calls = []
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            calls.append(frame)
        frame = frame.f_back
    for call in reversed(calls):  # the outermost first
        module = call.f_locals.get("self")
        if isinstance(module, torch.nn.Module):
            return module
    return None


def module_name(module: torch.nn.Module) -> str:
    """A model's name in keys: its class and a fingerprint of its module tree (see "Keys" in the module doc).

    The fingerprint covers every submodule's name and class and every
    parameter's name, shape and dtype, so it is the same for the same model
    step after step and differs between models that differ in any of these.
    """
    h = hashlib.blake2b(digest_size=4)
    for name, sub in module.named_modules():
        h.update(f"{name}:{type(sub).__qualname__};".encode())
    for name, p in module.named_parameters():
        h.update(f"{name}:{p.dtype}{tuple(p.shape)};".encode())
    return f"{type(module).__name__}-{h.hexdigest()}"


def _call_site() -> str:
    """``"file.py:line"`` of the first frame outside buddy: where the user opened the block."""
    here = os.path.dirname(__file__)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(here):
        frame = frame.f_back
    if frame is None:
        return "session"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(note)


class _AsIs:
    """What autograd keeps for a saved tensor buddy leaves as it is: ``t.detach()`` (the same memory, no
    ``grad_fn``) and ``t``'s version when it was saved.

    Autograd checks that a saved tensor was not changed in place only where no saved-tensor hooks are installed.
    Under the session's, a tensor changed in place after its save would come back changed and its gradient be
    silently wrong: :meth:`unpack` raises there, as PyTorch does without hooks.
    """

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.tensor = t.detach()
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {self.version} instead. "
                f"buddy kept this saved tensor as it is (not compressed), and it was changed in place after it was "
                f"saved: change a copy instead (PyTorch raises the same without buddy)."
            )
        return t


class _Kept(_AsIs):
    """What autograd keeps for a tensor the tracker left as it is (the raw slot).

    Its device bytes are held on the tracker's ledger for as long as autograd
    holds it -- not as long as the tensor lives, which may be many steps (an
    input batch reused every step).
    """

    __slots__ = ()

    def __init__(self, t: torch.Tensor, tracker: Tracker):
        super().__init__(t)
        hold = tracker.ledger.hold(t.numel() * t.element_size())
        weakref.finalize(self, hold.release)  # the hold refers to the ledger only: no cycle through the graph


class _View:
    """What autograd keeps for a dense view of bytes already taken under another shape: the other save's
    object, and this view's shape and strides (its storage offset is the other's: the same bytes)."""

    __slots__ = ("source", "shape", "stride")

    def __init__(self, source, shape: tuple[int, ...], stride: tuple[int, ...]):
        self.source, self.shape, self.stride = source, shape, stride

    def unpack(self) -> torch.Tensor:
        base = self.source.unpack()
        return base.as_strided(self.shape, self.stride, base.storage_offset())


class _Compressed:
    """What autograd keeps for a compressed saved tensor.

    The graph (C++, invisible to the garbage collector) owns it, so it refers
    to nothing of the user's: the session only weakly. Were the session (and
    its policy) held strongly, a session or policy referring back to the
    graph -- ``policy.trainer.loss`` -- would make a cycle through C++ that
    keeps the graph and its buddy memory alive for good. The step's
    :class:`~buddy.prefetch.Schedule` refers to no one's objects but its
    entries, weakly.
    """

    __slots__ = (
        "bt", "session", "row", "cache", "kept", "uses_left", "schedule", "position", "ahead", "checks", "__weakref__",
    )  # fmt: skip

    def __init__(self, bt: BuddyTensor, session: Session, row: KeyRow, schedule: Schedule, checks: _Checks):
        self.bt = bt
        self.checks = checks  # the step's error flags, read at the end of each backward
        self.session = weakref.ref(session)  # for its counters only; see above
        self.row = row  # the session's stats row, counting deduplicated saves
        # weakref to the last decompressed tensor, shared by deduplicated saves
        self.cache: weakref.ref[torch.Tensor] | None = None
        self.kept: torch.Tensor | None = None  # that tensor, held until every save of it has been unpacked
        self.uses_left = 0
        self.schedule = schedule
        self.position = schedule.add(self)
        self.ahead: Ahead | None = None  # decompressed ahead of use by the look-ahead

    def cached(self) -> torch.Tensor | None:
        return self.cache() if self.cache is not None else None

    def unpack(self) -> torch.Tensor:
        t = self.cached()
        if t is not None:
            self.uses_left -= 1
            if self.uses_left <= 0:
                self.kept = None
            return t
        _look_ahead(self.schedule, self.position)  # the next tensors' copies start before this one decodes
        start = time.perf_counter()
        ahead, self.ahead = self.ahead, None
        ready = ahead is not None or self.bt.prefetched
        device = self.bt.device
        try:
            if ahead is not None:
                t, flag = ahead.take(streams.for_device(device).current(device)), ahead.flag
            else:
                flag = self.checks.flag(self.bt)
                t = self.bt.decompress(error_flag=flag)
        except CorruptDataError as exc:  # the reference's checks: name the key in the error itself
            error = CorruptDataError(
                f"buddy: the saved activation {self.row.key!r} failed the format's checks when decompressed for "
                f"backward ({exc}). No data was returned; this backward pass cannot finish: drop the graph and "
                f"run the step again."
            )
            _add_note(error, self._failed_note())
            raise error from exc
        except BaseException as exc:  # keep its type (an out-of-memory error stays one); say what failed
            _add_note(exc, self._failed_note())
            raise
        if flag is not None:
            self.checks.add(self.row.key, flag)
        self.schedule.used(self.position, ready)
        session = self.session()
        if session is not None:  # no one can read the counters of a session that is gone
            session._count_unpack(time.perf_counter() - start)
        self.cache = weakref.ref(t)
        # Several ops saved it (a ReLU's output is also the next layer's input): their backward
        # nodes run one after the other, each unpacking it. Held until the last has, it is
        # decompressed once -- and holds no more than the graph held without buddy.
        self.uses_left = self.row.saves - 1
        self.kept = t if self.uses_left > 0 else None
        return t

    def unpack_ahead(self) -> None:
        """Decompress on the device's copy stream now; :meth:`unpack` hands the result over."""
        bt = self.bt
        ops = streams.for_device(bt.device)
        if isinstance(ops, streams.HostStreams):  # nothing runs beside the host's work
            return
        copy = ops.copy_stream(bt.device)
        issued = ops.record(ops.current(bt.device))
        with ops.activate(copy):
            ops.wait(copy, issued)  # the slots were written by kernels queued on the compute stream
            flag = self.checks.flag(bt)
            t = bt.decompress(error_flag=flag)
            self.ahead = Ahead(t, ops.record(copy), ops, flag)

    def _failed_note(self) -> str:
        return (
            f"buddy: decompressing the saved activation {self.row.key!r} for backward failed. No data was "
            f"returned; the compressed copy is freed with the graph. This backward pass cannot finish: drop the "
            f"graph and run the step again."
        )

    def drop_ahead(self) -> None:
        """Give back what the look-ahead prepared (the tensor was not asked for in time)."""
        self.ahead = None  # allocated and written on the copy stream only: reused in that stream's order
        self.bt.drop_prefetch()


class _Checks:
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
                torch.autograd.Variable._execution_engine.queue_callback(_eager_only(self.check))
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


def _look_ahead(schedule: Schedule, position: int) -> None:
    """Prepare the next tensors of backward; a failure there costs the look-ahead, never the step."""
    try:
        schedule.advance(position)
    except Exception as exc:
        _warn_once(
            f"prefetch {type(exc).__name__}: {exc}"[:200],
            f"buddy could not prefetch saved activations ({type(exc).__name__}: {exc}); backward goes on "
            f"without look-ahead for them. This warning is shown once per cause.",
        )


# ---- torch.compile -------------------------------------------------------------------
# TorchDynamo must never trace buddy. Backward called inside a compiled train
# step, an eager op at a graph break or a session opened inside a compiled
# function would otherwise run the hooks -- and the BuddyTensor finalizers --
# under the frame evaluator, which compiles the codec and the store piece by
# piece (slow, recompiled per tensor size, and the codec's integer work handed
# to another compiler).


def _eager_only(fn):
    """``fn``, never traced by TorchDynamo (called from compiled code, it runs eagerly).

    Applied when a session opens. If the compiler is not loaded by then,
    nothing in this process has been compiled, and it is not loaded for this
    (importing it takes seconds).
    """
    if "torch._dynamo" not in sys.modules:
        return fn
    disabled = torch.compiler.disable(fn)
    frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
    skip_code = getattr(sys.modules["torch._dynamo"].eval_frame, "skip_code", None)
    if frame_callback is None or skip_code is None:  # (a torch without them: always through the compiler's wrapper)
        return disabled

    def eager(*args):
        # Where no compiled code runs (TorchDynamo's frame callback unset: most calls), fn as it is -- the
        # compiler's wrapper costs a few microseconds a call, on every save and unpack -- else through it.
        return fn(*args) if frame_callback() is None else disabled(*args)

    skip_code(eager.__code__)  # TorchDynamo runs this frame as it is, never traces it
    return functools.wraps(fn)(eager)


def _release(held: _Held) -> None:
    held.packed = None  # the last reference frees slots and buddy memory here


class _Held:
    """What autograd keeps for a packed saved tensor (see :func:`_compile_safe_hooks`).

    ``stride``: the strides the tensor had when its layout was not dense (it
    decompresses contiguous), else ``None``. ``release`` runs when autograd
    drops it, possibly inside a compiled frame (backward in a compiled step).
    """

    __slots__ = ("packed", "stride", "release")

    def __init__(self, packed, stride: tuple[int, ...] | None, release):
        self.packed = packed
        self.stride = stride
        self.release = release

    def __del__(self):
        self.release(self)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _compile_safe_hooks(pack, unpack):
    """The session's pack and unpack hooks, made safe for ``torch.compile``d code.

    * Packing, unpacking and releasing run eagerly, never traced
      (:func:`_eager_only`).
    * A tensor saved with a non-dense layout (a strided slice) decompresses
      contiguous; it is handed back in its original strides, bit-exact:
      inductor compiled the backward kernels for those strides and asserts
      them (``assert_size_stride``), and an eager kernel may round
      differently on another layout.
    """
    release = _eager_only(_release)

    def pack_hook(t):
        packed = pack(t)
        if type(packed) is _AsIs:  # kept as it is: nothing to release
            return packed
        bt = getattr(packed, "bt", None)
        dense = bt is None or tuple(bt.stride) == tuple(t.stride())
        return _Held(packed, None if dense else tuple(t.stride()), release)

    def unpack_hook(held):
        if not isinstance(held, _Held):
            return unpack(held)
        t = unpack(held.packed)
        if held.stride is None:
            return t
        out = torch.empty_strided(t.shape, held.stride, dtype=t.dtype, device=t.device)
        as_int = _SAME_SIZE_INT.get(t.element_size())
        if as_int is None:  # complex128: a same-dtype copy moves the bytes
            return out.copy_(t)
        out.view(as_int).copy_(t.view(as_int))  # integers: bit-exact for NaN payloads and -0.0 alike
        return out

    return _eager_only(pack_hook), _eager_only(unpack_hook)


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

    def __init__(self, *, min_bytes: int, exclude, key_prefix: str, enabled: bool):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int (bytes), got {min_bytes!r}")
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
        hooks.__exit__(*exc)

    _what = "saved-tensor hooks block"

    def _begin(self) -> None:
        """Called as the block opens."""

    def _reset(self) -> None:
        with self._lock:
            self._index: dict[str, int] = {}  # per key prefix: tensors taken under it
            self._names: dict[int, tuple[weakref.ref, str]] = {}  # id(module) -> (module, its name), this block
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
                if reason != "parameter":
                    st.kept_bytes += t.numel() * t.element_size()
                return _AsIs(t)  # never ``t`` itself: see "kept as it is" in the module doc
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
        module = _outermost_module()
        if module is None:  # outside any module's forward: the step's previous model, else the call site
            return self._last_prefix or f"{self._site}/"
        found = self._names.get(id(module))
        if found is None or found[0]() is not module:  # named once per block (a model's tree does not change)
            found = self._names[id(module)] = (weakref.ref(module), module_name(module))
        self._last_prefix = f"{found[1]}/"
        return self._last_prefix

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
        strict: bool = True,
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
        self._schedule = Schedule(self.prefetch)
        self._checks = _Checks()
        self._histograms = Counters(torch.int64, _HISTOGRAMS_CHUNK)
        self._pending: list[_Pending] = []
        self._reads_at = 0
        super().__init__(min_bytes=min_bytes, exclude=exclude, key_prefix=key_prefix, enabled=enabled)

    def _begin(self) -> None:
        self.tracker.begin_step(self.policy)
        self._stats.overflow_bound = getattr(self.policy or self.tracker.policy, "overflow_bound", None)
        self._schedule = Schedule(self.prefetch)  # one per step: the old one lives on with the old graph
        self._checks = _Checks()  # likewise
        self._histograms.next_step()
        self._pending = []
        self._reads_at = engines.host_reads()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._settle()
        self._stats.host_reads = engines.host_reads() - self._reads_at  # forward's; backward's: its checks
        self._check_bound()
        if exc[0] is None:  # forward is done: backward will first ask for what was packed last
            _look_ahead(self._schedule, len(self._schedule))

    def _settle(self) -> None:
        """Where forward ends: the sizes of every tensor packed ahead in one read (per device), each tensor's
        buddy memory trimmed to its overflow, the tracker taught, the stats filled in (see ``strict``)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        sizes = {device: iter(self._histograms.read(device)) for device in self._histograms.devices}
        st = self._stats
        for p in pending:
            histogram = next(sizes[p.device])
            if p.bt is not None:
                p.bt.settle(histogram)
            row = p.row
            row.buddy_bytes = 0 if p.bt is None else p.bt.buddy_bytes
            row.ideal_bytes = Layout.compacted_bytes(histogram)
            st.device_bytes += row.device_bytes
            st.buddy_bytes += row.buddy_bytes
            st.ideal_bytes += row.ideal_bytes
            slot = p.layout.sectors_per_entry if p.bt is None else p.bt.slot_sectors
            self.tracker.record(
                row.key, histogram, slot=slot, layout=p.layout,
                predicted_overflow_bytes=row.predicted_overflow_bytes, statistics=p.codec.statistics, fitted=p.codec,
            )  # fmt: skip

    def _check_bound(self) -> None:
        """Warn (once per process and policy) if the step passed its policy's overflow bound.

        The policies that state a bound keep it whatever the history (see
        :mod:`buddy.tracker`); what can still push a step past it is a slot
        the policy did not choose. The warning names the tensor with which the
        step's running overflow first passed the bound, and the figures.
        """
        with self._lock:
            st = self._stats
            bound, spent, seen = st.overflow_bound, 0, 0
            if bound is None:
                return
            for row in st.rows:
                spent, seen = spent + row.buddy_bytes, seen + row.original_bytes
                if spent > bound * seen:
                    break
            else:
                return
        policy = self.policy or self.tracker.policy
        why = (
            "A slot the policy did not choose (a custom policy, or a store that could not take the overflow) does "
            "this." if self.strict else
            "With strict=False slots come from the tracker's plan before the tensors are sized, so tensors that "
            "compress worse than their history spill past it (the next step is planned from this one); "
            "strict=True keeps the bound on every tensor's own sizes, at a read per tensor."
        )  # fmt: skip
        _warn_once(
            f"bound {type(policy).__name__} {bound} {self.strict}",
            f"buddy: this step's overflow passed its policy's bound ({policy!r}): with {row.key!r} the step's "
            f"tensors so far spilled {spent:,} of {seen:,} bytes ({spent / seen:.1%} > {bound:.1%}); the step "
            f"ended at {st.overflow_fraction:.1%}. {why} This warning is shown once.",
        )

    def _take(self, t: torch.Tensor, key: str):
        start = time.perf_counter()
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
        row = self._row(t, result, key, time.perf_counter() - start)
        packed = (
            _Kept(t, self.tracker)
            if result.bt is None
            else _Compressed(result.bt, self, row, self._schedule, self._checks)
        )
        return packed, row

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
        # prefix sums kept for unpack (8 bytes an entry)
        carried = (0 if fitted is None else fitted.table_bytes) + 8 * layout.n_entries
        place = tracker.plan_ahead(key, layout, policy=self.policy, table_bytes=carried)
        if place is None:
            return None
        histogram = self._histograms.take(layout.bins, t.device)
        bt = None
        if place.keep:  # the raw slot: kept as it is, its sizes counted all the same (the key goes on learning)
            codec = engine.measure_ahead(memory_bytes(t)[0], layout, histogram, prior=prior, keep=fitted, count=count)
        else:
            bt = pack_ahead(
                t, engine, layout, place.slot, histogram, store=self.store, ledger=tracker.ledger, prior=prior,
                keep=fitted, count=count,
            )  # fmt: skip
            if bt is None:
                return None
            codec = bt.codec_object
        elapsed = time.perf_counter() - start
        row = KeyRow(
            key=key, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
            codec="kept" if bt is None else bt.codec, target_ratio=1.0 if bt is None else bt.target_ratio,
            original_bytes=layout.nbytes, device_bytes=layout.nbytes if bt is None else bt.device_bytes,
            buddy_bytes=0, ideal_bytes=0, predicted_overflow_bytes=place.predicted_overflow_bytes,
            compress_seconds=elapsed, corrected=place.corrected,
        )  # fmt: skip (buddy and ideal bytes: once the sizes are read, where forward ends)
        st = self._stats
        st.rows.append(row)
        st.corrected += place.corrected
        st.compress_seconds += elapsed
        self._pending.append(_Pending(row, layout, t.device, bt, codec))
        packed = _Kept(t, tracker) if bt is None else _Compressed(bt, self, row, self._schedule, self._checks)
        return packed, row

    def _row(self, t, result: _Packed, key: str, elapsed: float) -> KeyRow:
        st = self._stats
        nbytes = t.numel() * t.element_size()
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
            ideal_bytes=Layout.compacted_bytes(result.histogram),
            predicted_overflow_bytes=result.predicted,
            compress_seconds=elapsed,
            corrected=result.corrected,
        )
        st.corrected += result.corrected
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


#: elements of the buffer a step's histograms are slices of (int64; 254 tensors of 4 KiB entries): made when the
#: step packs its first tensor ahead, and larger when a step needs more
_HISTOGRAMS_CHUNK = 1 << 15


class _Pending(NamedTuple):
    """A tensor packed ahead whose sizes the step reads where forward ends."""

    row: KeyRow
    layout: Layout
    device: torch.device
    bt: BuddyTensor | None  # None: kept as it is (the raw slot), only measured
    codec: CodecLike  # what it was measured with (the tracker keeps its table)


class _Packed(NamedTuple):
    bt: BuddyTensor | None  # None: kept as it is (the tracker chose the raw slot)
    histogram: tuple[int, ...]
    predicted: int | None  # overflow bytes the tracker predicted; None for a new key
    corrected: bool  # the bound widened the slot the key's history planned (see buddy.tracker.Choice)


def _tracked(t, key, tracker: Tracker, policy, store, codec, entry_bytes, *, keep: bool, on_full="device"):
    """Measure ``t``, let the tracker place it under ``key``, pack it there, and record what happened.

    With ``keep``, a tensor the tracker gives the raw slot is not packed
    (``bt`` is ``None``): the raw slot would hold the same bytes plus
    metadata; the caller keeps it (see :class:`_Kept`). A full store keeps
    the tensor whole on the device by default (``on_full="device"``): a full
    store must not cost a training step.
    """
    measured = measure(
        t, codec, entry_bytes=entry_bytes, prior=tracker.prior(key), keep=tracker.fitted(key), count=tracker.counts(key)
    )
    place = tracker.plan(
        key, measured.histogram, layout=measured.layout, policy=policy, table_bytes=measured.codec.table_bytes
    )
    bt = None
    if not (keep and place.keep):
        bt = pack(measured, place.slot, store=store, on_full=on_full, ledger=tracker.ledger)
    tracker.record(
        key,
        measured.histogram,
        slot=place.slot if bt is None else bt.slot_sectors,
        layout=measured.layout,
        predicted_overflow_bytes=place.predicted_overflow_bytes,
        statistics=measured.statistics,
        fitted=measured.codec,
    )
    return _Packed(bt, measured.histogram, place.predicted_overflow_bytes, place.corrected)


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
    tracker = tracker if tracker is not None else default_tracker()
    return _tracked(tensor, key, tracker, policy, store, codec, entry_bytes, keep=False, on_full=on_full).bt


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

    Returns:
        A :class:`Session`; ``session.stats()`` reports what it held.
    """
    return Session(policy, **kwargs)


# ---- recording --------------------------------------------------------------------
@dataclass
class RecordedTensor:
    """One tensor a session would have compressed: its key, a copy of it, and the op that made it.

    ``tensor`` is a detached copy on the recorder's device with the
    original's strides when they were dense (its bytes in memory order are
    the ones a session compresses); ``op`` is the name of the autograd node
    that produced it (e.g. ``"ReluBackward0"``; ``""`` for inputs and
    tensors made without grad).
    """

    key: str
    tensor: torch.Tensor = field(repr=False)
    op: str


class Recorder(_SavedTensorHooks):
    """Records what a :class:`Session` with the same settings would compress; changes nothing.

    After the block, :attr:`tensors` lists the :class:`RecordedTensor` s in
    saving order and :meth:`stats` counts as a session's would
    (``original_bytes``: the unique storages behind them; ``skipped_bytes``:
    every save a session would not compress). Autograd keeps the original
    tensors, so training goes on exactly as without the block.
    """

    _what = "record_activations block"

    def __init__(self, *, min_bytes: int = DEFAULT_MIN_BYTES, exclude=None, key_prefix: str = "", device="cpu"):
        self.device = torch.device(device)
        super().__init__(min_bytes=min_bytes, exclude=exclude, key_prefix=key_prefix, enabled=True)

    def _reset(self) -> None:
        super()._reset()
        self.tensors: list[RecordedTensor] = []

    def _take(self, t: torch.Tensor, key: str):
        op = type(t.grad_fn).__name__ if t.grad_fn is not None else ""
        x = t.detach().resolve_conj().resolve_neg()
        # the bytes a session compresses: memory order for a dense layout, C order for one with gaps
        layout = torch.preserve_format if dense_strides(x.shape, x.stride()) else torch.contiguous_format
        self.tensors.append(RecordedTensor(key, x.to(self.device, memory_format=layout, copy=True), op))
        return _AsIs(t), None  # a new object a save: a dedup hit can check it is still held

    def stats(self) -> SessionStats:
        """What a session would have seen (no rows: nothing was compressed)."""
        with self._lock:
            return SessionStats(**{k: v for k, v in vars(self._stats).items() if k != "rows"})


def record_activations(*, min_bytes: int = DEFAULT_MIN_BYTES, exclude=None, key_prefix: str = "", device="cpu"):
    """A context manager that records, without compressing, what a session would compress.

    The same skip, dedup and key rules as :func:`compressed_activations`
    (``min_bytes``, ``exclude``, ``key_prefix`` as there); each tensor taken
    is copied to ``device``. Returns a :class:`Recorder`.
    """
    return Recorder(min_bytes=min_bytes, exclude=exclude, key_prefix=key_prefix, device=device)
