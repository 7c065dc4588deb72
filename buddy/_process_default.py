"""One process-wide instance of a class, made on first use and replaceable (the default store, tracker, ledger)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["ProcessDefault"]

T = TypeVar("T")


class ProcessDefault(Generic[T]):
    """Holds the process-wide ``cls`` instance; ``get`` makes one with ``factory`` when there is none."""

    def __init__(self, cls: type[T], factory: Callable[[], T]):
        self._cls = cls
        self._factory = factory
        self._value: T | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value

    def set(self, value: T | None) -> T | None:
        """Replace it (``None``: a fresh one on next use); returns the previous one."""
        if value is not None and not isinstance(value, self._cls):
            raise TypeError(f"expected a {self._cls.__name__}, got {type(value).__name__}")
        with self._lock:
            previous, self._value = self._value, value
        return previous
