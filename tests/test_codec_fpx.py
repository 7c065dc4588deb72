"""``fpx`` worked by hand: exact payload bits, the per-entry choices, and damaged streams.

Expected streams are strings of bits in stream order (the first character is
bit 0 of payload byte 0), built from LSB-first fields as in the module
docstring.
"""

from __future__ import annotations

import struct

import pytest
import torch
from conftest import decode, encode_values, field, stream_bytes

import buddy
from buddy.codecs.fpx import header_geometry

CODEC = buddy.get_codec("fpx")


def bf16(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.bfloat16).view(torch.int16)) & 0xFFFF


def encode(values: torch.Tensor, entry_bytes: int = 128):
    """One entry of ``values``; checks decode and sizes, returns (entries, Encoded)."""
    return encode_values(CODEC, values, entry_bytes)


def check_stream(values: torch.Tensor, bits: str, entry_bytes: int = 128) -> None:
    _, enc = encode(values, entry_bytes)
    k = -(-len(bits) // 256)
    assert k < entry_bytes // 32, "the example must compress"
    assert enc.sectors.tolist() == [k], f"{len(bits)} bits -> k = {k}"
    assert enc.payload[0].tolist() == stream_bytes(bits, entry_bytes)


def test_header_geometry():
    assert [header_geometry(w).bits for w in (1, 2, 4, 8)] == [8, 13, 13, 16]
    assert [(header_geometry(w).e, header_geometry(w).m) for w in (1, 2, 4, 8)] == [(4, 3), (8, 7), (8, 23), (11, 52)]
    assert [header_geometry(w).b_bits for w in (1, 2, 4, 8)] == [3, 4, 4, 4]


def test_constant_bfloat16_entry_needs_no_codes():
    # 64 x 1.0: exponent 127 everywhere, b = 0, so each word is its 8-bit sign-mantissa (0)
    values = torch.ones(64, dtype=torch.bfloat16)
    header = "0" + field(127, 8) + field(0, 4)  # zmode 0, emax 127, b 0
    check_stream(values, header + field(0, 8) * 64)
    _, enc = encode(values)
    assert enc.payload[0, :3].tolist() == [0xFE, 0x00, 0x00]


def test_sparse_bfloat16_entry_with_an_escape():
    # E = 64: 32 words, 8 of them non-zero
    nonzero = [1.0, -1.5, 0.75, 3.0, 0.5, 2.0**-20, 1.25, -2.0]
    values = torch.zeros(32, dtype=torch.bfloat16)
    values[1::4] = torch.tensor(nonzero, dtype=torch.bfloat16)
    # exponents 127 127 126 128 126 107 127 128: emax 128, offsets 1 1 2 0 2 21 1 0;
    # b = 2 (codes 0..2, 3 = escape) costs 13 + 32 + 8 * 10 + 8 = 133 bits, the least
    codes = [1, 1, 2, 0, 2, 3, 1, 0]
    bits = "1" + field(128, 8) + field(2, 4)  # zmode 1 (bitmap)
    bits += field(0x22222222, 32)  # words 1, 5, 9, ..., 29
    for x, code in zip(nonzero, codes):
        p = bf16(x)
        bits += field(code, 2) + field((p >> 15) << 7 | (p & 0x7F), 8)
    bits += field(107, 8)  # the escaped exponent of 2**-20
    assert len(bits) == 133
    check_stream(values, bits, entry_bytes=64)


def test_float16_words_use_the_bfloat16_split():
    # float16 0x3C00 | low (low < 128): exponent 15 and the top 3 mantissa bits 0 make bits 7..14 = 120
    low = torch.arange(64) * 5 % 128
    values = (0x3C00 | low).to(torch.int16).view(torch.float16)
    bits = "0" + field(120, 8) + field(0, 4)  # zmode 0, emax 120, b 0: only the 8-bit sign-mantissas
    bits += "".join(field(int(v), 8) for v in low)
    assert len(bits) == 13 + 64 * 8
    check_stream(values, bits)


def test_float32_bitmap_entry():
    values = torch.zeros(32, dtype=torch.float32)
    values[:8] = torch.tensor([1.0, 2.0, 3.0, 4.0] * 2)
    # exponents 127 128 128 129: emax 129, offsets 2 1 1 0, b = 2 without escapes
    bits = "1" + field(129, 8) + field(2, 4) + field(0xFF, 32)
    for code, mantissa in [(2, 0), (1, 0), (1, 0x400000), (0, 0)] * 2:
        bits += field(code, 2) + field(mantissa, 24)
    assert len(bits) == 253
    check_stream(values, bits)


def test_float64_bitmap_entry():
    values = torch.zeros(16, dtype=torch.float64)
    values[3], values[10] = -3.5, 1.0
    (p,) = struct.unpack("<Q", struct.pack("<d", -3.5))
    sm = (p >> 63) << 52 | (p & ((1 << 52) - 1))
    bits = "1" + field(1024, 11) + field(2, 4) + field((1 << 3) | (1 << 10), 16)
    bits += field(0, 2) + field(sm, 53) + field(1, 2) + field(0, 53)
    assert len(bits) == 142
    check_stream(values, bits)


def test_negative_zero_is_listed():
    values = torch.zeros(64, dtype=torch.bfloat16)
    values[0] = -0.0
    _, enc = encode(values)
    assert enc.sectors.tolist() == [1]


def test_zero_and_raw_entries():
    _, enc = encode(torch.zeros(64, dtype=torch.float32))
    assert enc.sectors.tolist() == [0, 0] and not bool(enc.payload.any())
    noise = torch.randint(0, 256, (256,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    entries, enc = encode(noise.view(torch.float32))
    assert enc.sectors.tolist() == [4, 4] and torch.equal(enc.payload, entries)


def test_dense_bfloat16_normal_values_mostly_fit_three_sectors():
    # about 11.5 bits a value: most entries of 64 values fit 3 sectors of 32 B (768 bits)
    values = torch.randn(64 * 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    _, enc = encode(values)
    assert float((enc.sectors <= 3).float().mean()) > 0.6


# ---------------------------------------------------------------------------
# damaged streams
# ---------------------------------------------------------------------------
def _decode(bits: str, k: int, word_bytes: int = 2, entry_bytes: int = 128):
    payload = torch.tensor([stream_bytes(bits, entry_bytes)], dtype=torch.uint8)
    one = torch.tensor([k], dtype=torch.int32)
    return decode(CODEC, payload, one, torch.zeros_like(one), word_bytes)


def test_decoding_a_hand_made_stream():
    out = _decode("0" + field(127, 8) + field(0, 4) + field(0, 8) * 64, 3)
    assert torch.equal(out.view(torch.bfloat16).view(-1), torch.ones(64, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("bits", "k"),
    [
        pytest.param("0" + field(127, 8) + field(0, 4) + field(0, 8) * 64, 2, id="k-disagrees"),
        pytest.param("0" + field(127, 8) + field(0, 4) + field(0, 8) * 63 + "1" * 8 + "1", 3, id="bits-after"),
        pytest.param("0" + field(127, 8) + field(10, 4) + "0" * 600, 3, id="b-too-large"),
        pytest.param("0" + field(1, 8) + field(2, 4) + (field(2, 2) + field(0, 8)) * 64, 3, id="below-zero"),
        pytest.param("0" + field(1, 8) + field(2, 4) + (field(3, 2) + field(0, 8)) * 64, 3, id="escapes-past-k"),
    ],
)
def test_damaged_streams_raise(bits, k):
    with pytest.raises(buddy.CorruptDataError):
        _decode(bits, k)
