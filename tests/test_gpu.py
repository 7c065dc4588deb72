"""CUDA tensors: round trips, buffer placement, and byte-identity with the CPU path.

Every test here is marked ``gpu`` and skips cleanly without CUDA (see conftest).
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from conftest import MiB, assert_bitexact, assert_roundtrip, dtype_params, held, ids, make_data, ratio_name

import buddy

pytestmark = pytest.mark.gpu

# nvcomp chunk codecs have their own suite at chunk-sized entries (test_codecs_nvcomp.py)
CODECS = [c for c in buddy.available_codecs("cuda") if not c.startswith("nvcomp-")]
GPU_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.bool,
    torch.complex64,
]


@pytest.fixture
def pinned_store(cuda):
    return buddy.BuddyStore(capacity_bytes=256 * MiB, block_bytes=4 * MiB, pin=True)


@pytest.mark.parametrize("codec", ids("codec", CODECS))
@pytest.mark.parametrize("ratio", ids("ratio", (math.inf, 4.0, 2.0, 1.0), ratio_name))
@pytest.mark.parametrize("kind", ids("data", ("relu", "random_bytes", "special")))
@pytest.mark.parametrize("n", ids("n", (1, 129, 98433)))
@pytest.mark.parametrize("dtype", dtype_params(GPU_DTYPES))
def test_cuda_roundtrip(dtype, n, kind, ratio, codec, cuda, pinned_store, gen):
    t = make_data(kind, n, dtype, gen).to(cuda)
    bt = buddy.compress(t, target_ratio=ratio, codec=codec, store=pinned_store)
    assert bt.device == t.device
    out = assert_roundtrip(bt, t)
    assert out.device == t.device
    if kind == "random_bytes" and dtype != torch.bool and ratio > 1.0:
        assert bt.buddy_bytes > 0
    bt.free()
    assert pinned_store.bytes_held == 0


@pytest.mark.parametrize("codec", ids("codec", CODECS))
def test_cuda_buffer_placement(codec, cuda, pinned_store, gen):
    t = make_data("random_bytes", 50_000, torch.float32, gen).to(cuda)
    bt = buddy.compress(t, target_ratio=4.0, codec=codec, store=pinned_store)
    meta, slots, overflow = bt.buffers()
    assert meta.is_cuda and slots.is_cuda
    assert overflow.device.type == "cpu" and overflow.is_pinned()
    assert overflow.numel() == bt.buddy_bytes > 0
    table = 0 if bt.table is None else bt.table.numel()  # fpe and auto2 keep their table on the device too
    assert (bt.table is None or bt.table.is_cuda) and meta.numel() + slots.numel() + table == bt.device_bytes
    assert pinned_store.stats().pinned
    assert_roundtrip(bt, t)


def test_default_store_pins_with_cuda(cuda):
    assert buddy.BuddyStore(capacity_bytes=MiB).pin


def test_stores_dropped_without_trim_leave_nothing_pinned(cuda, gen):
    """Each store dropped holding its blocks: the next ones pin fresh mappings, often at the same addresses."""
    for _ in range(20):
        store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=4 * MiB, pin=True)
        t = make_data("random_bytes", 300_000, torch.float32, gen).cuda()
        bt = buddy.compress(t, 4.0, "zvc", store=store)
        assert bt.buddy_bytes > 0
        assert_roundtrip(bt, t)
        del bt, store
        gc.collect()


def test_a_refused_pin_fails_no_later_launch(cuda):
    """A failed cudaHostRegister is answered by the store; its error is not left for PyTorch's next launch."""
    from buddy import store as store_module

    store = buddy.BuddyStore(capacity_bytes=64 * MiB, block_bytes=4 * MiB, pin=True)
    alloc = store.allocate(1000)
    assert alloc.block is not None
    with pytest.raises(RuntimeError, match="cudaHostRegister failed: CUDA error"):  # pinned already
        store_module._cuda_call("cudaHostRegister", alloc.block.buffer.data_ptr(), 4096, 1)
    x = torch.arange(10, device="cuda") * 2  # a kernel launch, checked by PyTorch
    torch.cuda.synchronize()
    assert x.sum().item() == 90
    store.release(alloc)


