"""``fpe``: float fields with an entropy-coded sign, exponent and top mantissa bits (format versions 2 and 3).

A word is ``sign | exponent (e bits) | mantissa (m bits)``, split by word
size as :mod:`~buddy.codecs.fpx` splits it (bfloat16 and float32: ``e = 8``).
Its **symbol** is its top ``b`` bits, the rest of it its **tail**
(``t = 8 * word bytes - b`` bits). The table says which ``b`` and which
payload layout (byte 0, its format):

* format 3 (what a fit makes; format version 3): ``b = min(12, 8 * word
  bytes)`` -- sign, exponent and the mantissa's top bits (3 for bfloat16 and
  float32, none for float64; a 1-byte word is all symbol) -- in the **split
  layout** below, which a GPU warp decodes with every lane;
* format 2 (decoded, no longer written): the same symbols in the **serial
  layout**;
* format 1 (decoded, never written any more): ``b = 1 + e``, sign and
  exponent alone, in the serial layout.

In activations few symbols are common -- a handful of binades, often one
sign -- so a prefix code fitted to the tensor codes them in about as many
bits as they carry, while the rest of the mantissa, close to uniform, is
passed through. The mantissa's top bits are not uniform (values thin out
towards the top of a binade), so coding them with the sign and exponent
gains 0.7-3.4 % of ideal ratio over format 1 on the measured bfloat16
workloads (4 KiB entries).

Symbols (``S = 2 ** b``)::

    0 .. S-1   a word's top b bits; it has a tail (t bits)
    S          ZERO: the word is all zero bits (no tail)
    S + 1      ESC: a symbol the table has no code for follows, b bits;
               the word has a tail

The table
---------
Every compressed tensor carries its **table** (format version 2 and later:
the tensor's fourth buffer, on its device): a canonical prefix code of
lengths 1 .. :data:`MAX_CODE_BITS` over at most :data:`MAX_CODED` regular
symbols, ZERO (when the tensor has zero words) and ESC (always)::

    byte 0        table format (3; 2 or 1 in tensors written before it)
    byte 1        word bytes the table is for
    bytes 2-3     n, little-endian: how many symbols have codes
    3 n bytes     per symbol, in canonical order (by code length, then
                  symbol): the symbol (uint16, little-endian), its code length

Canonical codes: the first symbol gets code 0; each next one gets
``(previous + 1) << (its length - previous length)``. The code is written
most significant bit first. :meth:`Table.from_counts` fits the table to
symbol counts: the :data:`MAX_CODED` most frequent regular symbols (ties:
smaller symbol), ZERO, and ESC weighted by the count of all the others
(at least 1), Huffman lengths limited by halving the counts until they fit
(ties broken by symbol, so equal counts give equal tables). The counts are
the tensor's own unless a session passes those its tracker learned for the
key over earlier steps (:meth:`FPECodec.fit`), which a GPU can use without
a pass of its own. Fitting costs the host about a millisecond, so a session
keeps a key's table from step to step (:func:`fit_table`) until it codes the
learned statistics :data:`REFIT_BITS` bits per word worse, against their
entropy, than it coded the counts it was fitted to.

Payload of an entry
-------------------
The little-endian bit stream of :mod:`buddy.codecs._bitstream`. Each of the
``W = E / word_bytes`` words has a **code** -- ZERO's for an all-zero word
when the table has ZERO; its symbol's when the table has it; else ESC's
followed by the symbol (``b`` bits) -- and, unless its code is ZERO, a
**tail** (``t`` bits). ``C`` is the bits of all codes, ``N`` the number of
tails, ``T = C + N t`` and ``k = ceil(T / 256)``. One metadata mode (0).

* **split layout** (table format 3): the codes of the ``W`` words in word
  order from bit 0 (the **code section**, ``[0, C)``); the tails at the
  payload's end, backwards: the tail of the ``j``-th word that has one
  (``j = 0, 1, ...`` in word order) at bits ``[256 k - (j + 1) t, 256 k -
  j t)``; zero bits between the sections. A tail's place follows from how
  many tails come before it, so a decoder that splits the code section
  among lanes needs nothing else to place them, and ``k`` is exactly the
  serial layout's: the split costs no bit.
* **serial layout** (table formats 1 and 2): for each word in order, its
  code, then its tail; zero bits after the ``T`` bits.

The decoder rejects (:class:`~buddy.errors.CorruptDataError`) a code the
table does not have, ESC followed by a symbol the table has (the encoder
would have coded it), a stream whose length disagrees with ``k``, and set
bits outside the codes and tails (after the stream; between the sections
of the split layout).

Decoding the code section in parallel
-------------------------------------
A code's length is known only once it is read, so where the ``i``-th code
starts is serial -- but a prefix code resynchronizes: decoded from a bit
inside some code, a decoder soon lands on a true code boundary, and from
there on it decodes exactly what a decoder from bit 0 does. The GPU's warp
(csrc/codec_fpe.h) gives each of its 32 lanes a span of the code section
(an estimate of ``C`` from ``k`` and the table: nothing is stored), each
lane decodes from its span's first bit, and a lane whose start turns out not
to be the true end of the lane before it decodes again from that end until
none changes; a warp scan of the lanes' code counts then gives each lane its
words' places, and one of their tail counts its tails' places. Measured on
the capture workloads (``python -m experiments.lab.fpe_lanes``): see
docs/format-v3.md for the rounds and the work per lane, and for the
layouts weighed against this one: per-lane offsets stored in the entry and
interleaved sub-streams, which cost 0.6-2.8 % of ideal ratio, and sub-streams
the lanes fetch in lockstep, which cost nothing but whose decoder takes as many
instructions as this one's.

The torch reference below decodes every entry at once, serially within an
entry: one table lookup per code walks the code section (a word's length
follows from the next 12 bits alone), then every word's fields are read in
one pass.
"""

