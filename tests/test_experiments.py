"""The experiment scripts' fast paths, on tiny settings."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

import buddy

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


@pytest.mark.exhaustive  # most of a minute: the exhaustive tier
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


TINY = ["--size", "tiny", "--workloads", "resnet-fp32", "lstm-fp32", "--no-progress"]


def test_capacity_tiny(tmp_path, capsys):
    from experiments import capacity

    rows = capacity.main([*TINY, "--out", str(tmp_path)])
    families = {(r["workload"], r["family"]) for r in rows}
    assert {("resnet-fp32", f) for f in ("FixedRatio", "BuddyThreshold", "DeviceBudget")} <= families
    for r in rows:
        assert r["capacity"] > 0.9 and 0 <= r["overflow_fraction"] <= 1
        if r["family"] == "BuddyThreshold" and r["policy"] == "0%":
            assert r["overflow_fraction"] == 0  # zero tolerance on the first (size-pass) point and after
        if r["family"] == "FixedRatio" and r["policy"] == "4.00x":
            assert r["capacity"] == pytest.approx(128 / 33)  # one sector + 1 B metadata per entry
    table = capsys.readouterr().out
    assert "geometric mean" in table and "1.5x" in table
    assert (tmp_path / "capacity_overview.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "results.json").read_text())["experiment"] == "capacity"


def test_compressibility_tiny(tmp_path):
    from experiments import compressibility

    rows = compressibility.main([*TINY, "--codecs", "zvc", "--entry-bytes", "128", "512", "--out", str(tmp_path)])
    methods = {(r["method"], r["entry_bytes"]) for r in rows}
    assert {("zvc", 128), ("zvc", 512), ("zstd-3", None), ("lz4", None), ("entropy-bound", None)} <= methods
    summary = compressibility.summarise(rows)
    assert all(s["ratio"] > 0 for s in summary)


def test_over_training_tiny(tmp_path):
    from experiments import over_training

    rows = over_training.main([*TINY, "--steps", "3", "--out", str(tmp_path), "--no-plot"])
    summary = over_training.summarise(rows)
    assert {s["workload"] for s in summary} == {"resnet-fp32", "lstm-fp32"}
    for s in summary:
        assert s["steps"] == 3 and s["predictions"] == s["keys"] * 2  # every key predicted after its first step


def test_over_training_resumes_what_an_interrupted_run_finished(tmp_path, monkeypatch, capsys):
    from experiments import over_training

    base = ["--size", "tiny", "--steps", "2", "--no-progress", "--no-plot", "--out", str(tmp_path)]
    first = over_training.main([*base, "--workloads", "lstm-fp32"])
    calls = []
    track = over_training.track
    monkeypatch.setattr(over_training, "track", lambda name, **kw: calls.append(name) or track(name, **kw))
    rows = over_training.main([*base, "--workloads", "lstm-fp32", "resnet-fp32", "--resume"])
    assert calls == ["resnet-fp32"], "the finished workload is kept, not run again"
    assert [r for r in rows if r["workload"] == "lstm-fp32"] == first
    assert "resumed from" in capsys.readouterr().out
    # other settings: nothing is kept
    calls.clear()
    over_training.main([*base, "--workloads", "lstm-fp32", "--every", "2", "--resume"])
    assert calls == ["lstm-fp32"] and "not resuming" in capsys.readouterr().out
    calls.clear()
    over_training.main([*base, "--workloads", "lstm-fp32", "--every", "2", "--count-every", "1", "--resume"])
    assert calls == ["lstm-fp32"] and "not resuming" in capsys.readouterr().out, "other counting: run again"


def test_over_training_passes_the_trackers_counting(monkeypatch, tmp_path):
    from experiments import over_training

    made = []
    tracker = buddy.Tracker
    monkeypatch.setattr(buddy, "Tracker", lambda *a, **kw: made.append(tracker(*a, **kw)) or made[-1])
    base = ["--size", "tiny", "--steps", "1", "--no-progress", "--no-plot", "--workloads", "lstm-fp32"]
    over_training.main([*base, "--count-every", "2", "--count-warmup", "5", "--out", str(tmp_path)])
    assert [(t.count_every, t.count_warmup) for t in made][-1] == (2, 5)
    settings = json.loads((tmp_path / "results.json").read_text())["settings"]
    assert (settings["count_every"], settings["count_warmup"]) == (2, 5)
    with pytest.raises(SystemExit):
        over_training.main([*base, "--count-every", "0", "--out", str(tmp_path)])


def test_main_job_tiny_reports_both_sets(tmp_path, capsys):
    from experiments import run

    args = ["--size", "tiny", "--workloads", "gpt-bf16", "resnet-bf16", "--check", "vit-bf16", "--codecs", "zvc"]
    result = run.main([*args, "--no-progress", "--out", str(tmp_path)])
    headline = result["capacity"]["zvc"]
    by = {r["workload"]: r for r in headline}
    assert [r["workload"] for r in headline[-2:]] == ["tuning set", "check set"]
    assert by["gpt-bf16"]["set"] == "tuning" and by["vit-bf16"]["set"] == "check"
    tuning, check = result["sets"]["zvc"]["tuning"], result["sets"]["zvc"]["check"]
    assert tuning["workloads"] == 2 and check["workloads"] == 1
    assert tuning["capacity"] == pytest.approx((by["gpt-bf16"]["capacity"] * by["resnet-bf16"]["capacity"]) ** 0.5)
    assert tuning["worst_overflow"] == max(by["gpt-bf16"]["overflow_fraction"], by["resnet-bf16"]["overflow_fraction"])
    assert check["capacity"] == pytest.approx(by["vit-bf16"]["capacity"])
    assert {r["workload"] for r in result["regions"]["zvc"]} == {"gpt-bf16", "resnet-bf16", "vit-bf16"}
    for png in ("capacity_gpt-bf16.png", "capacity_overview.png", "capacity_sets.png"):
        assert (tmp_path / "capacity-zvc" / png).stat().st_size > 10_000
    assert (tmp_path / "compressibility" / "results.csv").exists()
    saved = json.loads((tmp_path / "capacity-zvc" / "results.json").read_text())
    assert saved["sets"] == {"tuning": ["gpt-bf16", "resnet-bf16"], "check": ["vit-bf16"]}
    out = capsys.readouterr().out
    assert "Ideal compacted ratio" in out and "Generalisation" in out and "check set (1)" in out
    # the results page from these files: the run's table, command and machine, and its plots beside it
    from experiments import report

    page = tmp_path / "docs" / "results.md"
    report.main(["--results", str(tmp_path), "--out", str(page), "--readme", str(tmp_path / "no-readme.md")])
    text = page.read_text()
    assert f"| gpt-bf16 | tuning | {by['gpt-bf16']['ideal_ratio']:.2f} | {by['gpt-bf16']['capacity']:.2f} |" in text
    assert f"`python -m experiments.run {' '.join(args)} --no-progress --out {tmp_path}`" in text
    assert "cores, no GPU, torch" in text or torch.cuda.is_available()
    assert (tmp_path / "docs" / "img" / "main-capacity_sets-zvc.png").stat().st_size > 10_000


def test_step_cost_tiny(tmp_path):
    from experiments import step_cost

    args = ["--size", "tiny", "--workloads", "resnet-fp32", "--steps", "1", "--warmup", "0", "--no-progress"]
    (row,) = step_cost.main([*args, "--learn", "1", "--out", str(tmp_path)])
    assert (row["codec"], row["entry_bytes"], row["learn_steps"]) == (buddy.defaults().codec, buddy.defaults().entry_bytes, 1)
    assert row["none_cpu_s"] > 0 and row["buddy_cpu_s"] > 0 and row["capacity"] > 1
    assert row["cpu_ratio"] == pytest.approx(row["buddy_cpu_s"] / row["none_cpu_s"])
    assert row["ahead_cpu_ratio"] == pytest.approx(row["ahead_cpu_s"] / row["none_cpu_s"])
    # sized first: a read a tensor (those kept whole too) and backward's; ahead: the step's two
    assert row["host_reads"] >= row["tensors"] + 1 and row["ahead_host_reads"] == 2
    # one timed step: its kernels' seconds are the sum of its operations'; the rest of the added wall time the host's
    assert row["kernels_s"] == pytest.approx(sum(row["kernels_by_op_s"].values()))
    assert (row["kernels_s"] > 0) == (row["backend"] == "native")
    assert row["host_s"] == pytest.approx(row["buddy_wall_s"] - row["none_wall_s"] - row["kernels_s"])
    # the session's compresses and decompresses: at least their kernels, within the buddy step's wall time
    assert row["kernels_s"] <= row["calls_s"] <= row["buddy_wall_s"]
    added = row["buddy_wall_s"] - row["none_wall_s"]
    assert row["calls_share"] == (pytest.approx(row["calls_s"] / added) if added > 0 else None)
    # the main thread's CPU time: at most the process's; per tensor the host's work of the tensors the step compressed
    for kind in ("buddy", "none"):  # (the two clocks are read one after the other: a few microseconds apart)
        assert 0 < row[f"{kind}_main_s"] <= row[f"{kind}_cpu_s"] + 1e-3
    assert row["main_ratio"] == pytest.approx(row["buddy_main_s"] / row["none_main_s"])
    assert row["tensors"] >= 1 and row["host_per_tensor_us"] == pytest.approx(row["host_s"] / row["tensors"] * 1e6)
    assert json.loads((tmp_path / "results.json").read_text())["experiment"] == "step_cost"


def test_host_cost_tiny(tmp_path):
    from experiments import host_cost

    args = ["--tensors", "3", "6", "--numel", "2048", "--steps", "1", "--warmup", "1", "--saves", "20", "--no-progress",
            "--models"]  # (no model: test_host_cost_of_a_models_step)  # fmt: skip
    rows = host_cost.main([*args, "--out", str(tmp_path)])
    assert [r["tensors_asked"] for r in rows] == [3, 6]
    for row in rows:
        # each ReLU saves its output, which the next multiply saves again (one storage; the weights are leaves,
        # skipped): a tensor a link, and the first input unless the tracker keeps it whole (random: incompressible)
        assert row["tensors_asked"] <= row["tensors"] <= row["tensors_asked"] + 1
        assert row["buddy_step_s"] > 0 and row["plain_step_s"] > 0 and row["compress_us"] > 0
        assert row["decompress_us"] > 0 and row["plan_ms"] > 0
        added = (row["buddy_step_s"] - row["plain_step_s"]) / row["tensors"] * 1e6
        assert row["added_per_tensor_us"] == pytest.approx(added)
        # sized first, a read a tensor and backward's; ahead, the step's two
        assert row["host_reads"] >= row["tensors"] + 1 and row["ahead_host_reads"] == 2
        assert row["ahead_step_s"] > 0 and row["ahead_compress_us"] > 0 and row["ahead_decompress_us"] > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["experiment"] == "host_cost"
    # where a step packed ahead spends its host time: every stage timed, a compressed tensor's once a step each
    stages = {r["stage"]: r for r in saved["stages"]}
    assert {what for *_, what in host_cost.STAGES} <= set(stages)
    whole, tensors = stages["the step, all of it"]["us_per_tensor"], stages["the step, all of it"]["tensors"]
    for what in ("  the engine's pack ahead", "  a decompression", "launches of sizes (their host work, run)"):
        assert stages[what]["calls_per_step"] == tensors and stages[what]["us_per_tensor"] > 0, what
    assert stages["a tensor packed ahead"]["calls_per_step"] >= tensors  # (and those kept whole, measured ahead)
    assert whole > stages["the pack hook, every save"]["us_per_tensor"] > stages["a tensor packed ahead"]["us_per_tensor"]
    # a save buddy does not take: every kind timed, per save over the step without hooks
    kinds = {"identity_hooks_us", "detach_hooks_us", "buddy_disabled_us", "buddy_small_us"}
    assert set(saved["skipped_saves"]) == kinds


def test_host_cost_of_a_models_step():
    from experiments import host_cost

    row = host_cost.model_steps("mlp16-bf16", steps=1, warmup=0, device="cpu")
    assert row["tensors"] >= 16 and row["plain_step_s"] > 0 and row["buddy_ratio"] > 0 and row["ahead_ratio"] > 0
    # sized first: a read a tensor and backward's; ahead: the step's two, and fewer operators a tensor
    assert row["buddy_host_reads"] == row["taken"] + 1 and row["ahead_host_reads"] == 2
    assert 0 < row["ahead_operators_per_tensor"] < row["buddy_operators_per_tensor"]
    assert row["ahead_capacity"] > 1


def test_report_keeps_what_no_file_holds_and_says_where_each_date_comes_from(tmp_path):
    from experiments import report

    folder = tmp_path / "results" / "max_batch"
    folder.mkdir(parents=True)
    rows = [
        {"workload": "resnet-fp32", "method": method, "max_batch": batch, "vs_none": batch / 64, "step_seconds": s, "note": ""}
        for method, batch, s in (("none", 64, 0.1), ("buddy", 107, 5.0))
    ]
    environment = {"cpu": "some CPU", "cpu_count": 2, "torch": "2.13.0+cpu", "gpu": None}
    doc = {"experiment": "max_batch", "size": "tiny", "accounting": True, "environment": environment, "rows": rows}
    (folder / "results.json").write_text(json.dumps({**doc, "command": "python -m experiments.max_batch --size tiny"}))
    page, readme = tmp_path / "results.md", tmp_path / "README.md"
    kept = "## The decision table\n\nas it was\n"
    page.write_text(f"# Results\n\n<!-- report:decision -->\n{kept}<!-- /report:decision -->\n")
    readme.write_text("intro\n<!-- report:headline -->\nold\n<!-- /report:headline -->\nrest\n")
    report.main(["--results", str(tmp_path / "results"), "--out", str(page), "--readme", str(readme)])
    text = page.read_text()
    assert f"<!-- report:decision -->\n{kept}<!-- /report:decision -->" in text  # no decide file: kept word for word
    assert "| resnet-fp32 | tuning | 64 (1.00x); 0.10 s | 107 (1.67x); 5.00 s (50.0x) |" in text
    assert "`python -m experiments.max_batch --size tiny` — some CPU, 2 cores, no GPU, torch 2.13.0+cpu" in text
    assert "not in the file: the file's modification time" in text  # no date recorded, not in git
    assert "The main job" not in text  # neither a file nor an earlier section
    new = readme.read_text()
    assert new.startswith("intro\n<!-- report:headline -->\n|") and new.endswith("<!-- /report:headline -->\nrest\n")
    assert "old" not in new and "| 1.67x-1.67x | - |" in new


def test_report_headline_keeps_the_rows_no_file_holds(tmp_path):
    """A quick run's files regenerate the README's headline table without erasing the full-size record."""
    from experiments import report

    folder = tmp_path / "results" / "max_batch"
    folder.mkdir(parents=True)
    rows = [
        {"workload": "resnet-fp32", "method": method, "max_batch": batch, "vs_none": batch / 64, "step_seconds": 0.1,
         "note": ""}
        for method, batch in (("none", 64), ("buddy", 107))
    ]  # fmt: skip
    doc = {"experiment": "max_batch", "size": "tiny", "environment": {"cpu": "some CPU", "cpu_count": 2}, "rows": rows}
    (folder / "results.json").write_text(json.dumps({**doc, "command": "python -m experiments.max_batch --size tiny"}))
    full = "| capacity, `auto2` @ 4096 B, full size | 2.03x | 1.54x | 9.93 % | [2026-11-24](docs/results.md#x) |"
    speed = "On the CPU the reference path of `auto2` @ 4096 B compresses 0.045 GB/s (as it was)."
    old_batch = "| largest batch against none, full size | 0.66x-2.28x | 1.31x-1.56x | - | [2026-11-24](y) |"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n<!-- report:headline -->\n| | a |\n| --- | --- |\n{full}\n{old_batch}\n\n{speed}\n"
                      "<!-- /report:headline -->\nrest\n")  # fmt: skip
    page = tmp_path / "results.md"
    report.main(["--results", str(tmp_path / "results"), "--out", str(page), "--readme", str(readme)])
    block = readme.read_text().split("<!-- report:headline -->\n")[1].split("<!-- /report:headline -->")[0]
    lines = block.splitlines()
    assert lines[0].startswith("|  | tuning set | check set |")  # the table's own header, not the old one
    assert lines[2] == full  # no full-size file: the row as it was
    assert lines[3].startswith("| largest batch against none, tiny size | 1.67x-1.67x | - |")  # made from the file
    assert old_batch not in block and block.endswith(f"\n\n{speed}\n")  # no decision file: the line as it was


def test_report_headline_gives_the_native_engines_speed(tmp_path):
    """With a run of the CPU engines against lz4 and zstd, the README's line on the CPU speed is the default codec's
    native engine (its span over the tensors) beside theirs, not the reference path's."""
    from experiments import report

    def row(tensor, method, comp, decomp):
        return {"tensor": tensor, "dtype": "float32", "method": method, "ratio": 2.0, "comp_gbps": comp,
                "decomp_gbps": decomp}  # fmt: skip

    codec = buddy.defaults().codec
    rows = [row("a", f"buddy:{codec}@native", 1.25, 2.5), row("b", f"buddy:{codec}@native", 0.75, 1.5)]
    rows += [row("a", f"buddy:{codec}@reference", 0.04, 0.05), row("a", "lz4", 2.0, 6.0), row("b", "lz4", 1.0, 3.0)]
    rows += [row("a", "zstd-3", 0.3, 1.0), row("a", "memcpy", 9.0, 9.0)]
    for name, doc in (
        ("cpu_engines", {"experiment": "bench_codecs", "args": {"entry_bytes": 4096}, "rows": rows}),
        ("max_batch", {"experiment": "max_batch", "size": "tiny",
                       "rows": [{"workload": "resnet-fp32", "method": "buddy", "max_batch": 96, "vs_none": 1.5,
                                 "step_seconds": 0.2, "note": ""}]}),
    ):  # fmt: skip
        (tmp_path / "results" / name).mkdir(parents=True)
        doc["environment"] = {"torch_threads": 2}
        (tmp_path / "results" / name / "results.json").write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- report:headline -->\nOn the CPU the reference path of (old)\n<!-- /report:headline -->\n")
    out = tmp_path / "results.md"
    report.main(["--results", str(tmp_path / "results"), "--out", str(out), "--readme", str(readme)])
    block = readme.read_text()
    assert "reference path" not in block
    assert f"native engine of `{codec}` @ 4096 B compresses 0.75-1.25 GB/s and decompresses 1.50-2.50 GB/s" in block
    assert "on 2 threads (lz4: 1.00-2.00 / 3.00-6.00; zstd-3: 0.30-0.30 / 1.00-1.00, one thread each" in block
    assert "memcpy" not in block
    page = out.read_text()  # a row a method, a column a tensor
    assert f"| {codec}@native | 1.250 / 2.500 | 0.750 / 1.500 |" in page
    assert f"| {codec}@reference | 0.040 / 0.050 | - |" in page
    assert f"| {codec} | 2.00 | 2.00 |" in page and "| lz4 | 2.000 / 6.000 | 1.000 / 3.000 |" in page


