"""The CUDA kernels (buddy.engines.cuda) against the torch reference, on a GPU.

Marked ``gpu``: skipped without CUDA (see conftest), and skipped without CuPy.
For every codec with kernels, the kernels must write the reference's
metadata, slots and overflow byte for byte -- every dtype, entry size,
tensor size and slot -- decode them back, flag damaged buffers without an
out-of-bounds access, and reject bad arguments before anything is launched.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ALL_DTYPES, DATA_KINDS, MiB, assert_bitexact, assert_roundtrip, dtype_params, ids, make_data

import buddy
from buddy.engines import cuda as bcuda
from buddy.codecs import fpe_device
from buddy.engines import kernels as bkernels
from buddy.engines.kernel_engine import KernelEngine
from buddy.engines import launch as blaunch
from buddy.engines import sources as bsources
from buddy.engines.tuning import tuned
from buddy import spec
from buddy.layout import Layout

pytestmark = pytest.mark.gpu

KERNEL_CODECS = tuple(bsources.KERNEL_CODECS)
ENTRY_SIZES = (32, 128, 256, 512, 4096, 65536)
SIZES = (0, 1, 127, 128, 129, 98433)


@pytest.fixture(autouse=True)
def _needs_cupy(cuda):
    pytest.importorskip("cupy", reason="the CUDA backend needs CuPy (pip install 'buddy[cuda12]' or 'buddy[cuda13]')")


@pytest.fixture
def pinned_store(cuda):
    return buddy.BuddyStore(capacity_bytes=1024 * MiB, block_bytes=16 * MiB, pin=True)


def _same_buffers(t: torch.Tensor, codec: str, slot: int, e: int, store) -> buddy.BuddyTensor:
    """compress(backend="cuda") == compress(backend="reference"), buffer for buffer; returns the CUDA one."""
    ratio = spec.ratio_for_slot(slot, e)
    a = buddy.compress(t, ratio, codec, entry_bytes=e, store=store, backend="cuda")
    b = buddy.compress(t, ratio, codec, entry_bytes=e, store=store, backend="reference")
    torch.cuda.synchronize()
    assert (a.backend, b.backend) == ("cuda", "reference")
    assert a.slot_sectors == b.slot_sectors == slot and a.histogram == b.histogram
    for name, x, y in zip(("meta", "slots", "overflow"), a.buffers(), b.buffers()):
        assert torch.equal(x.cpu(), y.cpu()), f"{codec}: {name} differs (slot {slot}, E {e})"
    assert (a.table is None) == (b.table is None), codec
    assert a.table is None or torch.equal(a.table.cpu(), b.table.cpu()), f"{codec}: the fitted table differs"
    b.free()
    return a


@pytest.mark.parametrize("e", ids("E", ENTRY_SIZES))
@pytest.mark.parametrize("kind", ids("data", DATA_KINDS))
@pytest.mark.parametrize("dtype", dtype_params(ALL_DTYPES))
@pytest.mark.parametrize("codec", ids("codec", KERNEL_CODECS))
def test_kernels_write_the_reference_buffers(codec, dtype, kind, e, cuda, pinned_store, gen):
    for n in SIZES:
        t = make_data(kind, n, dtype, gen).to(cuda)
        bt = _same_buffers(t, codec, spec.sectors_per_entry(e) // 2, e, pinned_store)
        assert_bitexact(bt.decompress(check=True), t)
        bt.free()


@pytest.mark.parametrize("e", ids("E", (128, 512)))
@pytest.mark.parametrize("kind", ids("data", ("relu", "random_bytes", "special")))
@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16, torch.uint8, torch.float64]))
@pytest.mark.parametrize("codec", ids("codec", KERNEL_CODECS))
def test_every_slot_same_buffers(codec, dtype, kind, e, cuda, pinned_store, gen):
    t = make_data(kind, 70_001, dtype, gen).to(cuda)
    for slot in range(e // spec.SECTOR_BYTES + 1):
        bt = _same_buffers(t, codec, slot, e, pinned_store)
        assert_roundtrip(bt, t)
        assert_bitexact(bt.decompress(backend="reference"), t)
        bt.free()


@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16, torch.int8, torch.float64]))
@pytest.mark.parametrize("codec", ids("codec", KERNEL_CODECS))
def test_large_tensors(codec, dtype, cuda, pinned_store, gen):
    """A few MB: many blocks, warps striding over entries."""
    numel = (5 * MiB + 12345) // torch.empty((), dtype=dtype).element_size()
    t = make_data("relu", numel, dtype, gen).to(cuda)
    for e in (512, 4096):
        bt = _same_buffers(t, codec, spec.sectors_per_entry(e) // 4, e, pinned_store)
        assert_bitexact(bt.decompress(check=True), t)


def test_grid_stride(cuda, pinned_store, gen, monkeypatch):
    """More entries than one launch's warps: the stride loop covers the rest."""
    monkeypatch.setattr(blaunch, "MAX_BLOCKS", 3)  # where launch_config reads it
    t = make_data("relu", 200_000, torch.float32, gen).to(cuda)
    bt = _same_buffers(t, "auto", 8, 512, pinned_store)
    assert_bitexact(bt.decompress(check=True), t)


