"""``fpx``: a float-aware codec. Exponents become short offsets below the
entry's largest exponent, sign and mantissa bits are passed through.

A floating-point word is ``sign | exponent (e bits) | mantissa (m bits)``. In
one entry of activations most exponents lie within a few binades of the
largest one, so each word's exponent is stored as a ``b``-bit offset below
the entry's largest exponent ``emax``; the rare smaller ones *escape* and
are stored whole at the end of the entry. Sign and mantissa are copied bit
for bit. For dense bfloat16 activations that is about ``1 + 7 + 3`` bits a
value plus a few escapes, which fits an entry of 64 values (E = 128) in 3
sectors instead of 4 most of the time.

The codec only sees bytes and a word size, so it is lossless for any bytes
(integers, NaN payloads, denormals, -0.0): an "exponent" is just the bit
field at that position. The split (``e``, ``m``) by word size::

    word bytes  split (e, m)  as in             header bits H
    1           (4, 3)        float8 e4m3       1 + 4 + 3  =  8
    2           (8, 7)        bfloat16 (*)      1 + 8 + 4  = 13
    4           (8, 23)       float32           1 + 8 + 4  = 13
    8           (11, 52)      float64           1 + 11 + 4 = 16

(*) float16 data is coded with the bfloat16 split too: its 5 exponent bits
and top 3 mantissa bits then form the "exponent". Measured on ReLU'd normal
float16 (E = 128): 1.577x with this split, 1.566x with float16's own
(5, 10), 1.574x choosing per entry (one more header bit), so one split is
kept. Dense float16 does not fit 3 sectors either way (11 bits of sign and
mantissa a value).

Payload layout
--------------
A little-endian bit stream, least significant bit first (stream bit ``t`` is
bit ``t % 8`` of byte ``t // 8``; a field's bit 0 comes first; see
:mod:`buddy.codecs._bitstream`). Word ``i`` of the ``W = E / word_bytes``
words has exponent field ``x_i`` (bits ``m .. m+e-1``) and sign-mantissa
``s_i = sign << m | mantissa`` (``1 + m`` bits). "Zero" means all bits zero
(-0.0 is not zero)::

    header, H bits:
        zmode   1 bit    0: every word is listed; 1: only the non-zero words
        emax    e bits   the largest exponent field of the listed words
        b       BB bits  code width, 0 <= b <= e + 1 (BB = 3, 4, 4, 4)
    bitmap, W bits (zmode 1 only): bit i set iff word i is non-zero
    words, b + 1 + m bits for each listed word, in word order:
        code    b bits   emax - x_i, or 2**b - 1 (all ones): escape
        s_i     1 + m bits
    escapes, e bits for each escaped word, in word order: its x_i

A word escapes iff ``b > 0`` and ``emax - x_i >= 2**b - 1``; with ``b = 0``
every listed word has ``x_i = emax`` and there are no codes. A zero word in
zmode 0 is just a word with ``x_i = 0``, ``s_i = 0``; an unlisted word
(zmode 1) decodes to zero. The encoder writes, per entry, the zmode and
``b`` with the shortest stream (ties: zmode 0, then the smaller ``b``):
``T = H + (W if zmode 1) + listed * (b + 1 + m) + escaped * e`` bits and
``k = ceil(T / 256)``, zero bits up to ``32 k`` bytes; ``k = 0`` for an
all-zero entry and ``k = E/32`` (raw) when the stream is not shorter than
the entry. Only mode 0 is used.

The decoder rejects (:class:`CorruptDataError`) a ``b`` out of range, a
code that points below exponent 0, a stream whose length disagrees with
``k`` and set bits after the stream.

Implementation: batched over a block of entries (the format layer's
blocks, see :mod:`buddy.format`). The stream length for every zmode and
``b`` comes from one per-entry histogram of ``bit_length(emax - x_i + 1)``
(a word escapes for code widths below it). The words of an entry are then
fields at ``start + rank * (b + 1 + m)``, written with one scatter; the rare
escapes with a second, sparse one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import CorruptDataError
from ._bitstream import StreamWriter, bits_after, pack_bools, read_bits, stream_windows
from .base import Analysis, Codec, bits_to_sectors

__all__ = ["FPXCodec", "header_geometry", "SPLITS"]

#: (exponent bits, mantissa bits) by word size
SPLITS: dict[int, tuple[int, int]] = {1: (4, 3), 2: (8, 7), 4: (8, 23), 8: (11, 52)}
_INT_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NEVER = 1 << 40


@dataclass(frozen=True)
class HeaderGeometry:
    """The split and the header's field widths for one word size."""

    e: int
    m: int
    b_bits: int  # BB
    bits: int  # H

    @property
    def n_b(self) -> int:
        """Number of code widths: ``b`` in ``0 .. e + 1``."""
        return self.e + 2


