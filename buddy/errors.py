"""Exceptions raised by buddy, how it warns once, and how a moved name warns.

Every error a user can trigger is one of these (or a built-in ``TypeError`` /
``ValueError`` for plainly wrong arguments), with a message that says what to
do. All of them derive from :class:`BuddyError` so callers can catch the
family at once. :func:`warn_once` is the one way a module warns once per cause;
:class:`Moved` is a module's ``__getattr__`` for the public names it no longer holds.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from typing import Any

__all__ = [
    "BuddyError",
    "CorruptDataError",
    "FreedTensorError",
    "HostStoreFull",
    "MissingDependencyError",
    "UnsupportedTensorError",
]  # warn_once is the package's own helper, not part of the API

_warn_lock = threading.Lock()


def warn_once(seen: set[str], cause: str, message: str, *, stacklevel: int) -> None:
    """A ``RuntimeWarning`` of ``message``, unless ``cause`` is in ``seen`` (a module's own set), which it joins.
    ``stacklevel`` as :func:`warnings.warn` counts it from the caller of this function."""
    with _warn_lock:
        if cause in seen:
            return
        seen.add(cause)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


class Moved:
    """A module's ``__getattr__`` (PEP 562) for its moved names: ``table`` maps an old name to ``(module, name)``,
    where the object lives now. An old name returns that same object; its first use in the process warns, naming
    the new place. Any other name raises ``AttributeError`` as a missing attribute does."""

    def __init__(self, module: str, table: dict[str, tuple[str, str]]):
        self.module = module
        self.table = table
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str) -> Any:
        try:
            module, new = self.table[name]
        except KeyError:
            raise AttributeError(f"module {self.module!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), new)
        with self._lock:
            first = name not in self._warned
            self._warned.add(name)
        if first:
            message = f"{self.module}.{name} is deprecated; use {module}.{new}"
            warnings.warn(message, DeprecationWarning, stacklevel=2)
        return value


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