@pytest.mark.parametrize("ratio", ids("ratio", (4.0, math.inf)))
def test_overflow_heavy(ratio, cuda, pinned_store, gen):
    """Incompressible data in small slots: nearly everything goes to buddy memory."""
    t = make_data("random_bytes", 3 * MiB // 4, torch.float32, gen).to(cuda)
    bt = _same_buffers(t, "auto", spec.slot_for_ratio(ratio, 512), 512, pinned_store)
    assert bt.buddy_bytes >= 0.74 * t.numel() * 4
    assert_roundtrip(bt, t)


@pytest.mark.parametrize("n", ids("n", (0, 1, 127, 129, 98433)))
@pytest.mark.parametrize("dtype", dtype_params(ALL_DTYPES))
def test_compress_round_trip(dtype, n, cuda, pinned_store, gen):
    t = make_data("special", n, dtype, gen).to(cuda)
    bt = buddy.compress(t, store=pinned_store, backend="cuda")
    assert bt.backend == "cuda"
    assert_roundtrip(bt, t)


def test_views(cuda, pinned_store, gen):
    base = make_data("relu", 300_001, torch.float32, gen).to(cuda)
    for t in (base, base[1:], base[3:-5].view(-1)[::2], base.view(torch.uint8)[1:-2]):
        bt = _same_buffers(t, "auto", 8, 512, pinned_store)
        assert_roundtrip(bt, t)


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
    t = make_data("relu", 10_000, torch.float32, gen).to(cuda)
    on_cpu = buddy.compress(t.cpu()).backend  # "auto" on the host: the native engine where it builds, else reference
    assert on_cpu in ("native", "reference")
    previous = buddy.set_defaults(backend="cuda")
    try:
        bt = buddy.compress(t, store=pinned_store)
        assert bt.backend == "cuda"
        assert_roundtrip(bt, t)
        assert buddy.compress(t.cpu()).backend == on_cpu  # a CPU tensor is run as "auto" runs it, never on CUDA
        assert buddy.compress(t, codec="raw", store=pinned_store).backend == "reference"  # raw has no kernels
    finally:
        buddy.set_defaults(backend=previous.backend)


def test_one_host_read_per_compress_none_per_decompress(cuda, pinned_store, gen):
    t = make_data("relu", 4 * MiB, torch.float32, gen).to(cuda)
    measured = buddy.measure(t, "auto", entry_bytes=4096, backend="cuda")  # the suite's default is 128 B
    assert measured.engine.readbacks == 1  # the histogram
    bt = buddy.pack(measured, 8, store=pinned_store)
    assert measured.engine.readbacks == 1  # pack reads nothing back
    engine = buddy.dispatch.engine(buddy.get_codec("auto"), cuda, "cuda")
    engine.unpack(*bt.buffers(), bt.slot_sectors, bt.layout, check=False)
    assert engine.readbacks == 0


@pytest.mark.parametrize("codec", ids("codec", ("fpe", "auto2")))
def test_table_codecs_read_once(codec, cuda, pinned_store, gen):
    """Without a prior the table is fitted on the GPU and read back with the histogram: one read."""
    t = make_data("relu", 4 * MiB, torch.bfloat16, gen).to(cuda)
    measured = buddy.measure(t, codec, backend="cuda")
    reference = buddy.measure(t, codec, backend="reference")
    assert measured.engine.readbacks == 1
    assert torch.equal(measured.table, reference.table) and measured.histogram == reference.histogram
    assert torch.equal(measured.statistics.cpu(), reference.statistics.cpu())


@pytest.mark.parametrize("codec", ids("codec", ("fpe", "auto2")))
def test_table_fitted_to_a_prior_on_the_gpu(codec, cuda, pinned_store, gen):
    """With learned statistics (frequencies) and no table to keep, the fit kernel fits their weights: the table the
    host's fit of them makes, in the one read, with nothing else waiting for the GPU."""
    t = make_data("relu", 4 * MiB, torch.bfloat16, gen)
    prior = buddy.measure(t, codec, backend="reference").statistics.double() / 3 + 0.5
    want = buddy.measure(t, codec, backend="reference", prior=prior)
    x = t.to(cuda)
    buddy.measure(x, codec, backend="cuda", prior=prior)  # compiled, allocator warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        measured = buddy.measure(x, codec, backend="cuda", prior=prior)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert measured.engine.readbacks == 1
    assert torch.equal(measured.table, want.table) and measured.histogram == want.histogram
    assert torch.equal(measured.measurement.meta.cpu(), want.measurement.meta)


@pytest.mark.parametrize("codec", ids("codec", ("fpe", "auto2")))
def test_a_prior_without_the_count_on_the_gpu(codec, cuda, pinned_store, gen, monkeypatch):
    """``count=False`` with a prior (a learned key's steps between two counts): no count kernel, no statistics, the
    same table, sizes and metadata as with the count, in the one read; and a compress of it decodes bit-exact."""
    t = make_data("relu", 4 * MiB, torch.bfloat16, gen)
    prior = buddy.measure(t, codec, backend="reference").statistics.double() / 3 + 0.5
    x = t.to(cuda)
    ops: list[str] = []
    launch = bcuda._launch
    monkeypatch.setattr(bcuda, "_launch", lambda codec, op, *args: ops.append(op) or launch(codec, op, *args))
    counted = buddy.measure(x, codec, backend="cuda", prior=prior)
    assert "count" in ops
    ops.clear()
    skipped = buddy.measure(x, codec, backend="cuda", prior=prior, count=False)
    assert "count" not in ops and "measure" in ops
    assert skipped.statistics is None and counted.statistics is not None
    assert torch.equal(skipped.table, counted.table) and skipped.histogram == counted.histogram
    assert torch.equal(skipped.measurement.meta, counted.measurement.meta) and skipped.engine.readbacks == 1
    bt = buddy.pack(skipped, skipped.histogram.index(max(skipped.histogram)), store=pinned_store)
    assert_bitexact(bt.decompress(), x)
    bt.free()


@pytest.mark.parametrize("codec", ids("codec", KERNEL_CODECS))
def test_no_hidden_syncs(codec, cuda, pinned_store, gen):
    """Under torch's sync debug mode nothing waits for the GPU in a compress but the engine's one read, and
    nothing in a decompress (check=False): no blocking copy, no .item(), no data-dependent shape."""
    t = make_data("relu", 1 << 20, torch.bfloat16, gen).to(cuda)
    buddy.compress(t, codec=codec, store=pinned_store, backend="cuda").free()  # compiled, allocator warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bt = buddy.compress(t, codec=codec, store=pinned_store, backend="cuda")
        out = bt.decompress(check=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, t)
    bt.free()


@pytest.mark.parametrize("word", ids("w", (1, 2, 4, 8)))
def test_table_fitted_on_the_gpu(word, cuda, gen):
    """The fit kernel against Table.from_counts on every shape of counts the host tests use."""
    from test_device_codecs import fit_cases

    kernels = bkernels.Kernels("fpe", launch=bcuda.LAUNCHER)
    for name, counts in fit_cases(word, torch.Generator().manual_seed(word)).items():
        want = buddy.codecs.fpe.Table.from_counts(counts, word)
        table = torch.empty(fpe_device.DEVICE_TABLE_BYTES, dtype=torch.uint8, device=cuda)
        serial = torch.empty(fpe_device.FIT_SERIAL_BYTES, dtype=torch.uint8, device=cuda)
        work = torch.empty(fpe_device.FIT_WORK_BYTES, dtype=torch.uint8, device=cuda)
        kernels.fit(Layout(512, 0, word), counts.to(cuda), work, table, serial)
        expected = want.to_bytes()
        assert torch.equal(serial.cpu()[: expected.numel()], expected), name
        assert not serial.cpu()[expected.numel() :].any(), name
        assert torch.equal(table.cpu(), fpe_device.device_table(want)), name


def test_compile_cache(cuda, gen):
    """One module per codec, entry size, word size and architecture, compiled once in a process."""
    before = len(bcuda._modules)
    t = make_data("relu", 10_000, torch.float32, gen).to(cuda)
    words = (torch.float32, torch.uint8, torch.bfloat16)
    for word_dtype in words:
        buddy.measure(t.view(word_dtype), "zvc", entry_bytes=128, backend="cuda")
    compiled = len(bcuda._modules)
    assert compiled <= before + len(words)
    for word_dtype in words:
        buddy.measure(t.view(word_dtype), "zvc", entry_bytes=128, backend="cuda")
    assert len(bcuda._modules) == compiled  # found, not compiled again
    buddy.measure(t, "zvc", entry_bytes=256, backend="cuda")
    assert len(bcuda._modules) <= compiled + 1


def test_damaged_buffers_are_flagged(cuda, pinned_store, gen):
    t = make_data("relu", 32 * 1000, torch.float32, gen).to(cuda)
    bt = buddy.compress(t, 4.0, "zvc", entry_bytes=128, store=pinned_store, backend="cuda")
    meta, slots, overflow = (b.clone() for b in bt.buffers())
    kw = dict(codec="zvc", entry_bytes=128, slot_sectors=1, shape=t.shape, dtype=t.dtype, backend="cuda")
    assert_bitexact(buddy.unpack(meta, slots, overflow, **kw), t)
    coded = ((meta > 1) & (meta < 4)).nonzero().view(-1)
    cases = []
    bad = meta.clone()
    bad[coded[0]] = 15  # more sectors than an entry has
    cases.append((bad, slots, overflow, "more sectors"))
    bad = meta.clone()
    bad[coded[0]] = 1  # disagrees with its bitmap (and with the overflow's size)
    cases.append((bad, slots, overflow, "bitmap|overflow"))
    greedy = slots.clone()
    greedy[coded[0] * 32 : coded[0] * 32 + 4] = 0xFF  # a bitmap claiming every word: must not be read through
    cases.append((meta, greedy, overflow, "bitmap"))
    bad = meta.clone()
    bad[3] |= 0x10  # mode 1: zvc writes only 0
    cases.append((bad, slots, overflow, "modes"))
    cases.append((meta, slots, overflow[:-32], "overflow"))
    for m, s, o, match in cases:
        with pytest.raises(buddy.CorruptDataError, match=match):
            buddy.unpack(m, s, o, **kw)
    assert_bitexact(buddy.unpack(meta, slots, overflow, **kw), t)  # and the next call on the stream is fine


# ---------------------------------------------------------------------------
# bad arguments never reach a launch
# ---------------------------------------------------------------------------
def test_bad_arguments_rejected_before_launch(cuda):
    launched = []
    kernels = bkernels.Kernels("zvc", launch=lambda *a: launched.append(a))
    e, n = 128, 64
    b = torch.zeros(n * e, dtype=torch.uint8, device=cuda)
    tail = torch.zeros(e, dtype=torch.uint8, device=cuda)
    meta, hist = torch.zeros(n, dtype=torch.uint8, device=cuda), torch.zeros(5, dtype=torch.int64, device=cuda)
    good = dict(layout=Layout(e, n * e, 4), data=b, tail=tail, meta=meta, histogram=hist)
    kernels.measure(**good)
    cases = [
        (dict(data=b.cpu()), "CUDA device"),
        (dict(data=b.view(torch.int32)), "uint8"),
        (dict(data=b[:-1]), "shape"),
        (dict(data=torch.zeros(n * e + 1, dtype=torch.uint8, device=cuda)[1:]), "aligned"),
        (dict(meta=meta.cpu()), "CUDA device"),
        (dict(histogram=hist[:-1]), "shape"),
        (dict(layout=Layout(e, n * e - 1, 4)), "shape"),  # a partial last entry: one whole entry less
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            kernels.measure(**(good | change))
    assert len(launched) == 1


# ---------------------------------------------------------------------------
# the kernels under autograd, and memory back to where it started
# ---------------------------------------------------------------------------
@pytest.mark.library_defaults
def test_training_with_the_kernels_is_bit_exact(cuda, pinned_store, monkeypatch):
    """Saved activations compressed by the kernels (the library's default codec): the same gradients, bit for
    bit, as a plain step; and the kernels did the packing."""
    packed = []
    real_pack = KernelEngine.pack
    monkeypatch.setattr(KernelEngine, "pack", lambda self, *a, **k: packed.append(1) or real_pack(self, *a, **k))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]).to(cuda)
    x = torch.randn(1024, 1024, device=cuda)

    def step(session=None):
        model.zero_grad()
        if session is None:
            loss = model(x).square().sum()
        else:
            with session:
                loss = model(x).square().sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = step()
    previous = buddy.set_defaults(backend="cuda")
    try:
        got = step(buddy.compressed_activations(tracker=buddy.Tracker(), store=pinned_store, min_bytes=1 << 16))
    finally:
        buddy.set_defaults(backend=previous.backend)
    for a, b in zip(got, expected):
        assert_bitexact(a, b)
    assert packed, "the CUDA kernels packed nothing"