def test_entropy_bound_and_simulation():
    from experiments.analysis import byte_entropy_bits, simulate_policy

    assert byte_entropy_bits(torch.zeros(100, dtype=torch.uint8)) == 0
    assert byte_entropy_bits(torch.arange(256, dtype=torch.uint8)) == pytest.approx(8)
    hist_sparse, hist_dense = [0, 10, 0, 0, 0], [0, 0, 0, 0, 10]
    points = [(0, [("a", hist_sparse, 1280)]), (1, [("a", hist_dense, 1280)]), (2, [("a", hist_dense, 1280)])]
    out = simulate_policy(points, __import__("buddy").BuddyThreshold(0.0), 128)
    assert [o.slot for o in out] == [1, 4, 4]  # the bound is checked on each step's own histogram
    assert out[1].buddy_bytes == 0 and out[1].predicted_overflow_bytes == 0
    # the history's miss shows where it predicts: the sparse step said slot 1 would spill nothing
    out = simulate_policy(points, __import__("buddy").FixedRatio(4.0), 128)
    assert [o.slot for o in out] == [1, 1, 1] and out[1].predicted_overflow_bytes == 0 < out[1].buddy_bytes


@pytest.mark.exhaustive  # most of a minute: the exhaustive tier
def test_decide_tiny(tmp_path, capsys):
    from experiments import decide

    args = ["--size", "tiny", "--workloads", "resnet-fp32", "--codecs", "zvc", "auto", "--entry-bytes", "128", "512"]
    args += ["--check", "llama-bf16"]
    result = decide.main([*args, "--repeats", "1", "--no-progress", "--out", str(tmp_path)])
    for r in result["decision"]:  # the tuning geomean is resnet-fp32's alone, the check set's llama-bf16's
        assert r["ratio:geomean"] == pytest.approx(r["ratio:resnet-fp32"])
        assert r["check:ratio:geomean"] == pytest.approx(r["ratio:llama-bf16"])
        if r["codec"] in ("zvc", "auto"):
            assert r["check:capacity:geomean"] == pytest.approx(r["capacity:llama-bf16"])
    chosen = result["chosen"]
    assert result["check"]["capacity"] == chosen["check:capacity:geomean"]
    assert "own_choice" in result["check"]
    labels = {r["method"] for r in result["decision"]}
    assert {"zvc@128", "auto@512", "zstd-3@128", "zstd-3", "lz4", "entropy (fields)"} <= labels
    assert {"auto@512 OverflowBudget", "zvc@128 OverflowBudget"} <= labels  # every codec x E under both policies
    assert result["chosen"]["policy"] in decide.POLICIES
    for r in result["decision"]:
        assert r["ratio:geomean"] > 0.9
        if r["codec"] in ("zvc", "auto"):
            assert r["capacity:geomean"] > 0.9 and r["compress_gbps"] > 0 and r["decompress_gbps"] > 0
    best = max(
        r["capacity:geomean"]
        for r in result["decision"]
        if r["codec"] in ("zvc", "auto") and r["overflow:max"] <= decide.POLICY_OVERFLOW
    )
    assert result["chosen"]["capacity:geomean"] >= best * (1 - decide.TIE)
    out = capsys.readouterr().out
    assert "chosen by measurement on the tuning set" in out and "Effective capacity" in out
    assert "on the check set (never used to choose)" in out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["chosen"]["codec"] in ("zvc", "auto") and saved["sets"]["check"] == ["llama-bf16"]
    assert "capacity" in saved["check"] and "text" not in saved["check"]
    assert (tmp_path / "entry_size.png").stat().st_size > 10_000


