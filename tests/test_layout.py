"""buddy.layout.Layout: validation, and every derived count against the format's own formulas."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import buddy
from buddy import spec
from buddy.layout import WORD_SIZES, Layout
from buddy.slots import overflow_sectors

ENTRY_SIZES = [32, 64, 128, 256, 512, 4096, 65536]


def _awkward_sizes(e: int) -> list[int]:
    """0 bytes, 1 byte, one byte short of an entry, one entry, a partial last entry, several whole entries."""
    return [0, 1, e - 1, e, e + 1, 3 * e + 7, 5 * e]


CASES = [(e, n) for e in ENTRY_SIZES for n in _awkward_sizes(e)]


# ---- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("entry_bytes", [0, 16, 31, 48, 100, 4095, 65536 * 2, -4096])
def test_entry_bytes_not_a_power_of_two_in_range_is_a_value_error(entry_bytes):
    with pytest.raises(ValueError, match="entry_bytes"):
        Layout(entry_bytes, 100)


@pytest.mark.parametrize("entry_bytes", [4096.0, "4096", None, True])
def test_entry_bytes_not_an_int_is_a_type_error(entry_bytes):
    with pytest.raises(TypeError, match="entry_bytes"):
        Layout(entry_bytes, 100)


def test_nbytes_checked():
    with pytest.raises(ValueError, match="nbytes"):
        Layout(4096, -1)
    for bad in (1.0, "1", None, True):
        with pytest.raises(TypeError, match="nbytes"):
            Layout(4096, bad)


@pytest.mark.parametrize("word_bytes", [0, 3, 16, -1, True, 4.0, None])
def test_word_bytes_must_be_a_word_size(word_bytes):
    with pytest.raises(ValueError, match="word_bytes"):
        Layout(4096, 100, word_bytes)


def test_a_layout_is_a_frozen_value():
    a, b = Layout(4096, 100, 4), Layout(4096, 100, 4)
    assert a == b and hash(a) == hash(b) and a != Layout(4096, 100, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.nbytes = 7  # type: ignore[misc]
    assert Layout(512, 9).word_bytes == 1  # a tracker's layouts leave it at 1


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64, torch.bool])
def test_of_reads_the_tensor(dtype):
    t = torch.zeros(3, 1001, dtype=dtype)
    layout = Layout.of(t, 512)
    assert layout == Layout(512, t.numel() * t.element_size(), spec.word_bytes(dtype))
    assert layout.word_bytes in WORD_SIZES
    with pytest.raises(ValueError):
        Layout.of(t, 500)


# ---- derived counts, against the spec ----------------------------------------------------------
@pytest.mark.parametrize(("e", "n"), CASES)
def test_entries(e, n):
    layout = Layout(e, n)
    assert layout.n_entries == math.ceil(n / e)
    assert layout.n_full == n // e
    assert layout.tail_bytes == n % e
    assert layout.n_full * e + layout.tail_bytes == n
    assert layout.n_entries == layout.n_full + (layout.tail_bytes > 0)


@pytest.mark.parametrize(("e", "n"), CASES)
def test_metadata_and_sectors(e, n):
    layout = Layout(e, n, 2)
    assert layout.sectors_per_entry == spec.sectors_per_entry(e) == e // spec.SECTOR_BYTES
    assert layout.bins == spec.sectors_per_entry(e) + 1
    assert layout.meta_fields == spec.meta_fields(e)
    assert layout.entry_meta_bytes == spec.meta_bytes(e) == (1 if e <= 256 else 2)
    assert layout.meta_bytes == math.ceil(n / e) * spec.meta_bytes(e)


@pytest.mark.parametrize(("e", "n"), CASES)
def test_slot_byte_counts(e, n):
    layout = Layout(e, n)
    entries = math.ceil(n / e)
    for slot in sorted({0, 1, e // 64, e // 32}):
        assert layout.check_slot(slot) == slot
        assert layout.slots_bytes(slot) == entries * slot * spec.SECTOR_BYTES
        assert layout.device_bytes(slot) == entries * (slot * spec.SECTOR_BYTES + spec.meta_bytes(e))
        assert layout.device_bytes(slot, table_bytes=100) == layout.device_bytes(slot) + 100
        assert layout.ratio(slot) == spec.ratio_for_slot(slot, e)


@pytest.mark.parametrize("e", [32, 256, 4096])
def test_check_slot_refuses_what_no_entry_has(e):
    layout = Layout(e, 10 * e)
    for bad in (-1, e // 32 + 1, 1.0, True, None, "2"):
        with pytest.raises(ValueError, match="slot"):
            layout.check_slot(bad)


@pytest.mark.parametrize("e", [32, 512, 4096])
def test_histogram_byte_counts(e):
    spe = e // spec.SECTOR_BYTES
    gen = torch.Generator().manual_seed(e)
    histogram = torch.randint(0, 50, (spe + 1,), generator=gen).tolist()
    compacted = sum(k * c for k, c in enumerate(histogram)) * spec.SECTOR_BYTES
    assert Layout.compacted_bytes(histogram) == Layout(e, 0).compacted_bytes(histogram) == compacted
    assert Layout.compacted_bytes([]) == 0
    for slot in range(spe + 1):
        spilled = sum((k - slot) * c for k, c in enumerate(histogram) if k > slot) * spec.SECTOR_BYTES
        assert Layout.overflow_bytes(histogram, slot) == spilled == overflow_sectors(histogram, slot) * 32
    assert Layout.overflow_bytes(histogram, spe) == 0
    assert Layout.overflow_bytes(histogram, 0) == compacted
    # a predicted (float) histogram: whole sectors
    assert Layout.overflow_bytes([0.0, 0.5, 1.25], 0) == int(0.5 + 2.5) * spec.SECTOR_BYTES


# ---- what a compressed tensor reports is its layout's --------------------------------------------
@pytest.mark.parametrize(
    ("numel", "dtype", "entry_bytes"),
    [(0, torch.float32, 4096), (1, torch.uint8, 32), (1000, torch.float32, 4096), (3 * 64 + 5, torch.bfloat16, 128)],
)
def test_a_compressed_tensor_agrees_with_its_layout(numel, dtype, entry_bytes, store):
    gen = torch.Generator().manual_seed(numel)
    t = torch.relu(torch.randn(numel, generator=gen)).to(dtype)
    measured = buddy.measure(t, "zvc", entry_bytes=entry_bytes)
    layout = measured.layout
    assert layout == Layout.of(t, entry_bytes)
    assert measured.n_entries == layout.n_entries and measured.nbytes == layout.nbytes
    assert len(measured.histogram) == layout.bins and sum(measured.histogram) == layout.n_entries
    slot = layout.sectors_per_entry // 2
    with buddy.pack(measured, slot, store=store) as bt:
        assert bt.layout == layout
        assert bt.n_entries == layout.n_entries and bt.original_bytes == layout.nbytes
        assert bt.device_bytes == layout.device_bytes(slot)
        assert bt.buddy_bytes == layout.overflow_bytes(bt.histogram, slot)
        assert bt.compressed_bytes == layout.compacted_bytes(bt.histogram)
        assert bt.target_ratio == layout.ratio(slot)
        assert torch.equal(bt.decompress().view(torch.uint8), t.view(torch.uint8))
