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

from buddy.engines import tuning
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
    result = bench_cuda.run(
        tensors, codecs=("zvc", "auto"), backends=("reference",), repeats=2, warmup=0, log=lines.append
    )
    methods = [(r["tensor"], r["method"]) for r in result["rows"]]
    expected = ("memcpy", "buddy:zvc/reference", "buddy:auto/reference")
    assert methods == [(n, m) for n in tensors for m in expected]
    for row in result["rows"]:
        assert row["compress_gbps"] > 0 and row["decompress_gbps"] > 0
        assert row["bytes"] == 70_001 * tensors[row["tensor"]].element_size()
        assert {"method", "dtype", "ratio", "compress_gbps", "decompress_gbps", "device"} <= row.keys()
    auto = [r for r in result["rows"] if r["method"] == "buddy:auto/reference"]
    assert all(
        r["entry_bytes"] == bench_cuda.buddy.defaults().entry_bytes and r["backend"] == "reference" for r in auto
    )
    assert all(r["compress_counts"] is None for r in auto)  # launches and syncs: counted on CUDA only
    assert result["pcie"] == []  # CUDA only
    table = bench_cuda.format_table(result)
    assert "buddy:auto/reference" in table and "memcpy" in table
    json.dumps(result)
    assert len(lines) == 6


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
    assert (args.mib, args.size, args.reference, args.no_nvcomp) == (256, "full", False, False)
    assert args.codecs == ["zvc", "fpx", "bpc", "auto", "fpe", "auto2"], "every codec with kernels"
    assert bench_cuda.buddy.defaults().codec in args.codecs, "the default codec is measured"
    with pytest.raises(SystemExit):
        bench_cuda.parse_args(["--repeats", "0"])
    with pytest.raises(SystemExit):
        bench_cuda.parse_args(["--codecs", "raw"])  # no kernels


def test_absent_nvcomp_stops_the_run_with_the_reason(monkeypatch):
    from experiments import bench_codecs

    def absent(device):
        raise bench_cuda.MissingDependencyError("the nvcomp baseline needs 'nvidia.nvcomp', which is not importable")

    monkeypatch.setattr(bench_codecs, "nvcomp_baselines", absent)
    with pytest.raises(SystemExit, match="(?s)nvcomp is required.*not importable.*--no-nvcomp"):
        bench_cuda.nvcomp_or_exit(torch.device("cpu"))


def test_a_failing_nvcomp_algorithm_is_recorded_not_dropped(gen):
    def refuse(data):
        raise RuntimeError("algorithm not supported")

    broken = bench_cuda.Baseline("nvcomp-broken", refuse, refuse, len, lambda out: out)
    x = make_data("relu", 10_000, torch.float32, gen)
    result = bench_cuda.run({"x": x}, codecs=("zvc",), backends=("reference",), repeats=1, warmup=0, baselines=[broken])
    assert [r["method"] for r in result["rows"]] == ["memcpy", "buddy:zvc/reference"]
    assert result["errors"] == [{"method": "nvcomp-broken", "tensor": "x", "error": "RuntimeError: algorithm not supported"}]


def test_activation_bytes_are_a_workloads_saved_tensors():
    """The benchmark's data: one training step's saved activations, in saving order, repeated to the size."""
    x = bench_cuda.activation_bytes(torch.float32, 1, "cpu", size="tiny", point=0)
    assert x.dtype == torch.float32 and x.numel() * 4 == 1 << 20
    from experiments.workloads import capture

    (cap,) = capture("resnet-fp32", size="tiny", points=(0,))
    first = cap.tensors[0].tensor.reshape(-1)
    assert torch.equal(x[: first.numel()].view(torch.int32), first.view(torch.int32))


class _Freed:
    buddy_bytes = 0

    def free(self):
        pass


def _fake_bench(seen: list, state):
    """A ``bench_buddy`` that times nothing: it notes ``(codec, *state(codec, backend))`` in ``seen`` as it runs."""

    def fake(name, x, codec, backend, store, repeats, warmup):
        seen.append((codec, *state(codec, backend)))
        return {"method": f"buddy:{codec}/{backend}", "tensor": name, "dtype": "float32", "compress_gbps": 1.0,
                "decompress_gbps": 1.0, "ratio": 1.0}, _Freed()  # fmt: skip

    return fake


