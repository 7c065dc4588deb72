"""How fpe's split layout (table format 3) shares an entry among a warp's 32 lanes, and what the other layouts cost.

On the tensors the capture workloads save for backward (the tuning and the
check set of :mod:`experiments.decide`), each coded with the fpe table fitted
to it at E bytes a entry:

* **ratio cost of each layout** against the serial layout (table format 2):
  the split layout (codes first, tails at the end: no bit more, ``k`` the
  same by construction -- checked here on every entry), and what the
  alternatives weighed for it would add: the code section's length stored
  in the entry (``ceil(log2(8 E))`` bits), per-lane start offsets after it
  (DFloat11's way: 31 lanes x 5 bits, a code and an escaped symbol are at
  most 24 bits), and 32 interleaved sub-streams (word ``i`` in sub-stream
  ``i % 32``) each padded to 32 bits (DietGPU's way, lanes refilling in
  lockstep). The figure is the ideal ratio (original bytes / compacted
  sectors) lost, in percent.
* **work per lane** of the split layout's decoder (csrc/codec_fpe.h), run
  here step by step on a sample of coded entries: the passes over the code
  section (the estimate of its length from ``k`` can fall short), the
  rounds in which some lane decodes again from the true end of the lane
  before it, and the warp's steps -- per round the most codes any lane
  steps over, as the lanes run in lockstep -- against the ideal ``2 W / 32``
  (each code stepped over once to find the boundaries, once to write the
  word).
* **a layout weighed for one walk** (:func:`lockstep`): word ``i`` in lane
  ``i % 32``, a word a lane a round, the lanes taking their bits from one
  stream in the order they need them. A lane tops its buffer up by the bits
  its words left are sure to hold, and past them takes exactly the bits its
  code lacks: the table's codes are canonical, so a code looked up in the
  bits held with zeros past them is never longer than the true one. No bit
  is stored or padded (checked on every simulated entry; the tests decode
  the encoder's stream back from the stream alone); its work is ``W / 32``
  rounds of a word a lane and the fetch rounds they take (``top-up`` and
  ``lazy``), with no find walk. Run on the same entries as the split
  layout's decoder, the tails at the payload's end or after each code
  (``tails inline``).

    python -m experiments.lab.fpe_lanes --cache .cache/captures
    python -m experiments.lab.fpe_lanes --cache .cache/captures --sample 64 --entry-bytes 4096 512
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

import buddy
from buddy.codecs import fpe
from experiments import cli
from experiments.common import capture_all, format_table, start

__all__ = ["LANES", "simulate_entry", "lockstep", "lockstep_read", "lockstep_stream", "lockstep_payloads", "layout_bits", "fitted_entries", "main"]

LANES = 32
#: the first pass's spans cover the estimate of the code section and 1/OVERSHOOT more (csrc/codec_fpe.h)
OVERSHOOT = 32
#: bits at the start of a lane's span whose code starts it records (csrc/codec_fpe.h: `window`)
WINDOW = 32
#: bits a lane decodes before its span to fall in step (csrc/codec_fpe.h: `warmup`)
WARMUP = 128
#: no span is shorter (bits), and none longer (a lane's counts fit 16 bits)
MIN_SPAN, MAX_SPAN = 64, 0x7FFF
#: the bits a step looks at: a step from ``pos`` cuts no code at a limit ``pos + CODE_BITS`` or later
CODE_BITS = 12
#: a walk's three loops (csrc/codec_fpe.h, ``walk``): the span's first WINDOW bits, the middle, the last steps
PHASES = ("head", "mid", "tail")


def _bits(row: np.ndarray, nbits: int) -> np.ndarray:
    """A payload row's first ``nbits`` stream bits as 0/1, then 64 zero bits (reads past the payload)."""
    bits = np.unpackbits(row, bitorder="little")[:nbits]
    return np.concatenate([bits, np.zeros(64, np.uint8)])