from __future__ import annotations

import functools
import heapq

import numpy as np
import torch

from ..errors import CorruptDataError
from ._bitstream import StreamWriter, bits_after, bits_between, lookup, read_bits, stream_windows
from .base import Analysis, Codec, CodecLike, Fitting, bits_to_sectors
from .fpx import SPLITS

__all__ = [
    "FPECodec", "Table", "default_table", "fit_table", "symbol_counts", "symbol_bits", "MAX_CODE_BITS", "MAX_CODED",
    "TABLE_FORMAT", "TABLE_FORMATS", "SPLIT_FORMAT", "REFIT_BITS", "code_section_estimate", "fit_weights", "refits",
]  # fmt: skip

#: the longest code (bits): the decoder's lookup table has 2**MAX_CODE_BITS rows
MAX_CODE_BITS = 12
#: regular symbols with codes at most (the rest escape)
MAX_CODED = 255
#: byte 0 of the tables a fit makes: symbols of the word's top 12 bits, the split payload layout
TABLE_FORMAT = 3
#: the table formats a decoder reads (1: symbols of sign and exponent alone; 1 and 2: the serial layout)
TABLE_FORMATS = (1, 2, 3)
#: the first table format whose payloads have the split layout (codes first, tails at the end)
SPLIT_FORMAT = 3
#: bits per word a kept table may lose against the entropy, beyond what it lost on the counts it was fitted to
REFIT_BITS = 0.02

_INT_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.cache
def _split(word_bytes: int) -> tuple[int, int]:
    if word_bytes not in SPLITS:
        raise ValueError(f"fpe word size must be 1, 2, 4 or 8 bytes, got {word_bytes}")
    return SPLITS[word_bytes]


def symbol_bits(word_bytes: int, table_format: int = TABLE_FORMAT) -> int:
    """``b``: the bits of a word a symbol of this table format is (its top bits)."""
    e, _ = _split(word_bytes)
    if table_format not in TABLE_FORMATS:
        raise ValueError(f"fpe table formats are {TABLE_FORMATS}, got {table_format}")
    return 1 + e if table_format == 1 else min(12, 8 * word_bytes)


def n_symbols(word_bytes: int, table_format: int = TABLE_FORMAT) -> int:
    """``S + 2``: the regular symbols, ZERO and ESC."""
    return (1 << symbol_bits(word_bytes, table_format)) + 2


