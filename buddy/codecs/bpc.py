"""``bpc``: Bit-Plane Compression (Kim et al., "Bit-Plane Compression:
Transforming Data for Better Compression in Many-core Architectures", ISCA 2016),
the entry codec of the Buddy Compression paper.

Transform
---------
An entry of ``E`` bytes is read as ``W`` little-endian *BPC words* of ``ws``
bits, signed (two's complement):

* ``ws = 32`` for 4-byte words (float32, int32, complex64) -- the paper's case;
* ``ws = 16`` for 2-byte words (bfloat16, float16, int16);
* ``ws = 64`` for 8-byte words (float64, int64, complex128);
* ``ws = 32`` for 1-byte words (bool, int8, uint8, float8) too: four
  consecutive bytes form one little-endian 32-bit BPC word. BPC has nothing
  to gain from 8-bit planes (a run of 8-bit deltas rarely beats zvc), so
  1-byte data is simply coded as if it were 32-bit.

So ``W = 8 E / ws`` and the entry has ``L = W - 1`` deltas. With ``x_i`` the
signed words, ``d_i = x_{i+1} - x_i`` (``i = 0 .. L-1``) is computed exactly
as a ``(ws + 1)``-bit two's-complement number. Bit plane ``DBP_j``
(``j = 0 .. ws``) is the ``L``-bit vector whose bit ``i`` is bit ``j`` of
``d_i``; ``DBP_ws`` is the sign of the deltas (``x_{i+1} < x_i``). The planes
that are coded are ``DBX_ws = DBP_ws`` and ``DBX_j = DBP_j XOR DBP_{j+1}``.

Payload bit stream
------------------
The stream is written least-significant-bit first (see
:mod:`buddy.codecs._bitstream`): stream bit ``t`` is bit ``t % 8`` of byte
``t // 8``, and a field holding the number ``v`` puts bit 0 of ``v`` first.
The stream is

1. the **base** ``x_0``: ``ws`` bits, its unsigned bit pattern;
2. one code for each DBX plane, from the top plane ``DBX_ws`` down to
   ``DBX_0`` (``P = ws + 1`` planes), where a zero-run code covers several.

Plane codes. The prefixes are written as the paper writes them, in stream
order (the leftmost symbol is the first bit of the stream); ``n``, ``pos``
and the raw plane follow their prefix as LSB-first fields::

    code                 prefix   then                   bits       plane(s)
    zero run, n >= 2     01       n - 2   (rb bits)      2 + rb     n all-zero planes
    zero run, n = 1      001      -                      3          one all-zero plane
    all ones             00000    -                      5          all L bits set
    DBP = 0, DBX != 0    00001    -                      5          DBP_j = 0, so DBX_j = DBP_{j+1}
    two ones             00010    pos     (pb bits)      5 + pb     bits pos and pos + 1 set
    single one           00011    pos     (pb bits)      5 + pb     bit pos set
    raw plane            1        the plane (L bits)     1 + L      bit i of the field = bit i of the plane

with ``pb = bit_length(L - 1)`` and ``rb = bit_length(P - 2)``: for
``ws = 32`` and ``E = 128`` (the paper's 128-byte blocks), ``L = 31``,
``pb = 5``, ``rb = 5``, exactly the paper's table. In numbers, the 5-bit
prefixes read as LSB-first fields are 0 (all ones), 16 (DBP = 0), 8 (two
ones) and 24 (single one); ``01`` is the 2-bit field 2, ``001`` the 3-bit
field 4, and a raw plane's first bit is 1.

A zero run is always maximal (the encoder never writes two runs in a row)
and a run never extends past ``DBX_0``. For a non-zero plane the encoder
takes the shortest code that applies; between codes of equal length it
prefers all ones, then DBP = 0, then two ones, then single one, and the raw
plane only when it is strictly shorter (which happens only for 3-bit planes:
E = 32 with 64-bit words).

Sizes: ``T = ws + sum(code bits)`` and ``k = ceil(T / 256)``, the stream
followed by zero bits up to ``32 k`` bytes. An all-zero entry has ``k = 0``;
an entry with ``k >= E/32`` is stored raw (``k = E/32``). Only mode 0 is used.

The decoder raises :class:`CorruptDataError` when a zero run goes past
``DBX_0``, a position lies outside the plane (or a pair starts at its last
bit), a "DBP = 0" code is given for the top plane or follows an all-zero
plane, the stream does not end in the last of its ``k`` sectors, a bit after
the stream is set, or the decoded sign plane disagrees with the decoded
words.

Implementation (batched torch ops over a block of entries, the format
layer's blocks, see :mod:`buddy.format`): the bit-plane transpose is an in-place
16 x 16 block transpose of the delta words (four mask-and-shift rounds).
Encoding summarises every plane of every entry by a few flags (zero,
all ones, DBP = 0, one or two ones, start of a zero run and its length, from
a histogram of run numbers), looks the code's length and prefix up in small
tables, prefix-sums the lengths into bit offsets and scatters the codes into
the payload; only entries that stay coded are written. Decoding cannot know
where a code starts before reading the previous ones, so it loops over code
*positions* (at most ``P`` steps, each one batched read of every entry's
next code), then rebuilds all planes at once and undoes the XOR with a
log-step prefix XOR.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import CorruptDataError
from ._bitstream import bits_after, lookup, pack_bools, read_bits, stream_windows, write_fields
from .base import Analysis, Codec, bits_to_sectors

__all__ = ["BPCCodec", "geometry"]

_BPC_WORD_BITS = {1: 32, 2: 16, 4: 32, 8: 64}
_INT_DTYPE = {16: torch.int16, 32: torch.int32, 64: torch.int64}
_U32 = 0xFFFFFFFF

# plane kinds (decoder) -- also the order of preference of the special codes
_ZERO, _ONES, _DBP0, _TWO, _ONE, _RAW = 0, 1, 2, 3, 4, 5
# code prefixes as LSB-first field values
_P_RUN1, _P_RUN = 0b100, 0b10
_P_ONES, _P_DBP0, _P_TWO, _P_ONE = 0, 16, 8, 24


@dataclass(frozen=True)
class Geometry:
    """Sizes of the BPC transform for one entry size and word size."""

    word_bits: int  # ws
    words: int  # W
    deltas: int  # L = W - 1, the width of a plane
    planes: int  # P = ws + 1
    rows: int  # L rounded up to a multiple of 16 (transpose blocks)
    chunks: int  # rows / 16: 16-bit pieces of a plane
    supers: int  # ceil(L / 32): 32-bit pieces of a plane
    pos_bits: int  # pb
    run_bits: int  # rb

    @property
    def dtype(self) -> torch.dtype:
        return _INT_DTYPE[self.word_bits]


@functools.cache
def geometry(entry_bytes: int, word_bytes: int) -> Geometry:
    """The :class:`Geometry` of ``bpc`` for entries of ``entry_bytes`` and words of ``word_bytes``."""
    if word_bytes not in _BPC_WORD_BITS:
        raise ValueError(f"bpc word size must be 1, 2, 4 or 8 bytes, got {word_bytes}")
    ws = _BPC_WORD_BITS[word_bytes]
    words = entry_bytes * 8 // ws
    deltas = words - 1
    rows = -(-deltas // 16) * 16
    return Geometry(
        word_bits=ws,
        words=words,
        deltas=deltas,
        planes=ws + 1,
        rows=rows,
        chunks=rows // 16,
        supers=-(-deltas // 32),
        pos_bits=(deltas - 1).bit_length(),
        run_bits=(ws + 1 - 2).bit_length(),
    )


def _lane_mask(m16: int, bits: int) -> int:
    return sum(m16 << (16 * i) for i in range(bits // 16))


def _transpose16(a: torch.Tensor) -> None:
    """In place: transpose every 16 x 16 bit block of ``a`` (``(n, R)``, 16-bit lanes).

    Block ``(b, l)`` is rows ``16 b .. 16 b + 15``, bits ``16 l .. 16 l + 15``.
    Afterwards bit ``r`` of row ``16 b + c``, lane ``l`` is what bit ``c`` of
    row ``16 b + r``, lane ``l`` was. Its own inverse.
    """
    n, rows = a.shape
    bits = a.element_size() * 8
    for j, m16 in ((8, 0x00FF), (4, 0x0F0F), (2, 0x3333), (1, 0x5555)):
        pairs = a.view(n, rows // (2 * j), 2, j)
        lo, hi = pairs[:, :, 0], pairs[:, :, 1]
        t = (lo >> j).bitwise_xor_(hi).bitwise_and_(_lane_mask(m16, bits))
        hi ^= t
        lo ^= t.bitwise_left_shift_(j)


def _chunks_to_supers(chunks: torch.Tensor, supers: int) -> torch.Tensor:
    """``(n, p, C)`` int16 plane pieces -> ``(n, p, S)`` int64 32-bit pieces (unsigned)."""
    n, p, c = chunks.shape
    if c != 2 * supers:
        chunks = torch.nn.functional.pad(chunks, (0, 2 * supers - c))
    return chunks.contiguous().view(torch.int32).to(torch.int64).bitwise_and_(_U32)


def _supers_to_chunks(supers: torch.Tensor, chunks: int) -> torch.Tensor:
    """Inverse of :func:`_chunks_to_supers`: ``(n, p, S)`` -> ``(n, p, C)`` int16."""
    as_i32 = (supers ^ 0x80000000).sub_(0x80000000).to(torch.int32)  # exact: values fit int32 now
    return as_i32.view(torch.int16)[..., :chunks]


def _ctz_pow2(x: torch.Tensor) -> torch.Tensor:
    """log2 of int64 powers of two below 2**32 (garbage for 0)."""
    return (x.to(torch.float32).view(torch.int32) >> 23).sub_(127).to(torch.int64)


def _piece_masks(g: Geometry, device) -> torch.Tensor:
    """``(S,)`` int64: the valid bits of each 32-bit piece of a plane."""
    widths = [min(32, g.deltas - 32 * s) for s in range(g.supers)]
    return torch.tensor([(1 << w) - 1 for w in widths], dtype=torch.int64, device=device)


def _as_words(entries: torch.Tensor, g: Geometry) -> torch.Tensor:
    return entries.contiguous().view(g.dtype)


def _base_fields(x0: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, list[int]]:
    """The base word as LSB-first fields of at most 32 bits: ``(n, nb)`` values and their widths."""
    v = x0.to(torch.int64)
    if g.word_bits == 16:
        return (v & 0xFFFF).unsqueeze(1), [16]
    if g.word_bits == 32:
        return (v & _U32).unsqueeze(1), [32]
    return torch.stack([v & _U32, (v >> 32) & _U32], 1), [32, 32]


def _bit_planes(x: torch.Tensor, g: Geometry) -> torch.Tensor:
    """``(n, W)`` words -> the DBP planes in stream order (``DBP_ws`` first).

    Returns ``(n, P)`` int64 planes when they fit 63 bits (``L <= 63``), else
    ``(n, P, S)`` int64 32-bit pieces (unsigned), piece ``s`` holding bits
    ``32 s .. 32 s + 31``.
    """
    n = x.shape[0]
    lanes = g.word_bits // 16
    a = torch.zeros(n, g.rows, dtype=g.dtype, device=x.device)
    torch.sub(x[:, 1:], x[:, :-1], out=a[:, : g.deltas])  # low ws bits of each delta (wrapping)
    negative = x[:, 1:] < x[:, :-1]  # bit ws: the delta is negative
    _transpose16(a)
    # row 16 b + c, lane l now holds 16-bit piece b of plane 16 l + c
    chunks = a.view(torch.int16).view(n, g.chunks, 16, lanes).permute(0, 3, 2, 1).reshape(n, g.word_bits, g.chunks)
    if g.deltas <= 63:
        planes = torch.zeros(n, g.planes, 4, dtype=torch.int16, device=x.device)
        planes[:, 1:, : g.chunks] = chunks.flip(1)
        sign = pack_bools(negative, 64)
        planes[:, 0] = (sign[:, 0] | (sign[:, 1] << 32)).view(torch.int16).view(n, 4)
        return planes.view(torch.int64).view(n, g.planes)
    low = _chunks_to_supers(chunks, g.supers)  # (n, ws, S), plane j at index j
    sign = pack_bools(negative, 32 * g.supers)
    return torch.cat([sign.unsqueeze(1), low.flip(1)], 1)


def _words_from_planes(dbp: torch.Tensor, base: torch.Tensor, g: Geometry) -> torch.Tensor:
    """Inverse of :func:`_bit_planes` (without the sign plane): ``(n, W)`` words."""
    n = dbp.shape[0]
    lanes = g.word_bits // 16
    chunks = _supers_to_chunks(dbp[:, 1:].flip(1), g.chunks)  # (n, ws, C), plane j at index j
    a = chunks.reshape(n, lanes, 16, g.chunks).permute(0, 3, 2, 1).contiguous().view(g.dtype).view(n, g.rows)
    _transpose16(a)
    x = torch.empty(n, g.words, dtype=torch.int64, device=dbp.device)
    x[:, 0] = base
    torch.cumsum(a[:, : g.deltas], 1, dtype=torch.int64, out=x[:, 1:])
    x[:, 1:] += base.unsqueeze(1)  # wraps modulo 2**64, exact modulo 2**ws
    if g.word_bits == 64:
        return x
    half = 1 << (g.word_bits - 1)
    return x.bitwise_and_((1 << g.word_bits) - 1).bitwise_xor_(half).sub_(half).to(g.dtype)


@functools.cache
def _code_luts(g: Geometry, device: str) -> tuple[torch.Tensor, ...]:
    """Tables indexed by a plane's flags (see :class:`_Plan`): width, prefix, argument shift, mask, raw."""
    width, prefix, shift, raw = [], [], [], []
    for key in range(128):
        ones, dz, two, one, nz, start, long_run = ((key >> i) & 1 for i in range(7))
        if nz:
            code = None
            if ones:
                code = (5, _P_ONES, 5)
            elif dz:
                code = (5, _P_DBP0, 5)
            elif two:
                code = (5 + g.pos_bits, _P_TWO, 5)
            elif one:
                code = (5 + g.pos_bits, _P_ONE, 5)
            is_raw = code is None or 1 + g.deltas < code[0]
            if code is None or is_raw:
                code = (1 + min(g.deltas, 32), 1, 1)
        else:
            is_raw = False
            code = ((2 + g.run_bits, _P_RUN, 2) if long_run else (3, _P_RUN1, 3)) if start else (0, 0, 0)
        width.append(code[0])
        prefix.append(code[1])
        shift.append(code[2])
        raw.append(is_raw)
    as_t = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    mask = [(1 << w) - 1 for w in width]
    return as_t(width), as_t(prefix), as_t(shift), as_t(mask), torch.tensor(raw, dtype=torch.bool, device=device)


