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

#: codecs whose device functions the harness runs (its CODEC argument)
DEVICE_CODECS = ("zvc",)
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
    """``(k, mode, payload)`` of each entry by the torch reference under the format rules (payload zero after k sectors)."""
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