def test_compress_free_cycles_return_device_memory(cuda, pinned_store, gen):
    """Hundreds of compress/decompress/free cycles through the kernels leave no device or buddy bytes behind."""
    t = make_data("relu", 1 << 20, torch.bfloat16, gen).to(cuda)
    for _ in range(3):  # compiled, allocator and store warm
        buddy.compress(t, store=pinned_store, backend="cuda").free()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(cuda)
    for _ in range(200):
        bt = buddy.compress(t, store=pinned_store, backend="cuda")
        out = bt.decompress()
        bt.free()
        del out
    torch.cuda.synchronize()
    pinned_store.trim()
    assert torch.cuda.memory_allocated(cuda) == baseline
    assert pinned_store.bytes_held == 0 and buddy.ledger.default_ledger().stats().device_bytes_held == 0


@pytest.mark.parametrize("codec", ids("codec", KERNEL_CODECS))
def test_overflow_read_in_place_decodes_the_same(codec, cuda, pinned_store, gen, monkeypatch):
    """Tuned zero_copy: the unpack kernel reads the overflow in pinned host memory, over the bus."""
    t = make_data("random_bytes", 300_001, torch.float32, gen).to(cuda)  # overflows at 4x, a partial last entry
    bt = buddy.compress(t, 4.0, codec, store=pinned_store, backend="cuda")
    assert bt.buddy_bytes > 0
    copied = bt.decompress()
    with tuned(zero_copy=True) as tuning:
        assert bcuda.reads_overflow_in_place(bt.buffers()[2], cuda, tuning)
        assert_bitexact(bt.decompress(), t)
    assert_bitexact(copied, t)


@pytest.mark.parametrize("codec", ids("codec", sorted(bsources.TABLED_KERNELS)))
def test_unpack_at_fewer_warps_an_sm_decodes_the_same(codec, cuda, pinned_store, gen, monkeypatch):
    """Tuned unpack_warps (the bench's --unpack-warps): unpack's blocks of fewer warps, their table in shared memory,
    the resident blocks striding over the entries, decode byte for byte."""
    t = make_data("relu", 1_000_003, torch.bfloat16, gen).to(cuda)  # 489 entries of 4 KiB, a partial last one
    bt = buddy.compress(t, codec=codec, store=pinned_store, backend="cuda")
    for warps in (1, 8, 16):
        with tuned(unpack_warps=warps):
            assert_bitexact(bt.decompress(check=True), t)
    bt.free()
