"""Which implementation runs a codec: one table from (codec, device type, backend) to an engine.

Every way of running a codec is registered here, once:

* ``"reference"`` -- the codec's torch code under the format layer
  (:mod:`buddy.engines.reference`), on the CPU and on CUDA devices;
  registered here for every codec :func:`buddy.codecs.register_codec` registers
  with ``reference=True`` (the registry tells this table: see
  :func:`buddy.codecs.attach`);
* ``"cuda"`` -- the codec's CUDA kernels (:mod:`buddy.engines.cuda`): the
  default on CUDA devices for the codecs that have them;
* ``"native"`` -- the same kernel sources built for the host
  (:mod:`buddy.engines.native`): on the CPU for every codec with kernels, the
  default for those it runs faster than the reference
  (:data:`buddy.engines.native.DEFAULT_CODECS`);
* ``"nvcomp"`` -- nvcomp's batched GPU compressors (:mod:`buddy.engines.nvcomp`).

Each engine module lists its rows (``rows()``: :class:`Implementation` objects);
this module builds its one table from them.

``backend=`` in :func:`buddy.compress` and friends picks one:

* an explicit backend runs that implementation or raises -- ``ValueError``
  when it does not exist for this codec and device (never a silent
  fallback), :class:`~buddy.errors.MissingDependencyError` when it exists
  but cannot run here (no CuPy, no GPU, no nvcomp, no C++ compiler). An
  explicit ``"cuda"`` or ``"native"`` runs the kernels without their self-test;
* ``"auto"`` (also what ``None`` means) runs the implementation registered
  as the default for this codec and device: on a CUDA tensor the kernels
  wherever the codec has them, on a CPU tensor the native engine for the
  codecs it is the default of, else the reference. The compiled kernels
  (the backends of :data:`COMPILED`) run only where they can (CuPy importable and a GPU; a
  C++ compiler), for a codec object they reproduce
  (their factory raises ``ValueError`` for any other) and once they have passed their self-test
  on the device (:mod:`buddy.selftest`: golden vectors through the kernels
  both ways, once per process, device and codec); otherwise the reference
  runs, and a failed self-test warns once. :func:`chosen` records, per device and codec, what ``"auto"``
  ran last and why.

What ``"auto"`` prefers is, in this order: the environment variable
``BUDDY_BACKEND`` (read at every use; ``"reference"`` forces the reference,
``"auto"``, ``"cuda"`` and ``"native"`` the rule above; anything else raises a
``ValueError`` naming the valid values), else ``buddy.set_defaults(backend=...)``
(``"auto"``, the default; ``"reference"``; ``"cuda"`` or ``"native"``, which
also prefer the kernels on their kind of device where they are registered but
are not the default, and warn once where they cannot run).

Tests and users add implementations through :func:`register` (and remove
them with :func:`unregister`); the implementation that ran is recorded in
every :class:`~buddy.BuddyTensor`, whose ``decompress()`` asks for it
explicitly.

An engine is made once per codec object, device, backend asked for, preference
and launch settings (:func:`buddy.engines.tuning.current`), and kept: each
call gets a copy of it (:meth:`~buddy.engines.Engine.for_tensor`). What the
choice read that can change unseen -- each implementation's answer to whether
it can run here, the self-test's verdict -- is asked again at every use, and a
different answer makes the engine again; registering or removing an
implementation forgets every engine kept. Codecs that carry a table (fitted to
one tensor) are not kept: their engines are made at every call.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace as _replaced
from typing import NamedTuple

import torch

from . import codecs, selftest
from .codecs.base import CodecLike
from .config import DEFAULT_BACKENDS, defaults
from .engines import DEVICES, Engine, Implementation, cuda, native, nvcomp, reference, tuning
from .errors import MissingDependencyError, warn_once

__all__ = [
    "BACKENDS",
    "Implementation",
    "register",
    "unregister",
    "implementations",
    "Choice",
    "chosen",
    "ENV_BACKEND",
    "env_backend",
    "check_backend",
    "engine",
    "device_type",
]

#: values of ``backend=`` (``None`` means ``"auto"``)
BACKENDS = ("auto", "reference", "cuda", "native", "nvcomp")
_LABEL = {
    "reference": "torch reference", "cuda": "CUDA kernels", "native": "native CPU engine",
    "nvcomp": "nvcomp implementation",
}  # fmt: skip
#: the environment variable that overrides ``set_defaults(backend=...)`` (read at every use)
ENV_BACKEND = "BUDDY_BACKEND"


_TABLE: dict[tuple[str, str, str], Implementation] = {}
_lock = threading.Lock()
_warned: set[str] = set()
#: counts the table's changes: an engine made while it changed is not kept
_generation = 0


def register(
    codec: str,
    device: str,
    backend: str,
    factory: Callable[[CodecLike], Engine],
    *,
    default: bool = False,
    requires: Callable[[], str | None] | None = None,
    replace: bool = False,
) -> Implementation:
    """Register how ``backend`` runs codec ``codec`` (a name) on ``device`` (``"cpu"`` or ``"cuda"``).

    ``default=True`` makes it what ``backend="auto"`` runs there (the
    previous default for that codec and device stops being one).
    """
    if not isinstance(codec, str) or not codec:
        raise ValueError(f"codec must be a non-empty name, got {codec!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if backend not in BACKENDS[1:]:
        raise ValueError(f"backend must be one of {BACKENDS[1:]}, got {backend!r}")
    if not callable(factory):
        raise TypeError("factory must be a callable codec -> Engine")
    impl = Implementation(codec, device, backend, factory, default, requires)
    with _lock:
        key = (codec, device, backend)
        if key in _TABLE and not replace:
            raise ValueError(f"{backend} implementation of {codec!r} on {device} is already registered (replace=True)")
        if default:  # one default per codec and device
            for other_key, other in list(_TABLE.items()):
                if other.codec == codec and other.device == device and other.default:
                    _TABLE[other_key] = _replaced(other, default=False)
        _TABLE[key] = impl
        _changed()
    return impl


def unregister(codec: str, device: str | None = None, backend: str | None = None) -> list[Implementation]:
    """Remove the implementations of ``codec`` (on ``device``, of ``backend``, when given); returns them."""
    with _lock:
        gone = [key for key in _TABLE if key[0] == codec and device in (None, key[1]) and backend in (None, key[2])]
        _changed()
        return [_TABLE.pop(key) for key in gone]


def _changed() -> None:
    """The table changed (under ``_lock``): every engine kept is forgotten."""
    global _generation
    _generation += 1
    _MADE.clear()
    codecs.forget_usable()


def implementations(
    codec: str | None = None, *, device: str | None = None, backend: str | None = None
) -> list[Implementation]:
    """Registered implementations, optionally of one codec, device type or backend."""
    with _lock:
        rows = list(_TABLE.values())
    return [i for i in rows if codec in (None, i.codec) and device in (None, i.device) and backend in (None, i.backend)]


def check_backend(backend: str | None) -> str:
    """``backend`` validated (``None`` -> ``"auto"``)."""
    if backend is None:
        return "auto"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))} (or None), got {backend!r}")
    return backend


def device_type(device: torch.device | str) -> str:
    """``"cpu"`` or ``"cuda"`` for a device (another type: ``ValueError``)."""
    kind = torch.device(device).type
    if kind not in DEVICES:
        raise ValueError(f"buddy runs on CPU and CUDA tensors, got one on {device}")
    return kind


@dataclass(frozen=True)
class Choice:
    """What ``backend="auto"`` ran for one codec on one device, and why (see :func:`chosen`)."""

    #: ``"cuda:0"``, ``"cpu"``
    device: str
    codec: str
    #: ``"cuda"``, ``"reference"`` or ``"nvcomp"``
    backend: str
    #: ``"self-test passed in 0.12 s (2 golden cases)"``, ``"BUDDY_BACKEND=reference"``, ``"CuPy is not importable: ..."``
    why: str

    def __str__(self) -> str:
        return f"{self.device:<7} {self.codec:<16} {self.backend:<9} {self.why}"


_CHOSEN: dict[tuple[str, str], Choice] = {}


def chosen(codec: str | None = None, *, device: str | None = None) -> list[Choice]:
    """Per device and codec, what ``backend="auto"`` ran last in this process and why.

    ``device``: ``"cuda:0"`` (that device) or ``"cuda"`` (every CUDA device);
    ``codec``: a codec's name. Rows appear as codecs are first used.
    """
    with _lock:
        rows = sorted(_CHOSEN.values(), key=lambda c: (c.device, c.codec))
    return [
        c for c in rows if codec in (None, c.codec) and device in (None, c.device, c.device.split(":")[0])
    ]


def _record(where: str, codec: str, backend: str, why: str) -> None:
    _recorded(Choice(where, codec, backend, why))


def _recorded(row: Choice) -> None:
    if _CHOSEN.get((row.device, row.codec)) != row:
        with _lock:
            _CHOSEN[(row.device, row.codec)] = row


def env_backend() -> str | None:
    """``BUDDY_BACKEND`` validated (``None`` when unset or empty); read at every use."""
    value = os.environ.get(ENV_BACKEND, "").strip()
    if not value:
        return None
    if value not in DEFAULT_BACKENDS:
        raise ValueError(
            f"the environment variable {ENV_BACKEND}={value!r} is not a backend: use one of "
            f"{', '.join(DEFAULT_BACKENDS)} (or leave it unset)"
        )
    return value


def _preference() -> tuple[str, str]:
    """What ``"auto"`` prefers and where that came from."""
    forced = env_backend()
    if forced is not None:
        return forced, f"{ENV_BACKEND}={forced}"
    preferred = defaults().backend
    return preferred, f"set_defaults(backend={preferred!r})"


class _Made(NamedTuple):
    """An engine :func:`engine` made, and what decided it that its key does not hold."""

    #: the codec it runs (held: its id, in the key, names no other object while it is kept)
    codec: CodecLike
    engine: Engine
    #: the implementations asked whether they can run here, and their answers
    asked: tuple[tuple[Implementation, str | None], ...] = ()
    #: the self-test asked (its arguments) and its verdict
    tested: tuple[tuple, selftest.Verdict] | None = None
    #: what ``"auto"`` records of it
    choice: Choice | None = None

    def holds(self) -> bool:
        """Whether what decided the engine answers as it did: the implementations asked, the self-test."""
        for impl, why in self.asked:
            if impl.why_unusable() != why:
                return False
        return self.tested is None or selftest.verdict(*self.tested[0]) is self.tested[1]


#: the engines made, by codec object (its id), device, backend asked for, preference and tuning (see the module doc)
_MADE: dict[tuple, _Made] = {}
#: engines kept at most (the oldest is dropped first): a codec object is held only while one of its engines is
MADE_KEPT = 64


def engine(codec: CodecLike, device: torch.device | str, backend: str | None = None) -> Engine:
    """The engine that runs ``codec`` for a tensor on ``device`` with ``backend`` (see the module doc): a copy, for
    this call alone, of the one made for them."""
    backend = check_backend(backend)
    kind = device_type(device)
    where = _where(torch.device(device)) if kind == "cuda" else _HOST
    preference = _preference() if backend == "auto" else None
    # a codec that carries a table is fitted to one tensor (or bound to one's): its engine is not kept
    fitted = codec.table_bytes or codec.statistics is not None
    key = None if fitted else (id(codec), where, backend, preference, tuning.current())
    made = None if key is None else _MADE.get(key)
    if made is None or not made.holds():
        generation = _generation
        made = _named(codec, kind, backend, device) if preference is None else _auto(codec, where, kind, preference)
        if key is not None:
            _keep(key, made, generation)
    if made.choice is not None:
        _recorded(made.choice)  # again: the record may have been cleared since
    return made.engine if key is None else made.engine.for_tensor()


def _keep(key: tuple, made: _Made, generation: int) -> None:
    """Keeps ``made`` for ``key``, unless the table changed while it was made (``generation``: the table's count of
    changes when it was begun)."""
    with _lock:
        if generation == _generation:
            _MADE[key] = made
            while len(_MADE) > MADE_KEPT:
                del _MADE[next(iter(_MADE))]


def _named(codec: CodecLike, kind: str, backend: str, device) -> _Made:
    """The engine of an explicit ``backend``; ``ValueError`` where there is none, ``MissingDependencyError`` where it
    cannot run here."""
    impl = _explicit(codec, kind, backend, device)
    why = impl.why_unusable()
    if why is not None:
        raise MissingDependencyError(f"the {_LABEL[impl.backend]} of codec {codec.name!r} cannot run here: {why}")
    return _Made(codec, _made(impl, codec), ((impl, None),))


def _made(impl: Implementation, codec: CodecLike) -> Engine:
    made = impl.factory(codec)
    made.backend = impl.backend  # what BuddyTensors record is the registry's name for it
    return made


def _explicit(codec: CodecLike, kind: str, backend: str, device) -> Implementation:
    impl = _TABLE.get((codec.name, kind, backend))
    if impl is not None:
        return impl
    elsewhere = [i.device for i in implementations(codec.name, backend=backend)]
    if elsewhere:
        where = "a CUDA device" if "cuda" in elsewhere else f"a {' or '.join(elsewhere)} device"
        raise ValueError(
            f"backend={backend!r} needs a tensor on {where} for codec {codec.name!r}, got one on {device}; "
            f"use backend='reference' or 'auto'"
        )
    have = sorted({i.codec for i in implementations(backend=backend)}) or ["none"]
    raise ValueError(
        f"codec {codec.name!r} has no {_LABEL[backend]} (codecs with them: {', '.join(have)}); "
        f"use backend='reference' or 'auto'"
    )


_HOST = torch.device("cpu")


def _where(device: torch.device) -> torch.device:
    """The device with its index (a CUDA device without one: the current one)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _row_device(device: torch.device) -> str:
    """How :func:`chosen` names a device: ``"cuda:0"``, ``"cpu"``."""
    return str(device) if device.type == "cuda" else device.type