def test_decide_rule_prefers_smaller_entries_on_a_tie():
    from experiments.decide import decide

    rows = [
        {"codec": "auto", "entry_bytes": 4096, "capacity:geomean": 1.9, "overflow:max": 0.11, "compress_gbps": 1.0},
        {"codec": "auto", "entry_bytes": 1024, "capacity:geomean": 1.500, "compress_gbps": 1.0},
        {"codec": "auto", "entry_bytes": 512, "capacity:geomean": 1.495, "compress_gbps": 1.0},
        {"codec": "zvc", "entry_bytes": 512, "capacity:geomean": 1.496, "compress_gbps": 9.0},
        {"codec": "bpc", "entry_bytes": 128, "capacity:geomean": 1.20, "compress_gbps": 9.0},
        {"codec": "zstd-3@E", "entry_bytes": 128, "capacity:geomean": 9.0},
    ]
    # over the overflow limit: not eligible; within 1 %: the smaller E, then the faster codec
    assert (decide(rows)["codec"], decide(rows)["entry_bytes"]) == ("zvc", 512)
    with pytest.raises(ValueError):
        decide(rows[-1:])
    # the check set's columns never sway the choice, however good they look; the check set's own pick is apart
    rows[4]["check:capacity:geomean"], rows[4]["check:overflow:max"] = 9.0, 0.01
    assert (decide(rows)["codec"], decide(rows)["entry_bytes"]) == ("zvc", 512)
    assert decide(rows, prefix="check:")["codec"] == "bpc"
    # within 1 % at the same E: the per-tensor policy first
    rows = [
        {"codec": "auto", "entry_bytes": 512, "policy": "OverflowBudget", "capacity:geomean": 1.50, "overflow:max": 0.1},
        {"codec": "auto", "entry_bytes": 512, "policy": "BuddyThreshold", "capacity:geomean": 1.495},
    ]
    assert decide(rows)["policy"] == "BuddyThreshold"
    rows[1]["capacity:geomean"] = 1.40
    assert decide(rows)["policy"] == "OverflowBudget"