def _steps(bits: np.ndarray, table: fpe.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per stream bit p: the bits one code starting at p takes (0: none does), whether it is ZERO, its multi row."""
    n = bits.size - MAX_PEEK
    windows = np.zeros(n, np.int64)
    for i in range(fpe.MAX_CODE_BITS):
        windows |= bits[i : i + n].astype(np.int64) << i
    _, _, dec_sym, dec_len = (t.numpy() for t in table.lookups("cpu"))
    sym, length = dec_sym[windows], dec_len[windows]
    step = length + np.where(sym == table.esc, table.symbol_bits, 0) * (length > 0)
    return step, sym == table.zero, table.multi_rows.numpy()[windows]


MAX_PEEK = 64


def _shifted(x: int, d: int) -> int:
    """``x >> d`` for ``d >= 0``, ``x << -d`` otherwise."""
    return x >> d if d >= 0 else x << -d


class _Lane:
    """One lane's decode of its span: from ``start``, every code that starts before ``limit``."""

    def __init__(self, step, zero, multi, start: int, limit: int, use_multi: bool = True):
        self.step, self.zero, self.multi, self.limit, self.use_multi = step, zero, multi, limit, use_multi
        self.start, self.n, self.tails, self.starts, self.tail_starts = start, 0, 0, 0, 0
        self.steps = 0  # steps taken in the latest round
        self.singles = 0  # of them, steps over one code alone (ESC with its symbol)
        self.phase_steps = dict.fromkeys(PHASES, 0)  # of them, in each of the walk's loops
        self.early = start + WINDOW  # the walk's first loop: before this
        self.rest = 0  # codes with tails after a step's first code (the emit walk's inner loop)
        self.end, self.invalid = self._walk(start, lambda pos: False)

    def _walk(self, pos: int, merged) -> tuple[int, bool]:
        """Steps from ``pos`` while codes start before the limit, recording them; stops where ``merged(pos)``.

        A step takes every code wholly inside the next 12 bits (:func:`multi_rows`), or one ESC with its symbol.
        """
        while pos < self.limit and not merged(pos):
            phase = "head" if pos < self.early else "mid" if pos + CODE_BITS <= self.limit else "tail"
            self.phase_steps[phase] += 1
            row = int(self.multi[pos]) if self.use_multi else 0
            if row:
                starts, tails, bits = row & 0xFFF, row >> 12 & 0xFFF, row >> 24
                room = self.limit - pos
                if room < bits:  # codes from the limit on are the next lane's
                    cut = starts & ~((1 << room) - 1)
                    bits = (cut & -cut).bit_length() - 1 if cut else bits
                    starts &= (1 << bits) - 1
                    tails &= (1 << bits) - 1
                s = bits
                count, tail_count = bin(starts).count("1"), bin(tails).count("1")
                self.rest += bin(tails & ~1).count("1")
            else:
                s = int(self.step[pos])
                if s == 0:
                    return pos, True
                self.singles += 1
                starts, tails, count, tail_count = 1, int(not self.zero[pos]), 1, int(not self.zero[pos])
            off = pos - self.start
            if off < WINDOW:
                self.starts |= _shifted(starts, -off) & ((1 << WINDOW) - 1)
                self.tail_starts |= _shifted(tails, -off) & ((1 << WINDOW) - 1)
            self.n += count
            self.tails += tail_count
            self.steps += 1
            pos += s
        return pos, False

    def resync(self, true_start: int) -> None:
        """Decodes again from ``true_start`` (the true end of the lane before) until it meets a code start
        this lane recorded -- from there on its decode is the true one -- or to its limit."""
        self.steps = 0
        self.phase_steps = dict.fromkeys(PHASES, 0)
        old = (self.start, self.starts, self.tail_starts, self.n, self.tails, self.end, self.invalid)
        self.early = max(true_start, old[0]) + WINDOW

        def merged(pos: int) -> bool:
            return 0 <= pos - old[0] < WINDOW and bool((old[1] >> (pos - old[0])) & 1)

        self.start, self.n, self.tails, self.starts, self.tail_starts = true_start, 0, 0, 0, 0
        pos, invalid = self._walk(true_start, merged)
        if invalid or not merged(pos):
            self.end, self.invalid = pos, invalid
            return
        # met the old decode at pos: the rest of it stands
        d = pos - old[0]
        self.n += old[3] - bin(old[1] & ((1 << d) - 1)).count("1")
        self.tails += old[4] - bin(old[2] & ((1 << d) - 1)).count("1")
        if pos - true_start < WINDOW:
            mask = (1 << WINDOW) - 1
            self.starts |= ((old[1] >> d) << (pos - true_start)) & mask
            self.tail_starts |= ((old[2] >> d) << (pos - true_start)) & mask
        self.end, self.invalid = old[5], old[6]


def _warm_up(step: list, multi: list, base: int, starts: list[int], use_multi: bool = True) -> dict[str, list[int]]:
    """Moves each lane's start but the first to its first code start in its span, found by a decode from
    :data:`WARMUP` bits before the span (``starts`` changes in place); returns the steps each lane took in
    each of the warm-up's two loops (csrc/codec_fpe.h, ``warm_up``): "mid", the steps that end before its
    span, and "tail", the last."""
    warm = {"mid": [0] * LANES, "tail": [0] * LANES}
    for j in range(1, LANES):
        guess = starts[j]
        pos = max(base, guess - WARMUP)
        while pos < guess:
            warm["mid" if pos + CODE_BITS <= guess else "tail"][j] += 1
            row = int(multi[pos]) if use_multi else 0
            if row:  # a step of a multi row, stopped at its first code start at or past the guess
                ahead = (row & 0xFFF) & ~((1 << (guess - pos)) - 1) if guess - pos < row >> 24 else 0
                pos += (ahead & -ahead).bit_length() - 1 if ahead else row >> 24
            elif step[pos]:
                pos += int(step[pos])
            else:  # a code the table lacks: the lane starts at the guess
                pos = guess
        starts[j] = pos
    return warm


def _resync(lanes: list[_Lane], base: int) -> tuple[int, dict[str, int]]:
    """A lane whose start is not the true end of the lane before decodes again from it, round after round,
    until none is left; returns the rounds and their steps in each of the walk's loops (:data:`PHASES`; per
    round and loop the most steps any lane took)."""
    rounds, steps = 0, dict.fromkeys(PHASES, 0)
    while True:
        ends = [base] + [lane.end for lane in lanes[:-1]]
        dead = [False] + [lane.invalid for lane in lanes[:-1]]
        redo = [i for i in range(1, LANES) if not dead[i] and ends[i] != lanes[i].start]
        if not redo:
            return rounds, steps
        rounds += 1
        for i in redo:  # in lockstep, from the ends the lanes before had at the start of the round
            lanes[i].resync(ends[i])
        for phase in PHASES:
            steps[phase] += max(lanes[i].phase_steps[phase] for i in redo)


def _emit_work(lanes: list[_Lane], step, zero, multi, *, done: int, n_words: int, use_multi: bool):
    """``(work, done)``: the emit pass's ``(steps, tails)`` of each lane with words left to emit, and the words
    emitted after it."""
    work = []
    for lane in lanes:
        if done >= n_words:
            break
        if lane.invalid and done + lane.n < n_words:
            raise RuntimeError("a valid stream decoded to a code the table lacks")
        again = _Lane(step, zero, multi, lane.start, lane.limit, use_multi)  # the emit pass's walk
        work.append((again.steps, min(lane.tails, n_words - done), again.rest))
        done += lane.n
    return work, done


def simulate_entry(payload_row: np.ndarray, k: int, n_words: int, table: fpe.Table, *, overshoot: int = OVERSHOOT,
                   use_multi: bool = True) -> dict:  # fmt: skip
    """The split layout's warp decoder on one entry (see the module doc).

    The first pass's spans cover the estimated code section and ``1 /
    overshoot`` more (0: nothing more). Returns the
    passes, the resynchronizing rounds, the warp's find steps (per round the
    most steps any lane takes) and emit work (per pass the most steps plus
    tails any lane takes from its true start; and the most steps, the most
    tails), and the estimate of ``C``. The find steps are counted per loop of
    the kernel's (the warm-up's two, the walk's three: :data:`PHASES`), a
    warp running each as long as its slowest lane: ``warm_mid``,
    ``warm_tail``, ``find_head``, ``find_mid``, ``find_tail`` and the
    ``resync_`` ones; ``warm``, ``resync`` and ``find`` (all of them) sum them.
    """
    end = 256 * k
    bits = _bits(payload_row, end)
    step, zero, multi = _steps(bits, table)
    step, zero, multi = step.tolist(), zero.tolist(), multi.tolist()
    estimate = fpe.code_section_estimate(k, n_words, table.tail_bits, table.span_model)
    base, done, passes, rounds, emit, emit_steps, emit_tails, emit_rest = 0, 0, 0, 0, 0, 0, 0, 0
    steps = singles = 0
    loops = dict.fromkeys(("warm_mid", "warm_tail", *(f"{w}_{p}" for w in ("find", "resync") for p in PHASES)), 0)
    remaining_bits = estimate + (estimate // overshoot if overshoot else 0)
    while done < n_words:
        passes += 1
        span = min(MAX_SPAN, max(MIN_SPAN, -(-remaining_bits // LANES)))
        limits = [min(base + (lane + 1) * span, end) for lane in range(LANES)]
        starts = [min(base + lane * span, end) for lane in range(LANES)]
        warm_steps = _warm_up(step, multi, base, starts, use_multi)
        lanes = [_Lane(step, zero, multi, starts[lane], limits[lane], use_multi) for lane in range(LANES)]
        for phase, counts in warm_steps.items():
            loops[f"warm_{phase}"] += max(counts)
        steps += sum(lane.steps for lane in lanes)
        singles += sum(lane.singles for lane in lanes)
        for phase in PHASES:
            loops[f"find_{phase}"] += max(lane.phase_steps[phase] for lane in lanes)
        more_rounds, round_steps = _resync(lanes, base)
        rounds += more_rounds
        for phase, n in round_steps.items():
            loops[f"resync_{phase}"] += n
        work, done = _emit_work(lanes, step, zero, multi, done=done, n_words=n_words, use_multi=use_multi)
        emit += max(a + b for a, b, _ in work)
        emit_steps += max(a for a, _, _ in work)
        emit_tails += max(b for _, b, _ in work)
        emit_rest += max(c for _, _, c in work)
        if done < n_words:
            base = lanes[-1].end
            remaining_bits = max(1, (n_words - done) * base // max(1, done))
    warm = loops["warm_mid"] + loops["warm_tail"]
    resync = sum(loops[f"resync_{phase}"] for phase in PHASES)
    find = warm + resync + sum(loops[f"find_{phase}"] for phase in PHASES)
    return {"passes": passes, "rounds": rounds, "find": find, "emit": emit, "emit_steps": emit_steps,
            "emit_tails": emit_tails, "emit_rest": emit_rest, "estimate": estimate, "single": singles / max(1, steps),
            "resync": resync, "warm": warm} | loops


# ---- a layout weighed: 32 interleaved sub-streams fetched in lockstep ----------------------------------------------
#: the lockstep layout: a lane holding fewer than LOOKAHEAD bits (and a tail's, when its tails follow its codes) tops
#: its 64-bit buffer up by as many as its words left are sure to hold, BULK at most
LOOKAHEAD, BULK = 24, 32
#: the most bits a lane's buffer holds (a field is at most 24 + 52 bits: 8-byte words take no tails inline)
HELD = 63


def lockstep(table: fpe.Table, n: int, n_words: int, fetch, *, tails: bool = False, unit: int = 0) -> dict:
    """The lockstep layout's warp decoder on ``n`` entries (word ``i`` in lane ``i % 32``). Returns each word's
    field ``(heads, lengths)`` -- its code (and escaped symbol), with ``tails`` its tail after it --, the bits
    fetched (the code section's length: ``C``, with ``tails`` ``C + N t``) and the warp's fetch rounds of each kind.

    The lanes decode a word each a round, each from a bit buffer. A lane's bits lie in one stream, in the order
    the lanes take them: in each fetch round the lanes wanting bits take them in lane order from the warp's place
    in the stream. Before each word a lane holding fewer than LOOKAHEAD bits tops up by as many as its words left
    are sure to hold (each at least the table's shortest code -- field, with ``tails`` --): BULK where they hold
    that many (the lanes in order, a ballot: a top-up round), else fewer (after them, in order: a warp scan of
    how many, a partial round). It then looks its code up in the bits it holds, those past them read as zeros.
    The table's codes are canonical, so that guess is the shortest code beginning with the bits held: when it is
    longer than the bits held it is never longer than the true code, and the lane takes exactly the bits it
    lacks (``unit``: rounded up to a multiple of it) and looks up again, until its code, escaped symbol and
    (``tails``) tail are held (a lazy round). Nothing is stored and, with ``unit`` 0, nothing padded: no lane
    takes a bit that is not its own. Without ``tails`` the tails lie as the split layout's, from the payload's
    end (a lane finds its tails' places by a ballot of the words with one).

    ``fetch(f, at)``: the ``(n, 32)`` values of ``f`` bits (fewer than HELD) from stream places ``at`` -- the
    encoder's (:func:`lockstep_stream`) gives a lane's own bits and writes them there, the decoder's reads them.
    """
    rounds = -(-n_words // LANES)
    enc_len, _, dec_sym, dec_len = (t.numpy() for t in table.lookups("cpu"))
    b, esc, zero, t = table.symbol_bits, table.esc, table.zero, table.tail_bits if tails else 0
    if tails:  # the shortest field: a code, its escaped symbol, its tail
        fields = np.where(np.arange(enc_len.size) == zero, enc_len, enc_len + t)
        fields[esc] = enc_len[esc] + b + t
        shortest = int(fields[enc_len > 0].min())
    else:  # the shortest code: canonical, the code of value 0 is one (the kernel's: codec_fpe.h, decode_lockstep)
        shortest = int(dec_len[0])
    buf, level = np.zeros((n, LANES), np.int64), np.zeros((n, LANES), np.int64)
    cursor = np.zeros(n, np.int64)
    heads, lengths = np.zeros((n, rounds * LANES), np.int64), np.zeros((n, rounds * LANES), np.int64)
    topup_rounds, partial_rounds, lazy_rounds = (np.zeros(n, np.int64) for _ in range(3))
    bad = np.zeros((n, LANES), bool)

    def take(f: np.ndarray) -> None:
        nonlocal buf, level, cursor
        at = cursor[:, None] + np.cumsum(f, 1) - f
        buf = buf | fetch(f, at) << level
        level = level + f
        cursor = cursor + f.sum(1)

    for r in range(rounds):
        words = np.arange(LANES) + r * LANES < n_words
        sure = (-(-(n_words - np.arange(LANES)) // LANES) - r) * shortest - level  # the lane's unfetched bits
        low = (level < LOOKAHEAD + t) & words & ~bad
        whole = low & (sure >= BULK) & (level + BULK <= HELD)  # BULK bits, the lanes in order (a ballot)
        topup_rounds += whole.any(1)
        take(whole * BULK)
        f = np.where(low & ~whole, np.clip(sure, 0, HELD - level), 0)  # fewer, after them (a scan)
        partial_rounds += f.any(1)
        take(f)
        while True:
            held = buf & ((1 << np.minimum(level, fpe.MAX_CODE_BITS)) - 1)
            length, sym = dec_len[held], dec_sym[held]
            bad |= (length == 0) & words  # no code begins with the bits held: a damaged stream
            known = length <= level  # the code (a guess otherwise), then its escaped symbol and tail
            need = length + known * ((sym == esc) * b + (sym != zero) * t)
            want = (need > level) & words & ~bad
            if not want.any():
                break
            f = np.where(want, need - level, 0)
            if unit:
                f = -(-f // unit) * unit
            lazy_rounds += want.any(1)
            take(f)
        need = np.where(words & ~bad, need, 0)
        heads[:, r * LANES : (r + 1) * LANES] = buf & ((1 << need) - 1)
        lengths[:, r * LANES : (r + 1) * LANES] = need
        buf, level = buf >> need, level - need
    return {"heads": heads[:, :n_words], "lengths": lengths[:, :n_words], "bits": cursor, "bad": bad.any(1),
            "topup_rounds": topup_rounds, "partial_rounds": partial_rounds, "lazy_rounds": lazy_rounds}


def lockstep_fields(analysis, tails: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(fields, their bits)``, ``(n, W)``: each word's code (and escaped symbol) of an fpe analysis (of a table of
    the split layout), with ``tails`` its tail after it -- what a lane of the lockstep layout holds of the word."""
    head, bits = analysis.head.numpy(), analysis.head_bits.numpy()
    t = analysis.tail_bits
    if not tails or t == 0:
        return head, bits
    if analysis.word_bytes == 8:
        raise ValueError("8-byte words' fields (up to 76 bits) do not fit a lane's buffer: their tails stay apart")
    at = analysis.tail_at.numpy().astype(np.int64)  # the split layout's: a word with a tail moves it down by t
    end = analysis.sectors.numpy().astype(np.int64)[:, None] * 256
    has = np.concatenate([end, at[:, :-1]], 1) - at == t
    return head | analysis.tail.numpy() << bits, bits + t * has


def _bits_at(rows: np.ndarray, f: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The ``(n, 32)`` values of ``f`` bits from places ``at`` of ``rows`` (``(n, bits)`` of 0/1; 0 past them)."""
    i = np.arange(HELD)
    idx = at[..., None] + i
    got = np.take_along_axis(rows[:, None, :], np.minimum(idx, rows.shape[1] - 1), 2)
    got = np.where((i < f[..., None]) & (idx < rows.shape[1]), got, 0).astype(np.int64)
    return (got << i).sum(-1)


def lockstep_read(stream: np.ndarray, table: fpe.Table, n_words: int, *, tails: bool = False, unit: int = 0) -> dict:
    """:func:`lockstep`, the decoder, on ``stream`` (``(n, bits)`` of 0/1, as :func:`lockstep_stream` makes them)
    alone: each fetch reads the stream's bits (zeros past them)."""
    return lockstep(table, stream.shape[0], n_words, lambda f, at: _bits_at(stream, f, at), tails=tails, unit=unit)


def lockstep_stream(analysis, table: fpe.Table, *, tails: bool = False, unit: int = 0) -> tuple[np.ndarray, dict]:
    """The lockstep layout's streams of an fpe analysis' entries: ``(n, bits)`` of 0/1, and the encoder's run of
    :func:`lockstep` (the decoder's fetches, each lane's own bits written where it takes them: its fields in word
    order, then zeros a unit may take past them)."""
    head, head_bits = lockstep_fields(analysis, tails)
    n, n_words = head_bits.shape
    rounds = -(-n_words // LANES)
    pad = np.zeros((n, rounds * LANES - n_words), np.int64)
    head = np.concatenate([head, pad], 1).reshape(n, rounds, LANES)
    head_bits = np.concatenate([head_bits, pad], 1).reshape(n, rounds, LANES)
    place = np.cumsum(head_bits, 1) - head_bits  # each word's place in its lane's own bits
    width = int(head_bits.sum(1).max(initial=0)) + HELD
    own = np.zeros((n, LANES, width), np.uint8)
    for i in range(int(head_bits.max(initial=0))):
        e, r, lane = np.nonzero(head_bits > i)
        own[e, lane, place[e, r, lane] + i] = (head[e, r, lane] >> i) & 1
    stream = np.zeros((n, width * LANES), np.uint8)
    taken = np.zeros((n, LANES), np.int64)

    def fetch(f: np.ndarray, at: np.ndarray) -> np.ndarray:
        i = np.arange(HELD)
        got = np.take_along_axis(own, np.minimum(taken[..., None] + i, width - 1), 2)
        got = np.where(i < f[..., None], got, 0)
        e, lane, j = np.nonzero(i < f[..., None])
        stream[e, at[e, lane] + j] = got[e, lane, j]
        taken[...] += f
        return (got.astype(np.int64) << i).sum(-1)

    run = lockstep(table, n, n_words, fetch, tails=tails, unit=unit)
    return stream[:, : int(run["bits"].max(initial=0))], run


def lockstep_payloads(analysis, table: fpe.Table) -> np.ndarray:
    """An fpe analysis' entries (of a table of the split layout) in the lockstep layout, ``(n, E + 32)`` bytes: the
    split layout's payload with its code section (the same ``C`` bits) replaced by the lockstep stream of the same
    codes, zeros after -- what ``buddy_fpe_lockstep_decode`` reads (``E + 32`` bytes apart)."""
    stream, run = lockstep_stream(analysis, table)
    payload = analysis.streams().numpy()
    bits = np.unpackbits(payload, axis=1, bitorder="little")
    codes = analysis.code_bits.numpy()
    if not np.array_equal(run["bits"], codes):
        raise RuntimeError("the lockstep stream is not the code section's length")
    for j, c in enumerate(codes.tolist()):
        bits[j, :c] = stream[j, :c]
    out = np.zeros((payload.shape[0], analysis.entry_bytes + 32), np.uint8)
    out[:, : payload.shape[1]] = np.packbits(bits, axis=1, bitorder="little")
    return out

def layout_bits(analysis, entry_bytes: int) -> dict[str, torch.Tensor]:
    """``(n,)`` stream bits of each layout weighed, for the entries of an fpe analysis."""
    total, heads = analysis.total_bits, analysis.head_bits
    field = math.ceil(math.log2(8 * entry_bytes))  # C, 0 .. 8 E - 1
    out = {"split": total, "split + C": total + field, "split + C + lane offsets": total + field + (LANES - 1) * 5}
    if heads.shape[1] % LANES == 0:  # word i in sub-stream i % 32, each padded to 32 bits
        per_lane = heads.view(heads.shape[0], -1, LANES).sum(1)
        out["interleaved, padded"] = total - heads.sum(1) + ((per_lane + 31) // 32 * 32).sum(1)
    return out


def _sectors(bits: torch.Tensor) -> torch.Tensor:
    return (bits + 255) // 256


def fitted_entries(t: torch.Tensor, e: int):
    """``(entries (n, E), word bytes, fpe table fitted to the tensor)``, or ``None`` for a tensor under one entry."""
    word = buddy.spec.word_bytes(t.dtype)
    flat = t.detach().reshape(-1).view(torch.uint8)
    n = flat.numel() // e
    if n == 0:
        return None
    return flat[: n * e].view(n, e), word, fpe.symbol_counts(flat, word)


def ratio_costs(tensors, e: int) -> dict:
    """Compacted sectors of every layout over ``tensors`` (and the original's); checks the split layout's k."""
    sizes: dict[str, int] = {}
    for t in tensors:
        got = fitted_entries(t, e)
        if got is None:
            continue
        entries, word, counts = got
        new = fpe.FPECodec(fpe.Table.from_counts(counts, word)).analyse(entries, word)
        old = fpe.FPECodec(fpe.Table.from_counts(counts, word, table_format=2)).analyse(entries, word)
        if not torch.equal(new.sectors, old.sectors):
            raise RuntimeError("the split layout changed an entry's k")
        raw, nonzero = e // 32, (entries != 0).any(1)
        for layout, bits in layout_bits(new, e).items():
            k = torch.where(nonzero, _sectors(bits).clamp(max=raw), 0)  # the format's zero entry and raw escape
            sizes[layout] = sizes.get(layout, 0) + int(k.sum())
        sizes["original"] = sizes.get("original", 0) + entries.shape[0] * raw
    return sizes


def _lockstep_rounds(analysis, table: fpe.Table) -> dict[str, list]:
    """The lockstep layout's fetch rounds on the entries of an analysis, its tails at the payload's end and (words
    of at most 4 bytes; else None) after each code; checks that it pads nothing."""
    out: dict[str, list] = {}
    n = analysis.head_bits.shape[0]
    for tails, name in ((False, "lockstep"), (True, "lockstep_inline")):
        if tails and analysis.word_bytes == 8:
            out |= {f"{name}_{part}": [None] * n for part in ("topup", "partial", "lazy")}
            continue
        _, run = lockstep_stream(analysis, table, tails=tails)
        if not np.array_equal(run["bits"], lockstep_fields(analysis, tails)[1].sum(1)):
            raise RuntimeError("the lockstep layout took bits that are not a lane's own")
        out |= {f"{name}_{part}": run[f"{part}_rounds"].tolist() for part in ("topup", "partial", "lazy")}
    return out


def lane_work(tensors, e: int, sample: int, g: torch.Generator, **options) -> list[dict]:
    """:func:`simulate_entry` on up to ``sample`` coded entries drawn from ``tensors`` (a few per tensor)."""
    sims = []
    order = torch.randperm(len(tensors), generator=g).tolist()
    for i in order:
        got = fitted_entries(tensors[i], e)
        if got is None:
            continue
        entries, word, counts = got
        codec = fpe.FPECodec(fpe.Table.from_counts(counts, word))
        pick = torch.randperm(entries.shape[0], generator=g)[:64]
        analysis = codec.analyse(entries[pick], word)
        assert isinstance(analysis, fpe._Coded) and codec.fitted is not None
        coded = ((analysis.sectors > 0) & (analysis.sectors < e // 32)).nonzero().view(-1)[:4]
        if coded.numel() == 0:
            continue
        payload = analysis.streams(coded)
        locked = _lockstep_rounds(codec.analyse(entries[pick][coded], word), codec.fitted)  # (those entries alone)
        for j, row in enumerate(coded.tolist()):
            sim = simulate_entry(payload[j].numpy(), int(analysis.sectors[row]), e // word, codec.fitted, **options)
            sims.append(dict(sim, codes=int(analysis.code_bits[row]), per_lane=e // word / LANES,
                             k=int(analysis.sectors[row]), **{key: v[j] for key, v in locked.items()}))
        if len(sims) >= sample:
            break
    return sims


def _lockstep_columns(sims: list[dict]) -> dict[str, float]:
    """The lockstep layout's mean fetch rounds (a warp's) over simulated entries, both tails' places."""
    out = {}
    for name, label in (("lockstep", "lockstep"), ("lockstep_inline", "lockstep, tails inline")):
        for part in ("topup", "partial", "lazy"):
            got = [s[f"{name}_{part}"] for s in sims if s[f"{name}_{part}"] is not None]
            if got:
                out[f"{label}: {'top-up' if part == 'topup' else part} rounds"] = float(statistics.mean(got))
    return out


def main(argv=None) -> dict:
    from experiments.common import DEFAULT_POINTS
    from experiments.workloads import CHECK_WORKLOADS, TUNING_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entry-bytes", type=int, nargs="+", default=[4096])
    p.add_argument("--sample", type=int, default=48, help="coded entries per workload and entry size simulated")
    p.add_argument("--overshoot", type=int, default=OVERSHOOT, help="the first pass covers 1/OVERSHOOT more (0: none)")
    p.add_argument("--no-ratio", action="store_true", help="only the decoder's work (the ratio part codes every tensor)")
    p.add_argument("--workloads", nargs="+", default=None)
    cli.add_cache_argument(p, help="captures kept here between runs (as decide's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start("lab.fpe_lanes", sys.argv[1:] if argv is None else list(argv))
    workloads = args.workloads or [*TUNING_WORKLOADS, *CHECK_WORKLOADS]
    captures = capture_all(
        workloads, size="quick", points=DEFAULT_POINTS["quick"], device="cpu", seed=args.seed, show=False,
        cache=args.cache,
    )  # fmt: skip
    g = torch.Generator().manual_seed(args.seed)
    rows, lanes_rows = [], []
    for e in args.entry_bytes:
        for name in workloads:
            tensors = [saved.tensor for cap in captures[name] for saved in cap.tensors]
            if not args.no_ratio:
                sizes = ratio_costs(tensors, e)
                row = {"E": e, "workload": name, "ideal ratio": sizes["original"] / sizes["split"]}
                for layout in ("split + C", "split + C + lane offsets", "interleaved, padded"):
                    if layout in sizes:
                        row[layout] = 100 * (1 - sizes["split"] / sizes[layout])
                rows.append(row)
            sims = lane_work(tensors, e, args.sample, g, overshoot=args.overshoot)
            if sims:
                lanes_rows.append({
                    "E": e, "workload": name, "entries": len(sims), "codes / lane": sims[0]["per_lane"],
                    "passes (mean)": statistics.mean(s["passes"] for s in sims),
                    "passes (max)": max(s["passes"] for s in sims),
                    "resync rounds (mean)": statistics.mean(s["rounds"] for s in sims),
                    "resync rounds (max)": max(s["rounds"] for s in sims),
                    "estimate / C (median)": statistics.median(s["estimate"] / s["codes"] for s in sims),
                    "find steps (mean)": statistics.mean(s["find"] for s in sims),
                    "find steps (max)": max(s["find"] for s in sims),
                    "emit work (mean)": statistics.mean(s["emit"] for s in sims),
                    "emit work (max)": max(s["emit"] for s in sims),
                    **_lockstep_columns(sims),
                })  # fmt: skip
    if rows:
        cols = [(c, c, ".3f") for c in rows[0] if c not in ("E", "workload")]
        print("\nratio lost against the split layout (percent of ideal ratio; the split layout's k is the serial one's)")
        print(format_table(rows, [("E", "E", ""), ("workload", "workload", ""), *cols]))
    if lanes_rows:
        cols = [(c, c, ".2f" if isinstance(lanes_rows[0][c], float) else "") for c in lanes_rows[0]]
        print(f"\nthe split layout's warp decoder (overshoot 1/{args.overshoot}), step by step on sampled coded entries")
        print(format_table(lanes_rows, cols))
    return {"ratio": rows, "lanes": lanes_rows}


if __name__ == "__main__":
    main()
