"""experiments/bench_cuda.py without a GPU: a clear exit, and its measuring code on CPU tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_data

from experiments import bench_cuda

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_exits_with_a_message_without_cuda(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench_cuda.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode != 0
    assert "bench_cuda" in result.stderr and "GPU" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_run_on_cpu_tensors(gen):
    tensors = {
        "relu.f32": make_data("relu", 70_001, torch.float32, gen),
        "relu.bf16": make_data("relu", 70_001, torch.bfloat16, gen),
    }
    lines = []
    result = bench_cuda.run(tensors, backends=("reference",), repeats=2, warmup=0, nvcomp=False, log=lines.append)
    methods = [(r["tensor"], r["method"]) for r in result["rows"]]
    assert methods == [(n, m) for n in tensors for m in ("memcpy", "buddy:zvc/reference")]
    for row in result["rows"]:
        assert row["comp_gbps"] > 0 and row["decomp_gbps"] > 0
        assert row["bytes"] == 70_001 * tensors[row["tensor"]].element_size()
    assert result["pcie"] == []  # CUDA only
    table = bench_cuda.format_table(result)
    assert "buddy:zvc/reference" in table and "memcpy" in table
    json.dumps(result)
    assert len(lines) == 2


def test_backends_must_agree(gen, monkeypatch):
    """Two backends that write different bytes stop the run."""
    t = make_data("relu", 10_000, torch.float32, gen)
    store = bench_cuda.buddy.BuddyStore(capacity_bytes=1 << 26, pin=False)
    a = bench_cuda.buddy.compress(t, target_ratio=2.0, store=store)
    b = bench_cuda.buddy.compress(t, target_ratio=2.0, store=store)
    bench_cuda.check_backends_agree("t", a, b)
    b.buffers()[1][0] ^= 1  # damage one slot byte
    with pytest.raises(bench_cuda.RoundTripError, match="slots"):
        bench_cuda.check_backends_agree("t", a, b)


def test_args():
    args = bench_cuda.parse_args([])
    assert (args.scale, args.big_mib, args.entry_bytes) == ("full", 256, 128)
    with pytest.raises(SystemExit):
        bench_cuda.parse_args(["--repeats", "0"])
