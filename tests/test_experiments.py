"""The experiment scripts' fast paths, on tiny settings."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("sklearn", reason="the experiments need buddy[experiments]")
pytest.importorskip("zstandard", reason="the experiments need buddy[experiments]")

from experiments import bench_codecs  # noqa: E402
from experiments.data import activation_tensors, sample_image_crops, stdlib_text_bytes  # noqa: E402


def test_data_is_real_and_deterministic():
    a, b = sample_image_crops(4, size=16, seed=3), sample_image_crops(4, size=16, seed=3)
    assert a.shape == (4, 3, 16, 16) and torch.equal(a, b)
    text = stdlib_text_bytes(4096)
    assert text.dtype == torch.uint8 and text.numel() == 4096
    assert b"def " in bytes(text.tolist())  # Python source, not noise
    acts = activation_tensors("tiny")
    relu = acts["cnn.relu"]
    assert (relu == 0).float().mean() > 0.2 and (relu >= 0).all()


def test_bench_codecs_tiny(tmp_path, capsys):
    rows = bench_codecs.main(["--scale", "tiny", "--repeats", "1", "--out", str(tmp_path), "--no-progress"])
    methods = {r.method for r in rows}
    assert {"memcpy", "zstd-3", "lz4"} | {f"buddy:{c}" for c in ("raw", "zvc")} <= methods
    for r in rows:
        assert r.comp_gbps > 0 and r.decomp_gbps > 0 and r.ratio > 0
    out = json.loads((tmp_path / "results.json").read_text())
    assert out["environment"]["torch"] == torch.__version__ and len(out["rows"]) == len(rows)
    assert (tmp_path / "results.csv").read_text().count("\n") == len(rows) + 1
    assert "buddy:zvc" in capsys.readouterr().out
