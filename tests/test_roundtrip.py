"""Bit-exact round trips: every dtype, size, kind of data, slot, codec and entry size."""

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
    dtype_params,
    fuzz_settings,
    ids,
    make_data,
    ratio_name,
    raw_bytes,
    sizes,
)
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

import buddy
import buddy.tensor
from buddy import spec
from buddy.slots import overflow_sectors

CODECS = buddy.available_codecs("cpu")
SIZES = (0, 1, 127, 128, 129, 98433)
# E = 128: target ratio -> slot sectors
RATIO_SLOT_128 = ((math.inf, 0), (4.0, 1), (2.0, 2), (4 / 3, 3), (1.0, 4))
SLOT_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64]


def _check_accounting(bt: buddy.BuddyTensor, t: torch.Tensor, store: buddy.BuddyStore) -> None:
    e = bt.entry_bytes
    n_entries = -(-bt.original_bytes // e)
    assert bt.original_bytes == t.numel() * t.element_size()
    assert len(bt.histogram) == e // spec.SECTOR_BYTES + 1
    assert sum(bt.histogram) == n_entries
    table = 0 if bt.table is None else bt.table.numel()  # format versions 2 and 3: the codec's table
    assert (table > 0) == (bt.format_version >= 2)
    assert bt.device_bytes == n_entries * (bt.slot_sectors * spec.SECTOR_BYTES + spec.meta_bytes(e)) + table
    assert bt.buddy_bytes == overflow_sectors(bt.histogram, bt.slot_sectors) * spec.SECTOR_BYTES
    assert bt.compressed_bytes == sum(k * c for k, c in enumerate(bt.histogram)) * spec.SECTOR_BYTES
    assert store.bytes_held == bt.buddy_bytes
    assert buddy.ledger.default_ledger().bytes_held == bt.device_bytes


# ---------------------------------------------------------------------------
# the main matrix: dtype x size x data x codec (at 2x)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ids("codec", CODECS))
@pytest.mark.parametrize("kind", ids("data", DATA_KINDS))
@pytest.mark.parametrize("n", ids("n", SIZES))
@pytest.mark.parametrize("dtype", dtype_params())
def test_roundtrip_dtype_size_data(dtype, n, kind, codec, store, gen):
    t = make_data(kind, n, dtype, gen)
    before = raw_bytes(t).clone()
    bt = buddy.compress(t, target_ratio=2.0, codec=codec, store=store)
    assert bt.codec == codec
    assert bt.slot_sectors == 2 and bt.target_ratio == 2.0
    _check_accounting(bt, t, store)
    assert_roundtrip(bt, t)
    assert torch.equal(raw_bytes(t), before), "compress modified its input"
    if kind == "zeros" and codec == "zvc":
        assert bt.buddy_bytes == 0 and bt.compressed_bytes == 0
    bt.free()
    assert store.bytes_held == 0


# ---------------------------------------------------------------------------
# every slot of E = 128, for every codec
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", ids("n", (129, 98433)))
@pytest.mark.parametrize("dtype", dtype_params(SLOT_DTYPES))
@pytest.mark.parametrize("kind", ids("data", DATA_KINDS))
@pytest.mark.parametrize(("ratio", "slot"), [pytest.param(r, s, id=f"slot={s}") for r, s in RATIO_SLOT_128])
@pytest.mark.parametrize("codec", ids("codec", CODECS))
def test_roundtrip_every_slot(codec, ratio, slot, kind, dtype, n, store, gen):
    t = make_data(kind, n, dtype, gen)
    bt = buddy.compress(t, target_ratio=ratio, codec=codec, store=store)
    assert bt.slot_sectors == slot
    assert bt.target_ratio == ratio
    _check_accounting(bt, t, store)
    assert_roundtrip(bt, t)
    n_entries = -(-bt.original_bytes // 128)
    if codec == "raw":
        assert bt.histogram[4] == n_entries
        assert bt.buddy_bytes == n_entries * (4 - slot) * 32
    if kind == "zeros" and codec == "zvc":
        assert bt.histogram[0] == n_entries and bt.buddy_bytes == 0
    if kind == "random_bytes" and dtype != torch.bool and slot < 4:
        # incompressible: it overflows a slot smaller than the entry, or (a tiny tensor whose own table,
        # fitted to it, codes its few words short) the table makes up for what the slots save
        assert bt.buddy_bytes > 0 or bt.device_bytes >= bt.original_bytes, "random bytes got smaller"


# ---------------------------------------------------------------------------
# a tensor of a few MB
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "numel", "kind", "codec"),
    [
        pytest.param(torch.float32, 1_500_000, "relu", "zvc", id="dtype=f32-n=1.5M-data=relu-codec=zvc"),
        pytest.param(
            torch.float32, 1_500_000, "random_bytes", "zvc", id="dtype=f32-n=1.5M-data=random_bytes-codec=zvc"
        ),
        pytest.param(torch.bfloat16, 1_500_001, "special", "zvc", id="dtype=bf16-n=1.5M-data=special-codec=zvc"),
        pytest.param(torch.float32, 1_500_000, "relu", "raw", id="dtype=f32-n=1.5M-data=relu-codec=raw"),
    ],
)
def test_roundtrip_large(dtype, numel, kind, codec, store, gen):
    t = make_data(kind, numel, dtype, gen).view(-1, 1000) if numel % 1000 == 0 else make_data(kind, numel, dtype, gen)
    bt = buddy.compress(t, target_ratio=2.0, codec=codec, store=store)
    _check_accounting(bt, t, store)
    assert_roundtrip(bt, t)
    if kind == "relu" and codec == "zvc":
        assert bt.buddy_bytes > 0, "relu'd f32 is ~2.1x: some entries must overflow a 2x slot"
        assert 0.5 * bt.original_bytes < bt.compressed_bytes < 0.7 * bt.original_bytes


