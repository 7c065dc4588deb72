"""The CUDA kernels (buddy.cuda) against the torch reference, on a GPU.

Marked ``gpu``: skipped without CUDA (see conftest), and skipped without CuPy.
The kernels must give the reference's sizes, payloads and decoded entries
byte for byte, for every dtype, entry size, tensor size and slot, and reject
bad arguments before anything is launched.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    ALL_DTYPES,
    DATA_KINDS,
    MiB,
    assert_bitexact,
    assert_roundtrip,
    decode,
    dtype_params,
    encode,
    entry_payloads,
    ids,
    make_data,
)

import buddy
from buddy import cuda as bcuda
from buddy import spec

pytestmark = pytest.mark.gpu

ZVC = buddy.get_codec("zvc")
ENTRY_SIZES = (32, 128, 256, 512, 4096, 65536)
SIZES = (0, 1, 127, 128, 129, 98433)


@pytest.fixture(autouse=True)
def _needs_cupy(cuda):
    pytest.importorskip("cupy", reason="the CUDA backend needs CuPy (pip install 'buddy[cuda12]' or 'buddy[cuda13]')")


@pytest.fixture
def pinned_store(cuda):
    return buddy.BuddyStore(capacity_bytes=1024 * MiB, block_bytes=16 * MiB, pin=True)


def _entries(t: torch.Tensor, entry_bytes: int) -> torch.Tensor:
    return entry_payloads(t, "zvc", entry_bytes)[0]


def _check_codec(entries: torch.Tensor, word: int) -> None:
    """Kernels == reference for sizes, encode and decode of these entries."""
    ref = encode(ZVC, entries, word)
    kernels = bcuda.Kernels("zvc")
    sizes, modes = kernels.measure(entries, word)
    payload, k, enc_modes = kernels.encode(entries, word)
    torch.cuda.synchronize()
    assert torch.equal(sizes, ref.sectors) and torch.equal(modes, ref.modes), "sizes differ"
    assert torch.equal(k, ref.sectors), "k differs"
    assert torch.equal(enc_modes, ref.modes), "modes differ"
    assert torch.equal(payload, ref.payload), "payloads differ"
    out = kernels.decode(ref.payload, ref.sectors, ref.modes, word)
    assert torch.equal(out, entries), "decode differs"
    assert torch.equal(decode(ZVC, payload, k, enc_modes, word), entries)


@pytest.mark.parametrize("e", ids("E", ENTRY_SIZES))
@pytest.mark.parametrize("kind", ids("data", DATA_KINDS))
@pytest.mark.parametrize("dtype", dtype_params(ALL_DTYPES))
def test_kernels_match_reference(dtype, kind, e, cuda, gen):
    for n in SIZES:
        t = make_data(kind, n, dtype, gen).to(cuda)
        _check_codec(_entries(t, e), spec.word_bytes(dtype))


@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16, torch.int8, torch.float64]))
def test_kernels_match_reference_large(dtype, cuda, gen):
    """A few MB: many blocks, warps striding over entries."""
    numel = (5 * MiB + 12345) // torch.empty((), dtype=dtype).element_size()
    t = make_data("relu", numel, dtype, gen).to(cuda)
    for e in (128, 4096):
        _check_codec(_entries(t, e), spec.word_bytes(dtype))


def test_kernels_grid_stride(cuda, gen, monkeypatch):
    """More entries than one launch's warps: the stride loop covers the rest."""
    monkeypatch.setattr(bcuda, "MAX_BLOCKS", 3)
    t = make_data("relu", 200_000, torch.float32, gen).to(cuda)
    _check_codec(_entries(t, 128), 4)


@pytest.mark.parametrize("word", ids("w", (1, 2, 4, 8)))
@pytest.mark.parametrize("e", ids("E", (32, 128, 4096)))
def test_every_population(word, e, cuda):
    """Entries with 0, 1, ..., all words non-zero: every k, the raw threshold on both sides."""
    words = e // word
    counts = torch.arange(words + 1)
    g = torch.Generator().manual_seed(e + word)
    mask = torch.rand(words + 1, words, generator=g).argsort(1) < counts[:, None]
    values = torch.randint(1, 256, (words + 1, words, word), dtype=torch.uint8, generator=g)
    values[..., 1:] *= torch.rand(words + 1, words, word - 1, generator=g) < 0.5  # zero bytes in non-zero words
    entries = (values * mask[..., None]).view(words + 1, e).to(cuda)
    _check_codec(entries, word)