#: the backends that run compiled kernels, behind their self-test: the CUDA kernels, and the same sources built for
#: the host (buddy.engines.native)
COMPILED = ("cuda", "native")


def _auto(codec: CodecLike, device: torch.device, kind: str, preference: tuple[str, str]) -> _Made:
    """What ``backend="auto"`` runs (see the module doc) with ``preference`` (:func:`_preference`), and why;
    ``device`` with its index."""
    preferred, source = preference
    default = _default(codec, kind)
    reference = _TABLE.get((codec.name, kind, "reference"))
    where = _row_device(device)
    preferred_kernels = _TABLE.get((codec.name, kind, preferred)) if preferred in COMPILED else None
    impl = preferred_kernels or default
    if impl.backend in COMPILED and reference is not None:
        if preferred == "reference":
            return _Made(codec, _made(reference, codec), choice=Choice(where, codec.name, "reference", source))
        return _kernels(impl, reference, codec, device, preferred)
    if preferred == "reference" and reference is not None:
        impl = reference
    unusable = impl.why_unusable()
    if unusable is not None:  # nothing to fall back to (nvcomp's codecs)
        raise MissingDependencyError(
            f"the {_LABEL[impl.backend]} of codec {codec.name!r} cannot run here: {unusable}"
        )
    if kind == "cuda" and (codec.name, kind, "cuda") not in _TABLE and impl.backend == "reference":
        why = f"codec {codec.name!r} has no CUDA kernels"
    else:
        why = f"the default on {kind} tensors"
    return _Made(codec, _made(impl, codec), ((impl, None),), choice=Choice(where, codec.name, impl.backend, why))


