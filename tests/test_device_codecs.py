"""The device codecs (csrc/codec_*.h) on the host, byte for byte against the torch reference.

``tests/host/codec_host.cpp`` runs a codec's per-entry device functions with
the format rules around them (csrc/buddy_entry.h) under an emulated warp: the
very code the kernels run. For every codec with device functions, every word
size and entry sizes from 32 B to 64 KiB, it must give the reference's ``k``,
mode and payload, decode its own payloads (with garbage after their ``k``
sectors), and flag damaged metadata or payloads exactly where the reference
raises. Buffers are guarded: a read or write past an entry, or past a
payload's ``k`` sectors, crashes the harness.

What this harness is not: the kernels. It compiles the device functions
without ``__CUDA_ARCH__`` (their host branches: loads through ``memcpy``,
plain adds for atomics), loops over a tensor's entries itself where the
kernels have their block-level code (the shared-memory histogram, the count
kernel, the grid-stride loops, the staging buffers), and switches lanes at
every collective, so a shuffle acts as a memory barrier. The kernels of
``csrc/buddy_kernels.cu`` themselves, with their device branches, run under
the block emulator in tests/test_emulator.py (races, misaligned and
out-of-bounds accesses reported; docs/emulator.md); this harness remains the
quick, thorough check of the codecs' per-entry logic at every size.

The codecs with a table (fpe, auto2) code with the table fitted to the test
data (``get_codec(name).fit``), and fpe also with its default table; the
harness gets the table as the kernels do (buddy.codecs.fpe_device.device_table).

bpc has cases of its own: entries built plane by plane so that every plane
code turns up, the codec without the format rules (E = 32, where the format
stores every non-zero entry raw), hand-made hostile streams and damaged ones;
so do fpx (every choice) and fpe (tables of every shape, hand-made streams).
Last, every codec is instantiated in kernels and compiled with nvcc (and
NVRTC where libnvrtc is found) with warnings as errors.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ALL_DTYPES, DATA_KINDS, field, ids, make_data, stream_bytes

import buddy
from buddy.codecs import fpe_device
from buddy import spec
from buddy.codecs._bitstream import StreamWriter, write_fields
from buddy.codecs.bpc import geometry
from buddy.codecs.fpe import (
    MAX_CODE_BITS, FPECodec, Table, code_section_estimate, default_table, fit_weights, n_symbols, symbol_bits,
    symbol_counts,
)  # fmt: skip
from buddy.codecs.fpx import _write_streams, header_geometry

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def _defines(entry_bytes: int) -> list[str]:
    return [f"-D{k}={v}" for k, v in spec.c_defines(entry_bytes).items()]


#: codecs whose device functions the harness runs (its CODEC argument)
DEVICE_CODECS = ("zvc", "fpx", "bpc", "auto", "fpe", "auto2")
#: those that code with a table: the harness's input starts with the device table
TABLED = ("fpe", "auto2")
ENTRY_SIZES = (32, 128, 256, 512, 4096)
WORDS = (1, 2, 4, 8)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


class _Reader:
    def __init__(self, data: np.ndarray):
        self.data, self.at = data, 0

    def take(self, nbytes: int) -> torch.Tensor:
        part = self.data[self.at : self.at + nbytes]
        assert part.size == nbytes, "harness output too short"
        self.at += nbytes
        return torch.from_numpy(part.copy())

    def int32(self, n: int) -> torch.Tensor:
        return self.take(4 * n).view(torch.int32)

    def rows(self, n: int, e: int) -> torch.Tensor:
        return self.take(n * e).view(n, e)

    def done(self) -> None:
        assert self.at == self.data.size, "harness output too long"


def device_args(codec, word: int) -> tuple[str, torch.Tensor | None]:
    """``(CODEC argument, device table or None)`` of a codec name or object, for the harness.

    A codec with a table gives the one it was fitted to (else its word size's
    default table), laid out by buddy.codecs.fpe_device.device_table: what the kernels get.
    """
    codec = buddy.get_codec(codec)
    table = fpe_device.codec_table(codec, word)
    return codec.name, None if table is None else fpe_device.device_table(table)


def coded_with(codec: str, entries: torch.Tensor, word: int):
    """The codec object that codes ``entries``: fitted to them (a codec without a table: itself)."""
    return buddy.get_codec(codec).fit(entries.reshape(-1), word)


def _write_input(path: Path, table: torch.Tensor | None, *parts: np.ndarray) -> None:
    """The harness's input: the device table first for a codec with one (see codec_host.cpp)."""
    head = [] if table is None else [table.numpy()]
    np.concatenate([*head, *parts] or [np.zeros(0, np.uint8)]).tofile(path)


def run_encode(exe: Path, codec: str, entries: torch.Tensor, word: int, tmp_path: Path, table=None) -> dict:
    n, e = entries.shape
    src, dst = tmp_path / "entries.bin", tmp_path / "out.bin"
    _write_input(src, table, entries.contiguous().view(-1).numpy())
    subprocess.run([str(exe), codec, "encode", str(word), str(n), str(src), str(dst)], check=True, timeout=900)
    r = _Reader(np.fromfile(dst, dtype=np.uint8))
    out = {"k": r.int32(n), "mode": r.int32(n), "payload": r.rows(n, e), "decoded": r.rows(n, e), "err": r.int32(n)}
    r.done()
    return out


def run_decode(exe, codec, payload, sectors, modes, word, tmp_path, table=None) -> dict[str, torch.Tensor]:
    n, e = payload.shape
    src, dst = tmp_path / "payload.bin", tmp_path / "out.bin"
    blob = torch.cat([sectors.to(torch.int32).view(torch.uint8), modes.to(torch.int32).view(torch.uint8)])
    _write_input(src, table, blob.numpy(), payload.contiguous().view(-1).numpy())
    subprocess.run([str(exe), codec, "decode", str(word), str(n), str(src), str(dst)], check=True, timeout=900)
    r = _Reader(np.fromfile(dst, dtype=np.uint8))
    out = {"decoded": r.rows(n, e), "err": r.int32(n)}
    r.done()
    return out


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def run_tensor(exe: Path, codec: str, op: str, word: int, sizes: tuple[int, ...], inputs, tmp_path, table=None):
    """The kernel ``op`` (measure, pack, unpack) of ``codec`` over a whole tensor in the harness (a _Reader).

    ``sizes``: the op's integers after the word size (see tests/host/codec_host.cpp);
    ``inputs``: tensors whose bytes are concatenated as its input; ``table``: the
    device table of a codec with one.
    """
    src, dst = tmp_path / f"{op}.in", tmp_path / f"{op}.out"
    _write_input(src, table, *(_bytes(t) for t in inputs))
    cmd = [str(exe), codec, op, str(word), *(str(v) for v in sizes), str(src), str(dst)]
    subprocess.run(cmd, check=True, timeout=900)
    return _Reader(np.fromfile(dst, dtype=np.uint8))


def tensor_measure(exe, codec, data: torch.Tensor, entry_bytes: int, word: int, tmp_path, table=None):
    """``(meta, histogram)`` of a tensor's bytes by the measure kernel's per-entry work."""
    n_full, rest = divmod(data.numel(), entry_bytes)
    tail = torch.zeros(entry_bytes, dtype=torch.uint8)
    tail[:rest] = data[n_full * entry_bytes :]
    n = n_full + (rest > 0)
    r = run_tensor(exe, codec, "measure", word, (n, n_full), [data[: n_full * entry_bytes], tail], tmp_path, table)
    meta = r.take(n * spec.meta_bytes(entry_bytes))
    histogram = r.take(8 * (spec.sectors_per_entry(entry_bytes) + 1)).view(torch.int64)
    r.done()
    return meta, histogram


