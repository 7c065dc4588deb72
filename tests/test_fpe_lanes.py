"""experiments.fpe_lanes: the lane simulation of the split layout's decoder, on small synthetic activations."""

from __future__ import annotations

import torch

from experiments import fpe_lanes


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