def test_field_entropy_and_entry_zstd():
    from experiments.analysis import entry_zstd_histogram, field_entropy_bits

    g = torch.Generator().manual_seed(0)
    # one exponent value, random 7-bit mantissas: 7 bits per bf16 value at most
    x = (1.0 + torch.randint(0, 128, (50_000,), generator=g) / 128).to(torch.bfloat16)
    assert 6.9 < field_entropy_bits(x) <= 7.0 + 1e-9
    assert field_entropy_bits(torch.zeros(1000)) == 0
    assert field_entropy_bits(torch.zeros(0)) == 0
    assert field_entropy_bits(torch.arange(256, dtype=torch.uint8)) == pytest.approx(8)
    y = torch.zeros(1000)
    y[300] = 1.5
    hist = entry_zstd_histogram(y, 128)  # 4000 bytes: 32 entries, the last padded
    assert sum(hist) == 32 and hist[0] == 31 and hist[1] == 1
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    assert entry_zstd_histogram(noise, 512) == [0] * 16 + [8]  # incompressible: raw


def test_capture_cache_reuses_and_keys_on_arguments(tmp_path, capsys):
    from experiments.analysis import data_bytes
    from experiments.common import capture_all

    kw = dict(size="tiny", points=(0,), device="cpu", seed=0, show=False, cache=tmp_path)
    first = capture_all(["gpt-bf16"], **kw)["gpt-bf16"]
    assert "captured in" in capsys.readouterr().out and len(list(tmp_path.glob("*.pt"))) == 1
    again = capture_all(["gpt-bf16"], **kw)["gpt-bf16"]
    assert "read from" in capsys.readouterr().out
    assert [t.key for t in again[0].tensors] == [t.key for t in first[0].tensors]
    for a, b in zip(again[0].tensors, first[0].tensors):
        assert a.tensor.stride() == b.tensor.stride()  # layouts are kept: transposed weights stay transposed
        assert torch.equal(data_bytes(a.tensor), data_bytes(b.tensor))
    capture_all(["gpt-bf16"], **{**kw, "seed": 1})
    assert len(list(tmp_path.glob("*.pt"))) == 2  # another seed, another entry


