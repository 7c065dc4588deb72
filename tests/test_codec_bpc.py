"""``bpc`` worked by hand: exact payload bits and sizes, and damaged streams.

Expected streams are written as strings of bits in stream order (the first
character is stream bit 0: bit 0 of payload byte 0), built from the code
prefixes of the module docstring and LSB-first fields.
"""

from __future__ import annotations

import struct

import pytest
import torch
from conftest import decode, encode_values, field, raw_bytes, stream_bytes
from conftest import encode as encode_entries

import buddy
from buddy.codecs.bpc import geometry

CODEC = buddy.get_codec("bpc")


def run(n: int, rb: int) -> str:
    """A zero run of n planes."""
    return "001" if n == 1 else "01" + field(n - 2, rb)


ONES, DBP0 = "00000", "00001"


def two(pos: int, pb: int) -> str:
    return "00010" + field(pos, pb)


def one(pos: int, pb: int) -> str:
    return "00011" + field(pos, pb)


def raw_plane(bits: int, width: int) -> str:
    return "1" + field(bits, width)


def encode(values: torch.Tensor, entry_bytes: int = 128):
    """One entry of ``values``; checks decode and sizes, returns (entries, Encoded)."""
    entries, enc = encode_values(CODEC, values, entry_bytes)
    assert enc.modes.tolist() == [0] * entries.shape[0]
    return entries, enc