def _default(codec: CodecLike, kind: str) -> Implementation:
    """The implementation registered as the default for ``codec`` on ``kind`` devices."""
    for impl in implementations(codec.name, device=kind):
        if impl.default:
            return impl
    elsewhere = sorted({i.device for i in implementations(codec.name)})
    if elsewhere:
        where = "the GPU (CUDA tensors)" if elsewhere == ["cuda"] else f"{' and '.join(elsewhere)} tensors"
        raise MissingDependencyError(
            f"codec {codec.name!r} runs on {where} only: move the tensor there first (got a {kind} tensor), "
            f"or use a reference codec such as 'auto'"
        )
    raise ValueError(f"codec {codec.name!r} has no implementation registered; register_codec() gives it one")


def _kernels(
    impl: Implementation, reference: Implementation, codec: CodecLike, device: torch.device, preferred: str
) -> _Made:
    """The kernels' engine if they can run here, reproduce ``codec`` and passed their self-test on ``device``; else
    the reference's; and why."""
    why = impl.why_unusable()
    asked = ((impl, why),)
    if why is not None:
        label = _LABEL[impl.backend]
        if preferred == impl.backend:
            _warn_once(impl.backend, f"buddy's default backend is {impl.backend!r} but its {label} cannot run here "
                       f"({why}): using the torch reference instead.")  # fmt: skip
        elif impl.backend == "native" and not native.switched_off():  # one line saying why it is slower
            _warn_once("native:unusable", f"buddy's {label} cannot run here ({why}): the torch reference runs on "
                       "CPU tensors instead (slower; docs/cpu_engine.md).")  # fmt: skip
        return _fallback(reference, codec, device, why, asked)
    try:
        made = _made(impl, codec)
    except ValueError as exc:  # a codec object the kernels do not reproduce (a subclass, other members)
        return _fallback(reference, codec, device, str(exc), asked)
    test = (codec.name, device, impl.factory, _LABEL[impl.backend])
    verdict = selftest.verdict(*test)
    if not verdict.passed:
        return _fallback(reference, codec, device, verdict.why, asked, (test, verdict))
    choice = Choice(_row_device(device), codec.name, impl.backend, verdict.why)
    return _Made(codec, made, asked, (test, verdict), choice)