# ---------------------------------------------------------------------------
# other entry sizes, including the 2-byte metadata regime (E >= 512)
# ---------------------------------------------------------------------------
def _slot_choices(e: int) -> list[int]:
    spe = e // 32
    return sorted({0, 1, spe // 2, spe - 1, spe})


@pytest.mark.parametrize("dtype", dtype_params([torch.float32, torch.bfloat16, torch.int8]))
@pytest.mark.parametrize("kind", ids("data", ("relu", "random_bytes", "special")))
@pytest.mark.parametrize("codec", ids("codec", CODECS))
@pytest.mark.parametrize(
    ("e", "slot"),
    [pytest.param(e, s, id=f"E={e}-slot={s}") for e in (32, 64, 256, 512, 4096, 65536) for s in _slot_choices(e)],
)
def test_roundtrip_entry_sizes(e, slot, codec, kind, dtype, store, gen):
    t = make_data(kind, 5003, dtype, gen)
    ratio = spec.ratio_for_slot(slot, e)
    bt = buddy.compress(t, target_ratio=ratio, codec=codec, entry_bytes=e, store=store)
    assert bt.entry_bytes == e
    assert bt.slot_sectors == slot
    meta, slots, _ = bt.buffers()
    n_entries = -(-bt.original_bytes // e)
    assert meta.numel() == n_entries * (2 if e >= 512 else 1)
    assert slots.numel() == n_entries * slot * 32
    _check_accounting(bt, t, store)
    assert_roundtrip(bt, t)


# ---------------------------------------------------------------------------
# shapes and layouts
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", ids("ratio", [r for r, _ in RATIO_SLOT_128], ratio_name))
@pytest.mark.parametrize("dtype", dtype_params())
def test_roundtrip_zero_dim(dtype, ratio, store, gen):
    t = make_data("special", 1, dtype, gen).reshape(())
    assert t.dim() == 0
    bt = buddy.compress(t, target_ratio=ratio, store=store)
    assert bt.shape == torch.Size([])
    out = assert_roundtrip(bt, t)
    assert out.dim() == 0


@pytest.mark.parametrize(
    "shape",
    ids("shape", [(0,), (3, 0, 2), (0, 0), (1, 1, 1, 1), (2, 3, 4, 5), (7, 129)], lambda s: "x".join(map(str, s))),
)
def test_roundtrip_shapes(shape, store, gen):
    t = make_data("relu", math.prod(shape), torch.float32, gen).reshape(shape)
    bt = buddy.compress(t, target_ratio=2.0, store=store)
    assert bt.shape == torch.Size(shape)
    assert_roundtrip(bt, t)


def _noncontig_cases():
    def transposed(d, g):
        return make_data("special", 37 * 53, d, g).view(37, 53).t()

    def strided_slice(d, g):
        return make_data("special", 3000, d, g)[1::3]

    def slice_2d(d, g):
        return make_data("relu", 40 * 50, d, g).view(40, 50)[5:30:2, 3:47:3]

    def expanded(d, g):
        return make_data("special", 300, d, g).view(1, 300).expand(9, 300)

    def offset_view(d, g):
        base = make_data("special", 5000, d, g)
        v = base[1234:2234].view(10, 100)
        assert v.storage_offset() == 1234 and v.is_contiguous()
        return v

    def permuted(d, g):
        return make_data("relu", 2 * 3 * 5 * 7, d, g).view(2, 3, 5, 7).permute(3, 1, 0, 2)

    def channels_last(d, g):
        return make_data("special", 2 * 3 * 5 * 7, d, g).view(2, 3, 5, 7).contiguous(memory_format=torch.channels_last)

    def diagonal(d, g):
        return make_data("special", 64 * 64, d, g).view(64, 64).diagonal()

    return [transposed, strided_slice, slice_2d, expanded, offset_view, permuted, channels_last, diagonal]


@pytest.mark.parametrize("codec", ids("codec", CODECS))
@pytest.mark.parametrize(
    "dtype", dtype_params([torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64])
)
@pytest.mark.parametrize("make", [pytest.param(f, id=f"view={f.__name__}") for f in _noncontig_cases()])
def test_roundtrip_non_contiguous(make, dtype, codec, store, gen):
    t = make(dtype, gen)
    if make.__name__ in ("transposed", "strided_slice", "slice_2d", "expanded", "permuted", "diagonal"):
        assert not t.is_contiguous()
    before = raw_bytes(t).clone()
    bt = buddy.compress(t, target_ratio=2.0, codec=codec, store=store)
    assert bt.original_bytes == t.numel() * t.element_size()
    out = assert_roundtrip(bt, t)  # compares against t.contiguous()'s bytes
    assert_bitexact(out, t.contiguous())
    assert torch.equal(raw_bytes(t), before)


def test_roundtrip_conjugate_view(store, gen):
    """A lazily conjugated complex tensor compresses as the values it reads as."""
    t = make_data("special", 777, torch.complex64, gen)
    c = t.conj()
    assert c.is_conj()
    bt = buddy.compress(c, target_ratio=2.0, store=store)
    out = bt.decompress()
    assert not out.is_conj()
    assert_bitexact(out, c.resolve_conj())
    assert_bitexact(out.conj().resolve_conj(), t)


def test_roundtrip_negative_view(store, gen):
    """``t.conj().imag`` is a float tensor with the negative bit set."""
    t = make_data("relu", 500, torch.complex64, gen)
    im = t.conj().imag
    assert im.is_neg()
    bt = buddy.compress(im, target_ratio=2.0, store=store)
    out = bt.decompress()
    assert_bitexact(out, (-t.imag).contiguous())


def test_requires_grad_roundtrip(store, gen):
    t = make_data("relu", 1000, torch.float32, gen).requires_grad_()
    bt = buddy.compress(t, target_ratio=2.0, store=store)
    out = bt.decompress()
    assert not out.requires_grad
    assert_bitexact(out, t.detach())


# ---------------------------------------------------------------------------
# multi-chunk tensors
# ---------------------------------------------------------------------------
def _buffers_bytes(bt):
    meta, slots, overflow = bt.buffers()
    return meta.clone(), slots.clone(), overflow.clone()


@pytest.mark.parametrize(
    ("e", "chunk_bytes"),
    [pytest.param(e, c, id=f"E={e}-chunk={c}") for e, c in ((128, 4096), (128, 1000), (128, 1), (512, 4096), (512, 1))],
)
@pytest.mark.parametrize("slot_frac", ids("slot", (0, 1, 2, 4), lambda s: f"{s}/4"))
@pytest.mark.parametrize("kind", ids("data", ("relu", "random_bytes", "special", "zeros")))
@pytest.mark.parametrize("codec", ids("codec", CODECS))
def test_multi_chunk_matches_single_chunk(codec, kind, slot_frac, e, chunk_bytes, store, gen, monkeypatch):
    step = max(1, chunk_bytes // e)  # entries per chunk
    # 23 full chunks, then a last chunk of one entry that is itself partial
    numel = (23 * step * e + e // 2) // 4 + 1
    t = make_data(kind, numel, torch.float32, gen)
    slot = slot_frac * (e // 32) // 4
    ratio = spec.ratio_for_slot(slot, e)
    assert t.numel() * 4 <= buddy.format.BLOCK_BYTES  # one chunk by default
    single = buddy.compress(t, target_ratio=ratio, codec=codec, entry_bytes=e, store=store)
    ref = _buffers_bytes(single)

    monkeypatch.setattr(buddy.format, "BLOCK_BYTES", chunk_bytes)
    assert len(buddy.format.blocks(-(-numel * 4 // e), e)) == 24
    multi = buddy.compress(t, target_ratio=ratio, codec=codec, entry_bytes=e, store=store)
    assert multi.histogram == single.histogram
    assert (multi.device_bytes, multi.buddy_bytes) == (single.device_bytes, single.buddy_bytes)
    for name, a, b in zip(("meta", "slots", "overflow"), _buffers_bytes(multi), ref):
        assert torch.equal(a, b), f"{name} differs between the chunked and the single-chunk path"
    assert_roundtrip(multi, t)
    # the single-chunk buffers decode with the chunked decoder too
    assert_roundtrip(single, t)
    out = buddy.unpack(*ref, codec=codec, entry_bytes=e, slot_sectors=slot, shape=t.shape, dtype=t.dtype, table=single.table)
    assert_bitexact(out, t)


def test_default_chunk_size_splits_big_tensors(store, gen, monkeypatch):
    """With a 1 MiB chunk a 6 MB tensor takes several chunks and still round trips."""
    monkeypatch.setattr(buddy.format, "BLOCK_BYTES", 1 * MiB)
    t = make_data("relu", 1_500_000, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=4.0, store=store)
    assert bt.buddy_bytes > 0
    assert_roundtrip(bt, t)


# ---------------------------------------------------------------------------
# slot choice: on_full="device" and the default target_ratio=None
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", ids("capacity", (0, 1024)))
@pytest.mark.parametrize("kind", ids("data", ("random_bytes", "relu", "special")))
@pytest.mark.parametrize("codec", ids("codec", CODECS))
def test_on_full_device_keeps_tensor_whole(codec, kind, capacity, gen):
    tiny = buddy.BuddyStore(capacity_bytes=capacity, block_bytes=4096, pin=False)
    t = make_data(kind, 5000, torch.float32, gen)
    with pytest.raises(buddy.HostStoreFull):
        buddy.compress(t, target_ratio=4.0, codec=codec, store=tiny, on_full="raise")
    bt = buddy.compress(t, target_ratio=4.0, codec=codec, store=tiny, on_full="device")
    assert bt.buddy_bytes == 0
    assert tiny.bytes_held == 0
    largest_k = max(k for k, c in enumerate(bt.histogram) if c)
    assert bt.slot_sectors == largest_k, "on_full='device' uses the smallest slot without overflow"
    assert bt.slot_sectors > 1
    assert_roundtrip(bt, t)
    bt.free()
    assert buddy.ledger.default_ledger().tensors_held == 0


def test_on_full_device_is_a_no_op_when_the_store_has_room(store, gen):
    t = make_data("random_bytes", 5000, torch.float32, gen)
    a = buddy.compress(t, target_ratio=4.0, store=store, on_full="device")
    assert a.slot_sectors == 1 and a.buddy_bytes > 0
    assert_roundtrip(a, t)


@pytest.mark.parametrize("max_overflow", ids("max_overflow", (0.0, 0.05, 0.1, 0.5, 1.0)))
@pytest.mark.parametrize("kind", ids("data", DATA_KINDS))
@pytest.mark.parametrize("codec", ids("codec", CODECS))
def test_default_target_ratio_bounds_overflow(codec, kind, max_overflow, store, gen):
    t = make_data(kind, 20_000, torch.bfloat16, gen)
    kwargs = {} if max_overflow == buddy.slots.DEFAULT_MAX_OVERFLOW else {"max_overflow": max_overflow}
    bt = buddy.compress(t, codec=codec, store=store, **kwargs)
    limit = max_overflow * bt.original_bytes
    assert bt.buddy_bytes <= limit
    s = bt.slot_sectors
    if s > 0:  # and it is the most aggressive such slot
        assert overflow_sectors(bt.histogram, s - 1) * 32 > limit
    if max_overflow == 0.0:
        assert bt.buddy_bytes == 0
    assert_roundtrip(bt, t)


def test_default_target_ratio_compresses_relu(store, gen):
    t = make_data("relu", 100_000, torch.float32, gen)
    bt = buddy.compress(t, store=store)
    assert bt.slot_sectors < 4 and bt.device_bytes < bt.original_bytes
    assert bt.buddy_bytes <= buddy.slots.DEFAULT_MAX_OVERFLOW * bt.original_bytes
    assert_roundtrip(bt, t)


# ---------------------------------------------------------------------------
# property: random structured bytes, any entry size, any slot, any codec
# ---------------------------------------------------------------------------
@fuzz_settings(0.6, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.binary(max_size=2500),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.float64, torch.int8, torch.complex64]),
    e_log=st.integers(5, 10),
    slot_frac=st.floats(0, 1),
    zero_every=st.integers(1, 5),
    codec=st.sampled_from(CODECS),
)
def test_roundtrip_property(data, dtype, e_log, slot_frac, zero_every, codec, store):
    size = torch.empty((), dtype=dtype).element_size()
    data = data[: len(data) // size * size]
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    t = raw.view(dtype).clone()
    # zero some words so zvc sees every density
    words = t.view(torch.uint8).view(-1, size) if size > 1 and t.numel() else t.view(torch.uint8).view(-1, 1)
    words[::zero_every] = 0
    e = 1 << e_log
    slot = round(slot_frac * (e // 32))
    bt = buddy.compress(t, target_ratio=spec.ratio_for_slot(slot, e), codec=codec, entry_bytes=e, store=store)
    assert bt.slot_sectors == slot
    assert_roundtrip(bt, t)
    bt.free()
    assert store.bytes_held == 0


# ---------------------------------------------------------------------------
# the data maker itself: the matrix above is only as good as its data
# ---------------------------------------------------------------------------
def test_make_data_is_deterministic_and_meaningful():
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for dtype in ALL_DTYPES:
        for kind in DATA_KINDS:
            a, b = make_data(kind, 1000, dtype, g1), make_data(kind, 1000, dtype, g2)
            assert a.dtype == dtype and a.shape == (1000,)
            assert torch.equal(raw_bytes(a), raw_bytes(b)), (dtype, kind)
    g = torch.Generator().manual_seed(0)
    relu = make_data("relu", 10_000, torch.float32, g)
    assert 0.4 < float((relu == 0).float().mean()) < 0.6
    rnd = make_data("random_bytes", 10_240, torch.float32, g)
    k = sizes("zvc", raw_bytes(rnd).view(-1, 128), 4)
    assert bool((k == 4).all()), "random bytes must be incompressible"
    sp = make_data("special", 1000, torch.float32, g)
    bits = sp.view(torch.int32)
    assert bool(torch.isnan(sp).any()) and bool(torch.isinf(sp).any())
    assert bool((bits == -(2**31)).any()), "-0.0 present"
    assert bool((bits == 0x7F800001).any()), "signalling NaN payload present"
    assert bool(((bits > 0) & (bits < 0x00800000)).any()), "denormal present"
