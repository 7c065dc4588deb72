"""Which implementation runs a codec: one table from (codec, device type, backend) to an engine.

Every way of running a codec is registered here, once:

* ``"reference"`` -- the codec's torch code under the format layer
  (:class:`~buddy.engine.BlockEngine`), on the CPU and on CUDA devices;
  :func:`buddy.register_codec` registers it for every codec that has one;
* ``"cuda"`` -- the codec's CUDA kernels (:mod:`buddy.cuda`);
* ``"nvcomp"`` -- nvcomp's batched GPU compressors (:mod:`buddy.codecs.nvcomp`).

``backend=`` in :func:`buddy.compress` and friends picks one:

* an explicit backend runs that implementation or raises -- ``ValueError``
  when it does not exist for this codec and device (never a silent
  fallback), :class:`~buddy.errors.MissingDependencyError` when it exists
  but cannot run here (no CuPy, no GPU, no nvcomp);
* ``"auto"`` (also what ``None`` means) runs the implementation registered
  as the default for this codec and device -- except that with
  ``buddy.set_defaults(backend="cuda")`` the CUDA kernels are preferred
  wherever they exist and can run.

The CUDA kernels are registered, but not as the default, until they have
passed the GPU tests on a real GPU. Tests and users add implementations
through :func:`register` (and remove them with :func:`unregister`); the
implementation that ran is recorded in every :class:`~buddy.BuddyTensor`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace as _replaced
from typing import TYPE_CHECKING

import torch

from .errors import MissingDependencyError

if TYPE_CHECKING:  # the codec registry imports this module: no cycle at import
    from .codecs.base import Codec
    from .engine import Engine

__all__ = [
    "BACKENDS",
    "Implementation",
    "register",
    "unregister",
    "implementations",
    "check_backend",
    "engine",
    "device_type",
]

#: values of ``backend=`` (``None`` means ``"auto"``)
BACKENDS = ("auto", "reference", "cuda", "nvcomp")
_DEVICES = ("cpu", "cuda")
_LABEL = {"reference": "torch reference", "cuda": "CUDA kernels", "nvcomp": "nvcomp implementation"}


@dataclass(frozen=True)
class Implementation:
    """One way to run one codec on one kind of device."""

    codec: str
    device: str
    backend: str
    #: ``factory(codec) -> Engine``; raises ``ValueError`` for a codec object it does not reproduce
    factory: Callable[[Codec], Engine]
    #: what ``backend="auto"`` runs for this codec and device
    default: bool = False
    #: ``requires() -> None`` when it can run here, else the reason (and how to fix it)
    requires: Callable[[], str | None] | None = None

    def why_unusable(self) -> str | None:
        """Why this implementation cannot run here, or ``None``."""
        return None if self.requires is None else self.requires()


_TABLE: dict[tuple[str, str, str], Implementation] = {}
_lock = threading.Lock()
_warned: set[str] = set()


def register(
    codec: str,
    device: str,
    backend: str,
    factory: Callable[[Codec], Engine],
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
    if device not in _DEVICES:
        raise ValueError(f"device must be one of {_DEVICES}, got {device!r}")
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
    return impl


def unregister(codec: str, device: str | None = None, backend: str | None = None) -> list[Implementation]:
    """Remove the implementations of ``codec`` (on ``device``, of ``backend``, when given); returns them."""
    with _lock:
        gone = [key for key in _TABLE if key[0] == codec and device in (None, key[1]) and backend in (None, key[2])]
        return [_TABLE.pop(key) for key in gone]


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
    if kind not in _DEVICES:
        raise ValueError(f"buddy runs on CPU and CUDA tensors, got one on {device}")
    return kind


def engine(codec: Codec, device: torch.device | str, backend: str | None = None) -> Engine:
    """The engine that runs ``codec`` for a tensor on ``device`` with ``backend`` (see the module doc)."""
    backend = check_backend(backend)
    kind = device_type(device)
    impl = _auto(codec, kind) if backend == "auto" else _explicit(codec, kind, backend, device)
    why = impl.why_unusable()
    if why is not None:
        raise MissingDependencyError(f"the {_LABEL[impl.backend]} of codec {codec.name!r} cannot run here: {why}")
    made = impl.factory(codec)
    made.backend = impl.backend  # what BuddyTensors record is the registry's name for it
    return made


def _explicit(codec: Codec, kind: str, backend: str, device) -> Implementation:
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


def _auto(codec: Codec, kind: str) -> Implementation:
    from .config import defaults  # the defaults import the codec registry, which imports this module

    preferred = defaults().backend
    if preferred != "reference":
        impl = _TABLE.get((codec.name, kind, preferred))
        if impl is not None:
            why = impl.why_unusable()
            if why is None:
                return impl
            _warn_once(preferred, why)
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


def _warn_once(backend: str, why: str) -> None:
    with _lock:
        if backend in _warned:
            return
        _warned.add(backend)
    warnings.warn(
        f"buddy's default backend is {backend!r} but its {_LABEL[backend]} cannot run here ({why}): using "
        f"the default implementation instead.",
        RuntimeWarning,
        stacklevel=4,
    )
