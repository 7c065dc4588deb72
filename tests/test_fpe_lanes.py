"""experiments.lab.fpe_lanes: the lane simulation of the split layout's decoder, on small synthetic activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from buddy.codecs import fpe
from experiments.lab import fpe_lanes


def test_lane_work_on_small_entries_stays_inside_each_stream():
    """At E = 512 a lane's warm-up can end exactly at the end of the code stream; the simulation must not read past
    it (it once did: an IndexError on these tensors)."""
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.relu(torch.randn(64, 1024, generator=g)) * torch.rand(64, 1, generator=g),
        torch.randn(32, 512, generator=g).to(torch.bfloat16),
        torch.relu(torch.randn(16, 2048, generator=g)).to(torch.bfloat16),
    ]
    rows = fpe_lanes.lane_work(tensors, 512, 40, torch.Generator().manual_seed(1))
    assert rows, "no coded entry simulated"
    for row in rows:
        assert row["passes"] >= 1 and 0 < row["k"] < 512 // 32
        assert row["find"] >= row["warm"] >= 0 and row["emit"] >= row["emit_steps"]


def test_warm_up_by_multi_rows_finds_the_starts_a_code_at_a_time_finds():
    """The warm-up steps a multi row at a time, as the kernel's (csrc/codec_fpe.h, ``warm_up``), stopping at the
    first code start at or past the guess inside a row: the lanes start where a decode a code at a time puts
    them (the same resynchronizing rounds), in fewer steps."""
    g = torch.Generator().manual_seed(2)
    tensors = [torch.relu(torch.randn(64, 1024, generator=g)), torch.randn(64, 2048, generator=g).to(torch.bfloat16)]
    by_row = fpe_lanes.lane_work(tensors, 4096, 8, torch.Generator().manual_seed(3))
    by_code = fpe_lanes.lane_work(tensors, 4096, 8, torch.Generator().manual_seed(3), use_multi=False)
    assert len(by_row) == len(by_code) > 0
    for row, code in zip(by_row, by_code):
        assert (row["passes"], row["rounds"]) == (code["passes"], code["rounds"])
        assert row["warm_mid"] + row["warm_tail"] == row["warm"] <= code["warm"]
    assert sum(r["warm"] for r in by_row) < sum(c["warm"] for c in by_code)


def _analysis(t: torch.Tensor, e: int, fit_rows: int):
    """An fpe analysis of ``t``'s entries with a table fitted to its first ``fit_rows`` entries (escapes after)."""
    word = t.element_size()
    flat = t.reshape(-1).view(torch.uint8)
    table = fpe.Table.from_counts(fpe.symbol_counts(flat[: fit_rows * e], word), word)
    return fpe.FPECodec(table).analyse(flat.view(-1, e), word), table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("tails", [False, True])
@pytest.mark.parametrize("unit", [0, 4])
def test_lockstep_layout_decodes_from_its_stream_alone(dtype, tails, unit):
    """The lockstep layout weighed for one walk: the decoder, reading only the stream the encoder wrote, gives every
    word's field back; with exact fetches (unit 0) the stream is the fields' bits and no more -- a lane never takes
    a bit that is not its own -- and with 4-bit units it pads a few bits a lane. Entries of ReLU words (ZERO's
    1-bit code: the lanes top up little), of escapes (a table fitted to other entries) and of a word size whose
    tails stay at the payload's end (8 bytes)."""
    if tails and dtype == torch.float64:
        pytest.skip("8-byte words keep their tails apart (checked below)")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(24, 2048, generator=g) * torch.rand(24, 1, generator=g) * 4
    x[:12] = torch.relu(x[:12])
    x[18:] *= 1e6  # exponents the table fitted to the first rows has no code for
    analysis, table = _analysis(x.to(dtype), 4096, 6)
    stream, run = fpe_lanes.lockstep_stream(analysis, table, tails=tails, unit=unit)
    heads, bits = fpe_lanes.lockstep_fields(analysis, tails)
    decoded = fpe_lanes.lockstep_read(stream, table, bits.shape[1], tails=tails, unit=unit)
    assert not decoded["bad"].any()
    assert np.array_equal(decoded["heads"], heads) and np.array_equal(decoded["lengths"], bits)
    assert np.array_equal(decoded["bits"], run["bits"]) and np.array_equal(decoded["lazy_rounds"], run["lazy_rounds"])
    padded = run["bits"] - bits.sum(1)
    if unit == 0:
        assert (padded == 0).all()
    else:
        assert (padded >= 0).all() and padded.max() <= (unit - 1) * fpe_lanes.LANES and padded.sum() > 0
    assert (run["lazy_rounds"] > 0).any() and (run["topup_rounds"] + run["partial_rounds"] > 0).all()


def test_lockstep_fields_put_each_tail_after_its_code():
    """With tails inline a word's field is its code, escaped symbol and tail -- the split layout's parts, put
    together -- and a ZERO word's is its code alone; 8-byte words refuse (a field of up to 76 bits)."""
    g = torch.Generator().manual_seed(6)
    x = torch.relu(torch.randn(4, 1024, generator=g))
    analysis, _ = _analysis(x, 4096, 4)
    heads, bits = fpe_lanes.lockstep_fields(analysis, tails=True)
    zero = (x.reshape(4, 1024) == 0).numpy()
    t = analysis.tail_bits
    assert np.array_equal(bits, analysis.head_bits.numpy() + t * ~zero)
    assert np.array_equal(heads >> analysis.head_bits.numpy(), analysis.tail.numpy())
    with pytest.raises(ValueError, match="8-byte"):
        fpe_lanes.lockstep_fields(_analysis(x.double(), 4096, 2)[0], tails=True)


