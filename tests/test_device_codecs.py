"""The device codecs (csrc/codec_*.h) on the host, byte for byte against the torch reference.

``tests/host/codec_host.cpp`` runs a codec's per-entry device functions with
the format rules around them (csrc/buddy_entry.h) under an emulated warp: the
very code the kernels run. For every codec with device functions, every word
size and entry sizes from 32 B to 64 KiB, it must give the reference's ``k``,
mode and payload, decode its own payloads (with garbage after their ``k``
sectors), and flag damaged metadata or payloads exactly where the reference
raises. Buffers are guarded: a read or write past an entry, or past a
payload's ``k`` sectors, crashes the harness.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ALL_DTYPES, DATA_KINDS, ids, make_data

import buddy
from buddy import spec
from buddy.codecs.fpx import Analysis, _write_streams, header_geometry

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
HOST_SOURCE = Path(__file__).resolve().parent / "host" / "codec_host.cpp"
#: codecs whose device functions the harness runs (its CODEC argument)
DEVICE_CODECS = ("zvc", "fpx")
ENTRY_SIZES = (32, 128, 256, 512, 4096)
WORDS = (1, 2, 4, 8)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _defines(entry_bytes: int) -> list[str]:
    return [f"-D{k}={v}" for k, v in spec.c_defines(entry_bytes).items()]


@pytest.fixture(scope="module")
def host_exe(tmp_path_factory):
    """``host_exe(E)``: the harness built for entry size E (once per module)."""
    built: dict[int, Path] = {}
    folder = tmp_path_factory.mktemp("codec_host")

    def get(entry_bytes: int) -> Path:
        if entry_bytes not in built:
            exe = folder / f"codec_host_{entry_bytes}"
            base = ["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}", *_defines(entry_bytes)]
            # undefined behaviour (bad shifts, overflows) aborts when the sanitizer is available
            sanitized = subprocess.run(
                [*base, "-fsanitize=undefined", "-fno-sanitize-recover=undefined", str(HOST_SOURCE), "-o", str(exe)],
                capture_output=True,
                text=True,
            )
            if sanitized.returncode != 0:
                subprocess.run([*base, str(HOST_SOURCE), "-o", str(exe)], check=True)
            built[entry_bytes] = exe
        return built[entry_bytes]

    return get


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


def run_encode(exe: Path, codec: str, entries: torch.Tensor, word: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    n, e = entries.shape
    src, dst = tmp_path / "entries.bin", tmp_path / "out.bin"
    entries.contiguous().numpy().tofile(src)
    subprocess.run([str(exe), codec, "encode", str(word), str(n), str(src), str(dst)], check=True, timeout=900)
    r = _Reader(np.fromfile(dst, dtype=np.uint8))
    out = {"k": r.int32(n), "mode": r.int32(n), "payload": r.rows(n, e), "decoded": r.rows(n, e), "err": r.int32(n)}
    r.done()
    return out


def run_decode(exe, codec, payload, sectors, modes, word, tmp_path) -> dict[str, torch.Tensor]:
    n, e = payload.shape
    src, dst = tmp_path / "payload.bin", tmp_path / "out.bin"
    blob = torch.cat([sectors.to(torch.int32).view(torch.uint8), modes.to(torch.int32).view(torch.uint8)])
    np.concatenate([blob.numpy(), payload.contiguous().view(-1).numpy()]).tofile(src)
    subprocess.run([str(exe), codec, "decode", str(word), str(n), str(src), str(dst)], check=True, timeout=900)
    r = _Reader(np.fromfile(dst, dtype=np.uint8))
    out = {"decoded": r.rows(n, e), "err": r.int32(n)}
    r.done()
    return out


# ---------------------------------------------------------------------------
# the torch reference: the specification
# ---------------------------------------------------------------------------
def reference_encode(codec: str, entries: torch.Tensor, word: int):
    """``(k, mode, payload)`` of each entry by the torch reference (payload zero after k sectors)."""
    enc = buddy.get_codec(codec).encode(entries, word)
    return enc.sectors.to(torch.int32), enc.modes.to(torch.int32), enc.payload


def reference_decodes(codec: str, payload: torch.Tensor, k: torch.Tensor, mode: torch.Tensor, word: int):
    """The reference's decode of one entry, or ``None`` where it raises CorruptDataError."""
    try:
        return buddy.get_codec(codec).decode(payload, k, mode, word)
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
@pytest.mark.parametrize("word", ids("w", WORDS))
@pytest.mark.parametrize("entry_bytes", ids("E", ENTRY_SIZES))
@pytest.mark.parametrize("codec", ids("codec", DEVICE_CODECS))
def test_device_codec_matches_reference(host_exe, codec, entry_bytes, word, tmp_path):
    entries = all_entries(word, entry_bytes, seed=entry_bytes * 10 + word)
    k, mode, payload = reference_encode(codec, entries, word)
    got = run_encode(host_exe(entry_bytes), codec, entries, word, tmp_path)
    _assert_rows_equal(got["k"], k, "k")
    _assert_rows_equal(got["mode"], mode, "mode")
    _assert_rows_equal(got["payload"], payload, "payload")
    _assert_rows_equal(got["decoded"], entries, "decode of its own payload")
    assert not got["err"].any(), "decode of valid payloads flagged errors"
    raw = entry_bytes // spec.SECTOR_BYTES
    assert (k == 0).any() and (k == raw).any(), "the data has all-zero and incompressible entries"
    assert raw == 1 or ((k > 0) & (k < raw)).any(), "the data has coded entries (E = 32 B has none: one sector is raw)"