@functools.cache
def header_geometry(word_bytes: int) -> HeaderGeometry:
    """The :class:`HeaderGeometry` of ``fpx`` for a word size."""
    if word_bytes not in SPLITS:
        raise ValueError(f"fpx word size must be 1, 2, 4 or 8 bytes, got {word_bytes}")
    e, m = SPLITS[word_bytes]
    bb = (e + 1).bit_length()
    return HeaderGeometry(e, m, bb, 1 + e + bb)


def _bit_length(v: torch.Tensor) -> torch.Tensor:
    """``int.bit_length`` of non-negative integers below ``2**24`` (int32 result)."""
    # exact in float32; the biased exponent of v is bit_length(v) + 126
    return (v.to(torch.float32).view(torch.int32) >> 23).sub_(126).clamp_(min=0)


class _Choice:
    """Per-entry zmode, ``b``, ``emax`` and stream length for words ``x`` ``(n, W)``."""

    def __init__(self, x: torch.Tensor, word_bytes: int):
        n, n_words = x.shape
        hg = header_geometry(word_bytes)
        e, m = hg.e, hg.m
        device = x.device
        nz = x != 0
        nnz = nz.sum(1, keepdim=True)
        exp = (x >> m).bitwise_and_((1 << e) - 1)
        emax = exp.amax(1, keepdim=True)  # zero words have exponent 0: no harm
        # bl = bit_length(emax - x_i + 1), 0 for zero words: the word escapes for code widths b < bl
        bl = _bit_length((emax - exp).add_(1).mul_(nz)).to(torch.int64)
        ones = torch.ones(n, n_words, dtype=torch.int64, device=device)
        hist = torch.zeros(n, hg.n_b, dtype=torch.int64, device=device).scatter_add_(1, bl, ones)
        esc = n_words - hist.cumsum(1)  # non-zero words with bl > b, for b = 0, 1, ...
        emax = emax.to(torch.int64)
        bs = torch.arange(hg.n_b, device=device)
        zero_esc = (n_words - nnz) * (_bit_length(emax + 1) > bs)  # zero words escape too in zmode 0
        per_word = bs + 1 + m
        dense = hg.bits + n_words * per_word + e * (esc + zero_esc)
        bitmap = hg.bits + n_words + nnz * per_word + e * esc
        # b = 0 only when no word escapes at b = 1 (every listed exponent is emax)
        dense[:, 0] = torch.where(esc[:, 1] + zero_esc[:, 1] == 0, hg.bits + n_words * (1 + m), _NEVER)
        bitmap[:, 0] = torch.where(esc[:, 1] == 0, hg.bits + n_words + nnz[:, 0] * (1 + m), _NEVER)
        totals = torch.cat([dense, bitmap], 1)
        best = totals.argmin(1, keepdim=True)  # the first of equal minima
        self.total_bits = totals.gather(1, best).squeeze(1)
        best = best.squeeze(1)
        self.b = best % hg.n_b
        self.zmode = best // hg.n_b
        self.emax = emax.squeeze(1)
        self.nz, self.nnz = nz, nnz.squeeze(1)

    def select(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k).index_select(0, rows) for k in ("b", "zmode", "emax", "nz")}


