"""Process-wide defaults: the global switch for codec and entry size.

``buddy.set_defaults(codec="zvc", entry_bytes=128)`` changes what
:func:`buddy.compress`, :func:`buddy.wrap` and ``compressed_activations`` use
when they are not told otherwise. Explicit arguments always win.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from . import spec

__all__ = ["Defaults", "defaults", "set_defaults"]


@dataclass(frozen=True)
class Defaults:
    codec: str = "zvc"
    entry_bytes: int = spec.DEFAULT_ENTRY_BYTES


_current = Defaults()
_lock = threading.Lock()


def defaults() -> Defaults:
    """The current process-wide defaults."""
    return _current


def set_defaults(*, codec: str | None = None, entry_bytes: int | None = None) -> Defaults:
    """Change the process-wide codec and/or entry size; returns the previous defaults."""
    global _current
    from .codecs import get_codec  # the registry imports nothing from here; avoid a cycle at import

    changes = {}
    if codec is not None:
        changes["codec"] = get_codec(codec).name
    if entry_bytes is not None:
        changes["entry_bytes"] = spec.check_entry_bytes(entry_bytes)
    with _lock:
        previous, _current = _current, replace(_current, **changes)
    return previous