def test_histograms_come_from_one_measurement_and_match_buddys():
    import buddy
    from experiments.analysis import entry_sectors, histogram

    g = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(64, 1000, generator=g))  # 250 KiB, half zeros, a partial last entry
    for codec, entry_bytes in (("zvc", 128), ("auto", 512)):
        assert histogram(x, codec, entry_bytes) == buddy.size_histogram(x, codec, entry_bytes=entry_bytes)
    assert entry_sectors(x, "auto", 512) is entry_sectors(x, "auto", 512)  # sized once, remembered
    assert entry_sectors(x, "auto", 512).numel() == -(-x.numel() * 4 // 512)


def test_region_slots_on_a_case_worked_by_hand():
    """Two 64 KiB regions of 512-byte entries (128 entries each): the first compresses to 4 sectors, the second
    not at all (16). With a 10 % bound, one slot must hold 13 sectors: 16 - 13 = 3 sectors spill from half the
    entries, 9.4 % of the bytes; 12 would spill 12.5 %. Per region, each within 10 % of its own bytes: 3 and 15
    (1 sector of each entry, 6.25 %, in both). Per region at the same traffic as one slot (3 sectors of every
    raw entry): 4 and 13."""
    from experiments.analysis import REGION_BYTES, place_per_region, place_per_tensor, region_histograms

    e, n = 512, 256
    k = torch.tensor([4] * 128 + [16] * 128, dtype=torch.int32)
    nbytes = n * e
    assert REGION_BYTES == 128 * e
    assert region_histograms(k, e).tolist() == [[0] * 4 + [128] + [0] * 12, [0] * 16 + [128]]
    meta = n * 2  # 2 metadata bytes per entry at E = 512
    one = place_per_tensor(k, nbytes, e, 0.10)
    assert (one.device_bytes, one.buddy_bytes) == (n * 13 * 32 + meta, 128 * 3 * 32)
    each = place_per_region(k, nbytes, e, 0.10)
    assert (each.device_bytes, each.buddy_bytes) == (128 * (3 + 15) * 32 + meta + 2, 2 * 128 * 1 * 32)
    same = place_per_region(k, nbytes, e, budget_bytes=one.buddy_bytes)
    assert (same.device_bytes, same.buddy_bytes) == (128 * (4 + 13) * 32 + meta + 2, one.buddy_bytes)
    # uniform data: regions cannot beat one slot, and pay their table byte
    flat = torch.full((n,), 7, dtype=torch.int32)
    a = place_per_tensor(flat, nbytes, e, 0.10)  # slot 6: 1 of 7 sectors spills
    b = place_per_region(flat, nbytes, e, budget_bytes=a.buddy_bytes)
    assert b.device_bytes == a.device_bytes + 2 and b.buddy_bytes == a.buddy_bytes == n * 32
    # every region raw: kept as it is, like one raw slot
    raw = torch.full((n,), 16, dtype=torch.int32)
    assert (
        place_per_region(raw, nbytes, e, 0.0).device_bytes
        == place_per_tensor(raw, nbytes, e, 0.0).device_bytes
        == nbytes
    )
    with pytest.raises(ValueError):
        place_per_region(k, nbytes, e)


def test_report_shows_the_latest_gpu_sessions_bench_and_step_time(tmp_path, monkeypatch):
    from experiments import report

    assert report.gpu([], folder=tmp_path) is None  # no session committed: no section
    env = {"gpu": "NVIDIA H200", "driver": "580", "cuda": "13.0", "torch": "2.11", "cupy": "14", "nvcomp": "6"}
    bench = {"args": {"mib": 256, "repeats": 5, "warmup": 1}, "rows": [
        {"tensor": "t", "dtype": "float32", "method": "buddy:auto2/cuda", "ratio": 1.47, "compress_gbps": 99.6,
         "decompress_gbps": 181.6}]}  # fmt: skip
    step = {"models": {"gpt2": "a decoder"}, "verdicts": ["  gpt2: NOT met"], "rows": [
        {"model": "gpt2", "method": "buddy", "step_ms": 1694.2, "vs_none": 33.7, "peak_gib": 15.1, "capacity": 1.03}]}
    for day, gbps in (("2026-11-26-h100", 1.0), ("2026-11-27-h200", 99.6)):
        (tmp_path / day).mkdir()
        bench["rows"][0]["compress_gbps"] = gbps
        record = {"command": "bash experiments/gpu_session.sh lease", "environment": env, "finished": day,
                  "steps": [{"name": "bench_cuda", "result": bench}, {"name": "step_time", "result": step}]}
        (tmp_path / day / "essentials.json").write_text(json.dumps(record))
    (tmp_path / "2026-11-27-h200" / "sanitize.json").write_text(json.dumps({"steps": [{"name": "sanitize-memcheck"}]}))
    monkeypatch.setattr(report, "ROOT", tmp_path.parent)  # the files' folder is named relative to it
    section = report.gpu([], folder=tmp_path)
    assert section is not None and section.key == "gpu"
    assert "| buddy:auto2/cuda | 1.47 | 100 / 182 |" in section.body  # the latest session's
    assert "| gpt2 | buddy | 1,694.2 | 33.70 | 15.10 | 1.03 |" in section.body and "* gpt2: NOT met" in section.body
    assert "NVIDIA H200, driver 580" in section.body and "2026-11-27-h200" in section.body
    # the step phase's record, newer in the same folder: its step table (every method), what each step held at its
    # peak, and the largest batches under the cap
    peak = {"peak_bytes": 3 * 2**30, "sites": [{"site": "before the step", "bytes": 2**30, "allocations": None},
                                               {"site": "buddy cuda.py:pack", "bytes": 2**30, "allocations": 2}]}
    rows = [{"model": "gpt2", "method": "buddy-model", "step_ms": 70.0, "vs_none": 1.4, "peak_gib": 9.0,
             "capacity": 1.3, "memory_peak": peak}]
    batch = {"rows": [{"workload": "gpt2 (step_time)", "method": "buddy", "budget_mib": 16000.0, "max_batch": 24,
                       "vs_none": 1.5, "note": ""}]}
    record = {"command": "x", "environment": env, "steps": [{"name": "step_time", "result": {"rows": rows}},
                                                            {"name": "max_batch", "result": batch}]}
    (tmp_path / "2026-11-27-h200" / "step.json").write_text(json.dumps(record))
    body = report.gpu([], folder=tmp_path).body
    assert "| gpt2 | buddy-model | 70.0 | 1.40 | 9.00 | 1.30 |" in body and "1,694.2" not in body
    assert "(`2026-11-27-h200/step.json`)" in body
    assert "* gpt2 / buddy-model: 3.00 GiB -- before the step 1.00; buddy cuda.py:pack 1.00 (GiB)" in body
    assert "| gpt2 (step_time) | buddy | 16,000 | 24 | 1.50 |  |" in body
    assert "| buddy:auto2/cuda | 1.47 | 100 / 182 |" in body  # the bench: essentials' still
    batch["rows"][0] |= {"max_batch": 0, "note": "Expected a torch.device with a specified index"}  # a failed search
    (tmp_path / "2026-11-27-h200" / "step.json").write_text(json.dumps(record))
    body = report.gpu([], folder=tmp_path).body
    assert "found no batch anywhere: Expected a torch.device with a specified index." in body
    assert "| 16,000 |" not in body


def test_region_report_per_workload_and_set():
    from experiments import regions
    from experiments.common import capture_all

    caps = capture_all(["gpt-bf16", "vit-bf16"], size="tiny", points=(0,), device="cpu", seed=0, show=False)
    rows = regions.analyse(caps, codec="auto", entry_bytes=512, show=False)
    summary = regions.summarise(rows, {"tuning": ["gpt-bf16"], "check": ["vit-bf16"]})
    assert [r["workload"] for r in summary] == ["tuning set", "check set"]
    for r in rows:
        assert r["same_overflow"] <= r["tensor_overflow"] + 1e-12  # same traffic at most
        assert r["gain"] == pytest.approx(r["same_capacity"] / r["tensor_capacity"] - 1)
    assert "per region (same traffic)" in regions.format_rows(rows, summary)


@pytest.mark.exhaustive  # most of a minute: the exhaustive tier
def test_step_time_tiny(tmp_path, capsys):
    from experiments import step_time

    argv = ["--device", "cpu", "--models", "resnet50", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]
    rows = step_time.main([*argv, "--methods", "none", "buddy-offload", "checkpoint", "buddy-model", "--no-progress",
                           "--profile", "--memory-peak"])  # fmt: skip
    assert [r["method"] for r in rows] == ["none", "buddy-offload", "checkpoint", "buddy-model"]
    model_only = rows[3]["buddy"]  # the block around the model alone: its activations compressed, not the loss's
    assert model_only["original_bytes"] > 0 and model_only["device_bytes"] < model_only["original_bytes"]
    rows = rows[:3]
    assert all(r["memory_peak"] is None for r in rows)  # the allocator's history: a CUDA device only
    # --profile (the GPU lease's): one more step of each buddy method under cProfile and the PyTorch profiler
    assert rows[0]["profile"] is None and rows[2]["profile"] is None
    profiled = rows[1]["profile"]
    assert profiled["wall_ms_under_cprofile"] > 0 and profiled["python"] and profiled["ops"]
    for r in rows:
        assert r["step_ms"] > 0 and r["device"] == "cpu" and r["peak_bytes"] is None
        # a CPU run's capacity: one more step's peak resident memory above its start, against none's (Linux)
        assert r["host_peak_bytes"] is None or r["capacity"] == pytest.approx(
            rows[0]["host_peak_bytes"] / r["host_peak_bytes"]
        )
    offload = rows[1]["buddy"]
    assert offload["original_bytes"] > 0 and offload["device_bytes"] < offload["original_bytes"] / 50
    out = capsys.readouterr().out
    assert "CPU RUN" in out and "not GPU times" in out
    assert "resnet50 / none: needs a CUDA device" in out
    # a line as each method is measured (--no-progress, the runbook's): what a run stopped by its time limit keeps
    assert out.index("  measured resnet50 / none: ") < out.index("  measured resnet50 / buddy-model: ")
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["cpu_run"] and results["experiment"] == "step_time" and len(results["rows"]) == 4
    assert (tmp_path / "step_time.png").stat().st_size > 10_000


@pytest.mark.exhaustive  # most of a minute: the exhaustive tier
def test_frontier_tiny(tmp_path, capsys):
    from experiments import frontier

    argv = ["--device", "cpu", "--models", "resnet50", "--batch", "1", "--steps", "1", "--warmup", "2",
            "--methods", "buddy-target-0.5", "buddy+checkpoint", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    rows = frontier.main(argv)
    assert [r["method"] for r in rows] == ["none", "buddy-target-0.5", "buddy+checkpoint"]  # none: what all are set against
    for r in rows[1:]:
        assert r["buddy"]["original_bytes"] > 0 and r["buddy"]["device_bytes"] < r["buddy"]["original_bytes"]
    # with checkpointing, the session takes what checkpointing keeps: fewer bytes than the model saves whole
    assert rows[2]["buddy"]["original_bytes"] < rows[1]["buddy"]["original_bytes"]
    out = capsys.readouterr().out
    assert "time vs none" in out and "  measured resnet50 / buddy+checkpoint: " in out  # (a line as each is made)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["cpu_run"] and results["experiment"] == "frontier"
    assert (tmp_path / "frontier.png").stat().st_size > 10_000


def test_a_cuda_run_exits_when_the_kernels_fail_their_self_test(monkeypatch):
    """On an H200 the kernels of auto2 failed their self-test (a compile error), every buddy method then ran the
    torch reference, and step_time spent its whole 150 s on it: a GPU run now stops at once, saying why."""
    from buddy import dispatch
    from experiments import common

    calls = []

    def engine(codec, device, backend=None):  # what dispatch records after a self-test, without a GPU
        calls.append((codec.name, str(device), backend))
        assert str(device) == "cuda:0"  # the device's index, as the dispatch records it
        dispatch._record("cuda:0", codec.name, outcome["backend"], outcome["why"])

    monkeypatch.setattr(dispatch, "engine", engine)
    monkeypatch.setattr(dispatch, "_CHOSEN", {})
    monkeypatch.setattr(buddy.engines.cuda, "why_unusable", lambda: None)
    monkeypatch.setattr(common, "require_cuda", lambda what: None)  # as on a GPU machine with CuPy
    monkeypatch.setattr(common, "require", lambda name, what: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    outcome = {"backend": "reference", "why": "CompileException: static assertion failed"}
    default = buddy.defaults().codec  # (the tests' default, the one a run compresses with)
    with pytest.raises(SystemExit, match=f"kernels of codec '{default}' cannot run on cuda.*CompileException"):
        common.choose_backend("step_time", None, "cuda")
    with pytest.raises(SystemExit, match="CompileException"):
        common.choose_backend("step_time", "cuda", "cuda")  # asked for explicitly: the same
    outcome = {"backend": "cuda", "why": "self-test passed in 0.1 s"}
    assert common.choose_backend("step_time", None, "cuda") == "cuda"
    assert calls and {c[0] for c in calls} == {default}
    calls.clear()
    assert common.choose_backend("step_time", None, "cpu") == "auto"  # the CPU: what buddy runs there by default
    assert common.choose_backend("step_time", "reference", "cuda") == "reference"
    assert not calls


@pytest.mark.gpu
def test_side_stream_offload_is_exact(cuda):
    from experiments.step_time import SideStreamOffload

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.GELU())]).to(cuda)
    x = torch.randn(1024, 1024, device=cuda)

    def grads(context):
        model.zero_grad()
        with context:
            loss = model(x).square().sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(SideStreamOffload()), grads(contextlib.nullcontext())):
        assert torch.equal(a, b)