class _Plan:
    """Per-plane code choices of a batch: the field widths, and the field values when asked.

    Every plane is summarised by 7 flags, ``key = ones | dbp_zero << 1 | two
    << 2 | one << 3 | nonzero << 4 | run_start << 5 | long_run << 6``, and
    small tables turn the key into the code's width, prefix and where its
    argument (run length, position or the plane itself) goes.
    """

    def __init__(self, entries: torch.Tensor, word_bytes: int):
        n, entry_bytes = entries.shape
        g = geometry(entry_bytes, word_bytes)
        device = entries.device
        x = _as_words(entries, g)
        dbp = _bit_planes(x, g)
        dbx = dbp.clone()
        dbx[:, 1:] ^= dbp[:, :-1]
        P, L, S = g.planes, g.deltas, g.supers

        if dbx.dim() == 2:  # planes of at most 63 bits, one int64 each
            v = dbx
            nz = v != 0
            low = v & -v
            one = v == low
            two = v == low * 3
            ones = v == (1 << L) - 1
            dbp_zero = dbp == 0
            pos = _ctz_pow2(low)
        else:
            nzs = dbx != 0
            nzc = nzs.sum(-1)
            nz = nzc > 0
            s0 = nzs.to(torch.uint8).argmax(-1, keepdim=True)  # the first non-zero piece
            v0 = dbx.gather(-1, s0).squeeze(-1)
            v1 = dbx.gather(-1, (s0 + 1).clamp_(max=S - 1)).squeeze(-1)
            s0 = s0.squeeze(-1)
            low = v0 & -v0
            one = (nzc == 1) & (v0 == low)
            two = ((nzc == 1) & (v0 == low * 3)) | ((nzc == 2) & (v0 == 1 << 31) & (v1 == 1))
            ones = (dbx == _piece_masks(g, device)).all(-1)
            pos = _ctz_pow2(low).add_(s0 * 32)
            dbp_zero = (dbp == 0).all(-1)

        # zero planes: a maximal run is coded at its first plane. The planes of
        # one run share their count of non-zero planes above them, so that
        # count numbers the runs; a histogram of it gives their lengths.
        run_id = torch.cumsum(nz, 1)
        run = torch.zeros(n, P + 1, dtype=torch.int64, device=device).scatter_add_(1, run_id, (~nz).to(torch.int64))
        run = run.gather(1, run_id)
        start = ~nz
        start[:, 1:] &= nz[:, :-1]
        flags = [ones, dbp_zero, two, one, nz, start, run >= 2]
        key = flags[0].view(torch.uint8).clone()
        for i, f in enumerate(flags[1:], 1):
            key |= f.view(torch.uint8) << i
        key = key.to(torch.int64)
        width_lut, prefix_lut, shift_lut, mask_lut, raw_lut = _code_luts(g, str(device))
        width = lookup(width_lut, key)
        raw = lookup(raw_lut, key)
        if S > 1:
            extra = torch.tensor([min(32, L - 32 * s) for s in range(1, S)], device=device)
            width = torch.cat([width.unsqueeze(-1), extra * raw.unsqueeze(-1)], -1).view(n, P * S)
        base, base_w = _base_fields(x[:, 0], g)
        widths = torch.cat([torch.tensor(base_w, device=device).expand(n, len(base_w)), width], 1)
        ends = torch.cumsum(widths, 1)
        self.total_bits = ends[:, -1].clone()
        self.offsets = ends.sub_(widths)
        self.geometry = g
        self._parts = (dbx, raw, nz, pos, run, key, base)

    def values(self) -> torch.Tensor:
        """The field values ``(n, F)``, in the order of :attr:`offsets`."""
        dbx, raw, nz, pos, run, key, base = self._parts
        g = self.geometry
        n, P, S = dbx.shape[0], g.planes, g.supers
        _, prefix_lut, shift_lut, mask_lut, _ = _code_luts(g, str(dbx.device))
        if dbx.dim() == 2:
            pieces = [dbx & _U32, dbx >> 32] if S > 1 else [dbx]
        else:
            pieces = list(dbx.unbind(-1))
        arg = torch.where(raw, pieces[0], torch.where(nz, pos.to(torch.int64), run - 2))
        value = (arg << lookup(shift_lut, key)).bitwise_or_(lookup(prefix_lut, key)).bitwise_and_(lookup(mask_lut, key))
        if S > 1:
            rest = torch.stack(pieces[1:], -1) * raw.unsqueeze(-1)
            value = torch.cat([value.unsqueeze(-1), rest], -1).view(n, P * S)
        return torch.cat([base, value], 1)


