"""Exceptions raised by buddy, and how it warns once.

Every error a user can trigger is one of these (or a built-in ``TypeError`` /
``ValueError`` for plainly wrong arguments), with a message that says what to
do. All of them derive from :class:`BuddyError` so callers can catch the
family at once. :func:`warn_once` is the one way a module warns once per cause.
"""

from __future__ import annotations

import threading
import warnings

__all__ = [
    "BuddyError",
    "CorruptDataError",
    "FreedTensorError",
    "HostStoreFull",
    "MissingDependencyError",
    "UnsupportedTensorError",
    "warn_once",
]

_warn_lock = threading.Lock()


def warn_once(seen: set[str], cause: str, message: str, *, stacklevel: int) -> None:
    """A ``RuntimeWarning`` of ``message``, unless ``cause`` is in ``seen`` (a module's own set), which it joins.
    ``stacklevel`` as :func:`warnings.warn` counts it from the caller of this function."""
    with _warn_lock:
        if cause in seen:
            return
        seen.add(cause)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


class BuddyError(Exception):
    """Base class of every buddy-specific error."""


class FreedTensorError(BuddyError, RuntimeError):
    """A BuddyTensor was used (decompressed, freed) after it was freed."""


class HostStoreFull(BuddyError, MemoryError):
    """The host buddy store cannot hold the overflow of a tensor.

    Raised before anything is written, so nothing is half-stored: the source
    tensor is untouched and still owned by the caller.
    """


class CorruptDataError(BuddyError, ValueError):
    """Metadata, slots or overflow of a BuddyTensor do not agree with each other."""


class UnsupportedTensorError(BuddyError, TypeError):
    """The tensor's layout or dtype cannot be compressed (sparse, meta, nested, ...)."""


class MissingDependencyError(BuddyError, ImportError):
    """An optional dependency (CUDA, CuPy, nvcomp) needed by a feature is missing."""