def test_learned_tables_tiny(tmp_path, capsys):
    from experiments.lab import learned_tables

    rows = learned_tables.main(["--size", "tiny", "--workloads", "gpt-bf16", "--no-progress", "--out", str(tmp_path)])
    (row,) = rows
    assert row["codec"] == "auto2" and row["tensors"] > 0  # the suite's default (zvc) has no table; keys seen twice
    assert row["cost"] == pytest.approx(row["own_ratio"] / row["learned_ratio"] - 1)
    assert abs(row["cost"]) < 0.2  # two steps apart, the key's statistics barely move
    assert json.loads((tmp_path / "results.json").read_text())["rows"][0]["tensors"] == row["tensors"]
    assert "previous point's table" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        learned_tables.main(["--codec", "zvc"])  # a codec without a table has nothing to learn


def test_context_bound():
    from experiments.lab.context_bound import context_bits

    g = torch.Generator().manual_seed(0)
    # two exponents taking turns: one bit a word at order 0, none given the previous word's
    x = torch.tensor([1.5, 96.0] * 4096, dtype=torch.float32) * (1 + torch.rand(8192, generator=g) / 4)
    bits = context_bits(x)
    assert bits["previous"] < bits["order0"] - 0.99 * 8192, "a bit less per word"
    # independent values: no context helps (a few bits of estimation bias at most)
    y = torch.randn(1 << 16, generator=g).to(torch.bfloat16)
    bits = context_bits(y)
    assert bits["order0"] >= bits["previous"] >= bits["top"] > 0.98 * bits["order0"]
    assert context_bits(torch.arange(10)) is None