class _Planned(Analysis):
    """bpc's analysis of a block: every plane's code, and so each entry's size."""

    def __init__(self, entries: torch.Tensor, word_bytes: int):
        self.entry_bytes = entries.shape[1]
        self.plan = _Plan(entries, word_bytes)
        self.sectors = bits_to_sectors(self.plan.total_bits)
        self.modes = torch.zeros_like(self.sectors)

    def streams(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        values, offsets = self.plan.values(), self.plan.offsets
        if rows is not None:
            values, offsets = values.index_select(0, rows), offsets.index_select(0, rows)
        return write_fields(values, offsets, self.entry_bytes)


class BPCCodec(Codec):
    """Bit-plane compression: deltas, bit planes, XOR of neighbouring planes, variable-length plane codes."""

    name = "bpc"

    def analyse(self, entries: torch.Tensor, word_bytes: int) -> Analysis:
        geometry(entries.shape[1], word_bytes)  # a clear error for a word size bpc does not know
        return _Planned(entries, word_bytes)

    def decode(self, payload, sectors, modes, word_bytes):
        n, entry_bytes = payload.shape
        words = _decode_streams(payload.contiguous(), sectors, geometry(entry_bytes, word_bytes))
        return words.view(torch.uint8).view(n, entry_bytes)


@functools.cache
def _code_table(g: Geometry, device: str) -> torch.Tensor:
    """By the first 5 stream bits of a code: ``bits | run << 16 | kind << 17``.

    ``bits`` is the whole code's length, ``run`` marks the ``01`` zero runs
    (whose length field follows the prefix) and ``kind`` is what the code
    says about its plane (``_ZERO`` for both kinds of run).
    """
    table = []
    for c in range(32):
        if c & 1:
            kind, bits, run = _RAW, 1 + g.deltas, 0
        elif c & 2:
            kind, bits, run = _ZERO, 2 + g.run_bits, 1
        elif c & 4:
            kind, bits, run = _ZERO, 3, 0
        else:
            kind = {_P_ONES: _ONES, _P_DBP0: _DBP0, _P_TWO: _TWO, _P_ONE: _ONE}[c]
            bits, run = 5 + (g.pos_bits if kind in (_TWO, _ONE) else 0), 0
        table.append(bits | run << 16 | kind << 17)
    return torch.tensor(table, dtype=torch.int64, device=device)


def _decode_streams(payload: torch.Tensor, sectors: torch.Tensor, g: Geometry) -> torch.Tensor:
    """Coded entries' payloads -> ``(n, W)`` words. Raises :class:`CorruptDataError`."""
    words = stream_windows(payload)
    info = _walk_codes(words, sectors, g)
    kind = info & 7
    dbp = _dbp_planes(kind, _dbx_planes(words, info, kind, g))
    return _words_checked(words, dbp, g)


def _walk_codes(words: torch.Tensor, sectors: torch.Tensor, g: Geometry) -> torch.Tensor:
    """Per plane of every entry: ``kind | code bits << 3 | offset of the code << 32``, the stream checked.

    Each step reads every entry's next code (a code's position depends on
    the codes before it). An entry that has covered its P planes stops
    moving and writes to a spare column P, cut off at the end.
    """
    n, device, P = words.shape[0], words.device, g.planes
    table = _code_table(g, str(device))
    off = torch.full((n, 1), g.word_bits, dtype=torch.int64, device=device)
    plane = torch.zeros(n, 1, dtype=torch.int64, device=device)
    info = torch.zeros(n, P + 1, dtype=torch.int64, device=device)
    run_mask = (1 << g.run_bits) - 1
    for _ in range(P):
        active = plane < P
        if not bool(active.any()):
            break
        h = read_bits(words, off, 32)
        t = lookup(table, h & 31)
        info.scatter_(1, plane.clamp(max=P), (t >> 17) | ((h & ((1 << 29) - 1)) << 3) | (off << 32))
        # a run's planes: 2 + its length field; any other code: 1 plane
        planes = ((h >> 2) & run_mask).add_(1).mul_((t >> 16) & 1).add_(1)
        off += (t & 0xFFFF).mul_(active)
        plane += planes.mul_(active)
    total = off.squeeze(1)
    if bool((plane.squeeze(1) != P).any()):
        raise CorruptDataError("bpc: a zero run goes past the last plane")
    if bool((((total + 255) // 256) != sectors).any()):
        raise CorruptDataError("bpc: bit stream length does not match the entry sizes in the metadata")
    if bool(bits_after(words, total).any()):
        raise CorruptDataError("bpc: bits set after the end of the bit stream")
    return info[:, :P]


def _dbx_planes(words: torch.Tensor, info: torch.Tensor, kind: torch.Tensor, g: Geometry) -> torch.Tensor:
    """The DBX planes ``(n, P, S)`` (32-bit pieces) from the codes :func:`_walk_codes` found."""
    n, device = words.shape[0], words.device
    P, L, S = g.planes, g.deltas, g.supers
    pos = (info >> 8) & ((1 << g.pos_bits) - 1)  # the bits after a 5-bit prefix
    raw_off = (info >> 32) + 1  # a raw plane follows its 1-bit prefix
    if bool(((kind == _DBP0)[:, 0]).any()):
        raise CorruptDataError("bpc: a DBP = 0 code for the top plane")
    if bool((((kind == _ONE) & (pos >= L)) | ((kind == _TWO) & (pos >= L - 1))).any()):
        raise CorruptDataError("bpc: a one-bit position lies outside its plane")
    full = _piece_masks(g, device)
    piece = torch.arange(S, device=device) * 32
    dbx = read_bits(words, (raw_off.unsqueeze(-1) + piece).view(n, P * S), 32).view(n, P, S) & full
    dbx.masked_fill_((kind != _RAW).unsqueeze(-1), 0)
    dbx |= full * (kind == _ONES).unsqueeze(-1)
    rel = pos.unsqueeze(-1) - piece  # position relative to each 32-bit piece
    inside = (rel >= 0) & (rel < 32)
    shifted = rel.clamp(0, 31)
    one = (1 << shifted).mul_(inside)
    two = ((3 << shifted) & _U32).mul_(inside) | (rel == -1)
    dbx |= one.mul_((kind == _ONE).unsqueeze(-1))
    dbx |= two.mul_((kind == _TWO).unsqueeze(-1))
    return dbx


def _dbp_planes(kind: torch.Tensor, dbx: torch.Tensor) -> torch.Tensor:
    """DBP from DBX (in place), top plane first.

    ``DBP_e = DBX_e ^ DBP_(e-1)``, except that a "DBP = 0" plane is 0 and
    restarts the chain. With S the prefix XOR of the DBX planes (those planes
    counted as 0), ``DBP_e = S_e ^ S`` at the last "DBP = 0" plane at or
    above e. Both scans take log2(P) batched steps.
    """
    n, P, S = dbx.shape
    dbp0 = kind == _DBP0
    any_dbp0 = bool(dbp0.any())
    dbp = dbx.masked_fill_(dbp0.unsqueeze(-1), 0) if any_dbp0 else dbx
    step = 1
    while step < P:
        dbp[:, step:] ^= dbp[:, :-step].clone()
        step *= 2
    if any_dbp0:
        last = torch.where(dbp0, torch.arange(P, device=dbx.device), -1)
        step = 1
        while step < P:
            last[:, step:] = torch.maximum(last[:, step:], last[:, :-step])
            step *= 2
        at_last = dbp.gather(1, last.clamp(min=0).unsqueeze(-1).expand(n, P, S))
        dbp ^= at_last * (last >= 0).unsqueeze(-1)
        if bool((dbp0[:, 1:] & (dbp[:, :-1] == 0).all(-1)).any()):
            raise CorruptDataError("bpc: a DBP = 0 code follows an all-zero plane")
    return dbp


def _words_checked(words: torch.Tensor, dbp: torch.Tensor, g: Geometry) -> torch.Tensor:
    """The entries' words from the base and the DBP planes, the sign plane checked against them."""
    n, device = words.shape[0], words.device
    base = read_bits(words, torch.zeros(n, 1, dtype=torch.int64, device=device), 32).squeeze(1)
    if g.word_bits == 64:
        hi = read_bits(words, torch.full((n, 1), 32, dtype=torch.int64, device=device), 32).squeeze(1)
        base = base | (hi << 32)
    elif g.word_bits == 16:
        base = base & 0xFFFF
    x = _words_from_planes(dbp, base, g)
    sign = pack_bools(x[:, 1:] < x[:, :-1], 32 * g.supers)
    if not torch.equal(sign, dbp[:, 0]):
        raise CorruptDataError("bpc: the sign plane does not match the decoded words")
    return x