@pytest.mark.parametrize("codec", ids("codec", CODECS))
@pytest.mark.parametrize("e", ids("E", (128, 512)))
@pytest.mark.parametrize("ratio", ids("ratio", (math.inf, 4.0, 2.0), ratio_name))
@pytest.mark.parametrize("kind", ids("data", ("relu", "special", "random_bytes")))
@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16, torch.int8, torch.complex64]))
def test_cuda_buffers_match_cpu(dtype, kind, ratio, e, codec, cuda, pinned_store, store, gen):
    t = make_data(kind, 40_001, dtype, gen)
    on_cpu = buddy.compress(t, target_ratio=ratio, codec=codec, entry_bytes=e, store=store)
    on_gpu = buddy.compress(t.to(cuda), target_ratio=ratio, codec=codec, entry_bytes=e, store=pinned_store)
    torch.cuda.synchronize()
    assert on_gpu.histogram == on_cpu.histogram
    assert (on_gpu.device_bytes, on_gpu.buddy_bytes) == (on_cpu.device_bytes, on_cpu.buddy_bytes)
    for name, g, c in zip(("meta", "slots", "overflow"), on_gpu.buffers(), on_cpu.buffers()):
        assert torch.equal(g.cpu(), c), f"{name} differs between CUDA and CPU"
    assert (on_gpu.table is None) == (on_cpu.table is None)  # fpe and auto2: the fitted table, on each side
    if on_cpu.table is not None:
        assert torch.equal(on_gpu.table.cpu(), on_cpu.table), "table differs between CUDA and CPU"
    # and each side decodes the other's buffers (with the other's table)
    meta, slots, overflow = on_cpu.buffers()
    kw = dict(codec=codec, entry_bytes=e, slot_sectors=on_cpu.slot_sectors, shape=t.shape, dtype=dtype)
    table = None if on_cpu.table is None else on_cpu.table.to(cuda)
    assert_bitexact(buddy.unpack(meta.to(cuda), slots.to(cuda), overflow, table=table, **kw), t.to(cuda))
    meta, slots, overflow = on_gpu.buffers()
    table = None if on_gpu.table is None else on_gpu.table.cpu()
    assert_bitexact(buddy.unpack(meta.cpu(), slots.cpu(), overflow.clone(), table=table, **kw), t)


def test_cuda_multi_chunk_matches_single_chunk(cuda, pinned_store, gen, monkeypatch):
    t = make_data("relu", 200_003, torch.float32, gen).to(cuda)
    single = buddy.compress(t, target_ratio=4.0, store=pinned_store)
    ref = [b.cpu().clone() for b in single.buffers()]
    monkeypatch.setattr(buddy.format, "BLOCK_BYTES", 64 * 1024)
    multi = buddy.compress(t, target_ratio=4.0, store=pinned_store)
    torch.cuda.synchronize()
    for name, a, b in zip(("meta", "slots", "overflow"), multi.buffers(), ref):
        assert torch.equal(a.cpu(), b), name
    assert_roundtrip(multi, t)


def test_cuda_non_contiguous(cuda, pinned_store, gen):
    base = make_data("special", 300 * 200, torch.float32, gen).view(300, 200).to(cuda)
    for t in (base.t(), base[::3, 1::2], base[7:107]):
        bt = buddy.compress(t, target_ratio=2.0, store=pinned_store)
        assert_roundtrip(bt, t)


def test_cuda_free_and_gc_release(cuda, pinned_store, gen):
    t = make_data("random_bytes", 20_000, torch.float32, gen).to(cuda)
    bt = buddy.compress(t, target_ratio=4.0, store=pinned_store)
    assert pinned_store.bytes_held > 0
    del bt
    gc.collect()
    torch.cuda.synchronize()
    pinned_store.trim()
    assert held(pinned_store) == (0, 0, 0)


def test_cuda_store_reuse_after_free(cuda, pinned_store, gen):
    """A range freed while its copy may be in flight is reused only safely: data stays intact."""
    ts = [make_data("random_bytes", 30_000, torch.float32, gen).to(cuda) for _ in range(3)]
    for _ in range(5):
        a = buddy.compress(ts[0], target_ratio=4.0, store=pinned_store)
        a.free()
        b = buddy.compress(ts[1], target_ratio=4.0, store=pinned_store)
        c = buddy.compress(ts[2], target_ratio=4.0, store=pinned_store)
        assert_roundtrip(b, ts[1])
        assert_roundtrip(c, ts[2])
        b.free()
        c.free()
    assert pinned_store.stats().buddy_blocks == 1


def test_cuda_on_full_device(cuda, gen):
    tiny = buddy.BuddyStore(capacity_bytes=0, pin=True)
    t = make_data("relu", 10_000, torch.float32, gen).to(cuda)
    with pytest.raises(buddy.HostStoreFull):
        buddy.compress(t, target_ratio=4.0, store=tiny)
    bt = buddy.compress(t, target_ratio=4.0, store=tiny, on_full="device")
    assert bt.buddy_bytes == 0
    assert_roundtrip(bt, t)