def _fallback(reference: Implementation, codec: CodecLike, device: torch.device, why: str, asked, tested=None) -> _Made:
    """The reference's engine where the kernels do not run, and ``why``."""
    choice = Choice(_row_device(device), codec.name, "reference", why)
    return _Made(codec, _made(reference, codec), asked, tested, choice)


def _warn_once(key: str, message: str) -> None:
    warn_once(_warned, key, message, stacklevel=4)


# ---------------------------------------------------------------------------
# the table: every implementation of buddy's codecs, registered here
# ---------------------------------------------------------------------------
def _add(row: Implementation, replace: bool = False) -> Implementation:
    return register(
        row.codec, row.device, row.backend, row.factory, default=row.default, requires=row.requires, replace=replace
    )


def _codec_added(codec: CodecLike, reference_code: bool) -> None:
    """A codec registered by name: its reference implementation, the default on the CPU and on CUDA devices."""
    if reference_code:
        for row in reference.rows(codec.name):
            _add(row, replace=True)


def _codec_removed(name: str) -> None:
    unregister(name)


def _reasons(name: str, device: str | None) -> list[str | None]:
    return [i.why_unusable() for i in implementations(name, device=device)]


codecs.attach(_codec_added, _codec_removed, _reasons)  # the reference of every codec registered
for _codec in nvcomp.CODECS:  # nvcomp's chunk codecs, by name: they have no reference
    codecs.register_codec(_codec, reference=False)
for _row in (*cuda.rows(), *native.rows(), *nvcomp.rows()):
    _add(_row)