@pytest.mark.parametrize("codec", ids("codec", DEVICE_CODECS))
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
        k, mode, payload = reference_encode(codec, entries, word)
        got = run_encode(host_exe(e), codec, entries, word, tmp_path)
        _assert_rows_equal(got["k"], k, f"w={word} k")
        _assert_rows_equal(got["mode"], mode, f"w={word} mode")
        _assert_rows_equal(got["payload"], payload, f"w={word} payload")
        _assert_rows_equal(got["decoded"], entries, f"w={word} decode")


# ---------------------------------------------------------------------------
# damage: flagged exactly where the reference raises, never read out of bounds
# ---------------------------------------------------------------------------
def damaged_cases(codec: str, entry_bytes: int, word: int, g: torch.Generator):
    """``(payload, k, mode)`` rows: valid ones, and damaged ones of every kind."""
    raw = entry_bytes // spec.SECTOR_BYTES
    entries = torch.cat([sparse_entries(word, entry_bytes, g), float_entries(word, entry_bytes, g)])
    k, mode, payload = reference_encode(codec, entries, word)
    rows = [(payload, k, mode)]
    coded = ((k > 0) & (k < raw)).nonzero().view(-1)[:6]
    coded_mode = mode[coded[0]] if coded.numel() else torch.tensor(0, dtype=mode.dtype)
    # k beyond the entry, and negative as int32
    rows.append((payload[:4], torch.tensor([raw + 1, 2 * raw, -1, -(1 << 31)]), mode[:4]))
    # k that disagrees with the payload (one more / one fewer sector)
    rows.append((payload[coded], torch.clamp(k[coded] + 1, max=raw - 1), mode[coded]))
    rows.append((payload[coded], torch.clamp(k[coded] - 1, min=1), mode[coded]))
    # every byte of the payload set, with small and large k
    greedy = torch.full((2, entry_bytes), 0xFF, dtype=torch.uint8)
    rows.append((greedy, torch.tensor([1, raw - 1]), coded_mode.repeat(2)))
    # random payload bytes with a coded k
    noise = torch.randint(0, 256, (8, entry_bytes), dtype=torch.uint8, generator=g)
    rows.append((noise, torch.randint(1, max(2, raw), (8,), generator=g), coded_mode.repeat(8)))
    # modes the codec never writes for such an entry
    zero, full = (k == 0).nonzero().view(-1)[:1], (k == raw).nonzero().view(-1)[:1]
    picks = torch.cat([zero, full, coded[:1]])
    rows.append((payload[picks], k[picks], torch.full((picks.numel(),), 15)))
    out = [torch.cat([r[i] for r in rows]) for i in range(3)]
    return out[0], out[1].to(torch.int32), out[2].to(torch.int32)