def test_context_bound_tiny(tmp_path):
    from experiments.lab import context_bound

    args = ["--size", "tiny", "--workloads", "gpt-bf16", "lstm-fp32", "--no-progress", "--out", str(tmp_path)]
    rows = {r["workload"]: r for r in context_bound.main(args)}
    assert set(rows) == {"gpt-bf16", "lstm-fp32", "tuning set"}
    for r in rows.values():
        assert r["top_ratio"] >= r["previous_ratio"] >= r["order0_ratio"] > 1


def test_repeated_rows():
    from experiments.lab.repeats import repeated_rows

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(10, 64, generator=g)
    assert repeated_rows(rows) == 0.0
    tokens = torch.tensor([0, 1, 0, 2, 0, 1, 3, 4, 5, 6])  # 3 of 10 rows repeat an earlier one
    assert repeated_rows(rows[tokens]) == pytest.approx(0.3)
    assert repeated_rows(rows[tokens].to(torch.bfloat16)) == pytest.approx(0.3)
    near = rows[tokens].clone()
    near[2, 5] = near[2, 5].nextafter(torch.tensor(9.0))  # one bit apart: not a repeat
    assert repeated_rows(near) == pytest.approx(0.2)
    assert repeated_rows(torch.zeros(100)) == 0.0  # one row only


def test_repeats_tiny(tmp_path, capsys):
    from experiments.lab import repeats

    args = ["--size", "tiny", "--workloads", "gpt-bf16", "--codec", "auto2", "--no-progress", "--out", str(tmp_path)]
    (row,) = repeats.main(args)
    assert row["all_bytes"] == row["repeated_bytes"] + row["other_bytes"] > 0
    assert 0 <= row["repeated_share"] <= 1 and row["all_zstd"] > 1 and row["all_codec"] > 1
    assert json.loads((tmp_path / "results.json").read_text())["rows"][0]["all_bytes"] == row["all_bytes"]
    assert "zstd-3 on them" in capsys.readouterr().out


@pytest.mark.exhaustive  # most of a minute: the exhaustive tier
def test_max_batch_tiny(tmp_path):
    from experiments import max_batch
    from experiments.workloads import WORKLOADS

    args = ["--size", "tiny", "--workloads", "resnet-fp32", "--no-progress", "--no-plot", "--out", str(tmp_path)]
    rows = {r["method"]: r for r in max_batch.main(args)}
    assert set(rows) == set(max_batch.METHODS)
    base = WORKLOADS["resnet-fp32"].size("tiny").batch
    assert rows["none"]["max_batch"] == base, "the default budget is what the base batch needs uncompressed"
    assert rows["save_on_cpu"]["max_batch"] >= rows["none"]["max_batch"]
    assert all(r["accounting"] and r["total_mib"] <= r["budget_mib"] for r in rows.values() if r["max_batch"])
    assert json.loads((tmp_path / "results.json").read_text())["rows"]