def test_max_blocks_times_the_cuda_kernels_again_on_a_capped_grid(gen, monkeypatch):
    """--max-blocks: each codec's CUDA kernels once more per cap, the loader's block cap set while they run and
    restored after; the rows named by the cap."""
    seen = []
    monkeypatch.setattr(bench_cuda, "bench_buddy",
                        _fake_bench(seen, lambda codec, backend: (backend, bench_cuda.buddy.engines.launch.MAX_BLOCKS)))
    monkeypatch.setattr(bench_cuda, "check_backends_agree", lambda *a: None)
    before = bench_cuda.buddy.engines.launch.MAX_BLOCKS
    t = {"relu.f32": make_data("relu", 1_001, torch.float32, gen)}
    result = bench_cuda.run(t, codecs=("auto2",), backends=("cuda",), repeats=1, warmup=0, pcie=False,
                            max_blocks=(792, 1584), log=lambda line: None)  # fmt: skip
    assert seen == [("auto2", "cuda", before), ("auto2", "cuda", 792), ("auto2", "cuda", 1584)]
    assert bench_cuda.buddy.engines.launch.MAX_BLOCKS == before
    methods = [r["method"] for r in result["rows"]]
    assert methods == ["memcpy", "buddy:auto2/cuda", "buddy:auto2/cuda+blocks<=792", "buddy:auto2/cuda+blocks<=1584"]
    assert [r.get("max_blocks") for r in result["rows"]] == [None, None, 792, 1584]


@pytest.mark.parametrize(("option", "dtype", "change", "suffix"), [
    ("global_table", torch.float32, {"shared_tables": False}, "global-table"),
    ("other_count", torch.float32, {"count_match": False}, "count-ballot"),
    ("other_count", torch.bfloat16, {"count_match": True}, "count-match"),
    ("pack_fields", torch.float32, {"pack_fields": True}, "pack-fields"),
])  # fmt: skip
def test_variants_time_the_table_codecs_again(gen, monkeypatch, option, dtype, change, suffix):
    """--global-table (--other-count, --pack-fields): each table codec's CUDA kernels once more tuned with
    shared_tables=False (count_match set to the form the word size does not take by default, pack_fields=True)
    while they run (and the default tuning after), the rows named so; the other codecs once."""
    seen = []
    monkeypatch.setattr(bench_cuda, "bench_buddy", _fake_bench(seen, lambda codec, backend: (tuning.current(),)))
    monkeypatch.setattr(bench_cuda, "check_backends_agree", lambda *a: None)
    t = {"relu": make_data("relu", 1_001, dtype, gen)}
    result = bench_cuda.run(t, codecs=("zvc", "auto2"), backends=("cuda",), repeats=1, warmup=0, pcie=False,
                            log=lambda line: None, **{option: True})  # fmt: skip
    default = tuning.Tuning()
    assert seen == [("zvc", default), ("auto2", default), ("auto2", tuning.Tuning(**change))]
    assert [r["method"] for r in result["rows"]][1:] == ["buddy:zvc/cuda", "buddy:auto2/cuda",
                                                         f"buddy:auto2/cuda+{suffix}"]  # fmt: skip
    assert tuning.current() == default


def test_unpack_warps_time_the_table_codecs_at_fewer_warps(gen, monkeypatch):
    """--unpack-warps 8 16: each table codec's CUDA kernels once more for each, tuned unpack_warps while they run
    (and the default tuning after), the rows named and marked so; a codec without a table once."""
    seen = []
    monkeypatch.setattr(bench_cuda, "bench_buddy",
                        _fake_bench(seen, lambda codec, backend: (tuning.current().unpack_warps,)))  # fmt: skip
    monkeypatch.setattr(bench_cuda, "check_backends_agree", lambda *a: None)
    t = {"relu": make_data("relu", 1_001, torch.bfloat16, gen)}
    result = bench_cuda.run(t, codecs=("zvc", "auto2"), backends=("cuda",), repeats=1, warmup=0, pcie=False,
                            unpack_warps=(8, 16), log=lambda line: None)  # fmt: skip
    assert seen == [("zvc", None), ("auto2", None), ("auto2", 8), ("auto2", 16)]
    rows = result["rows"][1:]
    assert [r["method"] for r in rows] == ["buddy:zvc/cuda", "buddy:auto2/cuda", "buddy:auto2/cuda+unpack-warps=8",
                                           "buddy:auto2/cuda+unpack-warps=16"]  # fmt: skip
    assert [r.get("unpack_warps") for r in rows] == [None, None, 8, 16]
    assert tuning.current() == tuning.Tuning()
    with pytest.raises(SystemExit):
        bench_cuda.parse_args(["--unpack-warps", "0"])
