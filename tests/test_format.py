"""The on-device / in-buddy-memory format: exact sizes, placement, metadata, damage, zvc by hand."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_bitexact, entry_payloads, ids, make_data, unpack_like

import buddy
from buddy import format as layout
from buddy import spec

CODECS = buddy.available_codecs("cpu")


def _clones(bt):
    return tuple(b.clone() for b in bt.buffers())


# ---------------------------------------------------------------------------
# truncation: the reported sizes are all the decoder needs
# ---------------------------------------------------------------------------
TRUNCATION_CASES = [
    pytest.param("random_bytes", torch.float32, 4.0, 128, True, id="data=random_bytes-ratio=4-overflows"),
    pytest.param("relu", torch.float32, 4.0, 128, True, id="data=relu-ratio=4-overflows"),
    pytest.param("relu", torch.bfloat16, math.inf, 128, True, id="data=relu-ratio=inf-overflows"),
    pytest.param("special", torch.float64, 2.0, 512, True, id="data=special-ratio=2-E=512-overflows"),
    pytest.param("relu", torch.float32, 1.0, 128, False, id="data=relu-ratio=1-fits"),
    pytest.param("zeros", torch.float32, 4.0, 128, False, id="data=zeros-ratio=4-fits"),
    pytest.param("random_bytes", torch.int8, 1.0, 4096, False, id="data=random_bytes-ratio=1-E=4096-fits"),
]


@pytest.mark.parametrize("codec", ids("codec", CODECS))
@pytest.mark.parametrize(("kind", "dtype", "ratio", "e", "overflows"), TRUNCATION_CASES)
def test_buffers_cut_to_reported_sizes_decode(kind, dtype, ratio, e, overflows, codec, store, gen):
    t = make_data(kind, 10_007, dtype, gen).view(-1)
    bt = buddy.compress(t, target_ratio=ratio, codec=codec, entry_bytes=e, store=store)
    meta, slots, overflow = _clones(bt)
    for b in (meta, slots, overflow):
        assert b.dtype == torch.uint8 and b.dim() == 1
    assert meta.numel() + slots.numel() + (0 if bt.table is None else bt.table.numel()) == bt.device_bytes
    assert overflow.numel() == bt.buddy_bytes
    assert meta.device == slots.device == t.device
    if codec == "zvc" or kind != "zeros":
        assert (bt.buddy_bytes > 0) == overflows
    bt_hist = bt.histogram
    s = bt.slot_sectors
    assert bt.buddy_bytes == sum(max(k - s, 0) * n for k, n in enumerate(bt_hist)) * spec.SECTOR_BYTES
    out = unpack_like(bt, meta, slots, overflow)
    assert_bitexact(out, t)
    # the clones do not depend on the tensor's own memory
    bt.free()
    assert_bitexact(unpack_like(bt, meta, slots, overflow), t)


# ---------------------------------------------------------------------------
# placement: slot i holds the first sectors of entry i's payload
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ids("codec", CODECS))
@pytest.mark.parametrize("slot", ids("slot", (0, 1, 2, 3, 4)))
@pytest.mark.parametrize("kind", ids("data", ("relu", "special", "random_bytes")))
def test_slots_and_overflow_hold_the_payload(kind, slot, codec, store, gen):
    e = 128
    t = make_data(kind, 1001, torch.float16, gen)  # 16 entries, the last one partial
    t[:64] = 0  # one all-zero entry
    bt = buddy.compress(t, target_ratio=spec.ratio_for_slot(slot, e), codec=codec, store=store)
    meta, slots, overflow = _clones(bt)
    entries, enc = entry_payloads(t, codec, e, table=bt.table)
    n = entries.shape[0]
    k, modes = layout.decode_meta(meta, e, n)
    assert torch.equal(k, enc.sectors.to(torch.int32))
    assert torch.equal(modes, enc.modes.to(torch.int32))
    assert list(bt.histogram) == torch.bincount(enc.sectors.long(), minlength=e // 32 + 1).tolist()
    slot_bytes = slot * 32
    expected_overflow = []
    for i in range(n):
        ki = int(k[i])
        payload = enc.payload[i]
        if ki == e // 32:
            assert torch.equal(payload, entries[i]), "k = E/32 must store the entry raw"
        assert not bool(payload[ki * 32 :].any()), "payload past k sectors must be zero"
        in_slot = min(ki, slot) * 32
        mine = slots[i * slot_bytes : (i + 1) * slot_bytes]
        assert torch.equal(mine[:in_slot], payload[:in_slot]), f"slot of entry {i}"
        assert not bool(mine[in_slot:].any()), f"slot padding of entry {i} must be zeros"
        expected_overflow.append(payload[slot_bytes : max(ki, slot) * 32])
    assert torch.equal(overflow, torch.cat(expected_overflow)), "overflow is the compacted spill in entry order"
    if codec == "zvc":
        assert int(k[0]) == 0, "the all-zero entry has k = 0"


def test_overflow_offsets_are_prefix_sums(store):
    """Entry i's overflow starts at sector sum_{j<i} max(k_j - s, 0)."""
    # 3 entries of 32 int32 words: 0 / 12 / 32 non-zero words -> k = 0, 2, 4 with E = 128
    words = torch.zeros(3, 32, dtype=torch.int32)
    words[1, :12] = torch.arange(1, 13)
    words[2] = torch.arange(100, 132)
    bt = buddy.compress(words, target_ratio=4.0, codec="zvc", store=store)
    assert bt.histogram == (1, 0, 1, 0, 1)
    _, slots, overflow = bt.buffers()
    assert overflow.numel() == (1 + 3) * 32
    # entry 1: second sector (words 7..11 of its packed body) is overflow sector 0
    _, enc = entry_payloads(words, "zvc", 128)
    assert torch.equal(overflow[:32], enc.payload[1, 32:64])
    assert torch.equal(overflow[32:], enc.payload[2, 32:128])
    assert torch.equal(slots[32:64], enc.payload[1, :32])
    assert torch.equal(slots[64:96], words[2].view(torch.uint8)[:32])


