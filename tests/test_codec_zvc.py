"""``zvc`` (zero-value compression): payloads worked by hand, sector boundaries, the bitmap, damage.

The codec shared suites (round trips, truncation, golden vectors, fuzzing)
cover zvc with the others; this file pins its own format down byte by byte.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from conftest import assert_bitexact, decode, encode, ids, raw_bytes, sizes, unpack_like

import buddy
from buddy import spec
from buddy.codecs.zvc import bitmap_geometry


def _clones(bt):
    return tuple(b.clone() for b in bt.buffers())


def _encode(values: torch.Tensor, entry_bytes: int):
    entries = raw_bytes(values).view(-1, entry_bytes)
    enc = encode("zvc", entries, spec.word_bytes(values.dtype))
    dec = decode("zvc", enc.payload, enc.sectors, enc.modes, spec.word_bytes(values.dtype))
    assert torch.equal(dec, entries)
    assert torch.equal(sizes("zvc", entries, spec.word_bytes(values.dtype)), enc.sectors)
    return entries, enc


def _f32(x: float) -> list[int]:
    return list(struct.pack("<f", x))


def test_zvc_float32_by_hand():
    # E = 64: 16 words, bitmap 2 bytes padded to 4, then the 2 non-zero words
    values = torch.tensor([0, 1.0, 0, 0, 2.0] + [0.0] * 11, dtype=torch.float32)
    _, enc = _encode(values, 64)
    assert enc.sectors.tolist() == [1] and enc.modes.tolist() == [0]
    expected = [0b00010010, 0, 0, 0] + _f32(1.0) + _f32(2.0)
    assert enc.payload[0].tolist() == expected + [0] * (64 - len(expected))


def test_zvc_float32_single_sector_entry_is_raw():
    # E = 32 (one sector): the same words would need 12 bytes, but k = 1 = E/32 means raw
    values = torch.tensor([0, 1.0, 0, 0, 2.0, 0, 0, 0], dtype=torch.float32)
    entries, enc = _encode(values, 32)
    assert enc.sectors.tolist() == [1]
    assert torch.equal(enc.payload, entries)


def test_zvc_float16_by_hand():
    # E = 64: 32 half words, bitmap 4 bytes (already 2-aligned)
    bits = torch.zeros(32, dtype=torch.int16)
    bits[1], bits[9], bits[31] = 0x3C00, -0x4000, 0x0001  # 1.0, -2.0, smallest denormal
    _, enc = _encode(bits.view(torch.float16), 64)
    assert enc.sectors.tolist() == [1]
    expected = [0x02, 0x02, 0x00, 0x80, 0x00, 0x3C, 0x00, 0xC0, 0x01, 0x00]
    assert enc.payload[0].tolist() == expected + [0] * (64 - len(expected))


def test_zvc_float64_by_hand():
    # E = 128: 16 words, bitmap 2 bytes padded to 8 (word-aligned), then 1.0 and -0.0
    values = torch.zeros(16, dtype=torch.float64)
    values[0], values[15] = 1.0, -0.0
    _, enc = _encode(values, 128)
    assert enc.sectors.tolist() == [1]
    expected = [0x01, 0x80, 0, 0, 0, 0, 0, 0] + list(struct.pack("<d", 1.0)) + list(struct.pack("<d", -0.0))
    assert enc.payload[0].tolist() == expected + [0] * (128 - len(expected))


def test_zvc_int8_by_hand():
    # E = 64: 64 byte words, bitmap 8 bytes, then the non-zero bytes
    values = torch.zeros(64, dtype=torch.int8)
    values[[0, 7, 8, 63]] = torch.tensor([1, -1, 5, 127], dtype=torch.int8)
    _, enc = _encode(values, 64)
    assert enc.sectors.tolist() == [1]
    expected = [0x81, 0x01, 0, 0, 0, 0, 0, 0x80, 0x01, 0xFF, 0x05, 0x7F]
    assert enc.payload[0].tolist() == expected + [0] * (64 - len(expected))


def test_zvc_negative_zero_is_not_zero():
    values = torch.zeros(32, dtype=torch.float32)
    values[7] = -0.0
    _, enc = _encode(values, 128)
    assert enc.sectors.tolist() == [1], "-0.0 has a set bit: zvc compares words, not values"


@pytest.mark.parametrize(
    ("nnz", "k"), [(0, 0), (1, 1), (7, 1), (8, 2), (15, 2), (16, 3), (23, 3), (24, 4), (31, 4), (32, 4)]
)
def test_zvc_sector_boundaries_float32(nnz, k):
    # E = 128, 32 words: k = ceil((4 + 4 * nnz) / 32), 4 = raw
    values = torch.zeros(32, dtype=torch.int32)
    values[:nnz] = torch.arange(1, nnz + 1)
    entries, enc = _encode(values, 128)
    assert enc.sectors.tolist() == [k]
    if k == 4:
        assert torch.equal(enc.payload, entries)


@pytest.mark.parametrize("e", ids("E", (32, 128, 4096)))
@pytest.mark.parametrize(
    "dtype",
    [pytest.param(d, id=f"dtype={n}") for d, n in ((torch.float32, "f32"), (torch.int8, "i8"), (torch.float64, "f64"))],
)
def test_zvc_all_zero_and_dense_entries(e, dtype):
    zeros = torch.zeros(e // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
    _, enc = _encode(zeros, e)
    assert enc.sectors.tolist() == [0]
    assert not bool(enc.payload.any())
    dense = torch.arange(1, zeros.numel() + 1).to(dtype)
    entries, enc = _encode(dense, e)
    assert enc.sectors.tolist() == [e // 32]
    assert torch.equal(enc.payload, entries)


def test_zvc_bitmap_geometry():
    assert bitmap_geometry(128, 4) == (32, 4, 4)
    assert bitmap_geometry(128, 8) == (16, 2, 8)
    assert bitmap_geometry(64, 2) == (32, 4, 4)
    assert bitmap_geometry(32, 1) == (32, 4, 4)
    assert bitmap_geometry(65536, 1) == (65536, 8192, 8192)


def test_zvc_bitmap_flip_that_changes_k_raises(store):
    # one entry of 32 int32 words, 7 non-zero: 4 bitmap bytes + 28 = 32 bytes -> k = 1
    words = torch.zeros(32, dtype=torch.int32)
    words[[0, 3, 5, 8, 13, 21, 30]] = torch.tensor([1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)
    bt = buddy.compress(words, target_ratio=1.0, codec="zvc", store=store)
    assert bt.histogram == (0, 1, 0, 0, 0)
    meta, slots, overflow = _clones(bt)
    assert slots[0] == 0b00101001  # words 0, 3 and 5
    assert_bitexact(unpack_like(bt, meta, slots, overflow), words)
    slots[0] ^= 0b00000100  # claim word 2 is non-zero too: 8 words need k = 2, metadata says 1
    with pytest.raises(buddy.CorruptDataError):
        unpack_like(bt, meta, slots, overflow)


def test_compressed_entry_bytes_end_to_end(store):
    """The hand-worked float32 entry, through compress: slot 0, so it all lands in overflow."""
    values = torch.tensor([0, 1.0, 0, 0, 2.0] + [0.0] * 11, dtype=torch.float32)
    bt = buddy.compress(values, target_ratio=math.inf, codec="zvc", entry_bytes=64, store=store)
    meta, slots, overflow = bt.buffers()
    assert meta.tolist() == [1] and slots.numel() == 0
    expected = [0b00010010, 0, 0, 0] + _f32(1.0) + _f32(2.0)
    assert overflow.tolist() == expected + [0] * (32 - len(expected))