def check_stream(values: torch.Tensor, bits: str, entry_bytes: int = 128) -> None:
    _, enc = encode(values, entry_bytes)
    k = -(-len(bits) // 256)
    assert enc.sectors.tolist() == [k], f"{len(bits)} bits -> k = {k}"
    assert enc.payload[0].tolist() == stream_bytes(bits, entry_bytes)


def test_geometry_matches_the_paper_for_32_bit_words():
    g = geometry(128, 4)
    assert (g.word_bits, g.words, g.deltas, g.planes) == (32, 32, 31, 33)
    assert (g.pos_bits, g.run_bits) == (5, 5)
    assert geometry(128, 1) == g, "1-byte words are coded as 32-bit words"
    g16, g64 = geometry(128, 2), geometry(128, 8)
    assert (g16.word_bits, g16.deltas, g16.planes, g16.pos_bits, g16.run_bits) == (16, 63, 17, 6, 4)
    assert (g64.word_bits, g64.deltas, g64.planes, g64.pos_bits, g64.run_bits) == (64, 15, 65, 4, 6)


def test_all_equal_float32_words():
    # base 1.0f, then every delta is 0: one run of all 33 planes
    values = torch.full((32,), 1.0, dtype=torch.float32)
    bits = field(0x3F800000, 32) + run(33, 5)
    assert len(bits) == 39
    check_stream(values, bits)
    _, enc = encode(values)
    assert enc.payload[0, :5].tolist() == [0x00, 0x00, 0x80, 0x3F, 0b01111110]


def test_linear_ramp():
    # deltas all 1: DBP_0 is all ones, every other plane zero
    values = torch.arange(32, dtype=torch.int32)
    bits = field(0, 32) + run(32, 5) + ONES
    assert len(bits) == 44
    check_stream(values, bits)
    _, enc = encode(values)
    assert enc.payload[0, :6].tolist() == [0, 0, 0, 0, 0b01111010, 0]


def test_one_non_zero_word():
    # word 5 = 1.0f (0x3F800000): d_4 = +0x3F800000, d_5 = -0x3F800000 (33 bits: 0x1C0800000)
    values = torch.zeros(32, dtype=torch.float32)
    values[5] = 1.0
    bits = (
        field(0, 32)  # base
        + one(5, 5)  # DBX_32 = DBP_32 = {5}: the sign of d_5
        + run(2, 5)  # DBX_31, DBX_30: {5} ^ {5}
        + two(4, 5)  # DBX_29 = {4} ^ {5}
        + run(5, 5)  # DBX_28 .. DBX_24
        + one(5, 5)  # DBX_23 = {4, 5} ^ {4}
        + DBP0  # DBX_22 = 0 ^ {4, 5}: DBP_22 is zero
        + run(22, 5)  # DBX_21 .. DBX_0
    )
    assert len(bits) == 88
    check_stream(values, bits)


def test_raw_planes_and_all_ones():
    # 0, 3, 0, 3, ...: deltas +3, -3, ...
    values = torch.tensor([0, 3] * 16, dtype=torch.int32)
    odd = 0x2AAAAAAA  # the plane of the odd deltas (31 bits); the even ones make 0x55555555
    bits = (
        field(0, 32)
        + raw_plane(odd, 31)  # DBX_32 = DBP_32: the -3s are negative
        + run(30, 5)  # DBX_31 .. DBX_2: DBP_2 .. DBP_32 are all equal
        + ONES  # DBX_1 = DBP_1 ^ DBP_2 = even ^ odd
        + raw_plane(odd, 31)  # DBX_0 = DBP_0 ^ DBP_1 = all ones ^ even
    )
    assert len(bits) == 108
    check_stream(values, bits)


def test_single_run_of_one_plane():
    # d_0 = 0b1011, every other delta 0: DBP_3 = DBP_1 = DBP_0 = {0}, DBP_2 = 0
    values = torch.tensor([0] + [11] * 31, dtype=torch.int32)
    bits = (
        field(0, 32)
        + run(29, 5)  # DBX_32 .. DBX_4
        + one(0, 5)  # DBX_3 = {0} ^ 0
        + DBP0  # DBX_2 = 0 ^ {0}: DBP_2 is zero
        + one(0, 5)  # DBX_1 = {0} ^ 0
        + run(1, 5)  # DBX_0 = {0} ^ {0}
    )
    check_stream(values, bits)


def test_bfloat16_words_are_16_bit():
    values = torch.full((64,), 1.0, dtype=torch.bfloat16)  # 0x3F80
    bits = field(0x3F80, 16) + run(17, 4)
    check_stream(values, bits)
    _, enc = encode(values)
    assert enc.payload[0, :3].tolist() == [0x80, 0x3F, 0b00111110]


def test_float16_ramp_of_16_bit_words():
    # int16 0, 1, 2, ...: a 63-bit all-ones DBP_0
    values = torch.arange(64, dtype=torch.int16)
    check_stream(values, field(0, 16) + run(16, 4) + ONES)


def test_float64_words_are_64_bit():
    values = torch.full((16,), -2.5, dtype=torch.float64)
    (pattern,) = struct.unpack("<Q", struct.pack("<d", -2.5))
    check_stream(values, field(pattern, 64) + run(65, 6))


def test_bytes_are_grouped_into_32_bit_words():
    values = torch.tensor([1, 2, 3, 4] * 32, dtype=torch.uint8)  # every 32-bit word is 0x04030201
    check_stream(values, field(0x04030201, 32) + run(33, 5))


def test_long_planes_of_large_entries():
    # E = 4096, int16: 2047 deltas of 1 -> an all-ones plane of 2047 bits in one 5-bit code
    values = torch.arange(2048, dtype=torch.int16)
    check_stream(values, field(0, 16) + run(16, 4) + ONES, entry_bytes=4096)
    # a single 1 far into a long plane: word 1000 is 1, everything else 0
    values = torch.zeros(2048, dtype=torch.int16)
    values[1000] = 1
    g = geometry(4096, 2)
    assert g.pos_bits == 11
    # d_999 = +1, d_1000 = -1 (17 bits: all ones)
    bits = field(0, 16) + one(1000, 11) + run(15, 4) + one(999, 11)
    # DBX_16 = {1000}; DBX_15..1 = 0; DBX_0 = DBP_0 ^ DBP_1 = {999, 1000} ^ {1000}
    check_stream(values, bits, entry_bytes=4096)


def test_a_straddling_pair_of_ones():
    # E = 4096, int16: bits 31 and 32 of a plane lie in different 32-bit pieces
    values = torch.zeros(2048, dtype=torch.int16)
    values[32:] = 1  # d_31 = 1: DBP_0 = {31}
    values[33:] = 2  # d_32 = 1 as well: DBP_0 = {31, 32}
    check_stream(values, field(0, 16) + run(16, 4) + two(31, 11), entry_bytes=4096)


def test_zero_and_raw_entries():
    entries, enc = encode(torch.zeros(64, dtype=torch.float32), 128)
    assert enc.sectors.tolist() == [0, 0] and not bool(enc.payload.any())
    g = torch.Generator().manual_seed(5)
    noise = torch.randint(0, 256, (4 * 128,), dtype=torch.uint8, generator=g)
    entries, enc = encode(noise.view(torch.float32), 128)
    assert enc.sectors.tolist() == [4] * 4
    assert torch.equal(enc.payload, entries)


def test_encoded_size_equal_to_the_entry_is_raw():
    # E = 32: 8 words; even the best stream (base + 7-bit run) is one sector = the entry
    values = torch.full((8,), 7, dtype=torch.int32)
    entries, enc = encode(values, 32)
    assert enc.sectors.tolist() == [1]
    assert torch.equal(enc.payload, entries)


# ---------------------------------------------------------------------------
# damaged streams
# ---------------------------------------------------------------------------
def _payload(bits: str, entry_bytes: int = 128) -> torch.Tensor:
    return torch.tensor([stream_bytes(bits, entry_bytes)], dtype=torch.uint8)


def _decode(payload: torch.Tensor, k: int, word_bytes: int = 4):
    return decode(
        CODEC, payload, torch.tensor([k], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), word_bytes
    )


def test_decoding_a_hand_made_stream():
    out = _decode(_payload(field(0, 32) + run(32, 5) + ONES), 1)
    assert torch.equal(out.view(torch.int32), torch.arange(32, dtype=torch.int32).view(1, 32))


@pytest.mark.parametrize(
    ("bits", "k"),
    [
        pytest.param(field(0, 32) + run(32, 5) + ONES, 2, id="k-too-large-for-the-stream"),
        pytest.param(field(0, 32) + raw_plane(5, 31) * 8 + run(25, 5), 1, id="k-too-small-for-the-stream"),
        pytest.param(field(0, 32) + run(33, 5) + run(2, 5), 1, id="bits-set-after-the-stream"),
        pytest.param(field(0, 32) + ONES + run(33, 5), 1, id="run-longer-than-the-planes-left"),
        pytest.param(field(0, 32) + one(31, 5) + run(32, 5), 1, id="position-outside-the-plane"),
        pytest.param(field(0, 32) + run(32, 5) + two(30, 5), 1, id="pair-starting-at-the-last-bit"),
        pytest.param(field(0, 32) + DBP0 + run(32, 5), 1, id="dbp0-on-the-top-plane"),
        pytest.param(field(0, 32) + run(1, 5) + DBP0 + run(31, 5), 1, id="dbp0-below-a-zero-plane"),
        pytest.param(
            field(0, 32) + one(3, 5) + DBP0 + run(30, 5) + one(3, 5), 1, id="sign-plane-disagrees-with-the-words"
        ),
    ],
)
def test_damaged_streams_raise(bits, k):
    with pytest.raises(buddy.CorruptDataError):
        _decode(_payload(bits), k)


def test_damaged_stream_among_good_ones_raises():
    values = torch.arange(32 * 8, dtype=torch.int32) * 3
    entries = raw_bytes(values).view(-1, 128)
    enc = encode_entries(CODEC, entries, 4)
    assert enc.sectors.tolist() == [1] * 8
    payload = enc.payload.clone()
    payload[3, 4] ^= 0x01  # the first code of entry 3: a zero run becomes a raw plane
    with pytest.raises(buddy.CorruptDataError):
        decode(CODEC, payload, enc.sectors, enc.modes, 4)