# ---------------------------------------------------------------------------
# metadata words
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("e", ids("E", (32, 128, 256, 512, 4096, 65536)))
def test_metadata_roundtrip_both_widths(e):
    mb, k_bits, mode_bits = spec.meta_fields(e)
    assert mb == (1 if e <= 256 else 2)
    assert (k_bits, mode_bits) == ((4, 4) if mb == 1 else (12, 4))
    spe = e // 32
    assert spe < 1 << k_bits, "the largest k must fit its field"
    k = torch.arange(spe + 1, dtype=torch.int32).repeat(16)
    modes = torch.arange(16, dtype=torch.int32).repeat_interleave(spe + 1)
    meta = layout.encode_meta(k, modes, e)
    assert meta.dtype == torch.uint8 and meta.numel() == k.numel() * mb
    k2, modes2 = layout.decode_meta(meta, e, k.numel())
    assert torch.equal(k2, k) and torch.equal(modes2, modes)
    # the bits, little endian: k in the low bits, mode above it
    expected = b"".join(int(a | (b << k_bits)).to_bytes(mb, "little") for a, b in zip(k.tolist(), modes.tolist()))
    assert bytes(meta.tolist()) == expected


def test_metadata_hand_worked():
    assert layout.encode_meta(torch.tensor([3]), torch.tensor([0]), 128).tolist() == [0x03]
    assert layout.encode_meta(torch.tensor([8]), torch.tensor([2]), 256).tolist() == [0x28]
    assert layout.encode_meta(torch.tensor([100]), torch.tensor([3]), 4096).tolist() == [0x64, 0x30]
    assert layout.encode_meta(torch.tensor([2048]), torch.tensor([15]), 65536).tolist() == [0x00, 0xF8]


def test_decode_meta_rejects_bad_buffers():
    ok = layout.encode_meta(torch.tensor([1, 2]), torch.tensor([0, 0]), 512)
    with pytest.raises(buddy.CorruptDataError):
        layout.decode_meta(ok[:-1], 512, 2)
    with pytest.raises(buddy.CorruptDataError):
        layout.decode_meta(ok.to(torch.int16), 512, 2)
    with pytest.raises(buddy.CorruptDataError):
        layout.decode_meta(layout.encode_meta(torch.tensor([17]), torch.tensor([0]), 512), 512, 1)
    with pytest.raises(buddy.CorruptDataError):
        layout.decode_meta(torch.tensor([5], dtype=torch.uint8), 128, 1)  # k = 5 > 4
    k, mode = layout.decode_meta(torch.tensor([4], dtype=torch.uint8), 128, 1)
    assert (int(k), int(mode)) == (4, 0)


