"""Process-wide defaults: the global switch for codec, entry size and backend.

``buddy.set_defaults(codec="zvc", entry_bytes=128)`` changes what
:func:`buddy.compress`, :func:`buddy.wrap` and ``compressed_activations`` use
when they are not told otherwise. Explicit arguments always win.

``backend`` picks who runs the codecs when a call says ``backend="auto"``
(or nothing): ``"reference"`` (the default) runs the torch reference codecs
everywhere; ``"cuda"`` runs a codec's CUDA kernels for tensors on a CUDA
device when the codec has kernels and CuPy is installed, and the reference
otherwise (see :mod:`buddy.backends`). The CUDA kernels stay off by default
until they have been validated on a GPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from . import spec

__all__ = ["Defaults", "DEFAULT_BACKENDS", "defaults", "set_defaults"]

#: values the process-wide ``backend`` default can take
DEFAULT_BACKENDS = ("reference", "cuda")


@dataclass(frozen=True)
class Defaults:
    codec: str = "zvc"
    entry_bytes: int = spec.DEFAULT_ENTRY_BYTES
    #: "reference" (off: the torch codecs) or "cuda" (kernels where they apply);
    #: the CUDA path is off by default until it has been validated on a GPU
    backend: str = "reference"


_current = Defaults()
_lock = threading.Lock()


def defaults() -> Defaults:
    """The current process-wide defaults."""
    return _current


def set_defaults(*, codec: str | None = None, entry_bytes: int | None = None, backend: str | None = None) -> Defaults:
    """Change the process-wide codec, entry size and/or backend; returns the previous defaults."""
    global _current
    from .codecs import get_codec  # the registry imports nothing from here; avoid a cycle at import

    changes = {}
    if codec is not None:
        changes["codec"] = get_codec(codec).name
    if entry_bytes is not None:
        changes["entry_bytes"] = spec.check_entry_bytes(entry_bytes)
    if backend is not None:
        if not isinstance(backend, str) or backend not in DEFAULT_BACKENDS:
            raise ValueError(f"the default backend must be one of {DEFAULT_BACKENDS}, got {backend!r}")
        changes["backend"] = backend
    with _lock:
        previous, _current = _current, replace(_current, **changes)
    return previous
