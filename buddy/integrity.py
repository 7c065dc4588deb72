"""Optional checksums of the three buffers of a compressed tensor.

``buddy.compress(t, checksum=True)`` (or ``buddy.set_defaults(checksum=True)``)
stores one 64-bit checksum per buffer -- metadata, slots, overflow -- in the
:class:`~buddy.BuddyTensor`, and :meth:`~buddy.BuddyTensor.decompress` checks
all three before decoding anything: a buffer changed after compression (a
stray write into the memory :meth:`~buddy.BuddyTensor.buffers` returns, a bad
DIMM holding buddy memory) raises :class:`~buddy.errors.CorruptDataError`
naming the buffer, instead of decoding to wrong values.

Algorithm (a Fletcher-style pair of sums)
-----------------------------------------
A buffer of ``n`` bytes, zero-padded to even length, is read as ``h``
little-endian **signed** 16-bit half-words ``x_0 .. x_{h-1}``. With
``p = 2**31 - 1`` (a Mersenne prime)::

    A = (n + sum(x_i)) mod 2**32
    B = sum((i + 1) * x_i) mod p
    checksum = B << 32 | A            (63 bits; a non-negative int64)

Guarantees, for a buffer under 4 GiB (fewer than ``p`` half-words):

* any change of a single byte changes ``A`` (the sum moves by at most
  ``2**16 - 1``, never by a multiple of ``2**32``);
* any swap of two different bytes changes the checksum: inside one half-word
  it changes ``A`` (by ``255 * (a - b)``, or that minus/plus ``2**16``:
  never 0); between half-words ``i != j`` at the same byte position it leaves
  ``A`` alone and changes ``B`` by ``(i - j) * d`` with ``0 < |d| < 2**16``, a
  product of factors ``p`` does not divide; between half-words at different
  positions it changes ``A``;
* appending or removing bytes changes ``A`` through ``n`` unless the length
  moves by a multiple of ``2**32``.

Anything else is caught with probability about ``1 - 2**-63`` per buffer
(it is a checksum against accidents, not a MAC against an adversary who can
also rewrite the stored checksum).

Cost: one read of each buffer, on the device the buffer lives on, in batched
torch ops -- half-words to ``float64``, per block of up to ``2**16``
half-words a plain sum and a matrix-vector product with the weights
``1 .. L`` (exact: every partial sum is an integer below ``2**47``), then a
few ``int64`` operations per block. Temporaries stay under about 40 MiB
(:data:`STEP_BYTES` of input at a time); the result needs one device-to-host
transfer. Nothing is computed unless checksums are switched on.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import engines
from .errors import CorruptDataError

__all__ = [
    "Checksum",
    "PRIME",
    "BLOCK_HALFWORDS",
    "STEP_BYTES",
    "Accumulator",
    "buffer_checksum",
    "checksums",
    "verify",
]

#: the modulus of the position-weighted sum ``B``
PRIME = (1 << 31) - 1
#: half-words per block: one plain sum and one weighted sum each
BLOCK_HALFWORDS = 1 << 16
#: bytes read at a time (bounds the float64 temporaries to 4x this)
STEP_BYTES = 8 << 20

_BUFFERS = ("meta", "slots", "overflow")
_WHERE = {
    "meta": "the metadata (on the device)",
    "slots": "the slots (on the device)",
    "overflow": "the overflow (in buddy memory)",
    "table": "the codec table (on the device)",
}


class Checksum(NamedTuple):
    """The 64-bit checksums of a compressed tensor's buffers (see :mod:`buddy.integrity`).

    ``table``: that of the codec table (format version 2), ``None`` for a tensor without one.
    """

    meta: int
    slots: int
    overflow: int
    table: int | None = None

    def __repr__(self) -> str:
        table = "" if self.table is None else f", table={self.table:#018x}"
        return f"Checksum(meta={self.meta:#018x}, slots={self.slots:#018x}, overflow={self.overflow:#018x}{table})"


@functools.cache
def _weights(device: torch.device) -> torch.Tensor:
    """``1 .. BLOCK_HALFWORDS`` as float64 on ``device`` (made once per device)."""
    return torch.arange(1, BLOCK_HALFWORDS + 1, dtype=torch.float64, device=device)


class Accumulator:
    """The checksum of a byte stream given in pieces (the overflow, chunk by chunk, as it is written).

    Every piece but the last must have an even number of bytes. Nothing is
    read back to the host before :meth:`value`.
    """

    def __init__(self) -> None:
        self.nbytes = 0
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._odd = False

    def add(self, piece: torch.Tensor) -> Accumulator:
        """Append the bytes of ``piece`` (any shape, ``uint8``); returns ``self``."""
        if piece.dtype != torch.uint8:
            raise TypeError(f"checksums are taken over uint8 bytes, got {piece.dtype}")
        n = piece.numel()
        if n == 0:
            return self
        if self._odd:
            raise ValueError("only the last piece given to a checksum may have an odd number of bytes")
        flat = piece.reshape(-1)
        first = self.nbytes // 2  # index of the piece's first half-word in the stream
        self.nbytes += n
        self._odd = bool(n % 2)
        if n % 2 or flat.storage_offset() % 2:  # pad to whole half-words; half-words must be aligned
            flat = torch.cat([flat, flat.new_zeros(n % 2)])
        halves = flat.view(torch.int16)
        step = STEP_BYTES // 2
        for a in range(0, halves.numel(), step):
            self._add_halves(halves[a : a + step], first + a)
        return self

    def _add_halves(self, halves: torch.Tensor, first: int) -> None:
        h = halves.numel()
        length = min(BLOCK_HALFWORDS, h)
        x = halves.to(torch.float64)
        if h % length:
            x = torch.nn.functional.pad(x, (0, length - h % length))  # zeros add nothing to either sum
        blocks = x.view(-1, length)
        plain = blocks.sum(1).to(torch.int64)  # |sum| < 2**31: exact
        weighted = (blocks @ _weights(halves.device)[:length]).to(torch.int64)  # < 2**47: exact
        # block c starts at half-word first + c * length: its weights are that offset + 1 .. + length
        offsets = torch.arange(blocks.shape[0], dtype=torch.int64, device=halves.device).mul_(length).add_(first)
        self._parts.append((offsets, plain, weighted))

    def value(self) -> int:
        """The 64-bit checksum of everything added (one device-to-host transfer)."""
        if not self._parts:
            return self.nbytes % (1 << 32)
        offsets, plain, weighted = (torch.cat(parts) for parts in zip(*self._parts))
        # each term < p before the sum, so the sum of up to 2**32 terms cannot overflow int64
        terms = offsets.remainder_(PRIME).mul_(plain.remainder(PRIME)).add_(weighted.remainder_(PRIME))
        total_b, total_a = engines.to_host(torch.stack([terms.remainder_(PRIME).sum(), plain.sum()])).tolist()
        return (total_b % PRIME) << 32 | (total_a + self.nbytes) % (1 << 32)


def buffer_checksum(buffer: torch.Tensor) -> int:
    """The 64-bit checksum of a ``uint8`` buffer (see the module doc), computed on its device."""
    return Accumulator().add(buffer).value()


def checksums(
    meta: torch.Tensor, slots: torch.Tensor, overflow: torch.Tensor, table: torch.Tensor | None = None
) -> Checksum:
    """The :class:`Checksum` of the buffers of a compressed tensor (``table``: format version 2's fourth)."""
    return Checksum(
        buffer_checksum(meta),
        buffer_checksum(slots),
        buffer_checksum(overflow),
        table=None if table is None else buffer_checksum(table),
    )


def verify(
    meta: torch.Tensor,
    slots: torch.Tensor,
    overflow: torch.Tensor,
    expected: Checksum,
    table: torch.Tensor | None = None,
) -> None:
    """Raise :class:`~buddy.errors.CorruptDataError` unless the buffers have the ``expected`` checksums."""
    if not isinstance(expected, Checksum):
        raise TypeError(f"checksum must be a buddy.integrity.Checksum, got {type(expected).__name__}")
    actual = checksums(meta, slots, overflow, table)
    bad = [name for name in _BUFFERS + ("table",) if getattr(actual, name) != getattr(expected, name)]
    if bad:
        where = " and ".join(_WHERE[name] for name in bad)
        raise CorruptDataError(
            f"checksum mismatch in {where}: the bytes changed after compression (a write into the memory "
            f"BuddyTensor.buffers() returns, or failing memory); nothing was decoded. The tensor cannot be "
            f"recovered from these buffers: recompute it or compress it again from a good copy "
            f"(expected {expected!r}, found {actual!r})"
        )