def _write_header(writer: StreamWriter, c: dict, n_words: int, hg: HeaderGeometry):
    """Headers (and bitmaps, in zmode 1) of every entry; returns ``(listed words or None, their ranks)``."""
    n, device = c["zmode"].shape[0], c["zmode"].device
    header = c["zmode"] | (c["emax"] << 1) | (c["b"] << (1 + hg.e))
    if not bool(c["zmode"].any()):
        writer.add(header.unsqueeze(1), torch.zeros(n, 1, dtype=torch.int64, device=device))
        return None, torch.arange(n_words, device=device)
    zmode = c["zmode"].unsqueeze(1)
    n_bm = -(-n_words // 32)
    bitmap = pack_bools(c["nz"], 32 * n_bm) * zmode  # nothing in zmode 0
    bm_pos = hg.bits + 32 * torch.arange(n_bm, device=device).expand(n, n_bm)
    writer.add(torch.cat([header.unsqueeze(1), bitmap], 1), torch.cat([torch.zeros_like(bm_pos[:, :1]), bm_pos], 1))
    listed = c["nz"] | (zmode == 0)
    return listed, torch.cumsum(listed, 1).sub_(1).clamp_(min=0)


def _write_streams(x: torch.Tensor, c: dict, word_bytes: int) -> torch.Tensor:
    """The payloads ``(n, E)`` of the coded entries ``x`` given their choices ``c``."""
    n, n_words = x.shape
    hg = header_geometry(word_bytes)
    e, m = hg.e, hg.m
    writer = StreamWriter(n, n_words * word_bytes, x.device)
    zmode, b, emax = c["zmode"].unsqueeze(1), c["b"].unsqueeze(1), c["emax"].unsqueeze(1)
    listed, rank = _write_header(writer, c, n_words, hg)

    exp = (x >> m).bitwise_and_((1 << e) - 1)
    # fields of 2-byte words fit 9 + 1 + 7 bits: build them in int32, the rest in int64
    wide = torch.int32 if word_bytes <= 2 else torch.int64
    sm = (x >> (8 * word_bytes - 1 - m)).bitwise_and_(1 << m).bitwise_or_(x & ((1 << m) - 1)).to(wide)
    d = emax.to(x.dtype) - exp
    bw = b.to(wide)
    esc_code = (1 << bw) - 1
    threshold = torch.where(b > 0, esc_code, 1 << e).to(x.dtype)  # offsets are below 2**e: b = 0 never escapes
    esc = d >= threshold
    if listed is not None:
        esc &= listed
    has_escapes = bool(esc.any())
    field = d.to(wide)
    if has_escapes:  # escaped words get the all-ones code
        field.sub_((field - esc_code).mul_(esc))
    per_word = b + 1 + m
    start = hg.bits + zmode * n_words
    pos = rank * per_word + start
    if word_bytes == 8:  # b + 1 + m can exceed 63 bits: the top of s_i goes in a second field
        high = sm >> 32
        field.bitwise_or_((sm & 0xFFFFFFFF) << b)
        if listed is not None:
            field.mul_(listed)
            high.mul_(listed)
        writer.add(field, pos)
        writer.add(high, pos + b + 32)
    else:
        field.bitwise_or_(sm.bitwise_left_shift_(bw))
        if listed is not None:
            field.mul_(listed)
        writer.add(field.to(torch.int64), pos)
    if has_escapes:
        r, col = esc.nonzero().unbind(1)
        n_listed = n_words if listed is None else listed.sum(1)
        esc_start = (start.squeeze(1) + n_listed * per_word.squeeze(1)).index_select(0, r)
        # escapes come in row order: an escape's rank is its index minus that of its row's first
        esc_rank = torch.arange(r.numel(), device=x.device) - torch.searchsorted(r, r)
        writer.add_rows(r, exp[r, col].to(torch.int64), esc_start + esc_rank * e)
    return writer.payload()


class _Chosen(Analysis):
    """fpx's analysis of a block: each entry's best zmode and ``b``, and so its size."""

    def __init__(self, entries: torch.Tensor, word_bytes: int):
        self.word_bytes = word_bytes
        self.x = entries.view(_INT_DTYPE[word_bytes])
        self.choice = _Choice(self.x, word_bytes)
        self.sectors = bits_to_sectors(self.choice.total_bits)
        self.modes = torch.zeros_like(self.sectors)

    def streams(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is None:
            return _write_streams(self.x, vars(self.choice), self.word_bytes)
        return _write_streams(self.x.index_select(0, rows), self.choice.select(rows), self.word_bytes)


def _read_header(windows: torch.Tensor, n_words: int, hg: HeaderGeometry):
    """``(zmode, emax, b, listed words or None, their ranks, how many)`` of every entry's stream."""
    n, device = windows.shape[0], windows.device
    head = read_bits(windows, torch.zeros(n, 1, dtype=torch.int64, device=device), hg.bits)
    zmode = head & 1
    emax = (head >> 1) & ((1 << hg.e) - 1)
    b = head >> (1 + hg.e)
    if bool((b > hg.e + 1).any()):
        raise CorruptDataError("fpx: code width out of range")
    if not bool(zmode.any()):
        return zmode, emax, b, None, torch.arange(n_words, device=device), n_words
    n_bm = -(-n_words // 32)
    bm = read_bits(windows, hg.bits + 32 * torch.arange(n_bm, device=device).expand(n, n_bm), 32)
    bits = (bm.unsqueeze(-1) >> torch.arange(32, device=device)).bitwise_and_(1)
    listed = bits.view(n, 32 * n_bm)[:, :n_words].bool() | (zmode == 0)
    return zmode, emax, b, listed, torch.cumsum(listed, 1).sub_(1).clamp_(min=0), listed.sum(1, keepdim=True)


def _decode_block(payload: torch.Tensor, sectors: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """Coded entries -> ``(n, W)`` words in the word's integer type; raises :class:`CorruptDataError`."""
    n, entry_bytes = payload.shape
    hg = header_geometry(word_bytes)
    e, m = hg.e, hg.m
    n_words = entry_bytes // word_bytes
    windows = stream_windows(payload)
    zmode, emax, b, listed, rank, n_listed = _read_header(windows, n_words, hg)
    per_word = b + 1 + m
    start = hg.bits + zmode * n_words
    pos = rank * per_word + start
    small = torch.int32 if word_bytes <= 2 else torch.int64  # wide enough to build the word exactly
    if word_bytes <= 2:  # at most 9 + 1 + 7 bits: one read
        f = read_bits(windows, pos, per_word).to(torch.int32)
        code = f & ((1 << b) - 1).to(torch.int32)
        sm = f >> b.to(torch.int32)
    else:
        code = read_bits(windows, pos, b)
        sm = read_bits(windows, pos + b, min(32, 1 + m))
        if word_bytes == 8:
            sm |= read_bits(windows, pos + b + 32, m + 1 - 32) << 32
    esc = code == torch.where(b > 0, (1 << b) - 1, -1).to(small)
    if listed is not None:
        esc &= listed
    esc_start = start + n_listed * per_word
    n_esc = esc.sum(1, keepdim=True)
    total = (esc_start + n_esc * e).squeeze(1)
    if bool((((total + 255) // 256) != sectors).any()):
        raise CorruptDataError("fpx: stream length does not match the entry sizes in the metadata")
    if bool(bits_after(windows, total).any()):
        raise CorruptDataError("fpx: bits set after the end of the bit stream")

    exp = emax.to(small) - code
    if bool(n_esc.any()):
        esc_rank = torch.cumsum(esc, 1).sub_(1).clamp_(min=0)
        exp = torch.where(esc, read_bits(windows, esc_start + esc_rank * e, e).to(small), exp)
    negative = exp < 0
    if listed is not None:
        negative &= listed
    if bool(negative.any()):
        raise CorruptDataError("fpx: an exponent code points below exponent 0")
    # the word as a signed integer: exponent and mantissa, minus the weight of the sign
    word = exp.bitwise_left_shift_(m).bitwise_or_(sm & ((1 << m) - 1))
    sign = sm.bitwise_right_shift_(m)
    if word_bytes == 8:
        word |= sign << 63
    else:
        word -= sign << (8 * word_bytes - 1)
    if listed is not None:
        word.mul_(listed)
    return word.to(_INT_DTYPE[word_bytes])


class FPXCodec(Codec):
    """Exponent offsets below the entry's largest exponent, with escapes; sign and mantissa passed through."""

    name = "fpx"

    def analyse(self, entries: torch.Tensor, word_bytes: int) -> Analysis:
        header_geometry(word_bytes)  # a clear error for a word size fpx does not know
        return _Chosen(entries, word_bytes)

    def decode(self, payload, sectors, modes, word_bytes):
        n, entry_bytes = payload.shape
        header_geometry(word_bytes)
        words = _decode_block(payload.contiguous(), sectors, word_bytes)
        return words.view(torch.uint8).view(n, entry_bytes)