def tensor_ends(meta: torch.Tensor, slot: int, entry_bytes: int) -> torch.Tensor:
    """What the engine computes on the device: per entry, the overflow sectors of entries 0..i."""
    k, _ = buddy.format.decode_meta(meta, entry_bytes, meta.numel() // spec.meta_bytes(entry_bytes), check=False)
    return torch.cumsum((k - slot).clamp(min=0), 0)


def tensor_pack(exe, codec, data, meta, slot: int, entry_bytes: int, word: int, tmp_path, table=None):
    """``(slots, overflow)`` by the pack kernel's per-entry work."""
    n_full, rest = divmod(data.numel(), entry_bytes)
    tail = torch.zeros(entry_bytes, dtype=torch.uint8)
    tail[:rest] = data[n_full * entry_bytes :]
    n = n_full + (rest > 0)
    ends = tensor_ends(meta, slot, entry_bytes)
    inputs = [data[: n_full * entry_bytes], tail, meta, ends]
    r = run_tensor(exe, codec, "pack", word, (n, n_full, slot), inputs, tmp_path, table)
    slots = r.take(n * slot * spec.SECTOR_BYTES)
    overflow = r.take(int(ends[-1]) * spec.SECTOR_BYTES if n else 0)
    r.done()
    return slots, overflow


def tensor_unpack(
    exe, codec, meta, slots, overflow, slot: int, n: int, entry_bytes: int, word: int, tmp_path, table=None
):
    """``(entries (n * E bytes), error bits)`` by the unpack kernel's per-entry work."""
    ends = tensor_ends(meta, slot, entry_bytes)
    m = overflow.numel() // spec.SECTOR_BYTES
    r = run_tensor(exe, codec, "unpack", word, (n, slot, m), [meta, ends, slots, overflow], tmp_path, table)
    out = r.take(n * entry_bytes)
    error = int(r.int32(1)[0])
    r.done()
    return out, error


# ---------------------------------------------------------------------------
# the torch reference: the specification
# ---------------------------------------------------------------------------
def reference_encode(codec, entries: torch.Tensor, word: int):
    """``(k, mode, payload)`` of each entry by the torch reference under the format rules (payload zero after k sectors).

    ``codec``: a name or a codec object (a fitted one: its table)."""
    payload, k, modes = buddy.format.encode(buddy.get_codec(codec), entries, word)
    return k, modes, payload


def reference_decodes(codec: str, payload: torch.Tensor, k: torch.Tensor, mode: torch.Tensor, word: int):
    """The reference's decode of entries under the format rules, or ``None`` where it raises CorruptDataError."""
    try:
        return buddy.format.decode_entries(
            buddy.get_codec(codec), payload, k.to(torch.int32), mode.to(torch.int32), word
        )
    except buddy.CorruptDataError:
        return None


# ---------------------------------------------------------------------------
# test data
# ---------------------------------------------------------------------------
def dtype_entries(word: int, entry_bytes: int, g: torch.Generator) -> torch.Tensor:
    """Entries of every test dtype with this word size, for every data kind (last entry zero-padded)."""
    parts = []
    for dtype in ALL_DTYPES:
        if spec.word_bytes(dtype) != word:
            continue
        size = torch.empty((), dtype=dtype).element_size()
        n_entries = 24 if entry_bytes <= 256 else 6
        numel = max(1, (n_entries * entry_bytes + 5) // size)
        for kind in DATA_KINDS:
            data = make_data(kind, numel, dtype, g).view(torch.uint8).reshape(-1)
            n = -(-data.numel() // entry_bytes)
            padded = torch.zeros(n * entry_bytes, dtype=torch.uint8)
            padded[: data.numel()] = data
            parts.append(padded.view(n, entry_bytes))
    return torch.cat(parts)


def sparse_entries(word: int, entry_bytes: int, g: torch.Generator) -> torch.Tensor:
    """Entries with a spread of non-zero word counts at random places; values often hold zero bytes."""
    words = entry_bytes // word
    counts = sorted({0, 1, 2, words - 1, words, *torch.linspace(0, words, 40).long().tolist()})
    rows = []
    for count in counts:
        row = torch.zeros(words, word, dtype=torch.uint8)
        where = torch.randperm(words, generator=g)[:count]
        values = torch.randint(0, 256, (count, word), dtype=torch.uint8, generator=g)
        values[torch.rand(count, word, generator=g) < 0.5] = 0  # zero bytes inside non-zero words
        values[values.view(count, word).sum(1) == 0, torch.randint(0, word, (1,), generator=g)] = 1
        row[where] = values
        rows.append(row.view(entry_bytes))
    first, last, alternate, full = (torch.zeros(words, word, dtype=torch.uint8) for _ in range(4))
    first[0, -1] = 0x80
    last[-1, 0] = 1
    alternate[::2] = 0x5A
    full[:] = 0xFF
    rows += [t.view(entry_bytes) for t in (first, last, alternate, full)]
    return torch.stack(rows)


def float_entries(word: int, entry_bytes: int, g: torch.Generator) -> torch.Tensor:
    """Activation-like floats of this word size: narrow and wide exponent ranges, ramps, constants."""
    dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[word]
    n = 8 * entry_bytes // word
    x = torch.randn(n, generator=g, dtype=torch.float64)
    parts = [
        torch.relu(x),
        x * 1e-3,
        x * torch.exp2(torch.randint(-30, 30, (n,), generator=g).double()),
        torch.arange(n, dtype=torch.float64) / 7,
        torch.full((n,), 3.0, dtype=torch.float64),
    ]
    return torch.cat([p.to(dtype).view(torch.uint8).view(-1, entry_bytes) for p in parts])


def all_entries(word: int, entry_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat(
        [dtype_entries(word, entry_bytes, g), sparse_entries(word, entry_bytes, g), float_entries(word, entry_bytes, g)]
    )


def _assert_rows_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if torch.equal(actual, expected):
        return
    bad = (actual != expected).reshape(actual.shape[0], -1).any(1).nonzero().view(-1)
    raise AssertionError(f"{what}: {bad.numel()} of {actual.shape[0]} entries differ; first: entry {int(bad[0])}")


# ---------------------------------------------------------------------------
# byte identity
# ---------------------------------------------------------------------------
def tables_for(codec: str, entries: torch.Tensor, word: int) -> list[tuple[str, object]]:
    """``(label, codec object)`` to check: fitted to the entries; fpe also with its default table."""
    out = [("fitted" if codec in TABLED else "", coded_with(codec, entries, word))]
    return out + [("default table", buddy.get_codec("fpe"))] if codec == "fpe" else out


def check_encode(exe, codec, entries: torch.Tensor, word: int, tmp_path, what: str = "") -> torch.Tensor:
    """The harness's k, mode, payload and decode of ``entries`` == the reference's (codec: name or object); k."""
    k, mode, payload = reference_encode(codec, entries, word)
    name, table = device_args(codec, word)
    got = run_encode(exe, name, entries, word, tmp_path, table)
    _assert_rows_equal(got["k"], k, f"{what} k")
    _assert_rows_equal(got["mode"], mode, f"{what} mode")
    _assert_rows_equal(got["payload"], payload, f"{what} payload")
    _assert_rows_equal(got["decoded"], entries, f"{what} decode of its own payload")
    assert not got["err"].any(), f"{what}: decode of valid payloads flagged errors"
    return k


#: (codec, E) of the byte-identity test: auto2 composes auto and fpe, both checked at every size, so it runs up to
#: the default entry size (at 4 KiB in the tensor-kernel test)
_MATCH_CASES = [
    pytest.param(codec, e, id=f"codec={codec}-E={e}")
    for codec in DEVICE_CODECS
    for e in ENTRY_SIZES
    if codec != "auto2" or e <= spec.DEFAULT_ENTRY_BYTES
]


@pytest.mark.parametrize("word", ids("w", WORDS))
@pytest.mark.parametrize(("codec", "entry_bytes"), _MATCH_CASES)
def test_device_codec_matches_reference(host_exe, codec, entry_bytes, word, tmp_path):
    entries = all_entries(word, entry_bytes, seed=entry_bytes * 10 + word)
    for what, coded in tables_for(codec, entries, word):
        k = check_encode(host_exe(entry_bytes), coded, entries, word, tmp_path, what)
        raw = entry_bytes // spec.SECTOR_BYTES
        assert (k == 0).any() and (k == raw).any(), "the data has all-zero and incompressible entries"
        assert raw == 1 or ((k > 0) & (k < raw)).any(), "the data has coded entries (E = 32 B has none: one sector is raw)"


# (auto2 composes auto's members and fpe, both run here; its kernels compile at 64 KiB in test_cuda_core)
@pytest.mark.parametrize("codec", ids("codec", [c for c in DEVICE_CODECS if c != "auto2"]))
def test_device_codec_largest_entry(host_exe, codec, tmp_path):
    """E = 64 KiB: 12-bit k, the longest streams, hundreds of warp steps per entry."""
    e = spec.MAX_ENTRY_BYTES
    g = torch.Generator().manual_seed(7)
    for word in WORDS:
        relu = torch.relu(torch.randn(3 * e // 4, generator=g)).view(torch.uint8).view(3, e)
        rand = torch.randint(0, 256, (1, e), dtype=torch.uint8, generator=g)
        sparse = torch.zeros(2, e, dtype=torch.uint8)
        sparse[0, 12345] = 7
        sparse[1, :4000] = 3
        entries = torch.cat([relu, rand, sparse, torch.zeros(1, e, dtype=torch.uint8)])
        check_encode(host_exe(e), coded_with(codec, entries, word), entries, word, tmp_path, f"w={word}")


# ---------------------------------------------------------------------------
# damage: flagged exactly where the reference raises, never read out of bounds
# ---------------------------------------------------------------------------
def damaged_cases(codec: str, entry_bytes: int, word: int, g: torch.Generator):
    """``(coded, payload, k, mode, valid)``: the codec object (fitted to the data) and rows, the first ``valid``
    of them valid payloads, then damaged ones of every kind."""
    raw = entry_bytes // spec.SECTOR_BYTES
    entries = torch.cat([sparse_entries(word, entry_bytes, g), float_entries(word, entry_bytes, g)])
    coded = coded_with(codec, entries, word)
    k, mode, payload = reference_encode(coded, entries, word)
    rows = [(payload, k, mode)]
    picked = ((k > 0) & (k < raw)).nonzero().view(-1)[:6]
    coded_mode = mode[picked[0]] if picked.numel() else torch.tensor(0, dtype=mode.dtype)
    # k beyond the entry, and negative as int32
    rows.append((payload[:4], torch.tensor([raw + 1, 2 * raw, -1, -(1 << 31)]), mode[:4]))
    # k that disagrees with the payload (one more / one fewer sector)
    rows.append((payload[picked], torch.clamp(k[picked] + 1, max=raw - 1), mode[picked]))
    rows.append((payload[picked], torch.clamp(k[picked] - 1, min=1), mode[picked]))
    # every byte of the payload set, with small and large k
    greedy = torch.full((2, entry_bytes), 0xFF, dtype=torch.uint8)
    rows.append((greedy, torch.tensor([1, raw - 1]), coded_mode.repeat(2)))
    # random payload bytes with a coded k
    noise = torch.randint(0, 256, (8, entry_bytes), dtype=torch.uint8, generator=g)
    rows.append((noise, torch.randint(1, max(2, raw), (8,), generator=g), coded_mode.repeat(8)))
    # modes the codec never writes for such an entry
    zero, full = (k == 0).nonzero().view(-1)[:1], (k == raw).nonzero().view(-1)[:1]
    picks = torch.cat([zero, full, picked[:1]])
    rows.append((payload[picks], k[picks], torch.full((picks.numel(),), 15)))
    out = [torch.cat([r[i] for r in rows]) for i in range(3)]
    return coded, out[0], out[1].to(torch.int32), out[2].to(torch.int32), k.numel()


#: (codec, E) of the damage test: the reference decodes a codec with a table word by word (a Python loop), so
#: those run at the small sizes (fpe's own damage test adds hand-made streams and flipped bits)
_DAMAGE_CASES = [
    pytest.param(codec, e, id=f"codec={codec}-E={e}")
    for codec in DEVICE_CODECS
    for e in (32, 128, 4096)
    if codec not in TABLED or e < 4096
]


@pytest.mark.parametrize("word", ids("w", WORDS))
@pytest.mark.parametrize(("codec", "entry_bytes"), _DAMAGE_CASES)
def test_device_codec_flags_damage(host_exe, codec, entry_bytes, word, tmp_path):
    g = torch.Generator().manual_seed(99)
    coded, payload, k, modes, valid = damaged_cases(codec, entry_bytes, word, g)
    name, table = device_args(coded, word)
    got = run_decode(host_exe(entry_bytes), name, payload, k, modes, word, tmp_path, table)
    # the valid rows at once (the reference raises for a whole batch)
    expected = reference_decodes(coded, payload[:valid], k[:valid], modes[:valid], word)
    assert expected is not None and not got["err"][:valid].any(), "valid payloads flagged"
    _assert_rows_equal(got["decoded"][:valid], expected, "decode of valid payloads")
    check_damage(got, coded, payload, k, modes, word, entry_bytes, first=valid)


def check_damage(got, coded, payload, k, modes, word: int, entry_bytes: int, first: int = 0) -> int:
    """Rows ``first..``: flagged (and zeroed) exactly where the reference raises, else decoded as it does.

    Returns how many the reference rejects."""
    raw, flagged = entry_bytes // spec.SECTOR_BYTES, 0
    for i in range(first, k.numel()):
        err = int(got["err"][i])
        ki = int(k[i])
        if not 0 <= ki <= raw:  # the reference's metadata decoder rejects such k before any codec runs
            assert err & 1, f"entry {i}: k={ki} not flagged"
            assert not got["decoded"][i].any()
            flagged += 1
            continue
        expected = _reference_entry(coded, payload[i], ki, int(modes[i]), word, entry_bytes)
        if expected is None:
            flagged += 1
            assert err != 0, f"entry {i} (k={ki}, mode={int(modes[i])}): the reference raises, the device code passes"
            assert not got["decoded"][i].any(), f"entry {i}: a flagged entry decodes to zeros"
        else:
            assert err == 0, f"entry {i} (k={ki}): the device code flags {err:#x}, the reference decodes"
            assert torch.equal(got["decoded"][i], expected), f"entry {i}: decodes differently"
    return flagged


def _reference_entry(codec, payload_row, k, mode, word, entry_bytes):
    """The reference's decode of one entry (metadata rules included), or ``None`` where it raises."""
    row = payload_row.clone()
    row[k * spec.SECTOR_BYTES :] = 0  # the reference sees exactly k sectors, zero after
    got = reference_decodes(codec, row.view(1, -1), torch.tensor([k]), torch.tensor([mode]), word)
    return None if got is None else got[0]


# ---------------------------------------------------------------------------
# bpc: every plane code, the codec without the format rules, hostile streams
# ---------------------------------------------------------------------------
_BPC_CODES = ("ones", "two", "dbp0", "one")  # the 5-bit codes by bits 3-4 of their field value


def bpc_codes(row: torch.Tensor, word: int, entry_bytes: int) -> list[tuple[str, int, int]]:
    """The codes of a bpc stream as ``(kind, stream plane, run length or position)``, by the module docstring."""
    g = geometry(entry_bytes, word)
    bits = int.from_bytes(bytes(row.tolist()), "little")
    off, plane, codes = g.word_bits, 0, []
    while plane < g.planes:
        h = bits >> off
        if h & 1:
            codes.append(("raw", plane, 0))
            off, plane = off + 1 + g.deltas, plane + 1
        elif h & 2:
            n = 2 + ((h >> 2) & ((1 << g.run_bits) - 1))
            codes.append(("run", plane, n))
            off, plane = off + 2 + g.run_bits, plane + n
        elif h & 4:
            codes.append(("run", plane, 1))
            off, plane = off + 3, plane + 1
        else:
            kind = _BPC_CODES[(h >> 3) & 3]
            codes.append((kind, plane, (h >> 5) & ((1 << g.pos_bits) - 1)))
            off, plane = off + 5 + (g.pos_bits if kind in ("two", "one") else 0), plane + 1
    return codes


def bpc_plane_entries(word: int, entry_bytes: int, n: int, g: torch.Generator) -> torch.Tensor:
    """Entries built plane by plane, so that every plane code turns up.

    DBP_ws (the signs) follows from the words, but DBP_{ws-1} .. DBP_0 can be
    chosen: each DBX plane below is picked as zero (runs of every length,
    down to DBX_0), all ones, one or two set bits (first, last, straddling
    positions), "DBP = 0", or random bits; the words are the prefix sums.
    """
    geo = geometry(entry_bytes, word)
    ws, L = geo.word_bits, geo.deltas
    rows = []
    for e in range(n):
        zero_share = (0.2, 0.5, 0.8, 0.95)[e % 4]  # the longer the zero runs, the shorter the stream
        dbp = torch.zeros(ws + 1, L, dtype=torch.bool)  # dbp[ws] (the signs) stays zero here
        for j in range(ws - 1, -1, -1):
            above = dbp[j + 1]
            dbx = torch.zeros(L, dtype=torch.bool)
            r = float(torch.rand((), generator=g))
            if j < ws - 1 and r < zero_share:
                pass  # a zero DBX plane
            elif r < zero_share + 0.05:
                dbx[:] = True
            elif r < zero_share + 0.15:
                pos = int(torch.randint(0, L, (), generator=g))
                dbx[(0, L - 1, min(31, L - 1), pos)[int(torch.randint(0, 4, (), generator=g))]] = True
            elif r < zero_share + 0.25:
                pos = int(torch.randint(0, L - 1, (), generator=g))
                p = (0, L - 2, min(31, L - 2), pos)[int(torch.randint(0, 4, (), generator=g))]
                dbx[p : p + 2] = True
            elif r < zero_share + 0.35:
                dbx = above.clone()  # DBP_j = 0
            else:
                dbx = torch.rand(L, generator=g) < (0.5 if r < 0.9 else 0.1)
            dbp[j] = dbx ^ above
        shifts = torch.arange(ws, dtype=torch.int64).unsqueeze(1)
        deltas = (dbp[:ws].to(torch.int64) << shifts).sum(0)  # disjoint bits: the sum is the OR (int64 wraps)
        base = int(torch.randint(-(1 << 62), 1 << 62, (), generator=g)) if e % 3 else 0
        x = torch.cat([torch.tensor([base]), deltas]).cumsum(0).numpy().astype(np.uint64)
        as_words = {16: np.uint16, 32: np.uint32, 64: np.uint64}[ws]
        rows.append(torch.from_numpy((x & np.uint64((1 << ws) - 1)).astype(as_words).view(np.uint8).copy()))
    return torch.stack(rows)


def _bpc_coverage(payload: torch.Tensor, k: torch.Tensor, word: int, entry_bytes: int) -> set[str]:
    """What the coded streams of a batch exercise."""
    geo = geometry(entry_bytes, word)
    seen = set()
    for i in ((k > 0) & (k < entry_bytes // spec.SECTOR_BYTES)).nonzero().view(-1).tolist():
        for kind, plane, arg in bpc_codes(payload[i], word, entry_bytes):
            seen.add(kind)
            if kind == "run":
                seen.add("run1" if arg == 1 else "long run")
                if plane + arg == geo.planes:
                    seen.add("run to DBX_0")
            if (kind, arg) in (("one", geo.deltas - 1), ("two", geo.deltas - 2)):
                seen.add(f"{kind} at the end")
            if kind == "two" and arg % 32 == 31:
                seen.add("two straddling")
    return seen


@pytest.mark.parametrize("word", ids("w", WORDS))
@pytest.mark.parametrize("entry_bytes", ids("E", (128, 512, 4096)))
def test_bpc_every_plane_code(host_exe, entry_bytes, word, tmp_path):
    g = torch.Generator().manual_seed(entry_bytes + word)
    entries = bpc_plane_entries(word, entry_bytes, 48 if entry_bytes < 4096 else 16, g)
    k, mode, payload = reference_encode("bpc", entries, word)
    got = run_encode(host_exe(entry_bytes), "bpc", entries, word, tmp_path)
    _assert_rows_equal(got["k"], k, "k")
    _assert_rows_equal(got["payload"], payload, "payload")
    _assert_rows_equal(got["decoded"], entries, "decode of its own payload")
    assert not got["err"].any()
    seen = _bpc_coverage(payload, k, word, entry_bytes)
    wanted = {"raw", "ones", "dbp0", "two", "one", "run1", "long run", "run to DBX_0", "one at the end"}
    wanted |= {"two at the end"}
    if geometry(entry_bytes, word).deltas > 32:
        wanted.add("two straddling")
    assert wanted <= seen, f"not exercised: {sorted(wanted - seen)}"


@pytest.mark.parametrize("word", ids("w", WORDS))
@pytest.mark.parametrize("entry_bytes", ids("E", (32, 128)))
def test_bpc_codec_without_the_format_rules(host_exe, entry_bytes, word, tmp_path):
    """measure, encode and decode alone: k not clamped, streams as long as 2E bytes.

    At E = 32 the format stores every non-zero entry raw, so only this shows
    the codec's own choices there, e.g. raw planes beating the 5-bit codes
    when planes have 3 bits (8-byte words).
    """
    g = torch.Generator().manual_seed(3 * entry_bytes + word)
    entries = torch.cat([bpc_plane_entries(word, entry_bytes, 64, g), all_entries(word, entry_bytes, seed=word)])
    entries = entries[(entries != 0).any(1)]
    analysis = buddy.get_codec("bpc").analyse(entries, word)  # the codec alone: no format rules
    bits = analysis.plan.total_bits
    k = ((bits + 255) // 256).to(torch.int32)
    stream = write_fields(analysis.plan.values(), analysis.plan.offsets, 2 * entry_bytes)
    exe = host_exe(entry_bytes)
    src, dst = tmp_path / "entries.bin", tmp_path / "out.bin"
    entries.numpy().tofile(src)
    n, e = entries.shape
    subprocess.run([str(exe), "bpc", "stream", str(word), str(n), str(src), str(dst)], check=True, timeout=900)
    r = _Reader(np.fromfile(dst, dtype=np.uint8))
    got = {"k": r.int32(n), "mode": r.int32(n), "payload": r.rows(n, 2 * e), "decoded": r.rows(n, e), "err": r.int32(n)}
    r.done()
    _assert_rows_equal(got["k"], k, "k")
    fits = k <= 2 * entry_bytes // spec.SECTOR_BYTES
    assert fits.sum() > n // 2
    _assert_rows_equal(got["payload"][fits], stream[fits], "stream")
    _assert_rows_equal(got["decoded"][fits], entries[fits], "decode of its own stream")
    assert not got["err"].any()
    if entry_bytes == 32 and word == 8:
        raw_planes = sum(
            kind == "raw" for i in fits.nonzero().view(-1).tolist() for kind, _, _ in bpc_codes(stream[i], 8, 32)
        )
        assert raw_planes > 0, "3-bit planes: a raw plane (4 bits) is shorter than every 5-bit code"


class _BpcStream:
    """Hand-made bpc streams for one geometry, as strings of stream bits."""

    def __init__(self, entry_bytes: int, word: int):
        g = geometry(entry_bytes, word)
        self.ws, self.L, self.P, self.pb, self.rb = g.word_bits, g.deltas, g.planes, g.pos_bits, g.run_bits
        self.ones, self.dbp0 = "00000", "00001"

    def base(self, v: int = 0) -> str:
        return field(v, self.ws)

    def run(self, n: int) -> str:
        return "001" if n == 1 else "01" + field(n - 2, self.rb)

    def two(self, pos: int) -> str:
        return "00010" + field(pos, self.pb)

    def one(self, pos: int) -> str:
        return "00011" + field(pos, self.pb)

    def raw(self, plane: int) -> str:
        return "1" + field(plane, self.L)


def bpc_hostile_streams(entry_bytes: int, word: int) -> list[tuple[str, str, int, bool]]:
    """``(name, bits, k, the reference raises)`` of valid, odd and damaged streams (None: the reference decides).

    k is the stream's own sector count unless the case says otherwise; the
    bits are cut at the entry's end (a payload row) and a test puts garbage
    after k sectors.
    """
    s = _BpcStream(entry_bytes, word)
    P, L, ws = s.P, s.L, s.ws
    odd = int("10" * L, 2) & ((1 << L) - 1)
    # more than a sector, and valid: a raw sign plane of zeros, then DBX_{m-1} .. DBX_0 raw, so
    # DBP_{m-1}, DBP_{m-3}, ... are `odd`: small non-negative deltas
    m = max(1, 400 // (L + 1))
    long = s.base() + s.raw(0) + s.run(P - 1 - m) + s.raw(odd) * m
    cases = [
        ("constant words", s.base(12345) + s.run(P), 0, False),
        ("ramp", s.base(7) + s.run(P - 1) + s.ones, 0, False),
        ("all ones everywhere", s.base() + s.ones * P, 0, None),
        ("two runs in a row", s.base(1) + s.run(3) + s.run(P - 3), 0, False),
        ("runs of one plane", s.base(1) + s.run(1) * P, 0, False),
        ("the longest run field", s.base(3) + "01" + "1" * s.rb, 0, False),
        ("a short stream read on into zero bits", s.base(3) + s.run(P - 1), 0, False),
        ("raw planes", long, 0, False),
        ("raw top plane", s.base() + s.raw(odd) + s.run(P - 2) + s.raw(odd), 0, None),
        ("one at the last position", s.base() + s.one(L - 1) + s.run(P - 2) + s.one(L - 1), 0, None),
        ("two at the last positions", s.base() + s.two(L - 2) + s.run(P - 1), 0, None),
        ("dbp0 after a non-zero plane", s.base() + s.one(3) + s.dbp0 + s.run(P - 3) + s.one(3), 0, True),
        ("run past the last plane", s.base() + s.ones + s.run(P), 0, True),
        ("run past the last plane by one", s.base() + s.run(P - 1) + s.run(2), 0, True),
        ("position outside the plane", s.base() + s.one(L) + s.run(P - 1), 0, True),
        ("pair from the last position", s.base() + s.run(P - 1) + s.two(L - 1), 0, True),
        ("dbp0 on the top plane", s.base() + s.dbp0 + s.run(P - 1), 0, True),
        ("dbp0 below a zero plane", s.base() + s.run(1) + s.dbp0 + s.run(P - 2), 0, True),
        ("dbp0 below a zero DBP plane", s.base() + s.one(5) + s.one(5) + s.dbp0 + s.run(P - 3), 0, True),
        ("dbp0 on the last plane below a zero plane", s.base() + s.run(P - 2) + s.dbp0, 0, True),
        ("k one too large", s.base(7) + s.run(P - 1) + s.ones, 1, True),
        ("k one too small", long, -1, True),
        ("bit set right after the stream", s.base(12345) + s.run(P) + "1", 0, True),
        ("bit set at the end of the last sector", s.base(12345) + s.run(P) + "0" * 200 + "1", 0, None),
        ("raw planes past the sectors", s.base() + s.raw(0) * P, 1 - (ws + P * (L + 1) + 255) // 256, True),
    ]
    return [(name, bits[: 8 * entry_bytes], -(-len(bits) // 256) + dk, raises) for name, bits, dk, raises in cases]


@pytest.mark.parametrize("word", ids("w", WORDS))
@pytest.mark.parametrize("entry_bytes", ids("E", (128, 512)))
def test_bpc_hostile_streams(host_exe, entry_bytes, word, tmp_path):
    raw = entry_bytes // spec.SECTOR_BYTES
    g = torch.Generator().manual_seed(entry_bytes * word)
    names, rows, ks = [], [], []
    for name, bits, k, raises in bpc_hostile_streams(entry_bytes, word):
        row = torch.tensor(stream_bytes(bits, entry_bytes), dtype=torch.uint8)
        row[k * spec.SECTOR_BYTES :] = torch.randint(0, 256, (entry_bytes - k * spec.SECTOR_BYTES,), generator=g)
        assert 0 < k < raw, f"{name}: k = {k} is not a coded entry's"
        expected = _reference_entry("bpc", row, k, 0, word, entry_bytes)
        if raises is not None:
            assert (expected is None) == raises, f"{name}: the reference {'decodes' if raises else 'raises'}"
        names.append(name), rows.append(row), ks.append(k)
    got = run_decode(
        host_exe(entry_bytes), "bpc", torch.stack(rows), torch.tensor(ks), torch.zeros(len(ks)), word, tmp_path
    )
    for i, name in enumerate(names):
        expected = _reference_entry("bpc", rows[i], ks[i], 0, word, entry_bytes)
        err = int(got["err"][i])
        if expected is None:
            assert err == 2, f"{name}: the reference raises, the device code gives {err:#x}"
            assert not got["decoded"][i].any(), f"{name}: a flagged entry decodes to zeros"
        else:
            assert err == 0, f"{name}: the device code flags {err:#x}, the reference decodes"
            assert torch.equal(got["decoded"][i], expected), f"{name}: decodes differently"


@pytest.mark.parametrize("word", ids("w", WORDS))
@pytest.mark.parametrize("entry_bytes", ids("E", (128, 512)))
def test_bpc_damaged_streams(host_exe, entry_bytes, word, tmp_path):
    """Valid streams with a few bits flipped, or cut short: flagged exactly where the reference raises."""
    raw = entry_bytes // spec.SECTOR_BYTES
    g = torch.Generator().manual_seed(entry_bytes + 17 * word)
    entries = bpc_plane_entries(word, entry_bytes, 24, g)
    k, _, payload = reference_encode("bpc", entries, word)
    coded = ((k > 0) & (k < raw)).nonzero().view(-1)
    assert coded.numel() >= 8
    rows, ks = [], []
    for i in coded.tolist():
        nbits = int(k[i]) * 256
        for flips in (1, 1, 2, 3):
            row = payload[i].clone()
            for t in torch.randint(0, nbits, (flips,), generator=g).tolist():
                row[t // 8] ^= 1 << (t % 8)
            rows.append(row), ks.append(int(k[i]))
        rows.append(payload[i].clone()), ks.append(int(k[i]) % (raw - 1) + 1)  # k of another size
    payload_rows = torch.stack(rows)
    got = run_decode(host_exe(entry_bytes), "bpc", payload_rows, torch.tensor(ks), torch.zeros(len(ks)), word, tmp_path)
    flagged = 0
    for i in range(len(rows)):
        expected = _reference_entry("bpc", payload_rows[i], ks[i], 0, word, entry_bytes)
        err = int(got["err"][i])
        if expected is None:
            flagged += 1
            assert err == 2 and not got["decoded"][i].any(), (
                f"row {i}: the reference raises, the device code gives {err:#x}"
            )
        else:
            assert err == 0 and torch.equal(got["decoded"][i], expected), f"row {i}: decodes differently"
    assert 0 < flagged < len(rows)


# ---------------------------------------------------------------------------
# fpx: the choices, code widths and damage that the generic data may miss
# ---------------------------------------------------------------------------
FPX_ENTRY_SIZES = (128, 512, 4096)
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fpx_pack(exp: torch.Tensor, g: torch.Generator, word: int) -> torch.Tensor:
    """Entries ``(n, E)`` of words with exponent fields ``exp`` ``(n, W)`` (-1: a zero word), random sign and mantissa."""
    m = header_geometry(word).m
    mant = torch.randint(0, 1 << m, exp.shape, generator=g, dtype=torch.int64)
    mant = torch.where(exp == 0, mant | 1, mant)  # exponent 0 is a denormal, never a zero word
    sign = torch.randint(0, 2, exp.shape, generator=g, dtype=torch.int64)
    x = (exp.clamp(min=0) << m) | mant | (sign << (8 * word - 1))  # int64 wraps for word 8
    x = torch.where(exp < 0, 0, x)
    return x.to(_INT[word]).view(torch.uint8).view(exp.shape[0], -1)


def fpx_crafted_entries(word: int, entry_bytes: int, g: torch.Generator) -> torch.Tensor:
    """Entries aimed at each choice: b = 0 in both zmodes, escapes in both, b = e, NaN/inf and denormal exponents."""
    e = header_geometry(word).e
    top, n_words = (1 << e) - 1, entry_bytes // word
    rows = []

    def add(exp: torch.Tensor, zeros: float = 0.0) -> None:
        exp = exp.clone()
        exp[torch.rand(n_words, generator=g) < zeros] = -1
        rows.append(exp)

    def uniform(lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi + 1, (n_words,), generator=g)

    for zeros in (0.0, 0.6, 0.95):
        add(torch.full((n_words,), 3 * top // 4), zeros)  # one exponent: b = 0
        add(torch.zeros(n_words, dtype=torch.int64), zeros)  # denormals (exponent 0): b = 0 even with zeros
        add(uniform(1, top - 1).index_fill_(0, torch.tensor([0]), top), zeros)  # spread out: b = e
        near = top - 2 - (torch.rand(n_words, generator=g) * 3).exp2().floor().long()
        far = torch.rand(n_words, generator=g) < 0.1
        add(torch.where(far, 0, near).index_fill_(0, torch.tensor([1]), top), zeros)  # NaN/inf, escaped denormals
        add(torch.where(far, (near - top // 2).clamp(min=1), near), zeros)  # escapes with b > 0
    # activation-like: offsets below a random emax, a random spread and share of zeros per entry
    for _ in range(24):
        emax = int(torch.randint(0, top + 1, (1,), generator=g))
        spread = float(torch.rand(1, generator=g)) * e
        off = (torch.rand(n_words, generator=g) * spread).exp2().floor().long() - 1
        add((emax - off).clamp(min=0), float(torch.rand(1, generator=g)) * 0.9)
    return _fpx_pack(torch.stack(rows), g, word)


def fpx_boundary_entries(word: int, entry_bytes: int, g: torch.Generator) -> torch.Tensor:
    """Entries whose stream is one bit short of, exactly at, or one bit past a sector boundary (when the
    reference picks the choice they are built for: zmode 1 with b = 1, or b = 0)."""
    hg = header_geometry(word)
    e, m, n_words, raw = hg.e, hg.m, entry_bytes // word, entry_bytes // 32
    top = (1 << e) - 1
    rows = []
    for delta in (-1, 0, 1):
        found = 0
        for j in range(1, raw):
            target = 256 * j + delta
            # zmode 1, nnz words of exponent emax = top but `esc` of exponent 1 (escapes for b < e):
            # T = H + W + nnz (b + 1 + m) + esc e with b = 1 (shorter than b = e: esc e < (e - 1) nnz),
            # or with b = 0 when esc = 0
            for nnz in range(1, n_words + 1):
                rest = target - hg.bits - n_words - nnz * (2 + m)
                flat = target - hg.bits - n_words - nnz * (1 + m)
                if flat == 0:
                    esc, b1 = 0, False
                elif rest > 0 and rest % e == 0 and rest // e < nnz and e * (rest // e) < (e - 1) * nnz:
                    esc, b1 = rest // e, True
                else:
                    continue
                exp = torch.full((n_words,), -1, dtype=torch.int64)
                exp[:nnz] = top
                if b1:
                    exp[nnz - esc : nnz] = 1
                rows.append(exp[torch.randperm(n_words, generator=g)])
                found += 1
                break
            if found >= 2:
                break
    return _fpx_pack(torch.stack(rows), g, word) if rows else torch.zeros(0, entry_bytes, dtype=torch.uint8)


def _fpx_escapes(x: torch.Tensor, emax: torch.Tensor, b: torch.Tensor, zmode: torch.Tensor, word: int) -> torch.Tensor:
    """Per entry of words ``x`` (int64), the words that escape for the choice (emax, b, zmode), all ``(n,)``."""
    e, m = header_geometry(word).e, header_geometry(word).m
    exp = (x >> m) & ((1 << e) - 1)
    listed = (x != 0) | (zmode == 0).unsqueeze(1)
    d = emax.unsqueeze(1) - exp
    esc = listed & (b > 0).unsqueeze(1) & (d >= (1 << b).unsqueeze(1) - 1)
    return esc.sum(1)


def _fpx_bits(x: torch.Tensor, emax: torch.Tensor, b: torch.Tensor, zmode: torch.Tensor, word: int) -> torch.Tensor:
    """Per entry, the stream length T of the choice (the module docstring's formula)."""
    hg = header_geometry(word)
    n_words = x.shape[1]
    listed = torch.where(zmode == 1, (x != 0).sum(1), n_words)
    escapes = _fpx_escapes(x, emax, b, zmode, word)
    return hg.bits + zmode * n_words + listed * (b + 1 + hg.m) + escapes * hg.e


#: (word, E): (emax, zero words, words at emax - 1) of an entry whose best streams in zmode 0 and 1
#: have the same length (found by a search over such entries; none was found for fp64)
_FPX_ZMODE_TIES = {
    (1, 128): (0, 32, 0),
    (1, 512): (1, 60, 75),
    (2, 512): (1, 16, 18),
    (2, 4096): (1, 128, 144),
    (4, 4096): (1, 32, 100),
}


def fpx_tie_entries(word: int, entry_bytes: int, g: torch.Generator) -> torch.Tensor:
    """Entries with equally long streams for two choices: b = 1 and 2 (when e divides the listed
    count), zmode 0 and 1 (see _FPX_ZMODE_TIES). The reference keeps zmode 0, then the smaller b."""
    e = header_geometry(word).e
    n_words = entry_bytes // word
    shapes = [(5, 0, n_words // e), (5, n_words // 2, n_words // 2 // e)] if n_words % (2 * e) == 0 else []
    shapes += [_FPX_ZMODE_TIES[word, entry_bytes]] if (word, entry_bytes) in _FPX_ZMODE_TIES else []
    rows = []
    for emax, zeros, lower in shapes:  # b = 1 costs `lower` escapes of e bits, b = 2 one bit a listed word
        exp = torch.full((n_words,), emax, dtype=torch.int64)
        exp[zeros : zeros + lower] = emax - 1
        exp[:zeros] = -1
        rows.append(exp[torch.randperm(n_words, generator=g)])
    return _fpx_pack(torch.stack(rows), g, word) if rows else torch.zeros(0, entry_bytes, dtype=torch.uint8)


@pytest.mark.parametrize("word", ids("w", WORDS))
def test_fpx_device_reaches_every_choice(host_exe, word, tmp_path):
    """Byte identity on data that reaches every kind of choice, ties included; the coverage is checked."""
    e = header_geometry(word).e
    seen = set()
    for entry_bytes in FPX_ENTRY_SIZES:
        g = torch.Generator().manual_seed(entry_bytes + word)
        parts = [fpx_crafted_entries, fpx_boundary_entries, fpx_tie_entries]
        entries = torch.cat([part(word, entry_bytes, g) for part in parts])
        k, mode, payload = reference_encode("fpx", entries, word)
        got = run_encode(host_exe(entry_bytes), "fpx", entries, word, tmp_path)
        _assert_rows_equal(got["k"], k, f"E={entry_bytes} k")
        _assert_rows_equal(got["payload"], payload, f"E={entry_bytes} payload")
        _assert_rows_equal(got["decoded"], entries, f"E={entry_bytes} decode")
        assert not got["err"].any()
        # every choice's stream length, in the reference's order of preference (None: b = 0 impossible)
        c = buddy.get_codec("fpx").analyse(entries, word).choice
        x = entries.view(_INT[word]).to(torch.int64)
        options = [(z, b) for z in (0, 1) for b in range(e + 2)]
        bits = {}
        for z, b in options:
            zm, bs = torch.full_like(c.b, z), torch.full_like(c.b, b)
            possible = _fpx_escapes(x, c.emax, bs + 1, zm, word) == 0 if b == 0 else torch.ones_like(c.nz[:, 0])
            bits[z, b] = torch.where(possible, _fpx_bits(x, c.emax, bs, zm, word), -1)
        escapes = _fpx_escapes(x, c.emax, c.b, c.zmode, word)
        exp = (x >> header_geometry(word).m) & ((1 << e) - 1)
        for i in ((k > 0) & (k < entry_bytes // 32)).nonzero().view(-1).tolist():
            z, b, t = int(c.zmode[i]), int(c.b[i]), int(c.total_bits[i])
            assert int(bits[z, b][i]) == t, "the test's formula gives the reference's length"
            later = options[options.index((z, b)) + 1 :]
            seen.update(("tie", "zmode" if z2 != z else "b") for z2, b2 in later if int(bits[z2, b2][i]) == t)
            seen.add(("zmode", z))
            seen.add(("b", z, min(b, 1)))  # b = 0 and b > 0 in either zmode
            seen.add(("escapes", z, bool(escapes[i])))
            if b == e:
                seen.add("b = e")
            if int(c.emax[i]) == (1 << e) - 1:
                seen.add("NaN/inf exponent")
            if bool(((exp[i] == 0) & (x[i] != 0)).any()) and int(c.emax[i]) > 0:
                seen.add("denormal below emax")
            if t % 256 == 0:
                seen.add("T at a sector boundary")
    wanted = {("zmode", 0), ("zmode", 1), ("escapes", 0, True), ("escapes", 1, True), "b = e", "NaN/inf exponent"}
    wanted |= {("b", z, b) for z in (0, 1) for b in (0, 1)} | {"denormal below emax", "T at a sector boundary"}
    if word != 8:  # fp64: e = 11 divides no W, and the search found no zmode tie
        wanted |= {("tie", "b"), ("tie", "zmode")}
    assert wanted <= seen, f"not reached: {wanted - seen}"


@pytest.mark.parametrize("word", ids("w", WORDS))
def test_fpx_device_decodes_every_code_width(host_exe, word, tmp_path):
    """Streams of every (zmode, b) that fits, written by the reference's stream writer, decode to their
    entries; b = e + 1 included, valid though the encoder never picks it (b = 1 is never longer)."""
    hg = header_geometry(word)
    written = set()
    for entry_bytes in (128, 512):
        g = torch.Generator().manual_seed(3 * entry_bytes + word)
        raw = entry_bytes // 32
        entries = fpx_crafted_entries(word, entry_bytes, g)
        x = entries.view(_INT[word])
        base = buddy.get_codec("fpx").analyse(entries, word).choice
        rows, ks = [], []
        for zmode in (0, 1):
            for b in range(hg.n_b):
                zm, bs = torch.full_like(base.b, zmode), torch.full_like(base.b, b)
                total = _fpx_bits(x.to(torch.int64), base.emax, bs, zm, word)
                ok = (base.nnz > 0) & ((total + 255) // 256 < raw)
                if b == 0:  # b = 0 codes nothing: only entries whose listed words all have exponent emax
                    ok &= _fpx_escapes(x.to(torch.int64), base.emax, bs + 1, zm, word) == 0
                pick = ok.nonzero().view(-1)[:4]
                if pick.numel() == 0:
                    continue
                c = {"zmode": zm[pick], "b": bs[pick], "emax": base.emax[pick], "nz": base.nz[pick]}
                rows.append((_write_streams(x[pick], c, word), entries[pick]))
                ks.append(((total[pick] + 255) // 256).to(torch.int32))
                written.add((zmode, b))
        payload, expected = (torch.cat(t) for t in zip(*rows))
        k = torch.cat(ks)
        modes = torch.zeros_like(k)
        assert torch.equal(buddy.get_codec("fpx").decode(payload, k, modes, word), expected)
        got = run_decode(host_exe(entry_bytes), "fpx", payload, k, modes, word, tmp_path)
        assert not got["err"].any()
        _assert_rows_equal(got["decoded"], expected, f"E={entry_bytes} decode")
    # (zmode 0 with b >= e is longer than the entry: H + W (1 + e + m) > 8 E)
    assert {(0, 0), (0, 1), (1, 0), (1, hg.e + 1)} <= written, written


def _set_bits(row: torch.Tensor, pos: int, width: int, value: int) -> None:
    """Stream bits [pos, pos + width) of a payload row := value (LSB first)."""
    for t in range(width):
        byte, bit = (pos + t) // 8, (pos + t) % 8
        row[byte] = (int(row[byte]) & ~(1 << bit)) | (((value >> t) & 1) << bit)


def fpx_damaged_cases(word: int, entry_bytes: int, g: torch.Generator):
    """``(payload, k)`` rows: valid coded payloads and damaged copies of every kind the reference rejects."""
    hg = header_geometry(word)
    entries = torch.cat([fpx_crafted_entries(word, entry_bytes, g), fpx_boundary_entries(word, entry_bytes, g)])
    k, _, payload = reference_encode("fpx", entries, word)
    total = buddy.get_codec("fpx").analyse(entries, word).choice.total_bits
    coded = ((k > 0) & (k < entry_bytes // 32)).nonzero().view(-1)
    coded = coded[torch.randperm(coded.numel(), generator=g)[:10]]
    rows, ks = [], []

    def add(row: torch.Tensor, ki: int) -> None:
        rows.append(row)
        ks.append(ki)

    for i in coded.tolist():
        ki, t, emax = int(k[i]), int(total[i]), int(payload[i, 0]) >> 1 | int(payload[i, 1]) << 7
        emax &= (1 << hg.e) - 1
        add(payload[i].clone(), ki)
        for b in range(hg.e + 2, 1 << hg.b_bits):  # code widths out of range
            row = payload[i].clone()
            _set_bits(row, 1 + hg.e, hg.b_bits, b)
            add(row, ki)
        for lower in {0, emax // 2, max(emax - 1, 0)}:  # a smaller emax: codes may point below 0
            row = payload[i].clone()
            _set_bits(row, 1, hg.e, lower)
            add(row, ki)
        row = payload[i].clone()
        _set_bits(row, 0, 1, 1 - (int(row[0]) & 1))  # the other zmode
        add(row, ki)
        for after in {t, 256 * ki - 1}:  # a set bit after the stream
            if after >= t:
                row = payload[i].clone()
                _set_bits(row, after, 1, 1)
                add(row, ki)
        for pos in torch.randint(0, t, (4,), generator=g).tolist():  # one flipped bit in the stream
            row = payload[i].clone()
            row[pos // 8] ^= 1 << (pos % 8)
            add(row, ki)
    # streams consistent in every other way, written with b = e + 2 (as if that width were allowed)
    c = buddy.get_codec("fpx").analyse(entries, word).choice
    x = entries.view(_INT[word])
    ones, wide = torch.ones_like(c.b), torch.full_like(c.b, hg.e + 2)
    bits = _fpx_bits(x.to(torch.int64), c.emax, wide, ones, word)
    fits = ((c.nnz > 0) & ((bits + 255) // 256 < entry_bytes // 32)).nonzero().view(-1)[:3]
    if fits.numel():
        choice = {"zmode": ones[fits], "b": wide[fits], "emax": c.emax[fits], "nz": c.nz[fits]}
        rows += list(_write_streams(x[fits], choice, word))
        ks += ((bits[fits] + 255) // 256).tolist()
    return torch.stack(rows), torch.tensor(ks, dtype=torch.int32)


#: the reference decoder's reasons to raise, as its messages word them
_FPX_REASONS = ("code width out of range", "stream length", "bits set after", "below exponent 0")


@pytest.mark.parametrize("word", ids("w", WORDS))
def test_fpx_device_flags_damage_like_reference(host_exe, word, tmp_path):
    """Damaged fpx streams: flagged exactly where the reference raises, for each of its reasons."""
    reasons = set()
    for entry_bytes in (128, 512, 4096):
        g = torch.Generator().manual_seed(5 * entry_bytes + word)
        payload, k = fpx_damaged_cases(word, entry_bytes, g)
        modes = torch.zeros_like(k)
        got = run_decode(host_exe(entry_bytes), "fpx", payload, k, modes, word, tmp_path)
        for i in range(k.numel()):
            row = payload[i].clone()
            row[int(k[i]) * spec.SECTOR_BYTES :] = 0  # the reference sees exactly k sectors
            try:
                expected = buddy.get_codec("fpx").decode(row.view(1, -1), k[i : i + 1], modes[i : i + 1], word)[0]
            except buddy.CorruptDataError as exc:
                reasons.update(r for r in _FPX_REASONS if r in str(exc))
                assert got["err"][i] != 0, f"E={entry_bytes} row {i}: the reference raises ({exc}), the device passes"
                assert not got["decoded"][i].any(), f"E={entry_bytes} row {i}: a flagged entry decodes to zeros"
            else:
                assert got["err"][i] == 0, f"E={entry_bytes} row {i}: the device flags, the reference decodes"
                assert torch.equal(got["decoded"][i], expected), f"E={entry_bytes} row {i}: decodes differently"
    assert reasons == set(_FPX_REASONS), f"not reached: {set(_FPX_REASONS) - reasons}"


# ---------------------------------------------------------------------------
# fpe: tables of every shape, the codec without the format rules, hand-made and damaged streams
# ---------------------------------------------------------------------------
def _format1_counts(flat: torch.Tensor, word: int) -> torch.Tensor:
    """Symbol counts of table format 1 (sign and exponent): format 2's, folded."""
    counts = symbol_counts(flat, word).double()
    s1 = n_symbols(word, 1) - 2
    regular = counts[:-2].view(s1, -1).sum(1)
    return torch.cat([regular, counts[-2:]])


def fpe_tables(word: int, flat: torch.Tensor) -> dict[str, Table]:
    """Tables of every shape for data ``flat`` (uint8): with and without ZERO, codes of 1 to 12 bits, the most
    coded symbols, incomplete prefix codes (codes that do not exist), ESC alone; and of table format 1 (what
    older tensors hold: symbols of sign and exponent)."""
    s = n_symbols(word)
    zero, esc = s - 2, s - 1
    counts = symbol_counts(flat, word).double()
    present = [int(v) for v in counts[:-2].argsort(descending=True) if counts[v] > 0]
    deep = torch.zeros(s, dtype=torch.float64)
    deep[present] = torch.tensor([2.0**-i for i in range(len(present))], dtype=torch.float64)
    deep[zero] = 1.0
    every = torch.ones(s, dtype=torch.float64)  # every symbol seen: the most that get codes, ESC for the rest
    no_zero = counts.clone()
    no_zero[zero] = 0
    old = _format1_counts(flat, word)  # table format 1: the same, deep codes on the symbols present
    old_present = [int(v) for v in old[:-2].argsort(descending=True) if old[v] > 0]
    old_deep = torch.zeros_like(old)
    old_deep[old_present] = torch.tensor([2.0**-i for i in range(len(old_present))], dtype=torch.float64)
    old_deep[-2] = 1.0
    return {
        "fitted": Table.from_counts(counts, word),
        "default": default_table(word),
        "no ZERO": Table.from_counts(no_zero, word),
        "12-bit codes": Table.from_counts(deep, word),
        "most coded": Table.from_counts(every, word),
        "ZERO and ESC": Table(word, {zero: 1, esc: 1}),
        "ESC alone": Table(word, {esc: 1}),  # every word escapes: longer than raw, every entry is stored raw
        "incomplete": Table(word, {esc: 2, zero: 3, present[0]: 3, present[-1]: 4}),
        "format 1": Table.from_counts(old, word, table_format=1),
        "format 1, 12-bit codes": Table.from_counts(old_deep, word, table_format=1),
    }


def _fpe_usage(table: Table, entries: torch.Tensor, word: int) -> set[str]:
    """What coding ``entries`` with ``table`` exercises: escapes, ZERO, zero words without it, 12-bit codes."""
    b, t = table.symbol_bits, table.tail_bits
    x = entries.contiguous().view(_INT[word]).to(torch.int64)
    x = x if word == 8 else x & ((1 << (8 * word)) - 1)
    sym, zero = (x >> t) & ((1 << b) - 1), x == 0
    lengths = table.lookups("cpu")[0][sym]
    as_zero = zero & (table.zero in table.lengths)
    escaped = (lengths == 0) & ~as_zero
    seen = {"escape"} if escaped.any() else set()
    seen |= {"ZERO"} if as_zero.any() else set()
    seen |= {"zero word without ZERO"} if (zero & ~as_zero).any() else set()
    seen |= {"12-bit code"} if ((lengths == 12) & ~as_zero).any() else set()
    return seen


@pytest.mark.parametrize("word", ids("w", WORDS))
def test_fpe_device_tables(host_exe, word, tmp_path):
    """Byte identity with tables of every shape; what they exercise is checked."""
    seen = set()
    # wide words need longer entries to shrink with zero words escaped: fpe passes mantissas through
    for entry_bytes in (128 if word <= 2 else 512,):
        g = torch.Generator().manual_seed(11 * entry_bytes + word)
        entries = torch.cat([sparse_entries(word, entry_bytes, g), float_entries(word, entry_bytes, g)])
        # one binade and a few zero words: short entries even where zero words escape
        few_zeros = float_entries(word, entry_bytes, g)[-1:].repeat(4, 1).view(4, -1, word)
        few_zeros[torch.arange(4), torch.randint(0, entry_bytes // word, (4,), generator=g)] = 0
        entries = torch.cat([entries, few_zeros.view(4, entry_bytes)])
        raw = entry_bytes // spec.SECTOR_BYTES
        for name, table in fpe_tables(word, entries.reshape(-1)).items():
            k = check_encode(host_exe(entry_bytes), FPECodec(table), entries, word, tmp_path, f"E={entry_bytes} {name}")
            seen |= {(name, what) for what in _fpe_usage(table, entries[(k > 0) & (k < raw)], word)}
    wanted = {("default", "escape"), ("default", "ZERO"), ("no ZERO", "zero word without ZERO")}
    wanted |= {("12-bit codes", "12-bit code"), ("incomplete", "escape"), ("ZERO and ESC", "ZERO")}
    wanted |= {("format 1", "ZERO"), ("format 1, 12-bit codes", "12-bit code")}
    if word > 1:  # 1-byte words: the symbol that escapes (the largest byte) is not in the data
        wanted.add(("most coded", "escape"))
    assert wanted <= seen, f"not exercised: {sorted(wanted - seen)}"


@pytest.mark.parametrize("word", ids("w", WORDS))
def test_fpe_code_section_estimate_as_the_reference(host_exe, word, tmp_path):
    """The decoder's estimate of the code section (integers of 32 bits up to 16 KiB entries, of 64 above) is
    fpe.code_section_estimate's for every k, with tables of every shape."""
    g = torch.Generator().manual_seed(word)
    tables = fpe_tables(word, torch.cat([sparse_entries(word, 128, g), float_entries(word, 128, g)]).reshape(-1))
    for entry_bytes in (4096, 32768):
        for name, table in tables.items():
            src, dst = tmp_path / "table.bin", tmp_path / "estimate.bin"
            fpe_device.device_table(table).numpy().tofile(src)
            subprocess.run([str(host_exe(entry_bytes)), "fpe", "estimate", str(word), str(src), str(dst)],
                           check=True, timeout=60)  # fmt: skip
            got = np.fromfile(dst, dtype=np.uint32).tolist()
            n_words, raw = entry_bytes // word, entry_bytes // spec.SECTOR_BYTES
            want = [code_section_estimate(k, n_words, table.tail_bits, table.span_model) for k in range(1, raw + 1)]
            assert got == want, f"E={entry_bytes} {name}"


@pytest.mark.parametrize("word", ids("w", WORDS))
def test_fpe_codec_without_the_format_rules(host_exe, word, tmp_path):
    """measure, encode and decode alone: k not clamped, streams as long as 2E (at E = 32 the format stores
    every non-zero entry raw)."""
    for entry_bytes in (32, 128):
        entries = all_entries(word, entry_bytes, seed=word)
        entries = entries[(entries != 0).any(1)]
        n = entries.shape[0]
        for name, table in (("fitted", Table.from_counts(symbol_counts(entries.reshape(-1), word), word)),
                            ("default", default_table(word))):  # fmt: skip
            analysis = FPECodec(table).analyse(entries, word)  # the codec alone: no format rules
            writer = StreamWriter(n, 2 * entry_bytes, entries.device)
            writer.add(analysis.head, analysis.offsets)
            if analysis.tail_bits:
                writer.add(analysis.tail, analysis.tail_at)
            src, dst = tmp_path / "entries.bin", tmp_path / "out.bin"
            _write_input(src, fpe_device.device_table(table), entries.reshape(-1).numpy())
            cmd = [str(host_exe(entry_bytes)), "fpe", "stream", str(word), str(n), str(src), str(dst)]
            subprocess.run(cmd, check=True, timeout=900)
            r = _Reader(np.fromfile(dst, dtype=np.uint8))
            got = [r.int32(n), r.int32(n), r.rows(n, 2 * entry_bytes), r.rows(n, entry_bytes), r.int32(n)]
            r.done()
            what = f"E={entry_bytes} {name}"
            _assert_rows_equal(got[0], analysis.sectors, f"{what} k")
            fits = analysis.sectors <= 2 * entry_bytes // spec.SECTOR_BYTES
            assert fits.sum() > n // 2
            _assert_rows_equal(got[2][fits], writer.payload()[fits], f"{what} stream")
            _assert_rows_equal(got[3][fits], entries[fits], f"{what} decode of its own stream")
            assert not got[4].any()


class _FpeStream:
    """Hand-made fpe streams for one table, as strings of stream bits (codes most significant bit first)."""

    def __init__(self, table: Table):
        self.table, self.b, self.t = table, table.symbol_bits, table.tail_bits

    def code(self, sym: int) -> str:
        n = self.table.lengths[sym]
        return f"{self.table.codes[sym]:0{n}b}"

    def coded(self, sym: int, tail: int = 0) -> str:
        return self.code(sym) + field(tail, self.t)

    def zero(self) -> str:
        return self.code(self.table.zero)

    def escaped(self, sym: int, tail: int = 0) -> str:
        return self.code(self.table.esc) + field(sym, self.b) + field(tail, self.t)

    def split(self, words: list[tuple[str, int | None]], k: int | None = None) -> str:
        """The split layout of ``(code, tail or None)`` per word: the codes, zeros, the tails backwards at the
        end of ``k`` sectors (default: as few as hold them)."""
        codes = "".join(c for c, _ in words)
        tails = [field(v, self.t) for _, v in words if v is not None]
        k = -(-(len(codes) + self.t * len(tails)) // 256) if k is None else k
        gap = 256 * k - len(codes) - self.t * len(tails)
        return codes + "0" * gap + "".join(reversed(tails)) if gap >= 0 else (codes + "".join(reversed(tails)))


def _format1_table(word: int) -> Table:
    """default_table's prior in table format 1's symbols (sign and exponent)."""
    d = default_table(word)
    per = 1 << (d.symbol_bits - symbol_bits(word, 1))
    counts = torch.zeros(n_symbols(word, 1), dtype=torch.float64)
    weights = [2.0 ** -d.lengths[s] if s in d.lengths else 0.0 for s in range(d.zero)]  # uncoded: none
    counts[: d.zero // per] = torch.tensor(weights, dtype=torch.float64).view(-1, per).sum(1)
    counts[-2] = 2.0 ** -d.lengths[d.zero]
    return Table.from_counts(counts, word, table_format=1)


def fpe_hostile_streams(word: int, entry_bytes: int) -> list[tuple[str, Table, str, int, bool | None]]:
    """``(name, table, bits, k adjustment, the reference raises)`` of valid, odd and damaged streams."""
    n_words, raw = entry_bytes // word, entry_bytes // spec.SECTOR_BYTES
    d = Table(word, default_table(word).lengths, table_format=2)  # the serial layout (table format 2)
    zero, esc, m = d.zero, d.esc, d.tail_bits
    coded = next(s for s in d.order if s < zero)
    free = next(s for s in range(zero) if s not in d.lengths)  # a symbol without a code
    s = _FpeStream(d)
    first = [s.coded(coded, (1 << m) - 1), s.zero(), s.escaped(free, 5 % (1 << m)), s.coded(coded, 1 % (1 << m))]
    valid = "".join(first) + s.zero() * (n_words - 4)  # short enough for a coded entry
    one_short = valid[: -len(s.zero())]
    incomplete = Table(word, {esc: 2, zero: 3, coded: 3}, table_format=2)  # codes 00, 010, 011: none starts with 1
    t = _FpeStream(incomplete)
    old = _format1_table(word)  # what tensors written before table format 2 hold
    o = _FpeStream(old)
    o_coded = next(x for x in old.order if x < old.zero)
    o_free = next(x for x in range(old.zero) if x not in old.lengths)
    o_m = old.tail_bits
    o_valid = o.coded(o_coded, (1 << o_m) - 1) + o.zero() + o.escaped(o_free, 3 % (1 << o_m)) + o.zero() * (n_words - 3)
    zeros = t.zero() * n_words
    lacking = t.zero() * (n_words // 2) + "1" + t.zero() * (n_words - n_words // 2 - 1)
    long = s.escaped(free, (1 << m) - 1) * n_words  # longer than the entry: cut at its end
    # the split layout (table format 3, what fits make): codes first, tails backwards at the end
    d3, inc3 = default_table(word), Table(word, incomplete.lengths)
    s3, t3 = _FpeStream(d3), _FpeStream(inc3)
    top = (1 << m) - 1
    words3 = [(s3.code(coded), top), (s3.zero(), None), (s3.code(esc) + field(free, s3.b), 5 % (1 << m)),
              (s3.code(coded), 1 % (1 << m))] + [(s3.zero(), None)] * (n_words - 4)  # fmt: skip
    valid3 = s3.split(words3)
    k3 = len(valid3) // 256
    codes3 = sum(len(c) for c, _ in words3)
    between = valid3[:codes3] + "1" + valid3[codes3 + 1 :] if codes3 < len(valid3) - 2 * m else None
    known3 = [(s3.code(esc) + field(coded, s3.b), top)] + words3[1:]
    cases3 = [
        ("split: coded, zero and escaped words", d3, valid3, 0, False),
        ("split: an escape of a coded symbol", d3, s3.split(known3), 0, True),
        ("split: k one too small", d3, valid3, -1, True),
        ("split: k one too large", d3, s3.split(words3, k3 + 1), 0, True if k3 + 1 < raw else None),
        ("split: tails one place off", d3, s3.split(words3)[1:] + "0", 0, None),
        ("split: every word ZERO", inc3, t3.split([(t3.zero(), None)] * n_words), 0, False),
        ("split: a code the table lacks", inc3, t3.split([(t3.zero(), None)] * (n_words - 1) + [("1", None)]), 0, True),
        ("split: escapes only", inc3, t3.split([(t3.code(esc) + field(free, t3.b), 3 % (1 << m))] * n_words), 0, None),
    ]
    if between is not None:
        cases3.append(("split: a bit set between the codes and the tails", d3, between, 0, True))
    cases = cases3 + [
        ("coded, zero and escaped words", d, valid, 0, False),
        ("a zero word escaped (not what the encoder writes)", d, s.escaped(0) + valid[len(first[0]) :], 0, None),
        ("an escape of a coded symbol", d, s.escaped(coded) + valid[len(first[0]) :], 0, True),
        ("an escape of a coded symbol last", d, one_short + s.escaped(coded), 0, True),
        ("a short stream read on into zero bits", d, one_short, 0, None),
        ("k one too large", d, valid, 1, True),
        ("k one too small", d, valid, -1, True),
        ("bit set right after the stream", d, valid + "1", 0, True),
        ("bit set at the end of the last sector", d, valid + "0" * (-(len(valid) + 1) % 256) + "1", 0, True),
        ("a stream longer than the payload", d, long, 0, True),
        ("every word ZERO", incomplete, zeros, 0, False),
        ("a code the table lacks", incomplete, lacking, 0, True),
        ("a code the table lacks first", incomplete, "1" + zeros[1:], 0, True),
        ("escapes only", incomplete, t.escaped(free) * n_words, 0, None),
        ("format 1: coded, zero and escaped words", old, o_valid, 0, False),
        ("format 1: an escape of a coded symbol", old, o.escaped(o_coded) + o_valid[len(o.coded(o_coded)) :], 0, True),
        ("format 1: k one too small", old, o_valid, -1, True),
    ]
    out = []
    for name, table, bits, dk, raises in cases:
        k = min(-(-len(bits) // 256), raw - 1) + dk
        if 0 < k < raw:
            out.append((name, table, bits[: 8 * entry_bytes], k, raises))
    return out


@pytest.mark.parametrize("word", ids("w", WORDS))
def test_fpe_device_flags_damage_like_reference(host_exe, word, tmp_path):
    """Hand-made streams (escapes of coded symbols, codes a table lacks, wrong lengths) and valid streams
    with bits flipped: flagged exactly where the reference raises, else decoded as it does."""
    names = set()
    for entry_bytes in (128,):  # the reference decodes a row word by word: small entries keep this quick
        g = torch.Generator().manual_seed(entry_bytes + 3 * word)
        # hand-made streams, each table in a run of its own; garbage after k sectors
        by_table: dict[int, list] = {}
        for name, table, bits, k, raises in fpe_hostile_streams(word, entry_bytes):
            row = torch.tensor(stream_bytes(bits, entry_bytes), dtype=torch.uint8)
            garbage = torch.randint(0, 256, (entry_bytes - k * spec.SECTOR_BYTES,), dtype=torch.uint8, generator=g)
            row[k * spec.SECTOR_BYTES :] = garbage
            by_table.setdefault(id(table), [table, []])[1].append((name, row, k, raises))
        for table, cases in by_table.values():
            payload = torch.stack([row for _, row, _, _ in cases])
            k = torch.tensor([k for _, _, k, _ in cases], dtype=torch.int32)
            codec = FPECodec(table)
            got = run_decode(host_exe(entry_bytes), "fpe", payload, k, torch.zeros_like(k), word, tmp_path,
                             fpe_device.device_table(table))  # fmt: skip
            for i, (name, row, ki, raises) in enumerate(cases):
                if raises is not None:
                    expected = _reference_entry(codec, row, ki, 0, word, entry_bytes)
                    assert (expected is None) == raises, f"{name}: the reference {'decodes' if raises else 'raises'}"
                names.add(name)
            check_damage(got, codec, payload, k, torch.zeros_like(k), word, entry_bytes)
        # streams of the encoder with a few bits flipped (mostly in mantissas: often still valid), or read
        # with k of another size
        entries = float_entries(word, entry_bytes, g)
        codec = coded_with("fpe", entries, word)
        k, _, payload = reference_encode(codec, entries, word)
        rows, ks, raw = [], [], entry_bytes // spec.SECTOR_BYTES
        for i in ((k > 0) & (k < raw)).nonzero().view(-1)[::3].tolist()[:5]:
            for flips in (1, 1, 3):
                row = payload[i].clone()
                for t in torch.randint(0, int(k[i]) * 256, (flips,), generator=g).tolist():
                    row[t // 8] ^= 1 << (t % 8)
                rows.append(row), ks.append(int(k[i]))
            rows.append(payload[i].clone()), ks.append(int(k[i]) % (raw - 1) + 1)
        payload, k = torch.stack(rows), torch.tensor(ks, dtype=torch.int32)
        name, table = device_args(codec, word)
        got = run_decode(host_exe(entry_bytes), name, payload, k, torch.zeros_like(k), word, tmp_path, table)
        assert 0 < check_damage(got, codec, payload, k, torch.zeros_like(k), word, entry_bytes) < len(rows)
    assert len(names) >= 18, names


# ---------------------------------------------------------------------------
# fpe's table on the device: symbol counts and the fit (csrc/codec_fpe_fit.h)
# ---------------------------------------------------------------------------
def device_fit(
    exe: Path, counts: torch.Tensor, word: int, tmp_path: Path, weighted: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(device table, serialized table)`` the fit kernel's warp writes for ``counts`` (int64, ``S + 2``);
    ``weighted``: the counts are the fit's weights (``fpe.fit_weights``)."""
    src, dst = tmp_path / "fit.in", tmp_path / "fit.out"
    counts.to(torch.int64).numpy().tofile(src)
    op = "fit-weights" if weighted else "fit"
    subprocess.run([str(exe), "fpe", op, str(word), str(src), str(dst)], check=True, timeout=120)
    r = _Reader(np.fromfile(dst, dtype=np.uint8))
    table, serial = r.take(fpe_device.DEVICE_TABLE_BYTES), r.take(fpe_device.FIT_SERIAL_BYTES)
    r.done()
    return table, serial


def _unlimited_depth(counts: torch.Tensor, word: int) -> int:
    """The longest Huffman code of the reference's weights for ``counts`` before any halving."""
    from buddy.codecs import fpe as fpe_module

    table = Table.from_counts(counts, word)
    total = float(counts.sum())
    c = [max(1, round(v * (1 << 30) / total)) if v > 0 else 0 for v in counts.double().tolist()]
    regular = sorted((s for s in range(len(c) - 2) if c[s]), key=lambda s: (-c[s], s))
    weights = {s: c[s] for s in regular[: fpe_module.MAX_CODED]}
    weights |= {table.zero: c[table.zero]} if c[table.zero] else {}
    weights[table.esc] = max(1, sum(c[s] for s in regular[fpe_module.MAX_CODED :]))
    saved = fpe_module.MAX_CODE_BITS
    fpe_module.MAX_CODE_BITS = 64
    try:
        return max(fpe_module._huffman_lengths(weights).values())
    finally:
        fpe_module.MAX_CODE_BITS = saved


def fit_cases(word: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Symbol counts of every shape a fit meets, by name."""
    s = n_symbols(word)
    zero, esc = s - 2, s - 1

    def counts(pairs) -> torch.Tensor:
        c = torch.zeros(s, dtype=torch.int64)
        for sym, n in pairs:
            c[sym] = n
        return c

    cases = {
        "nothing": torch.zeros(s, dtype=torch.int64),
        "one symbol": counts([(s // 3, 7)]),
        "zero words only": counts([(zero, 1000)]),
        "an ESC count (only in the total)": counts([(1, 5), (2, 9), (esc, 100)]),
        "every symbol once": torch.ones(s, dtype=torch.int64).index_fill_(0, torch.tensor([esc]), 0),
        "ties": counts([(sym, 64) for sym in range(0, zero, 3)] + [(zero, 64)]),
        "huge counts": counts([(sym, (1 << 40) + sym) for sym in range(0, zero, 5)]),
        "halves": counts([(i, 1 << (40 - i)) for i in range(min(zero, 40))]),  # needs halving rounds
        # scale 1/2: 5 -> 2.5, rounded to even (2), not up (3), which would tie it with 6 -> 3 and change the code
        "rounded halves": counts([(9, 5), (1, 6), (3, (1 << 31) - 11)]),
    }
    for i in range(6):
        c = torch.zeros(s, dtype=torch.int64)
        present = torch.randperm(zero, generator=g)[: int(torch.randint(1, zero + 1, (1,), generator=g))]
        c[present] = (2.0 ** (torch.rand(present.numel(), generator=g, dtype=torch.float64) * 34)).long()
        c[zero] = int(torch.randint(0, 1 << 24, (1,), generator=g)) * (i % 2)
        cases[f"random {i}"] = c
    if word > 1:
        cases["more than MAX_CODED symbols"] = counts([(sym, 1 + (sym * 7919) % 5000) for sym in range(zero)])
    for kind in DATA_KINDS:  # the statistics of real-looking tensors
        dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[word]
        cases[f"data {kind}"] = symbol_counts(make_data(kind, 30_001, dtype, g).reshape(-1).view(torch.uint8), word)
    return cases


@pytest.mark.parametrize("word", ids("w", WORDS))
def test_fpe_table_fitted_on_the_device(host_exe, word, tmp_path):
    """The fit kernel's table is Table.from_counts's, byte for byte: the device table and the serialized one."""
    g = torch.Generator().manual_seed(3 + word)
    exe, halved = host_exe(512), []
    for name, counts in fit_cases(word, g).items():
        want = Table.from_counts(counts, word)
        table, serial = device_fit(exe, counts, word, tmp_path)
        expected = want.to_bytes()
        assert torch.equal(serial[: expected.numel()], expected), f"{name}: serialized table"
        assert not serial[expected.numel() :].any(), f"{name}: bytes after the serialized table"
        assert torch.equal(table, fpe_device.device_table(want)), f"{name}: device table"
        assert Table.from_bytes(serial[: expected.numel()], word) == want
        if _unlimited_depth(counts, word) > MAX_CODE_BITS:
            halved.append(name)
    assert "halves" in halved and len(halved) >= 2, f"cases that needed halving rounds: {halved}"


@pytest.mark.parametrize("word", ids("w", WORDS))
def test_fpe_table_fitted_to_a_prior_on_the_device(host_exe, word, tmp_path):
    """Given fpe.fit_weights of a prior -- frequencies, as a tracker learns them, or counts --, the fit kernel
    writes Table.from_counts's table of the prior itself, byte for byte."""
    g = torch.Generator().manual_seed(11 + word)
    exe = host_exe(512)
    priors = {name: counts.double() / max(1, int(counts.sum())) for name, counts in fit_cases(word, g).items()}
    s = n_symbols(word)
    priors["tiny frequencies"] = torch.exp(-40 * torch.rand(s, generator=g, dtype=torch.float64))
    priors["sparse powers"] = torch.rand(s, generator=g, dtype=torch.float64) ** 8 * (torch.rand(s, generator=g) < 0.3)
    priors["counts, not frequencies"] = fit_cases(word, g)["random 0"]
    for name, prior in priors.items():
        want = Table.from_counts(prior, word)
        weights = fit_weights(prior, word)
        table, serial = device_fit(exe, weights, word, tmp_path, weighted=True)
        expected = want.to_bytes()
        assert torch.equal(serial[: expected.numel()], expected), f"{name}: serialized table"
        assert not serial[expected.numel() :].any(), f"{name}: bytes after the serialized table"
        assert torch.equal(table, fpe_device.device_table(want)), f"{name}: device table"
    # weights taken as they are, not scaled: Fibonacci weights of a small total halve into a table of their own
    weights = torch.zeros(s, dtype=torch.int64)
    a, b = 1, 1
    for i in range(24):
        weights[3 * i], (a, b) = a, (b, a + b)
    total = weights.clone()
    total[s - 1] = (1 << 30) - int(weights.sum())  # ESC's count: a total of 2**30, so the scale is 1
    want = Table.from_counts(total, word)
    assert want != Table.from_counts(weights, word)  # (scaled, they would fit another table)
    table, serial = device_fit(exe, weights, word, tmp_path, weighted=True)
    assert torch.equal(serial[: want.nbytes], want.to_bytes()) and torch.equal(table, fpe_device.device_table(want))


@pytest.mark.parametrize("word", ids("w", WORDS))
@pytest.mark.parametrize("entry_bytes", ids("E", (32, 512)))
def test_fpe_symbols_counted_on_the_device(host_exe, entry_bytes, word, tmp_path):
    """The count kernel's per-unit work gives fpe.symbol_counts of the tensor's whole words, on awkward sizes."""
    g = torch.Generator().manual_seed(entry_bytes + word)
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[word]
    for kind in DATA_KINDS:
        for numel in (1, 7, entry_bytes // word, 3_001):
            flat = make_data(kind, numel, dtype, g).reshape(-1).view(torch.uint8)
            flat = torch.cat([flat, torch.randint(0, 256, (word - 1,), dtype=torch.uint8, generator=g)])  # a part word
            n_full, rest = divmod(flat.numel(), entry_bytes)
            tail = torch.zeros(entry_bytes, dtype=torch.uint8)
            tail[:rest] = flat[n_full * entry_bytes :]
            sizes = (n_full * entry_bytes // 8, rest // word)
            r = run_tensor(host_exe(entry_bytes), "fpe", "count", word, sizes, [flat[: n_full * entry_bytes], tail], tmp_path)
            got = r.take(8 * n_symbols(word)).view(torch.int64)
            r.done()
            assert torch.equal(got, symbol_counts(flat, word)), f"{kind}, {numel} words"


# ---------------------------------------------------------------------------
# the device codecs instantiated for the GPU (tests/test_csrc.py compiles each
# header alone, where templates are never instantiated)
# ---------------------------------------------------------------------------
_CODEC_CLASSES = {
    "zvc": "BuddyZvc", "fpx": "BuddyFpx", "bpc": "BuddyBpc", "auto": "BuddyAuto",
    "fpe": "BuddyFpe", "auto2": "BuddyAuto2",
}  # fmt: skip

_INSTANTIATION = r"""
#include "buddy_entry.h"
{includes}
template <class Codec>
__device__ __forceinline__ void round_trip(const uint8_t* table, const uint8_t* entry, uint8_t* payload, uint8_t* out,
                                           int* result) {{
  const BuddyCudaWarp warp;
  const Codec codec = buddy_codec<Codec>(table);
  uint32_t mode;
  const uint32_t k = buddy_entry_measure<Codec>(warp, codec, entry, &mode);
  buddy_entry_encode<Codec>(warp, codec, entry, k, mode, payload);
  const uint32_t err = buddy_entry_decode<Codec>(warp, codec, payload, k, mode, out);
  if (warp.lane() == 0) *result = (int)(k | err << 16);
}}
{kernels}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize(("arch", "entry_bytes"), [("sm_90", 32), ("sm_80", spec.MAX_ENTRY_BYTES)])
def test_device_codecs_compile_for_the_gpu(tmp_path, arch, entry_bytes):
    """Every codec and word size instantiated in a kernel: no warning with -Werror all-warnings.

    (At the default entry size, for sm_80 and sm_90, test_cuda_core compiles every codec's kernels.)
    """
    unit = tmp_path / "codecs.cu"
    unit.write_text(_instantiation_unit())
    cmd = ["nvcc", f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings", f"-I{CSRC}", *_defines(entry_bytes)]
    subprocess.run([*cmd, "-ptx", str(unit), "-o", str(tmp_path / "codecs.ptx")], check=True)


def _instantiation_unit() -> str:
    """The instantiation above with the local headers inlined, as NVRTC takes it (one string)."""
    kernels = "\n".join(
        f'extern "C" __global__ void {c}_{w}(const uint8_t* t, const uint8_t* e, uint8_t* p, uint8_t* o, int* r) '
        f"{{ round_trip<{_CODEC_CLASSES[c]}<{w}>>(t, e, p, o, r); }}"
        for c in DEVICE_CODECS
        for w in WORDS
    )
    includes = "\n".join(f'#include "codec_{c}.h"' for c in DEVICE_CODECS)
    seen: set[str] = set()

    def expand(text: str) -> str:
        def include(match: re.Match) -> str:
            header = match.group(1)
            if header in seen:
                return ""
            seen.add(header)
            return expand((CSRC / header).read_text().replace("#pragma once", ""))

        return re.sub(r'#include "([^"]+)"', include, text)

    return expand(_INSTANTIATION.format(includes=includes, kernels=kernels))


def test_device_codecs_compile_with_nvrtc():
    """NVRTC (what CuPy uses) takes every codec and word size: no host-only function, no standard header."""
    from test_cuda_core import _find_nvrtc

    path = _find_nvrtc()
    if path is None:
        pytest.skip("needs libnvrtc (pip install nvidia-cuda-nvrtc, or set BUDDY_TEST_NVRTC)")
    here = Path(path).parent if "/" in path else None
    for builtins in sorted(here.glob("libnvrtc-builtins.so*")) if here else []:
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            break
    nvrtc = ctypes.CDLL(path)
    source = _instantiation_unit().encode()
    for entry_bytes in (32, spec.DEFAULT_ENTRY_BYTES, spec.MAX_ENTRY_BYTES):
        prog = ctypes.c_void_p()
        assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"codecs.cu", 0, None, None) == 0
        options = [o.encode() for o in ("-std=c++17", *_defines(entry_bytes), "-arch=compute_80")]
        result = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        assert result == 0, f"NVRTC failed for E={entry_bytes}:\n{log.value.decode(errors='replace')}"


# ---------------------------------------------------------------------------
# the kernels over whole tensors: measure, pack, unpack (csrc/buddy_ops.h)
# ---------------------------------------------------------------------------
TENSOR_CASES = [
    pytest.param(torch.float32, 512, id="dtype=f32-E=512"),
    pytest.param(torch.bfloat16, 512, id="dtype=bf16-E=512"),
    pytest.param(torch.float16, 256, id="dtype=f16-E=256"),
    pytest.param(torch.uint8, 128, id="dtype=u8-E=128"),
    pytest.param(torch.float64, 4096, id="dtype=f64-E=4096"),
    pytest.param(torch.int32, 32, id="dtype=i32-E=32"),
]


def _mixed_tensor(dtype: torch.dtype, entry_bytes: int, g: torch.Generator) -> torch.Tensor:
    """Seven entries and a bit of every kind of data, so the last entry is partial."""
    size = torch.empty((), dtype=dtype).element_size()
    per = entry_bytes // size
    parts = [make_data(kind, 2 * per, dtype, g) for kind in ("relu", "zeros", "special", "random_bytes")]
    return torch.cat(parts)[: 7 * per + max(1, per // 3)]


@pytest.mark.parametrize("codec", ids("codec", DEVICE_CODECS))
@pytest.mark.parametrize(("dtype", "entry_bytes"), TENSOR_CASES)
def test_tensor_kernels_write_the_reference_buffers(host_exe, codec, dtype, entry_bytes, tmp_path, store):
    """measure -> metadata and histogram, pack -> slots and compacted overflow, unpack -> the tensor: all as the reference."""
    t = _mixed_tensor(dtype, entry_bytes, torch.Generator().manual_seed(entry_bytes))
    data = t.view(torch.uint8)
    word = spec.word_bytes(dtype)
    exe = host_exe(entry_bytes)
    _, table = device_args(coded_with(codec, data, word), word)  # the table compress fits (and stores)
    meta, histogram = tensor_measure(exe, codec, data, entry_bytes, word, tmp_path, table)
    spe = spec.sectors_per_entry(entry_bytes)
    for slot in sorted({0, 1, spe // 2, spe}):
        ref = buddy.compress(t, spec.ratio_for_slot(slot, entry_bytes), codec, entry_bytes=entry_bytes, store=store)
        if ref.table is not None:
            assert torch.equal(device_args(buddy.get_codec(codec).bind(ref.table, word), word)[1], table)
        ref_meta, ref_slots, ref_overflow = ref.buffers()
        assert torch.equal(meta, ref_meta), "metadata"
        assert tuple(histogram.tolist()) == ref.histogram
        slots, overflow = tensor_pack(exe, codec, data, meta, slot, entry_bytes, word, tmp_path, table)
        assert torch.equal(slots, ref_slots), f"slots (slot {slot})"
        assert torch.equal(overflow, ref_overflow), f"overflow (slot {slot})"
        out, error = tensor_unpack(
            exe, codec, meta, slots, overflow, slot, ref.n_entries, entry_bytes, word, tmp_path, table
        )
        assert error == 0
        assert torch.equal(out[: data.numel()], data)
        ref.free()


@pytest.mark.parametrize("codec", ids("codec", ("zvc", "auto", "fpe", "auto2")))
def test_tensor_unpack_flags_inconsistent_buffers(host_exe, codec, tmp_path):
    """Damaged metadata, an overflow too short or too long: flagged, never read out of bounds (guarded buffers)."""
    e, word = 512, 4
    t = make_data("relu", 7 * 128 + 5, torch.float32, torch.Generator().manual_seed(1)).view(torch.uint8)
    exe = host_exe(e)
    _, table = device_args(coded_with(codec, t, word), word)
    meta, _ = tensor_measure(exe, codec, t, e, word, tmp_path, table)
    slot = 4
    slots, overflow = tensor_pack(exe, codec, t, meta, slot, e, word, tmp_path, table)
    n = meta.numel() // 2
    assert overflow.numel() >= 2 * spec.SECTOR_BYTES, "the data must overflow"

    def unpack(m=meta, s=slots, o=overflow):
        return tensor_unpack(exe, codec, m, s, o, slot, n, e, word, tmp_path, table)

    assert unpack()[1] == 0
    too_large = meta.clone()
    too_large[1] |= 0x0F  # k = 3855 (bits 0-11: 0x0F0F...): beyond 16 sectors
    out, error = unpack(m=too_large)
    assert error & 1 and not out[e : 2 * e].any()
    assert unpack(o=overflow[: -spec.SECTOR_BYTES])[1] & 16, "an overflow one sector short"
    assert unpack(o=torch.cat([overflow, torch.zeros(spec.SECTOR_BYTES, dtype=torch.uint8)]))[1] & 16, "one too long"
    assert unpack(o=overflow[:0])[1] & 16, "no overflow at all"
    coded = (meta.view(torch.int16) & 0xFFF).to(torch.int32)
    i = int(((coded > 0) & (coded < 16)).nonzero()[0])
    damaged = slots.clone()
    # its bitmap or header; fpe's all-ones code can be a valid escape (of NaN words), its all-zero one ZERO (too short)
    damaged[i * slot * spec.SECTOR_BYTES : (i + 1) * slot * spec.SECTOR_BYTES] = 0 if codec in TABLED else 0xFF
    assert unpack(s=damaged)[1] & 2, "a payload that disagrees with its k"