def _words(entries: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """``(n, W)`` int64 words, unsigned."""
    x = entries.contiguous().view(_INT_DTYPE[word_bytes]).to(torch.int64)
    return x if word_bytes == 8 else x & ((1 << (8 * word_bytes)) - 1)


def _symbols(x: torch.Tensor, word_bytes: int, table_format: int = TABLE_FORMAT) -> tuple[torch.Tensor, torch.Tensor]:
    """``(symbol, zero)`` of int64 words: their top ``b`` bits, and whether the word is all zero."""
    b = symbol_bits(word_bytes, table_format)
    return (x >> (8 * word_bytes - b)) & ((1 << b) - 1), x == 0


def symbol_counts(flat: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """``(S + 2,)`` int64 counts of a tensor's bytes, on its device: regular symbols of non-zero words, ZERO, 0 for ESC.

    The symbols of the tables a fit makes (:data:`TABLE_FORMAT`).
    """
    s = n_symbols(word_bytes)
    usable = flat.numel() - flat.numel() % word_bytes
    if usable == 0:
        return torch.zeros(s, dtype=torch.int64, device=flat.device)
    sym, zero = _symbols(_words(flat[:usable].view(1, -1), word_bytes).view(-1), word_bytes)
    return torch.bincount(torch.where(zero, s - 2, sym), minlength=s)


def _tree_height(weights: list[int], limit: int | None = None) -> int:
    """The height of a Huffman tree over ``weights`` (sorted, ascending): two queues, no tree kept.

    A tree's height does not depend on how equal weights are ordered, so this
    is the height of :func:`_code_lengths`'s tree (and of what the device fit
    computes per halving round). Each step takes the next leaf unless the next
    merged node weighs less (ties: the leaf); a leaf's height is 0. With a
    ``limit``, the height of the first merged node above it once one is made
    (the root is at least as high): a round that cannot fit stops there.
    """
    n = len(weights)
    if n == 1:
        return 1
    node_w = [0] * (n - 1)  # merged nodes in the order they are made (their weights never decrease)
    node_h = [0] * (n - 1)
    leaf = node = made = 0
    for _ in range(n - 1):
        if leaf < n and (node == made or weights[leaf] <= node_w[node]):
            w1, h1 = weights[leaf], 0
            leaf += 1
        else:
            w1, h1 = node_w[node], node_h[node]
            node += 1
        if leaf < n and (node == made or weights[leaf] <= node_w[node]):
            w2, h2 = weights[leaf], 0
            leaf += 1
        else:
            w2, h2 = node_w[node], node_h[node]
            node += 1
        h = (h1 if h1 > h2 else h2) + 1
        if limit is not None and h > limit:
            return h
        node_w[made] = w1 + w2
        node_h[made] = h
        made += 1
    return node_h[-1]


def _code_lengths(weights: dict[int, int]) -> dict[int, int]:
    """Huffman code lengths for positive ``weights`` (no limit); ties by symbol, merged nodes after leaves."""
    if len(weights) == 1:
        return {next(iter(weights)): 1}
    # (weight, id): a leaf's id is its symbol, merged nodes get ids after every symbol in the order they are made
    heap = sorted((w, s) for s, w in weights.items())
    first = made = max(weights) + 1
    parent = {}
    while len(heap) > 1:
        w1, a = heapq.heappop(heap)
        w2, b = heapq.heappop(heap)
        parent[a] = parent[b] = made
        heapq.heappush(heap, (w1 + w2, made))
        made += 1
    depth = {made - 1: 0}  # the root, then every merged node after its parent (made later)
    for node in range(made - 2, first - 1, -1):
        depth[node] = depth[parent[node]] + 1
    return {s: depth[parent[s]] + 1 for s in weights}


def _huffman_lengths(weights: dict[int, int]) -> dict[int, int]:
    """Code lengths (at most :data:`MAX_CODE_BITS`) of a prefix code for positive ``weights``; deterministic.

    Huffman's, on the weights halved (``max(1, w >> t)``) as few times ``t``
    as it takes the longest code to fit: each round's height is found without
    building its code, the code is built once.
    """
    ordered = sorted(weights.values())  # (halving keeps the order: max(1, w >> t) does not decrease with w)
    t = 0
    while True:
        if _tree_height([(w >> t) or 1 for w in ordered], MAX_CODE_BITS) <= MAX_CODE_BITS:
            lengths = _code_lengths({s: (w >> t) or 1 for s, w in weights.items()})
            if max(lengths.values()) <= MAX_CODE_BITS:
                return lengths
        t += 1


class Table:
    """A canonical prefix code over one word size's symbols (see the module doc)."""

    def __init__(self, word_bytes: int, lengths: dict[int, int], table_format: int = TABLE_FORMAT):
        self.word_bytes = word_bytes
        #: byte 0 of the table: which top bits of a word its symbols are (:data:`TABLE_FORMATS`)
        self.format = table_format
        #: ``b`` and ``t``: the bits of a word its symbol is and the bits after them (the tail)
        self.symbol_bits = symbol_bits(word_bytes, table_format)
        self.tail_bits = 8 * word_bytes - self.symbol_bits
        #: whether its payloads have the split layout (codes first, tails at the end; see the module doc)
        self.split = table_format >= SPLIT_FORMAT
        #: :meth:`slack` on the counts :meth:`from_counts` fitted it to (``None``: a table read from bytes)
        self.fit_slack: float | None = None
        self._serialized: np.ndarray | None = None  # to_bytes()'s bytes, made once
        #: the kernels' layout of this table (buddy.codecs.fpe_device.device_table's bytes, on the host), made once
        self.laid_out: torch.Tensor | None = None
        #: :attr:`laid_out` on each device it was copied to (buddy.codecs.fpe_device.kernel_table), never written
        self.on_device: dict[torch.device, torch.Tensor] = {}
        #: :meth:`to_bytes` on each device a tensor packed ahead stores it on (shared by them), never written
        self.stored_on: dict[torch.device, torch.Tensor] = {}
        self._slack_memo: tuple | None = None  # (counts, their version, slack): the last slack asked (slack)
        s = n_symbols(word_bytes, table_format)
        self.zero, self.esc = s - 2, s - 1
        if self.esc not in lengths:
            raise CorruptDataError("fpe table: no code for ESC")
        # (numpy: a table has up to 259 codes, made or read once or twice a compress)
        try:
            syms = np.fromiter(lengths, dtype=np.int64, count=len(lengths))
            lens = np.fromiter(lengths.values(), dtype=np.int64, count=len(lengths))
        except (OverflowError, TypeError, ValueError) as exc:
            raise CorruptDataError(f"fpe table: symbols and code lengths must be small integers ({exc})") from None
        bad = (syms < 0) | (syms >= s) | (lens < 1) | (lens > MAX_CODE_BITS)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CorruptDataError(f"fpe table: symbol {syms[i]} with a code of {lens[i]} bits is out of range")
        if len(lengths) - 1 - (self.zero in lengths) > MAX_CODED:
            raise CorruptDataError(f"fpe table: more than {MAX_CODED} regular symbols")
        room = np.left_shift(1, MAX_CODE_BITS - lens)  # of the 2**12 values of the next 12 bits, a code's
        if int(room.sum()) > 1 << MAX_CODE_BITS:
            raise CorruptDataError("fpe table: the code lengths do not form a prefix code")
        ranked = np.lexsort((syms, lens))  # canonical order: by length, then symbol
        syms, lens, room = syms[ranked], lens[ranked], room[ranked]
        # canonical codes: each the previous plus one, shifted to its length -- the room before it, in its bits
        codes = (np.cumsum(room) - room) >> (MAX_CODE_BITS - lens)
        self.order: list[int] = syms.tolist()
        self.lengths = dict(zip(self.order, lens.tolist()))
        self.codes: dict[int, int] = dict(zip(self.order, codes.tolist()))
        self._coded = (syms, lens)  # the order and its lengths, as arrays

    # ---- making one -------------------------------------------------------------
    @classmethod
    def from_counts(cls, counts: torch.Tensor, word_bytes: int, table_format: int = TABLE_FORMAT) -> Table:
        """The table fitted to symbol ``counts`` (``(S + 2,)``, any non-negative numbers).

        Fits make tables of :data:`TABLE_FORMAT`; ``table_format=1`` (counts
        of format 1's symbols) and ``2`` are for tests and tools of what
        older tensors hold.
        """
        s = n_symbols(word_bytes, table_format)
        counts = _checked_counts(counts, s, word_bytes)
        c = _weights(counts)
        present = np.flatnonzero(c[: s - 2] > 0)
        regular = present[np.lexsort((present, -c[present]))]  # by count, descending, then symbol
        coded = regular[:MAX_CODED].tolist()
        weights = dict(zip(coded, c[coded].tolist()))
        if c[s - 2] > 0:
            weights[s - 2] = int(c[s - 2])
        weights[s - 1] = max(1, int(c[regular[MAX_CODED:]].sum()))
        table = cls(word_bytes, _huffman_lengths(weights), table_format)
        table.fit_slack = table.slack(counts)
        return table

    @classmethod
    def from_bytes(cls, data: torch.Tensor, word_bytes: int) -> Table:
        """The table serialized in ``data`` (uint8); :class:`CorruptDataError` for anything else."""
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
            raise CorruptDataError("fpe table: expected a uint8 tensor")
        raw = np.array(data.detach().reshape(-1).cpu().tolist(), dtype=np.uint8)  # (tolist: no torch op to run)
        if len(raw) < 4 or int(raw[0]) not in TABLE_FORMATS:
            raise CorruptDataError(f"fpe table: not a table of format {' or '.join(map(str, TABLE_FORMATS))}")
        if raw[1] != word_bytes:
            raise CorruptDataError(f"fpe table is for {raw[1]}-byte words, the tensor has {word_bytes}-byte words")
        n = int(raw[2]) | int(raw[3]) << 8
        if len(raw) != 4 + 3 * n:
            raise CorruptDataError(f"fpe table: {len(raw)} bytes for {n} symbols")
        fields = raw[4:].reshape(n, 3).astype(np.int64)
        symbols = (fields[:, 0] | fields[:, 1] << 8).tolist()
        lengths = dict(zip(symbols, fields[:, 2].tolist()))
        if len(lengths) != n:
            twice = next(sym for i, sym in enumerate(symbols) if sym in symbols[:i])
            raise CorruptDataError(f"fpe table: symbol {twice} twice")
        table = cls(word_bytes, lengths, int(raw[0]))
        if table.order != symbols:
            raise CorruptDataError("fpe table: symbols not in canonical order")
        table._serialized = raw.copy()  # what to_bytes() would make: the same bytes
        return table

    @property
    def nbytes(self) -> int:
        """Bytes of :meth:`to_bytes` (the header and 3 bytes per code), without serializing."""
        return 4 + 3 * len(self.order)

    def to_bytes(self) -> torch.Tensor:
        """The serialized table (uint8, on the CPU; a new tensor each call)."""
        if self._serialized is None:
            order = np.array(self.order, dtype=np.int64)
            fields = np.stack([order & 0xFF, order >> 8, np.array([self.lengths[s] for s in self.order])], axis=1)
            head = [self.format, self.word_bytes, len(self.order) & 0xFF, len(self.order) >> 8]
            self._serialized = np.concatenate([head, fields.reshape(-1)]).astype(np.uint8)
        return torch.from_numpy(self._serialized.copy())

    @functools.cached_property
    def key(self) -> tuple:
        """What identifies the table's code: its word size, format and code lengths (hashable; for caches of what
        is made from a table, e.g. its device layout)."""
        return self.word_bytes, self.format, tuple(sorted(self.lengths.items()))

    def __eq__(self, other) -> bool:
        mine, theirs = (self.word_bytes, self.format, self.lengths), (other.word_bytes, other.format, other.lengths)
        return isinstance(other, Table) and mine == theirs

    def __repr__(self) -> str:
        return (
            f"fpe.Table({self.word_bytes}-byte words, format {self.format}, {len(self.order)} codes of "
            f"{min(self.lengths.values())}-{max(self.lengths.values())} bits)"
        )

    # ---- cost -----------------------------------------------------------------------
    @functools.cached_property
    def word_bits(self) -> torch.Tensor:
        """``(S + 2,)`` float64: the bits a word of each symbol takes (code, escaped symbol, tail); ESC 0."""
        bits = np.full(self.esc + 1, float(self.lengths[self.esc] + self.symbol_bits))
        syms, lens = self._coded
        regular = syms < self.zero
        bits[syms[regular]] = lens[regular]
        bits[: self.zero] += self.tail_bits
        bits[self.zero] = self.lengths.get(self.zero, bits[0])  # a zero word without ZERO: symbol 0 and its tail
        bits[self.esc] = 0
        return torch.from_numpy(bits)

    def slack(self, counts) -> float:
        """Bits per word this table spends on words of symbol ``counts`` beyond their entropy (tails as they are).

        The last tensor asked about is remembered with its answer (a key's learned statistics change only on the
        steps its tracker counts it, :meth:`buddy.Tracker.counts`, and each step asks whether its table still codes
        them): asked again about the same tensor, unchanged by torch since (its version), it answers at once.
        Only a refit's decision reads it: a wrong answer would cost ratio, never data. (An inference tensor has
        no version: it is not remembered.)"""
        if isinstance(counts, torch.Tensor) and not counts.is_inference():
            memo = self._slack_memo
            if memo is not None and memo[0] is counts and memo[1] == counts._version:
                return memo[2]
            value = self._slack(counts)
            self._slack_memo = (counts, counts._version, value)
            return value
        return self._slack(counts)

    def _slack(self, counts) -> float:
        counts = torch.as_tensor(counts).detach().to("cpu", torch.float64)
        if counts.shape != (self.esc + 1,):
            raise ValueError(f"fpe: counts of {self.esc + 1} symbols for this table, got shape {tuple(counts.shape)}")
        c = counts.numpy()  # (numpy: a few small arrays, where torch's per-operation cost dominates)
        total = float(c.sum())
        if total <= 0:
            return 0.0
        p = c / total
        seen = p[p > 0]
        entropy = float(-(seen * np.log2(seen)).sum()) + self.tail_bits * (1 - float(p[self.zero]))
        return float(p @ self.word_bits.numpy()) - entropy

    # ---- the code section's length, estimated (the GPU decoder's spans) -------------
    @functools.cached_property
    def span_model(self) -> tuple[int, int]:
        """``(zero bits, head bits * 256)``: what the table's code lengths say a word's code costs.

        ZERO's code length (0 when the table has no ZERO), and the mean bits
        of the code of a word with a tail (ESC's with its escaped symbol) when
        each code of length ``n`` is taken to be ``2 ** -n`` likely, in 1/256
        bits, rounded down: integers, so the device fit
        (csrc/codec_fpe_fit.h) computes the same. A decoder that splits the
        code section among lanes estimates its length from ``k`` with them
        (:func:`code_section_estimate`); nothing depends on them but how
        evenly the lanes share the work.
        """
        num = den = 0
        for sym, n in self.lengths.items():
            if sym == self.zero:
                continue
            weight = 1 << (MAX_CODE_BITS - n)
            num += weight * (n + (self.symbol_bits if sym == self.esc else 0))
            den += weight
        return self.lengths.get(self.zero, 0), num * 256 // den

    @functools.cached_property
    def multi_rows(self) -> torch.Tensor:
        """``(2**12,)`` int64: per value ``v`` of the next 12 stream bits, the codes that lie wholly inside them.

        ``starts | tails << 12 | bits << 24``: bit ``i`` of ``starts`` is set
        where one of those codes starts and of ``tails`` where that code is
        not ZERO (its word has a tail), ``bits`` is how many bits they take.
        A code is taken while it is decided by bits inside ``v`` (codes are
        at most 12 bits, so the first one always is) and is neither ESC nor
        a code the table lacks: for those the row stops before them (0 when
        the first code is one). The GPU decoder of the split layout steps
        over a run of short codes with one lookup.
        """
        _, _, dec_sym, dec_len = (t.numpy() for t in self.lookups("cpu"))  # (numpy: 4096 rows, 12 rounds)
        v = np.arange(1 << MAX_CODE_BITS, dtype=np.int64)
        pos, starts, tails = np.zeros_like(v), np.zeros_like(v), np.zeros_like(v)
        active = np.ones(v.shape, dtype=bool)
        for _ in range(MAX_CODE_BITS):
            u = v >> pos  # bits past the window read as zero: a code is taken only if it ends inside it
            sym, n = dec_sym[u], dec_len[u]
            active &= (n > 0) & (sym != self.esc) & (pos + n <= MAX_CODE_BITS)
            starts |= active.astype(np.int64) << pos
            tails |= (active & (sym != self.zero)).astype(np.int64) << pos
            pos += active * n
        return torch.from_numpy(starts | tails << 12 | pos << 24)

    # ---- lookups ------------------------------------------------------------------
    def lookups(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(length, stream code)`` per symbol (length 0: no code) and ``(symbol, length)`` per next-12-bits.

        Shared by equal tables (a key's table is often the same step after
        step), so each is built once per device.
        """
        codes = tuple((sym, self.lengths[sym], self.codes[sym]) for sym in self.order)
        return _lookups(self.esc + 1, codes, torch.device(device))


@functools.lru_cache(maxsize=64)
def _lookups(
    s: int, codes: tuple[tuple[int, int, int], ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`Table.lookups` of ``(symbol, length, code)`` in canonical order, ``s`` symbols (ZERO and ESC too).

    Whole arrays at once (numpy): each code's bits reversed (its first bit is stream bit 0), then the rows of
    each code length -- a prefix code gives each row at most one code."""
    sym, n, code = (np.array([c[i] for c in codes], dtype=np.int64) for i in range(3))
    stream = np.zeros_like(code)
    for i in range(MAX_CODE_BITS):  # code bit n - 1 - i (from the top) is stream bit i
        stream |= np.where(i < n, (code >> np.maximum(n - 1 - i, 0)) & 1, 0) << i
    enc_len, enc_code = np.zeros(s, dtype=np.int64), np.zeros(s, dtype=np.int64)
    enc_len[sym], enc_code[sym] = n, stream
    rows = np.arange(1 << MAX_CODE_BITS, dtype=np.int64)
    dec_sym, dec_len = np.zeros_like(rows), np.zeros_like(rows)
    for length in np.unique(n).tolist():
        which = np.full(1 << length, -1, dtype=np.int64)  # the code (its index) whose stream bits are these
        of = np.flatnonzero(n == length)
        which[stream[of]] = of
        hit = which[rows & ((1 << length) - 1)]
        found = hit >= 0
        dec_sym[found], dec_len[found] = sym[hit[found]], length
    as_t = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return as_t(enc_len), as_t(enc_code), as_t(dec_sym), as_t(dec_len)


# ---------------------------------------------------------------------------
# encoding
# ---------------------------------------------------------------------------
class _Coded(Analysis):
    """fpe's analysis of a block: each word's code, and so each entry's length."""

    def __init__(self, entries: torch.Tensor, word_bytes: int, table: Table):
        b, t = table.symbol_bits, table.tail_bits
        self.word_bytes, self.entry_bytes = word_bytes, entries.shape[1]
        x = _words(entries, word_bytes)
        sym, zero = _symbols(x, word_bytes, table.format)
        enc_len, enc_code, _, _ = table.lookups(x.device)
        if table.zero in table.lengths:
            sym = torch.where(zero, table.zero, sym)
        code_len = lookup(enc_len, sym)
        esc = code_len == 0
        coded = torch.where(esc, table.esc, sym)
        code_len = lookup(enc_len, coded)
        has_tail = coded != table.zero
        head_bits = code_len + esc * b
        if table.split:  # codes from bit 0, tails backwards from the payload's end
            self.offsets = torch.cumsum(head_bits, 1) - head_bits
            tails = has_tail.sum(1, keepdim=True)
            self.total_bits = head_bits.sum(1) + tails.squeeze(1) * t
            self.sectors = bits_to_sectors(self.total_bits)
            # the j-th tail ends j tails before the end (a word without one: its zero tail goes anywhere inside)
            end = self.sectors.to(torch.int64).unsqueeze(1) * 256
            self.tail_at = torch.cumsum(has_tail, 1, dtype=torch.int32).mul_(-t).add(end)
        else:  # each word's code, then its tail
            bits = head_bits + has_tail * t
            self.offsets = torch.cumsum(bits, 1) - bits
            self.total_bits = bits.sum(1)
            self.sectors = bits_to_sectors(self.total_bits)
            self.tail_at = self.offsets + head_bits
        self.modes = torch.zeros_like(self.sectors)
        #: per word, the bits of its code (and escaped symbol); per entry, their sum C
        self.head_bits = head_bits
        self.code_bits = head_bits.sum(1)
        # the fields, ready for the streams: code | escaped symbol << length, and the tail
        self.head = lookup(enc_code, coded) | (sym * esc) << code_len
        self.tail = (x & ((1 << t) - 1)) * has_tail
        self.tail_bits = t

    def streams(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        head, offsets, tail, at = (pick(t) for t in (self.head, self.offsets, self.tail, self.tail_at))
        writer = StreamWriter(head.shape[0], self.entry_bytes, head.device)
        writer.add(head, offsets)
        if self.tail_bits:  # a 1-byte word of format 2 is all symbol
            writer.add(tail, at)
        return writer.payload()


# ---------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------
def _read_wide(windows: torch.Tensor, at: torch.Tensor, width: int) -> torch.Tensor:
    """A field of up to 63 bits (two reads past 32)."""
    if width <= 32:
        return read_bits(windows, at, width)
    return read_bits(windows, at, 32) | read_bits(windows, at + 32, width - 32) << 32


def _decode_block(payload: torch.Tensor, sectors: torch.Tensor, word_bytes: int, table: Table) -> torch.Tensor:
    """Coded entries -> ``(n, W)`` int64 words; raises :class:`CorruptDataError`.

    Where each word starts is serial within an entry, but a word's whole
    length -- its code and escaped symbol, and in the serial layout its tail
    -- follows from the next 12 stream bits alone: one table lookup. So the
    serial loop only walks the starts (every entry at once); reading every
    word's fields is then one pass over all of them.
    """
    b, t = table.symbol_bits, table.tail_bits
    n, entry_bytes = payload.shape
    n_words = entry_bytes // word_bytes
    enc_len, _, dec_sym, dec_len = table.lookups(payload.device)
    escaped = dec_sym == table.esc
    # per next-12-bits: the bits the walk steps over (a code the table lacks reads as length 0 and is caught below)
    advance = dec_len + escaped * b
    if not table.split:
        advance = advance + (dec_sym != table.zero) * t
    windows = stream_windows(payload.contiguous())
    end = entry_bytes * 8
    # A start is clamped to `end` once the walk is over (a damaged stream stays inside the payload), not at each
    # step: past the payload the stream reads zero bits, so enough zero columns hold every step a walk can take.
    reach = n_words * int(advance.max()) + MAX_CODE_BITS
    padded = torch.nn.functional.pad(windows, (0, reach // 32 + 2))
    pos = torch.zeros(n, 1, dtype=torch.int64, device=payload.device)
    mask = (1 << MAX_CODE_BITS) - 1
    each = []
    for _ in range(n_words):  # serial within an entry, every entry at once; as few torch calls as it takes
        each.append(pos)
        peek = padded.gather(1, pos >> 5).bitwise_right_shift_(pos & 31).bitwise_and_(mask)
        pos = torch.take(advance, peek).add_(pos)
    starts = torch.cat(each, 1).clamp_(max=end)
    pos = pos.clamp_(max=end)
    peek = read_bits(windows, starts, MAX_CODE_BITS)
    sym, length = lookup(dec_sym, peek), lookup(dec_len, peek)
    bad = length == 0
    at = starts + length
    esc = sym == table.esc
    raw = read_bits(windows, at, b)
    bad |= esc & (lookup(enc_len, raw) > 0)  # an escaped symbol the table has a code for
    sym = torch.where(esc, raw, sym)
    has_tail = sym != table.zero
    if table.split:  # the j-th tail ends j tails before the payload's end (a word without one reads anything)
        at = torch.cumsum(has_tail, 1, dtype=torch.int32).mul_(-t).add(sectors.to(torch.int64).unsqueeze(1) * 256)
        at.clamp_(min=0)
    else:
        at += esc * b
    tail = _read_wide(windows, at, t) if t else torch.zeros_like(sym)
    words = (sym << t).bitwise_or_(tail).mul_(has_tail)  # a ZERO word is 0
    if bool(bad.any()):
        raise CorruptDataError("fpe: a code the table does not have, or an escape of a symbol it has")
    # where the walk ended: the code section's end (split) or the stream's
    _check_lengths(windows, sectors, pos.squeeze(1), has_tail.sum(1) * t if table.split else None)
    return words


def _check_lengths(windows: torch.Tensor, sectors: torch.Tensor, codes: torch.Tensor, tails) -> None:
    """Raise :class:`CorruptDataError` unless the streams fill exactly their k sectors and nothing else is set.

    ``codes``: per entry, where the walk ended; ``tails``: the bits of its tails (the split layout), or
    ``None`` (the serial layout: the walk ended at the stream's end).
    """
    total = codes if tails is None else codes + tails
    if bool((bits_to_sectors(total) != sectors).any()):
        raise CorruptDataError("fpe: stream length does not match the entry sizes in the metadata")
    if tails is None:
        if bool(bits_after(windows, codes).any()):
            raise CorruptDataError("fpe: bits set after the end of the bit stream")
        return
    # nothing set between the sections (the tails start at 256 k - tails) or after the payload's k sectors
    end = sectors.to(torch.int64) * 256
    if bool(bits_between(windows, codes, end - tails).any()):
        raise CorruptDataError("fpe: bits set between the codes and the tails")
    if bool(bits_after(windows, end).any()):
        raise CorruptDataError("fpe: bits set after the end of the bit stream")


def code_section_estimate(k: int, n_words: int, tail_bits: int, span_model: tuple[int, int]) -> int:
    """An estimate of the code section's bits ``C`` of an entry of ``k`` sectors (the split layout).

    ``T = C + N t`` lies in ``(256 (k - 1), 256 k]``; with ``T`` at the
    middle of its last sector, ``C`` a ZERO code for each of the ``W - N``
    zero words and the mean head bits for each of the ``N`` others
    (:attr:`Table.span_model`), ``N`` follows, and ``C = T - N t``. Integer
    arithmetic, in 1/256 bits, as the device decoder (csrc/codec_fpe.h)
    computes it; between 1 and ``256 k``.
    """
    zero, head = span_model
    middle = (256 * k - 128) * 256
    per_tail = head + 256 * tail_bits - 256 * zero  # what a word with a tail adds over a zero word
    if zero == 0:  # no ZERO code: every word has a tail
        tails = n_words
    elif per_tail <= 0:
        tails = 0
    else:
        tails = min(n_words, max(0, middle - 256 * zero * n_words) // per_tail)
    return min(256 * k, max(1, (middle - 256 * tails * tail_bits) // 256))


def _checked_counts(counts, s: int, word_bytes: int) -> torch.Tensor:
    """``counts`` as float64 on the CPU; ``ValueError`` unless they are ``s`` non-negative finite numbers."""
    counts = torch.as_tensor(counts).detach().to("cpu", torch.float64)
    c = counts.numpy()  # (numpy: torch's per-operation cost is most of it on a few thousand numbers)
    if counts.shape != (s,) or bool((c < 0).any()) or not bool(np.isfinite(c).all()):
        raise ValueError(f"fpe: symbol counts must be {s} non-negative numbers for {word_bytes}-byte words")
    return counts


def _weights(counts: torch.Tensor) -> np.ndarray:
    """The integer weights :meth:`Table.from_counts` fits (int64): ``max(1, round(v * 2**30 / total))`` for each
    count ``v > 0`` (round half to even, as Python's round), else 0 -- counts or frequencies alike."""
    total = float(counts.sum())
    v = counts.numpy()
    scale = (1 << 30) / total if total > 0 else 1.0
    return np.where(v > 0, np.maximum(1.0, np.rint(v * scale)), 0.0).astype(np.int64)


def fit_weights(counts, word_bytes: int) -> torch.Tensor:
    """The integer weights (int64, ``(S + 2,)``) :meth:`Table.from_counts` fits for ``counts``: each count
    ``v > 0`` scaled to ``max(1, round(v * 2**30 / total))`` (round half to even), 0 for the others and for
    ESC's (which enters only the total). What an engine's ``fit`` kernel takes, unscaled, to fit a learned
    prior -- frequencies, not counts -- on the device, byte for byte as the host would."""
    s = n_symbols(word_bytes)
    c = _weights(_checked_counts(counts, s, word_bytes))
    c[s - 1] = 0
    return torch.from_numpy(c)


def refits(counts, word_bytes: int, keep: Table | None) -> bool:
    """Whether :func:`fit_table` fits a new table to ``counts``: unless ``keep`` (a table fitted earlier, e.g. to
    the same key's statistics a step before) codes them within :data:`REFIT_BITS` of its :meth:`~Table.slack` on
    the counts it was fitted to."""
    if keep is not None and (keep.word_bytes, keep.format) == (word_bytes, TABLE_FORMAT) and keep.fit_slack is not None:
        return keep.slack(counts) > keep.fit_slack + REFIT_BITS
    return True


def fit_table(counts, word_bytes: int, keep: Table | None = None) -> Table:
    """:meth:`Table.from_counts`, or ``keep`` while it codes ``counts`` nearly as well as those it was fitted to.

    ``keep`` is returned unless :func:`refits` says otherwise: the fit (about
    a millisecond of Python) is skipped, at most :data:`REFIT_BITS` bits per
    word lost.
    """
    if keep is None or refits(counts, word_bytes, keep):
        return Table.from_counts(counts, word_bytes)
    return keep


@functools.cache
def default_table(word_bytes: int) -> Table:
    """The table of an unfitted codec: a fixed prior, for the format layer's tools and tests.

    Zero words and the binades just below 1 (``2**-1 .. 2**-12``, both signs,
    each half as likely as the one above, its mantissa's top bits alike) have
    codes; everything else escapes. :func:`buddy.compress` never codes with
    it: it fits a table to each tensor.
    """
    e, _ = _split(word_bytes)
    bias = (1 << (e - 1)) - 1
    top = symbol_bits(word_bytes) - 1 - e  # mantissa bits in a symbol
    counts = torch.zeros(n_symbols(word_bytes), dtype=torch.float64)
    for step in range(min(12, bias)):
        for sign in (0, 1 << e):
            for high in range(1 << top):
                counts[(sign | (bias - 1 - step)) << top | high] = 2.0 ** -step
    counts[-2] = 1.0
    return Table.from_counts(counts, word_bytes)


class FPECodec(Codec):
    """Sign and exponent entropy-coded with the tensor's own prefix code, mantissa passed through.

    ``get_codec("fpe")`` has no table of its own and codes with
    :func:`default_table` (format-level tools); :meth:`fit` returns the codec
    fitted to a tensor (what :func:`buddy.measure` does), :meth:`bind` the
    codec of a stored table (what decoding does).
    """

    name = "fpe"

    def __init__(self, table: Table | None = None, statistics: torch.Tensor | None = None):
        self._table = table
        self.statistics = statistics

    @property
    def format_version(self) -> int:  # type: ignore[override]  # a class attribute of Codec; here the table's
        """3 (the split layout), or 2 for a codec bound to a table of format 1 or 2 (the serial layout)."""
        return 2 if self._table is not None and not self._table.split else 3

    @property
    def fitted(self) -> Table | None:
        """The :class:`Table` (``None`` before :meth:`fit` or :meth:`bind`)."""
        return self._table

    @property
    def table(self) -> torch.Tensor | None:
        return None if self._table is None else self._table.to_bytes()

    @property
    def table_bytes(self) -> int:
        return 0 if self._table is None else self._table.nbytes

    def _fit(self, flat: torch.Tensor, word_bytes: int, how: Fitting) -> FPECodec:
        """The codec with a table fitted to ``flat``'s symbols (read with ``how.read``), or to ``how.prior``.

        With a ``prior``, ``keep`` (an fpe codec fitted before, e.g. for the
        same key a step earlier) lends its table while it still fits
        (:func:`fit_table`). :attr:`statistics` are the tensor's own symbol
        counts either way (``how.counts`` when given), left on its device --
        with a prior, only where ``how.count_symbols`` asks for them (else ``None``).
        """
        _split(word_bytes)  # a clear error for a word size fpe does not know
        counts = how.counts
        if how.prior is None:
            counts = symbol_counts(flat, word_bytes) if counts is None else counts
            return FPECodec(Table.from_counts((how.read or torch.Tensor.cpu)(counts), word_bytes), counts)
        if counts is None and how.count_symbols:
            counts = symbol_counts(flat, word_bytes)
        return FPECodec(fit_table(how.prior, word_bytes, self.kept_table(how.keep)), counts)

    def kept_table(self, keep: CodecLike | None) -> Table | None:
        """An fpe ``keep``'s table (``None`` for any other codec, or an unfitted one)."""
        return keep.fitted if isinstance(keep, FPECodec) else None

    def with_table(self, table: Table, statistics: torch.Tensor | None) -> FPECodec:
        if not isinstance(table, Table):
            raise TypeError(f"fpe: a table is an fpe.Table, got {type(table).__name__}")
        return FPECodec(table, statistics)

    def bind(self, table: torch.Tensor | None, word_bytes: int) -> FPECodec:
        if table is None or table.numel() == 0:
            raise CorruptDataError("fpe: a compressed fpe tensor needs its table (format version 2 and later)")
        return FPECodec(Table.from_bytes(table, word_bytes))

    def _table_for(self, word_bytes: int) -> Table:
        _split(word_bytes)  # a clear error for a word size fpe does not know
        if self._table is None:
            return default_table(word_bytes)
        if self._table.word_bytes != word_bytes:
            raise ValueError(f"this fpe table is for {self._table.word_bytes}-byte words, got {word_bytes}-byte words")
        return self._table

    def analyse(self, entries: torch.Tensor, word_bytes: int) -> Analysis:
        return _Coded(entries, word_bytes, self._table_for(word_bytes))

    def decode(self, payload, sectors, modes, word_bytes):
        n, entry_bytes = payload.shape
        words = _decode_block(payload, sectors, word_bytes, self._table_for(word_bytes))
        return words.to(_INT_DTYPE[word_bytes]).view(torch.uint8).view(n, entry_bytes)

    def __repr__(self) -> str:
        return f"<buddy codec 'fpe' {self._table!r}>" if self._table is not None else "<buddy codec 'fpe' (no table)>"
