"""``auto``: per-entry choice of zero / zvc / fpx / bpc / raw, its metadata modes, and damage."""

from __future__ import annotations

import pytest
import torch
from conftest import decode, encode, make_data, raw_bytes, sizes

import buddy
from buddy.spec import AUTO_MODES

MODE_ZERO, MODE_RAW, MODE_ZVC, MODE_FPX, MODE_BPC = (AUTO_MODES[m] for m in ("zero", "raw", "zvc", "fpx", "bpc"))
AUTO = buddy.get_codec("auto")
SUBCODECS = {MODE_ZVC: "zvc", MODE_FPX: "fpx", MODE_BPC: "bpc"}


def _mixed_entries() -> torch.Tensor:
    """Five int32/float32 entries of 128 B, one for each mode."""
    g = torch.Generator().manual_seed(0)
    zero = torch.zeros(32, dtype=torch.int32)
    noise = torch.randint(-(2**31), 2**31 - 1, (32,), dtype=torch.int32, generator=g)
    sparse = torch.zeros(32, dtype=torch.int32)
    sparse[[3, 17]] = torch.tensor([123456789, -987654321], dtype=torch.int32)  # zvc: 4 + 8 bytes
    ramp = torch.arange(1000, 1032, dtype=torch.int32)  # bpc: base + run + all-ones plane
    floats = torch.zeros(32, dtype=torch.float32)
    floats[:8] = torch.tensor([1.0, 2.0, 3.0, 4.0] * 2)  # fpx: 253 bits, zvc 36 bytes
    return torch.stack([zero, noise, sparse, ramp, floats.view(torch.int32)]).view(torch.uint8)


def test_modes_are_declared():
    assert AUTO.modes == frozenset({MODE_ZERO, MODE_RAW, MODE_ZVC, MODE_FPX, MODE_BPC})
    assert (MODE_ZERO, MODE_RAW, MODE_ZVC, MODE_FPX, MODE_BPC) == (0, 1, 2, 3, 4)


def test_each_entry_takes_the_smallest_mode():
    entries = _mixed_entries()
    enc = encode(AUTO, entries, 4)
    assert enc.modes.tolist() == [MODE_ZERO, MODE_RAW, MODE_ZVC, MODE_BPC, MODE_FPX]
    assert enc.sectors.tolist() == [0, 4, 1, 1, 1]
    assert torch.equal(sizes(AUTO, entries, 4), enc.sectors)
    assert torch.equal(decode(AUTO, enc.payload, enc.sectors, enc.modes, 4), entries)
    assert not bool(enc.payload[0].any())
    assert torch.equal(enc.payload[1], entries[1])
    # a coded entry's payload is exactly its sub-codec's payload
    for i in (2, 3, 4):
        sub = encode(SUBCODECS[int(enc.modes[i])], entries[i : i + 1], 4)
        assert torch.equal(enc.payload[i], sub.payload[0])


@pytest.mark.parametrize("kind", ["relu", "special", "random_bytes", "zeros"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8])
def test_sizes_are_the_minimum_of_the_subcodecs(kind, dtype):
    t = make_data(kind, 4096, dtype, torch.Generator().manual_seed(1))
    entries = raw_bytes(t).view(-1, 128)
    w = buddy.spec.word_bytes(dtype)
    subs = torch.stack([sizes(n, entries, w) for n in ("zvc", "fpx", "bpc")])
    assert torch.equal(sizes(AUTO, entries, w), subs.min(0).values.to(torch.int32))


@pytest.mark.parametrize(
    ("entry", "k", "mode"),
    [
        pytest.param(0, 1, MODE_ZERO, id="zero-mode-with-sectors"),
        pytest.param(1, 3, MODE_RAW, id="raw-mode-with-fewer-sectors"),
        pytest.param(2, 4, MODE_ZVC, id="codec-mode-with-raw-size"),
        pytest.param(2, 0, MODE_ZVC, id="codec-mode-with-no-sectors"),
        pytest.param(3, 1, 7, id="undefined-mode"),
        pytest.param(3, 1, MODE_FPX, id="bpc-payload-read-as-fpx"),
        pytest.param(3, 2, MODE_BPC, id="bpc-with-the-wrong-k"),
    ],
)
def test_damaged_metadata_raises(entry, k, mode):
    entries = _mixed_entries()
    enc = encode(AUTO, entries, 4)
    sectors, modes = enc.sectors.clone(), enc.modes.clone()
    sectors[entry], modes[entry] = k, mode
    with pytest.raises(buddy.CorruptDataError):
        decode(AUTO, enc.payload, sectors, modes, 4)


def test_end_to_end_through_compress(store):
    t = _mixed_entries().view(torch.float32).repeat(40, 1)
    bt = buddy.compress(t, target_ratio=2.0, codec="auto", store=store)
    meta, _, _ = bt.buffers()
    assert sorted(set((meta >> 4).tolist())) == [MODE_ZERO, MODE_RAW, MODE_ZVC, MODE_FPX, MODE_BPC]
    assert torch.equal(bt.decompress().view(torch.uint8), t.view(torch.uint8))
