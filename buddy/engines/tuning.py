"""How the compiled kernels are laid out and launched: one object, made once, passed down.

A :class:`Tuning` says what a GPU run may want to try beside the defaults:
where a table codec's tables live, how the count kernel counts, how many
warps an SM unpack runs, whether unpack reads the overflow in pinned host
memory. None changes a byte of the format; each changes only speed.

An engine takes the tuning current when it is made (:func:`current`) and
hands it to every launch it makes: nothing is read from the environment per
launch. :func:`tuned` changes the current one for a ``with`` block, as
``torch.backends`` flags do::

    with buddy.engines.tuning.tuned(unpack_warps=8):
        bt = buddy.compress(x)          # its engine launches unpack at 8 warps an SM

The current tuning is the process's (not a thread's): the runbook's bench
switches it between timed runs, not while another thread compresses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Tuning", "current", "tuned"]


@dataclass(frozen=True)
class Tuning:
    """The kernels' launch settings. Every field's default is what runs when nobody asks otherwise.

    ``shared_tables``: a table codec's unpack copies its table's decode rows into each block's shared memory where
    they fit (its pack then compiles from the same module); False reads them in global memory.
    ``count_match``: how the count kernel counts (the same counts either way): True, a warp's lanes of equal keys
    add their number once; False, its zero words by ballots and every other word on its own; None (default), by
    word size: 2-byte words take the ballots, the others the match.
    ``pack_fields``: where the tables are in shared memory, a table codec's pack first makes there a table of whole
    fields and reads each word's field from it (needs ``shared_tables``).
    ``unpack_warps``: with the table in shared memory, unpack runs at most this many warps an SM (1 to 64; None:
    as many as its shared memory allows).
    ``zero_copy``: unpack reads the overflow where it is, in pinned host memory over the bus, instead of copying it
    to the device first (where the device takes registered host pointers and the overflow is pinned and mapped).
    """

    shared_tables: bool = True
    count_match: bool | None = None
    pack_fields: bool = False
    unpack_warps: int | None = None
    zero_copy: bool = False

    def __post_init__(self) -> None:
        for name in ("shared_tables", "pack_fields", "zero_copy"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Tuning.{name} is True or False, got {getattr(self, name)!r}")
        if self.count_match is not None and not isinstance(self.count_match, bool):
            raise TypeError(f"Tuning.count_match is True (match), False (ballots) or None, got {self.count_match!r}")
        warps = self.unpack_warps
        if warps is not None and (isinstance(warps, bool) or not isinstance(warps, int) or not 1 <= warps <= 64):
            raise ValueError(f"Tuning.unpack_warps is a number of warps an SM, 1 to 64, or None, got {warps!r}")
        if self.pack_fields and not self.shared_tables:
            raise ValueError("Tuning.pack_fields makes its table in shared memory: it needs shared_tables=True")

    def count_matches(self, word_bytes: int) -> bool:
        """Whether the count kernel matches a warp's equal keys for words of ``word_bytes`` (else: ballots)."""
        return word_bytes != 2 if self.count_match is None else self.count_match

    def changed(self) -> dict[str, object]:
        """The fields that differ from the defaults, by name (what a results row records of its tuning)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


_lock = threading.Lock()
_current = Tuning()


def current() -> Tuning:
    """The tuning an engine made now takes."""
    return _current


@contextlib.contextmanager
def tuned(base: Tuning | None = None, /, **changes) -> Iterator[Tuning]:
    """Within the block, engines made take ``base`` (default: the current tuning) with ``changes``; restored after,
    whatever happens. ``TypeError`` for a name :class:`Tuning` has not, ``ValueError`` for a value it refuses."""
    global _current
    made = dataclasses.replace(current() if base is None else base, **changes)
    with _lock:
        before, _current = _current, made
    try:
        yield made
    finally:
        with _lock:
            _current = before