@pytest.mark.parametrize("e", ids("E", (128, 512)))
@pytest.mark.parametrize("kind", ids("data", ("relu", "random_bytes", "special")))
@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16, torch.uint8, torch.float64]))
def test_every_slot_same_buffers(dtype, kind, e, cuda, pinned_store, gen):
    """compress(backend="cuda") == compress(backend="reference"), buffer for buffer, for every slot."""
    t = make_data(kind, 70_001, dtype, gen).to(cuda)
    for slot in range(e // spec.SECTOR_BYTES + 1):
        ratio = spec.ratio_for_slot(slot, e)
        a = buddy.compress(t, target_ratio=ratio, entry_bytes=e, store=pinned_store, backend="cuda")
        b = buddy.compress(t, target_ratio=ratio, entry_bytes=e, store=pinned_store, backend="reference")
        torch.cuda.synchronize()
        assert a.backend == "cuda" and b.backend == "reference"
        assert a.slot_sectors == b.slot_sectors == slot
        assert a.histogram == b.histogram
        for name, x, y in zip(("meta", "slots", "overflow"), a.buffers(), b.buffers()):
            assert torch.equal(x.cpu(), y.cpu()), f"{name} differs (slot {slot})"
        assert_roundtrip(a, t)
        assert_bitexact(a.decompress(backend="reference"), t)
        assert_bitexact(b.decompress(backend="cuda"), t)
        a.free()
        b.free()


@pytest.mark.parametrize("ratio", ids("ratio", (4.0, math.inf)))
def test_overflow_heavy(ratio, cuda, pinned_store, gen):
    """Incompressible data in small slots: nearly everything goes to buddy memory."""
    t = make_data("random_bytes", 3 * MiB // 4, torch.float32, gen).to(cuda)
    bt = buddy.compress(t, target_ratio=ratio, store=pinned_store, backend="cuda")
    assert bt.buddy_bytes >= 0.74 * t.numel() * 4
    ref = buddy.compress(t, target_ratio=ratio, store=pinned_store, backend="reference")
    torch.cuda.synchronize()
    for x, y in zip(bt.buffers(), ref.buffers()):
        assert torch.equal(x.cpu(), y.cpu())
    assert_roundtrip(bt, t)


@pytest.mark.parametrize("n", ids("n", (0, 1, 127, 129, 98433)))
@pytest.mark.parametrize("dtype", dtype_params(ALL_DTYPES))
def test_compress_round_trip(dtype, n, cuda, pinned_store, gen):
    t = make_data("special", n, dtype, gen).to(cuda)
    bt = buddy.compress(t, store=pinned_store, backend="cuda")
    assert bt.backend == "cuda"
    assert_roundtrip(bt, t)


def test_multi_chunk_and_views(cuda, pinned_store, gen, monkeypatch):
    monkeypatch.setattr(buddy.format, "BLOCK_BYTES", 64 * 1024)
    base = make_data("relu", 300_001, torch.float32, gen).to(cuda)
    for t in (base, base[1:], base[3:-5].view(-1)[::2], base.view(torch.uint8)[1:-2]):
        a = buddy.compress(t, target_ratio=2.0, store=pinned_store, backend="cuda")
        b = buddy.compress(t, target_ratio=2.0, store=pinned_store, backend="reference")
        torch.cuda.synchronize()
        for x, y in zip(a.buffers(), b.buffers()):
            assert torch.equal(x.cpu(), y.cpu())
        assert_roundtrip(a, t)


def test_runs_on_the_current_stream(cuda, pinned_store, gen):
    t = make_data("relu", 1_000_003, torch.float32, gen).to(cuda)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        u = t * 1  # made on the side stream: the kernels must be ordered after it
        bt = buddy.compress(u, target_ratio=2.0, store=pinned_store, backend="cuda")
        out = bt.decompress()
    side.synchronize()
    assert_bitexact(out, t)


def test_default_backend_cuda(cuda, pinned_store, gen):
    previous = buddy.set_defaults(backend="cuda")
    try:
        t = make_data("relu", 10_000, torch.float32, gen).to(cuda)
        bt = buddy.compress(t, store=pinned_store)
        assert bt.backend == "cuda"
        assert_roundtrip(bt, t)
        assert buddy.compress(t.cpu()).backend == "reference"  # CPU tensors keep the reference
    finally:
        buddy.set_defaults(backend=previous.backend)


def test_compile_cache(cuda):
    before = len(bcuda._modules)
    t = torch.ones(1000, 128, dtype=torch.uint8, device=cuda)
    kernels = bcuda.Kernels("zvc")
    kernels.measure(t, 4)
    kernels.measure(t, 1)
    kernels.encode(t, 2)
    assert len(bcuda._modules) <= before + 1  # one module per entry size and architecture
    kernels.measure(torch.ones(10, 256, dtype=torch.uint8, device=cuda), 4)
    assert len(bcuda._modules) <= before + 2


# ---------------------------------------------------------------------------
# bad arguments never reach a launch
# ---------------------------------------------------------------------------
@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(bcuda, "_launch", refuse)  # Kernels() made after this launch through it


def test_bad_arguments_rejected_before_launch(cuda, no_launch):
    good = torch.zeros(64, 128, dtype=torch.uint8, device=cuda)
    k = torch.zeros(64, dtype=torch.int32, device=cuda)
    kernels = bcuda.Kernels("zvc")
    cases = [
        (kernels.measure, (good.cpu(), 4), "CUDA device"),
        (kernels.measure, (good.view(torch.int32), 4), "uint8"),
        (kernels.measure, (good.view(-1), 4), "n_entries, entry_bytes"),
        (kernels.measure, (good[:, :100], 4), "power of two"),
        (kernels.measure, (good.t(), 4), "contiguous"),  # (128, 64): 64-byte entries, not dense
        (kernels.measure, (torch.zeros(64 * 128 + 1, dtype=torch.uint8, device=cuda)[1:].view(64, 128), 4), "aligned"),
        (kernels.measure, (good, 3), "word_bytes"),
        (kernels.encode, (good, 16), "word_bytes"),
        (kernels.decode, (good, k[:63], k, 4), "shape"),
        (kernels.decode, (good, k, k.to(torch.int64), 4), "int32"),
        (kernels.decode, (good, k.cpu(), k, 4), "is on cpu"),
        (kernels.decode, (good, k, k[::2].repeat_interleave(2), 0), "word_bytes"),
    ]
    for fn, args, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(*args)


def test_damaged_metadata_raises(cuda):
    entries = make_data("relu", 32 * 100, torch.float32, torch.Generator().manual_seed(0)).to(cuda).view(torch.uint8)
    entries = entries.view(-1, 128)
    enc = encode(ZVC, entries, 4)
    coded = ((enc.sectors > 0) & (enc.sectors < 4)).nonzero().view(-1)
    assert coded.numel()
    cases = []
    k = enc.sectors.clone()
    k[coded[0]] = 9  # more sectors than an entry has
    cases.append((enc.payload, k, enc.modes, "more sectors"))
    k = enc.sectors.clone()
    k[coded[0]] = 1 if int(k[coded[0]]) != 1 else 2  # disagrees with its bitmap
    cases.append((enc.payload, k, enc.modes, "bitmap"))
    greedy = enc.payload.clone()
    greedy[coded[0], :4] = 0xFF  # a bitmap claiming every word: must not be read through
    cases.append((greedy, enc.sectors, enc.modes, "bitmap"))
    modes = enc.modes.clone()
    modes[3] = 1
    cases.append((enc.payload, enc.sectors, modes, "modes"))
    kernels = bcuda.Kernels("zvc")
    for payload, sectors, m, match in cases:
        with pytest.raises(buddy.CorruptDataError, match=match):
            kernels.decode(payload, sectors, m, 4)
        with pytest.raises(buddy.CorruptDataError):
            decode(ZVC, payload, sectors, m, 4)  # the reference agrees
    # and the next call on the same stream is fine
    assert torch.equal(kernels.decode(enc.payload, enc.sectors, enc.modes, 4), entries)
