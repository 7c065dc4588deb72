"""Batched bit-stream writing and reading, shared by the variable-length codecs.

Bit order (``bpc`` and ``fpx`` both use it): a payload is a little-endian bit
stream. Stream bit ``t`` is bit ``t % 8`` (value ``2 ** (t % 8)``) of payload
byte ``t // 8``. A *field* of width ``w`` holding the unsigned integer ``v``
occupies stream bits ``[o, o + w)``, bit ``i`` of ``v`` at stream bit ``o + i``
(least significant bit first). A stream of ``T`` bits is followed by zero bits
up to the end of the payload.

Everything here works on whole batches: ``(n, F)`` tensors of fields, one row
per entry, with no Python loop over entries or fields. The format layer hands
codecs blocks of thousands of entries (:data:`buddy.format.BLOCK_BYTES`), so
the many temporaries stay in cache.
"""

from __future__ import annotations

import sys

import torch

__all__ = [
    "lookup",
    "StreamWriter",
    "write_fields",
    "stream_windows",
    "read_bits",
    "bits_after",
    "bits_between",
    "pack_bools",
]

if sys.byteorder != "little":  # pragma: no cover - torch has no big-endian builds to speak of
    raise ImportError("buddy's bit-stream codecs assume a little-endian host")

_U32 = 0xFFFFFFFF


def lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D table (``index_select`` is much faster than advanced indexing on CPU)."""
    return table.index_select(0, index.reshape(-1)).view(index.shape)


class StreamWriter:
    """Accumulates fields into ``n`` payloads of ``nbytes`` bytes.

    A field is an int64 ``value`` with ``0 <= value < 2 ** w`` for its width
    ``w <= 63`` (``value == 0`` for ``w == 0``) and a bit ``offset``. Fields
    must not overlap. Bits at or past ``8 * nbytes`` are dropped (a stream
    that turns out too long escapes to raw anyway).
    """

    def __init__(self, n: int, nbytes: int, device):
        self.nbytes = nbytes
        self.nwords = -(-nbytes // 8)
        # two spare words per row take whatever lies past the payload
        self.words = torch.zeros(n, self.nwords + 2, dtype=torch.int64, device=device)

    def _split(self, values: torch.Tensor, offsets: torch.Tensor):
        word = (offsets >> 6).clamp_(max=self.nwords)
        shift = offsets & 63
        lo = values << shift
        hi = (values >> 1).bitwise_right_shift_(shift.neg_().add_(63))  # v >> (64 - shift): bits for the next word
        return word, lo, hi

    def add(self, values: torch.Tensor, offsets: torch.Tensor) -> None:
        """Fields ``(n, F)``: row ``i`` goes to payload ``i``."""
        word, lo, hi = self._split(values, offsets)
        # fields never overlap, so adding their bits is OR-ing them: no carries
        self.words.scatter_add_(1, word, lo)
        self.words.scatter_add_(1, word.add_(1), hi)

    def add_rows(self, rows: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor) -> None:
        """Fields given as 1-D ``(rows, values, offsets)``: for sparse fields."""
        if rows.numel() == 0:
            return
        word, lo, hi = self._split(values, offsets)
        flat = self.words.view(-1)
        index = word.add_(rows * (self.nwords + 2))
        flat.scatter_add_(0, index, lo)
        flat.scatter_add_(0, index.add_(1), hi)

    def payload(self) -> torch.Tensor:
        """The ``(n, nbytes)`` uint8 payloads."""
        return self.words[:, : self.nwords].view(torch.uint8)[:, : self.nbytes]


def write_fields(values: torch.Tensor, offsets: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Fields ``(n, F)`` (see :class:`StreamWriter`) -> ``(n, nbytes)`` uint8 payloads."""
    writer = StreamWriter(values.shape[0], nbytes, values.device)
    writer.add(values, offsets)
    return writer.payload()


def stream_windows(payload: torch.Tensor) -> torch.Tensor:
    """``(n, E)`` payloads -> ``(n, E/4)`` int64 windows: window ``j`` holds stream bits ``[32 j, 32 j + 64)``.

    The stream is zero past the payload. Windows are signed int64 holding the
    64 bits; :func:`read_bits` only ever uses their low 63 bits after a shift.
    """
    n, nbytes = payload.shape
    m = nbytes // 4
    words = torch.zeros(n, m + 1, dtype=torch.int64, device=payload.device)
    words[:, :m] = payload.contiguous().view(torch.int32)
    words.bitwise_and_(_U32)
    return words[:, 1:].bitwise_left_shift(32).bitwise_or_(words[:, :m])


def read_bits(windows: torch.Tensor, offsets: torch.Tensor, width) -> torch.Tensor:
    """The ``width``-bit fields (``width <= 32``, an int or a tensor broadcasting with ``offsets``) at ``offsets``.

    ``windows`` comes from :func:`stream_windows`; ``offsets`` is ``(n, K)``
    int64, non-negative. Offsets past the payload read clamped garbage, never
    out of bounds: callers check stream lengths against ``k``.
    """
    idx = (offsets >> 5).clamp_(max=windows.shape[1] - 1)
    # bits [shift, shift + 32) of a window lie below bit 63: the sign never matters
    return windows.gather(1, idx).bitwise_right_shift_(offsets & 31).bitwise_and_((1 << width) - 1)


def bits_after(windows: torch.Tensor, total_bits: torch.Tensor) -> torch.Tensor:
    """``(n,)`` bool: some stream bit at or past ``total_bits`` (``(n,)`` int64) is set."""
    words = windows & _U32  # the low half of window j is 32-bit word j
    starts = torch.arange(words.shape[1], device=words.device) * 32
    valid = (total_bits.unsqueeze(1) - starts).clamp_(0, 32)
    return ((words & ((_U32 << valid) & _U32)) != 0).any(1)


def bits_between(windows: torch.Tensor, start: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """``(n,)`` bool: some stream bit in ``[start, stop)`` (``(n,)`` int64 each; empty when ``stop <= start``) is set."""
    words = windows & _U32
    starts = torch.arange(words.shape[1], device=words.device) * 32
    lo = (start.unsqueeze(1) - starts).clamp_(0, 32)
    hi = (stop.unsqueeze(1) - starts).clamp_(0, 32)
    inside = ((1 << hi) - 1) & ~((1 << lo) - 1)  # bits [lo, hi) of each 32-bit word (none when hi <= lo)
    return ((words & inside) != 0).any(1)


def pack_bools(mask: torch.Tensor, nbits: int) -> torch.Tensor:
    """``(n, W)`` bool -> ``(n, nbits / 32)`` int64 of 32-bit words (unsigned), bit ``j`` of word ``i`` = column ``32 i + j``.

    ``nbits`` is a multiple of 32 and at least ``W``; missing columns are zeros.
    """
    n, w = mask.shape
    if w < nbits:
        mask = torch.nn.functional.pad(mask, (0, nbits - w))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    packed = (mask.reshape(n, nbits // 8, 8).view(torch.uint8) << shifts).sum(-1, dtype=torch.uint8)
    return packed.view(torch.int32).to(torch.int64).bitwise_and_(_U32)
