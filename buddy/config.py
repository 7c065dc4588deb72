"""Process-wide defaults: the global switch for codec, entry size and backend.

``buddy.set_defaults(codec="zvc", entry_bytes=128)`` changes what
:func:`buddy.compress`, :func:`buddy.wrap` and ``compressed_activations`` use
when they are not told otherwise. Explicit arguments always win.

``backend`` picks who runs the codecs when a call says ``backend="auto"``
(or nothing): ``"auto"`` (the default) runs a codec's CUDA kernels on a CUDA
tensor wherever it has them, they can run and they passed their self-test on
the device (:mod:`buddy.selftest`), else the torch reference (nvcomp's
codecs run nvcomp); ``"reference"`` always runs the torch reference;
``"cuda"`` is ``"auto"`` that also prefers kernels registered but not the
default, and warns once where they cannot run. The environment variable
``BUDDY_BACKEND`` overrides it (see :mod:`buddy.dispatch`).

``checksum=True`` makes every compressed tensor carry a 64-bit checksum of
each of its buffers, checked by ``decompress()`` before decoding (see
:mod:`buddy.integrity`); off by default: it costs one more read of the
buffers at both ends.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

from . import spec
from .codecs import DEFAULT_CODEC, get_codec

__all__ = ["Defaults", "DEFAULT_BACKENDS", "defaults", "set_defaults", "check_checksum"]

#: values the process-wide ``backend`` default (and ``BUDDY_BACKEND``) can take
DEFAULT_BACKENDS = ("auto", "reference", "cuda", "native")


@dataclass(frozen=True)
class Defaults:
    #: chosen by measurement: see docs/choosing.md
    codec: str = DEFAULT_CODEC
    entry_bytes: int = spec.DEFAULT_ENTRY_BYTES
    #: "auto" (the compiled kernels where they are the default and passed their self-test, else the reference),
    #: "reference", "cuda" or "native" (see :mod:`buddy.dispatch`)
    backend: str = "auto"
    #: store and check a checksum of each buffer (see :mod:`buddy.integrity`)
    checksum: bool = False


def check_checksum(checksum) -> bool:
    """Validate a ``checksum=`` switch: a real ``bool`` (no 0/1 or strings)."""
    if not isinstance(checksum, bool):
        raise TypeError(f"checksum must be True or False, got {checksum!r}")
    return checksum


_current = Defaults()
_lock = threading.Lock()


def defaults() -> Defaults:
    """The current process-wide defaults."""
    return _current


def set_defaults(
    *,
    codec: str | None = None,
    entry_bytes: int | None = None,
    backend: str | None = None,
    checksum: bool | None = None,
) -> Defaults:
    """Change the process-wide codec, entry size, backend and/or checksum switch; returns the previous defaults.

    ``None`` leaves a setting as it is. ``checksum`` must be ``True`` or
    ``False``.
    """
    global _current
    changes: dict[str, Any] = {}
    if codec is not None:
        changes["codec"] = get_codec(codec).name
    if entry_bytes is not None:
        changes["entry_bytes"] = spec.check_entry_bytes(entry_bytes)
    if backend is not None:
        if not isinstance(backend, str) or backend not in DEFAULT_BACKENDS:
            raise ValueError(f"the default backend must be one of {DEFAULT_BACKENDS}, got {backend!r}")
        changes["backend"] = backend
    if checksum is not None:
        changes["checksum"] = check_checksum(checksum)
    with _lock:
        previous, _current = _current, replace(_current, **changes)
    return previous
