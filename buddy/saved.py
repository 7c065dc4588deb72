"""What autograd keeps for each saved tensor under a session, and how it comes back.

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
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import torch

from . import streams
from .eager import eager_only
from .errors import CorruptDataError, warn_once
from .prefetch import Ahead, Schedule
from .stats import KeyRow
from .step import Checks
from .tensor import BuddyTensor
from .tracker import Tracker

if TYPE_CHECKING:
    from .autograd import Session
    from .peak import StepProfile

__all__: list[str] = []

_warned: set[str] = set()  # the causes warned of (errors.warn_once)


def _warn_once(cause: str, message: str) -> None:
    warn_once(_warned, cause, message, stacklevel=3)


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(note)


def _changed_in_place(t: torch.Tensor, version: int, what: str, why: str) -> RuntimeError:
    """PyTorch's error for ``t`` (``what``, its description's start), saved at ``version``, changed in place since."""
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"{what}[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead. {why}"
    )


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
            raise _changed_in_place(
                t, self.version, "", "buddy kept this saved tensor as it is (not compressed), and it was changed in "
                "place after it was saved: change a copy instead (PyTorch raises the same without buddy).",
            )  # fmt: skip
        return t


class _Kept(_AsIs):
    """What autograd keeps for a tensor the tracker left as it is (the raw slot).

    Its device bytes are held on the tracker's ledger for as long as autograd
    holds it -- not as long as the tensor lives, which may be many steps (an
    input batch reused every step).
    """

    __slots__ = ("profiled",)

    def __init__(self, t: torch.Tensor, tracker: Tracker, profiled: tuple[StepProfile, int] | None = None):
        super().__init__(t)
        self.profiled = profiled  # its step's profile and its place there: its first use is recorded
        hold = tracker.ledger.hold(t.numel() * t.element_size())
        weakref.finalize(self, hold.release)  # the hold refers to the ledger only: no cycle through the graph

    def unpack(self) -> torch.Tensor:
        t = super().unpack()
        if self.profiled is not None:
            profile, index = self.profiled
            profile.use(index)
        return t


class _Recast:
    """What autograd keeps for a saved copy of a parameter in another dtype (autocast's cast of a weight, or a
    view of it: :func:`buddy.keys.cast_source`): the parameter (``detach()``: the same memory and version counter)
    and the parameter's version when the copy was saved. Backward makes the copy again, ``source.to(dtype)``,
    bit-exact: nothing is held for it, and nothing compressed.

    A parameter changed in place after the save would give a gradient computed from its new values:
    :meth:`unpack` raises there, as PyTorch does where it saves a parameter itself (an fp32 weight).
    """

    __slots__ = ("source", "version", "dtype", "view", "__weakref__")

    def __init__(self, t: torch.Tensor, source: torch.Tensor):
        self.source = source.detach()
        self.version = source._version
        self.dtype = t.dtype
        self.view = None if t._base is None else (tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(self) -> torch.Tensor:
        s = self.source
        if s._version != self.version:  # (the message made only here: unpack is on backward's path)
            raise _changed_in_place(
                s, self.version, "the parameter ",
                f"buddy makes its saved {str(self.dtype).removeprefix('torch.')} copy (autocast's cast of a weight) "
                f"again from it in backward, and it was changed in place after the copy was saved: change parameters "
                f"after backward, or pass rederive_casts=False to compressed_activations to keep such copies.",
            )  # fmt: skip
        out = s.to(self.dtype)
        return out if self.view is None else out.as_strided(*self.view)


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
        "bt", "session", "row", "cache", "kept", "uses_left", "schedule", "position", "ahead", "checks", "profiled",
        "packed", "raced", "__weakref__",
    )  # fmt: skip

    def __init__(
        self, bt: BuddyTensor, session: Session, row: KeyRow, schedule: Schedule, checks: Checks,
        profiled: tuple[StepProfile, int] | None = None,
    ):  # fmt: skip
        self.bt = bt
        # its step's profile (saves, uses, memory: buddy.peak) and its place there; the profile refers to no one's
        # objects, and outlives the session (the tracker keeps the most recent step's)
        self.profiled = profiled
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
        # packed beside forward (buddy.overlap): the stream operations and the event of its pack, which its
        # decompression waits for; whether the original was changed in place while the pack could read it
        self.packed: tuple[streams.StreamOps, object] | None = None
        self.raced = False

    def _after_pack(self, stream) -> None:
        """Make ``stream``'s later work wait for the pack (packed beside forward), on the device."""
        if self.packed is None:
            return
        session = self.session()
        if session is not None:  # (a backward inside the block: its stashes let go first, their changes seen)
            session._drain()
        if self.raced:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"the saved activation {self.row.key!r} was changed in place while buddy was compressing it beside "
                f"forward (overlap), so its compressed copy may hold some of the new bytes; none is returned. "
                f"Change a copy instead (PyTorch raises the same without buddy)."
            )
        ops, event = self.packed
        ops.wait(stream, event)

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
        self._after_pack(streams.for_device(device).current(device))
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
        seconds = time.perf_counter() - start
        if self.profiled is not None:
            profile, index = self.profiled
            profile.use(index)
            profile.measured_seconds += seconds
        session = self.session()
        if session is not None:  # no one can read the counters of a session that is gone
            session._count_unpack(seconds)
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
            self._after_pack(copy)  # (or on the pack stream)
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


# ---- torch.compile: the hooks run eagerly (buddy.eager) -----------------------------
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
      (:func:`buddy.eager.eager_only`).
    * A tensor saved with a non-dense layout (a strided slice) decompresses
      contiguous; it is handed back in its original strides, bit-exact:
      inductor compiled the backward kernels for those strides and asserts
      them (``assert_size_stride``), and an eager kernel may round
      differently on another layout.
    """
    release = eager_only(_release)

    def pack_hook(t):
        packed = pack(t)
        if type(packed) in (_AsIs, _Recast):  # kept as it is, or made again: nothing to release
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

    return eager_only(pack_hook), eager_only(unpack_hook)