# ---------------------------------------------------------------------------
# damaged inputs
# ---------------------------------------------------------------------------
@pytest.fixture
def overflowing(store, gen):
    """A zvc tensor whose overflow is non-empty, and clones of its buffers."""
    t = make_data("relu", 4000, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=4.0, codec="zvc", store=store)
    assert bt.buddy_bytes > 64
    return bt, _clones(bt)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda m, s, o: (m, s, o[:-32]), id="overflow-one-sector-short"),
        pytest.param(
            lambda m, s, o: (m, s, torch.cat([o, torch.zeros(32, dtype=torch.uint8)])), id="overflow-one-sector-long"
        ),
        pytest.param(lambda m, s, o: (m, s, o[:-1]), id="overflow-one-byte-short"),
        pytest.param(lambda m, s, o: (m, s[:-1], o), id="slots-one-byte-short"),
        pytest.param(
            lambda m, s, o: (m, torch.cat([s, torch.zeros(32, dtype=torch.uint8)]), o), id="slots-one-sector-long"
        ),
        pytest.param(lambda m, s, o: (m[:-1], s, o), id="meta-one-byte-short"),
        pytest.param(lambda m, s, o: (torch.cat([m, m[:1]]), s, o), id="meta-one-byte-long"),
        pytest.param(lambda m, s, o: (m.to(torch.int32), s, o), id="meta-wrong-dtype"),
    ],
)
def test_wrong_sizes_raise(overflowing, damage):
    bt, bufs = overflowing
    with pytest.raises(buddy.CorruptDataError):
        unpack_like(bt, *damage(*bufs))


def test_metadata_k_too_large_raises(overflowing):
    bt, (meta, slots, overflow) = overflowing
    meta[3] = (int(meta[3]) & 0xF0) | 5  # k = 5 > E/32 = 4
    with pytest.raises(buddy.CorruptDataError):
        unpack_like(bt, meta, slots, overflow)


def test_metadata_k_changed_raises(overflowing):
    """A different but legal k moves the overflow: the sizes no longer add up."""
    bt, (meta, slots, overflow) = overflowing
    i = int(((meta.to(torch.int32) & 0xF) == 3).nonzero()[0])
    meta[i] = (int(meta[i]) & 0xF0) | 4
    with pytest.raises(buddy.CorruptDataError):
        unpack_like(bt, meta, slots, overflow)


@pytest.mark.parametrize("codec", ids("codec", CODECS))
def test_unknown_mode_raises(codec, store, gen):
    impl = buddy.get_codec(codec)
    unknown = min(set(range(16)) - set(impl.modes))
    t = make_data("relu", 1000, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=2.0, codec=codec, store=store)
    meta, slots, overflow = _clones(bt)
    meta[5] = (int(meta[5]) & 0x0F) | (unknown << 4)
    with pytest.raises(buddy.CorruptDataError):
        unpack_like(bt, meta, slots, overflow)
    # the 2-byte words of E >= 512 carry the mode in the high nibble of their second byte
    bt = buddy.compress(t, target_ratio=2.0, codec=codec, entry_bytes=512, store=store)
    meta, slots, overflow = _clones(bt)
    meta[1] = (int(meta[1]) & 0x0F) | (unknown << 4)
    with pytest.raises(buddy.CorruptDataError):
        unpack_like(bt, meta, slots, overflow)


def test_raw_codec_rejects_compressed_sizes(store, gen):
    t = make_data("random_bytes", 256, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=1.0, codec="raw", store=store)
    meta, slots, overflow = _clones(bt)
    assert unpack_like(bt, meta, slots, overflow).shape == t.shape
    meta[0] = 2  # still fits the slot, so only the codec can object
    with pytest.raises(buddy.CorruptDataError):
        unpack_like(bt, meta, slots, overflow)


