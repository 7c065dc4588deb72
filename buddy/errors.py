"""Exceptions raised by buddy.

Every error a user can trigger is one of these (or a built-in ``TypeError`` /
``ValueError`` for plainly wrong arguments), with a message that says what to
do. All of them derive from :class:`BuddyError` so callers can catch the
family at once.
"""

from __future__ import annotations

__all__ = [
    "BuddyError",
    "CorruptDataError",
    "FreedTensorError",
    "HostStoreFull",
    "MissingDependencyError",
    "UnsupportedTensorError",
]


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