@pytest.mark.parametrize("device, index", [("cuda", 3), ("cuda:1", 1)])
def test_the_cuda_cap_names_a_device_with_its_index(monkeypatch, device, index):
    """``set_per_process_memory_fraction`` refuses a plain ``cuda``: the cap names the device's index."""
    from types import SimpleNamespace

    from experiments import max_batch

    calls = []

    def set_fraction(fraction, dev):
        if not isinstance(dev, torch.device) or dev.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{dev}")
        calls.append((fraction, dev))

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=8 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    max_batch._cap_cuda(device, 2 * 2**30)
    max_batch._cap_cuda(device, None)
    assert calls == [(0.25, torch.device("cuda", index)), (1.0, torch.device("cuda", index))]


def test_the_step_models_batch_search_under_a_real_cap(monkeypatch):
    """--step-models: step_time's GPU models searched under the per-process cap (CUDA faked here): a method whose
    step holds half the bytes a sample reaches about twice the batch; the cap is lifted afterwards."""
    from types import SimpleNamespace

    from experiments import max_batch, step_time

    caps, steps = [], []
    state, per_sample = 1000, {"none": 100, "buddy": 50}

    def step(name, method, batch, device):
        steps.append(batch)
        peak = state + per_sample[method] * batch
        if caps[-1] is not None and peak > caps[-1]:
            raise torch.cuda.OutOfMemoryError("out of memory")
        return SimpleNamespace(peak_bytes=peak, state_bytes=state, step_ms=10.0 * batch)

    monkeypatch.setattr(max_batch, "step_model_step", step)
    monkeypatch.setattr(max_batch, "_cap_cuda", lambda device, budget: caps.append(budget))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    base = step_time.BATCH["cuda"]["gpt2"]
    caps.append(None)
    budget, known = max_batch._step_model_budget("gpt2", "cuda")
    assert budget == int(max_batch.CUDA_HEADROOM * (state + 100 * base)) and steps == [base] and list(known) == [base]
    rows = {"none": max_batch._step_model_row("gpt2", "none", budget=budget, device="cuda", known=known)}
    assert base not in steps[1:], "the plain step the budget was made from is none's first try: not run again"
    rows["buddy"] = max_batch._step_model_row("gpt2", "buddy", budget=budget, device="cuda")
    assert steps.count(base) == 2, "buddy's search runs its own first try"
    assert caps[-1] is None  # lifted again
    assert rows["none"]["max_batch"] == (budget - state) // 100 >= base  # the headroom may take a sample more
    assert rows["buddy"]["max_batch"] == (budget - state) // 50 > rows["none"]["max_batch"]
    assert rows["buddy"]["workload"] == "gpt2 (step_time)" and rows["buddy"]["note"] == ""
    assert rows["buddy"]["device_peak_mib"] * 2**20 == state + 50 * rows["buddy"]["max_batch"]
    assert rows["buddy"]["state_mib"] * 2**20 == state and rows["buddy"]["step_seconds"] > 0
    with pytest.raises(SystemExit, match="needs --device cuda"):
        max_batch.main(["--step-models", "gpt2", "--device", "cpu", "--no-progress", "--no-plot"])


def test_accounting_hooks_leave_no_graph_behind():
    """A forward under the accounting hooks that never runs backward is freed with its output."""
    import gc
    import weakref

    from torch.autograd.graph import saved_tensors_hooks

    from experiments.max_batch import _Account

    account = _Account()
    x = torch.randn(1000, requires_grad=True)
    with saved_tensors_hooks(account.pack, account.unpack):
        y = torch.exp(x)  # saves its own output
    assert account.outside == 4000
    alive = weakref.ref(y)
    del y
    gc.collect()
    assert alive() is None


def test_accounting_search_stays_within_host_memory():
    from experiments.common import host_peak_bytes
    from experiments.max_batch import HOST_MEMORY_SHARE, HOST_PEAK_SHARE, Measurement, host_batch_cap

    m = Measurement("w", "save_on_cpu", batch=16, state_bytes=0, activation_bytes=0, seconds=0.0, saved_bytes=16 << 20)
    assert host_batch_cap(m, memory=1 << 30) == int(HOST_MEMORY_SHARE * (1 << 30)) // (1 << 20)  # 1 MiB a sample
    assert host_batch_cap(m, memory=1 << 20) == 16, "never below the batch already measured"
    assert host_batch_cap(m) >= 16  # this machine's memory
    # the peak resident memory on the line through two batches: 1 GiB + 100 MiB a sample, 60 % of 8 GiB
    small = dataclasses.replace(m, batch=8, peak_bytes=(1 << 30) + 800 * (1 << 20))
    big = dataclasses.replace(m, batch=16, peak_bytes=(1 << 30) + 1600 * (1 << 20))
    want = 16 + int((HOST_PEAK_SHARE * (8 << 30) - big.peak_bytes) // (100 << 20))
    assert host_batch_cap(big, memory=8 << 30, smaller=small) == want == 38, "the peak binds before the saved bytes"
    unknown = dataclasses.replace(small, peak_bytes=None)
    assert host_batch_cap(big, memory=8 << 30, smaller=unknown) == 2048, "the saved bytes alone (1 MiB a sample)"
    assert host_peak_bytes() is None or host_peak_bytes() > 0


def test_the_chunked_loss_is_the_whole_loss():
    """step_time's GPT-2 loss a chunk of tokens at a time (each chunk's logits made again in backward): the same loss
    and gradients as the whole vocabulary's logits at once, within float rounding, for chunks that divide the tokens
    and chunks that do not; and the runbook's GPT-2 computes it so."""
    import torch.nn.functional as F

    from experiments.step_time import MODELS, chunked_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 10, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (3, 10), generator=g)
    whole = F.cross_entropy(F.linear(h, w).flatten(0, -2).float(), y.flatten())
    want = torch.autograd.grad(whole, (w, h))
    for chunk in (1, 7, 30, 64):
        part = chunked_cross_entropy(h, w, y, chunk)
        got = torch.autograd.grad(part, (w, h))
        assert torch.allclose(part, whole, rtol=1e-5, atol=1e-6), chunk
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got, want)), chunk
    spec = MODELS["cuda"]["gpt2"](None)
    assert spec.loss_chunk == 16 * 1024 // 8 and "chunks" in spec.description