@pytest.mark.parametrize("slot", [5, -1, 2.0, True])
def test_unpack_rejects_impossible_slot_sizes(overflowing, slot):
    """A slot larger than an entry (or not an int) is a plain ValueError, whatever the buffer sizes."""
    bt, (meta, _, _) = overflowing
    n = bt.n_entries
    fake_slots = torch.zeros(n * 5 * 32, dtype=torch.uint8)  # sized to match slot_sectors=5
    with pytest.raises(ValueError):
        buddy.unpack(
            meta,
            fake_slots,
            torch.empty(0, dtype=torch.uint8),
            codec="zvc",
            entry_bytes=128,
            slot_sectors=slot,
            shape=bt.shape,
            dtype=bt.dtype,
        )


def test_unpack_rejects_bad_entry_bytes(overflowing):
    bt, (meta, slots, overflow) = overflowing
    with pytest.raises(ValueError):
        buddy.unpack(
            meta, slots, overflow, codec="zvc", entry_bytes=100, slot_sectors=1, shape=bt.shape, dtype=bt.dtype
        )


def test_unpack_rejects_a_different_codec(overflowing):
    bt, bufs = overflowing
    with pytest.raises(buddy.CorruptDataError):
        buddy.unpack(*bufs, codec="raw", entry_bytes=128, slot_sectors=1, shape=bt.shape, dtype=bt.dtype)


def test_full_slot_with_overflow_raises():
    slots = torch.zeros(128, dtype=torch.uint8)
    with pytest.raises(buddy.CorruptDataError):
        layout.join_payload(slots, torch.zeros(32, dtype=torch.uint8), torch.tensor([4], dtype=torch.int32), 4, 128)


# ---------------------------------------------------------------------------
# spec
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ratio", "slot"),
    [
        (math.inf, 0),
        (4, 1),
        (4.0, 1),
        (2, 2),
        (2.0, 2),
        (1.33, 3),
        (4 / 3, 3),
        (1.335, 3),
        (1, 4),
        (1.0, 4),
        (3.0, 2),
        (1.2, 4),
        (8.0, 1),
        (1e9, 1),
    ],
)
def test_slot_for_ratio(ratio, slot):
    assert spec.slot_for_ratio(ratio, 128) == slot


@pytest.mark.parametrize("e", ids("E", (32, 64, 128, 512, 65536)))
def test_slot_for_ratio_inverts_ratio_for_slot(e):
    for s in range(e // 32 + 1):
        assert spec.slot_for_ratio(spec.ratio_for_slot(s, e), e) == s
    assert spec.ratio_for_slot(0, e) == math.inf


@pytest.mark.parametrize("bad", [0.5, 0.99, 0, -1, math.nan, -math.inf])
def test_slot_for_ratio_value_errors(bad):
    with pytest.raises(ValueError):
        spec.slot_for_ratio(bad, 128)


@pytest.mark.parametrize("bad", ["2", None, True, [2.0]])
def test_slot_for_ratio_type_errors(bad):
    with pytest.raises(TypeError):
        spec.slot_for_ratio(bad, 128)


def test_entry_bytes_validation():
    for e in (32, 64, 128, 256, 512, 1024, 65536):
        assert spec.check_entry_bytes(e) == e
        assert spec.sectors_per_entry(e) == e // 32
    for bad in (0, 16, 100, 96, 2**17, -128):
        with pytest.raises(ValueError):
            spec.check_entry_bytes(bad)
    for bad in (128.0, "128", True):
        with pytest.raises(TypeError):
            spec.check_entry_bytes(bad)


def test_word_bytes():
    expected = {
        torch.bool: 1,
        torch.int8: 1,
        torch.uint8: 1,
        torch.float16: 2,
        torch.bfloat16: 2,
        torch.int16: 2,
        torch.float32: 4,
        torch.int32: 4,
        torch.float64: 8,
        torch.int64: 8,
        torch.complex64: 4,
        torch.complex128: 8,
    }
    for dtype, w in expected.items():
        assert spec.word_bytes(dtype) == w, dtype