def test_lockstep_flags_a_stream_no_code_begins():
    """With an incomplete code (ESC 00, then 010 and 011 for a symbol and ZERO: no code begins with 1) a lane whose
    bits begin with 1 stops and flags its entry, where its guess would find nothing to fetch towards; the other
    entry, of zero words, decodes."""
    table = fpe.Table(4, {(1 << 12) + 1: 2, 1 << 12: 3, 5: 3})
    analysis = fpe.FPECodec(table).analyse(torch.zeros(2, 4096, dtype=torch.uint8), 4)
    stream, run = fpe_lanes.lockstep_stream(analysis, table)
    assert (run["lengths"] == 3).all() and not run["bad"].any()
    stream[1, 3 * 32 * 5 :] = 1  # from about the sixth round on, entry 1's lanes meet 1s
    decoded = fpe_lanes.lockstep_read(stream, table, 1024)
    assert decoded["bad"].tolist() == [False, True]
    assert np.array_equal(decoded["heads"][0], run["heads"][0])


# every word size under ASan; under TSan those whose build the emulator's own tests make (no build more for CI)
_KERNEL_CASES = [(dtype, "asan") for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.uint8)] + [
    (dtype, "tsan") for dtype in (torch.bfloat16, torch.float64)
]


@pytest.mark.emulator
@pytest.mark.parametrize(("dtype", "build"), _KERNEL_CASES)
def test_lockstep_decoder_kernel_reads_the_simulations_streams(dtype, build):
    """The kernel sources' decoder of the lockstep layout (codec_fpe.h, decode_lockstep), under the block emulator
    (bounds with ASan, races on the staging with TSan), gives back every coded entry of the streams the simulation
    (experiments/lab/fpe_lanes.py) writes, byte for byte -- ReLU entries, escapes and, for 8-byte and 1-byte words,
    tails of 52 bits and none -- and flags an entry with a bit set between its codes and its tails (its words
    zeros, the others exact)."""
    from emulator import Emulator

    from buddy.codecs import fpe_device

    e = 4096
    g = torch.Generator().manual_seed(8)
    x = torch.randn(32, 2048, generator=g) * torch.rand(32, 1, generator=g) * 4
    x[:16] = torch.relu(x[:16])
    x[24:] *= 1e6
    x = (x * 16).clamp(0, 255).to(dtype) if dtype == torch.uint8 else x.to(dtype)
    everything, table = _analysis(x, e, 8)
    rows = ((everything.sectors > 0) & (everything.sectors < e // 32)).nonzero().view(-1)  # the coded entries
    assert rows.numel() >= 8
    want = x.reshape(-1).view(torch.uint8).view(-1, e).index_select(0, rows)
    analysis = fpe.FPECodec(table).analyse(want, x.element_size())
    payloads = torch.from_numpy(fpe_lanes.lockstep_payloads(analysis, table))
    gap = analysis.sectors * 256 - analysis.total_bits
    damaged = int((gap > 0).nonzero()[0])  # a bit set after its code section: its codes then do not end there
    c = int(analysis.code_bits[damaged])
    payloads[damaged, c // 8] |= 1 << (c % 8)
    sectors = analysis.sectors.to(torch.int32).contiguous()
    out = torch.zeros(rows.numel(), e, dtype=torch.uint8)
    error = torch.zeros(1, dtype=torch.int32)
    n, word = np.int64(rows.numel()), np.int32(x.element_size())
    with Emulator(build, seed=4) as emu:
        emu.run("buddy_fpe_lockstep_decode", e, (2, 64, fpe_device.DECODE_ROWS_BYTES + 2 * (e + 32)),
                (payloads, sectors, n, out, error, fpe_device.device_table(table), word))  # fmt: skip
    keep = torch.arange(rows.numel()) != damaged
    assert torch.equal(out[keep], want[keep])
    assert int(error) != 0 and not out[damaged].any()


def test_the_lockstep_bench_prepares_exact_streams_without_a_gpu():
    """experiments.lab.bench_lockstep's CPU half (the GPU times what it makes): the coded entries of a tensor and their
    lockstep payloads, which the simulation's decoder reads back into those entries' fields -- made chunk by chunk
    (a chunk smaller than the entries here), so that the chunks' payloads and sectors line up with the entries."""
    from experiments.lab import bench_lockstep

    g = torch.Generator().manual_seed(9)
    x = torch.relu(torch.randn(40, 1024, generator=g)) * torch.rand(40, 1, generator=g)
    x[30:] = 0  # zero entries: not coded, left out
    prep = bench_lockstep.Prepared(x, chunk=7)
    assert prep.entries.shape == (30, 4096) and prep.payloads.shape == (30, 4096 + 32)
    analysis = fpe.FPECodec(prep.table).analyse(prep.entries, 4)
    assert torch.equal(prep.sectors, analysis.sectors.to(torch.int32))
    run = fpe_lanes.lockstep_read(np.unpackbits(prep.payloads.numpy(), axis=1, bitorder="little"), prep.table, 1024)
    assert np.array_equal(run["heads"], analysis.head.numpy()) and not run["bad"].any()