@pytest.mark.parametrize("word", ids("w", WORDS))
@pytest.mark.parametrize("entry_bytes", ids("E", (32, 128, 4096)))
@pytest.mark.parametrize("codec", ids("codec", DEVICE_CODECS))
def test_device_codec_flags_damage(host_exe, codec, entry_bytes, word, tmp_path):
    g = torch.Generator().manual_seed(99)
    payload, k, modes = damaged_cases(codec, entry_bytes, word, g)
    got = run_decode(host_exe(entry_bytes), codec, payload, k, modes, word, tmp_path)
    raw = entry_bytes // spec.SECTOR_BYTES
    for i in range(k.numel()):
        err = int(got["err"][i])
        ki = int(k[i])
        if not 0 <= ki <= raw:  # the reference's metadata decoder rejects such k before any codec runs
            assert err & 1, f"entry {i}: k={ki} not flagged"
            assert not got["decoded"][i].any()
            continue
        expected = _reference_entry(codec, payload[i], ki, int(modes[i]), word, entry_bytes)
        if expected is None:
            assert err != 0, f"entry {i} (k={ki}, mode={int(modes[i])}): the reference raises, the device code passes"
            assert not got["decoded"][i].any(), f"entry {i}: a flagged entry decodes to zeros"
        else:
            assert err == 0, f"entry {i} (k={ki}): the device code flags {err:#x}, the reference decodes"
            assert torch.equal(got["decoded"][i], expected), f"entry {i}: decodes differently"


def _reference_entry(codec, payload_row, k, mode, word, entry_bytes):
    """The reference's decode of one entry (metadata rules included), or ``None`` where it raises."""
    row = payload_row.clone()
    row[k * spec.SECTOR_BYTES :] = 0  # the reference sees exactly k sectors, zero after
    got = reference_decodes(codec, row.view(1, -1), torch.tensor([k]), torch.tensor([mode]), word)
    return None if got is None else got[0]


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
        c = Analysis(entries, word).choice
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
        base = Analysis(entries, word).choice
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
    total = Analysis(entries, word).choice.total_bits
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
    c = Analysis(entries, word).choice
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
# the same device functions compiled for the GPU
# ---------------------------------------------------------------------------
#: the class template of each device codec (csrc/codec_<name>.h)
DEVICE_CODEC_CLASSES = {"zvc": "BuddyZvc", "fpx": "BuddyFpx"}

_GPU_UNIT = r"""
#include "buddy_entry.h"
%(includes)s

// the format rules around a codec, as the kernels instantiate them: one kernel per
// operation, the word size picked by a switch
#define WORD_SWITCH(CODEC, CALL) \
  switch (word) {                \
    case 1: CALL(CODEC<1>); break; \
    case 2: CALL(CODEC<2>); break; \
    case 4: CALL(CODEC<4>); break; \
    default: CALL(CODEC<8>); break; \
  }
#define MEASURE(C) k[0] = buddy_entry_measure<C>(BuddyCudaWarp(), entry, &mode[0])
#define ENCODE(C) buddy_entry_encode<C>(BuddyCudaWarp(), entry, k[0], mode[0], payload)
#define DECODE(C) k[0] = buddy_entry_decode<C>(BuddyCudaWarp(), payload, k[0], mode[0], out)
#define KERNELS(NAME, CODEC)                                                                                     \
  extern "C" __global__ void NAME##_measure(const uint8_t* entry, uint32_t* k, uint32_t* mode, int word) {      \
    WORD_SWITCH(CODEC, MEASURE)                                                                                  \
  }                                                                                                              \
  extern "C" __global__ void NAME##_encode(const uint8_t* entry, uint8_t* payload, uint32_t* k, uint32_t* mode, \
                                           int word) {                                                           \
    WORD_SWITCH(CODEC, ENCODE)                                                                                   \
  }                                                                                                              \
  extern "C" __global__ void NAME##_decode(const uint8_t* payload, uint8_t* out, uint32_t* k, uint32_t* mode,   \
                                           int word) {                                                           \
    WORD_SWITCH(CODEC, DECODE)                                                                                   \
  }
%(kernels)s
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("entry_bytes", ids("E", (32, 65536)))
def test_device_codecs_compile_for_the_gpu(entry_bytes, tmp_path):
    """Every device codec, every word size, instantiated for sm_80 and sm_90 with warnings as errors
    (test_csrc.py compiles the headers alone, which instantiates no template)."""
    assert set(DEVICE_CODECS) <= set(DEVICE_CODEC_CLASSES)
    unit = tmp_path / "codecs.cu"
    unit.write_text(
        _GPU_UNIT
        % {
            "includes": "\n".join(f'#include "codec_{name}.h"' for name in DEVICE_CODECS),
            "kernels": "\n".join(f"KERNELS({name}, {DEVICE_CODEC_CLASSES[name]})" for name in DEVICE_CODECS),
        }
    )
    arch = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in (80, 90)]
    cmd = ["nvcc", *arch, "-std=c++17", "-Werror", "all-warnings", f"-I{CSRC}", *_defines(entry_bytes)]
    subprocess.run([*cmd, "-c", str(unit), "-o", str(tmp_path / "codecs.o")], check=True)
