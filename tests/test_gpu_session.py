"""The GPU session without a GPU: its dry run, its phases' plans and runner, the curated subsets, the golden
check on the host, and the size of what travels.

The dry run of every phase runs in CI (.ci/run); here are the pieces it rests on: that a missing argument
before the first CUDA call fails it while the first CUDA call stops it cleanly, that a phase writes what it
ran and why it failed, and that the subsets hold what the GPU run must show.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import buddy
from experiments.lab import dry_run, gpu_check, gpu_session, travel_size

ROOT = Path(__file__).resolve().parents[1]
#: the dry run pretends to torch that a GPU exists: where one really does, CUDA may already be initialised
no_gpu_here = pytest.mark.skipif(torch.cuda.is_available(), reason="a dry run is for a machine without a GPU")


# ---- the dry run -------------------------------------------------------------------------------
def _entry(tmp_path: Path, monkeypatch, body: str) -> str:
    """A module ``entry_<n>`` in tmp_path whose ``main(argv)`` runs ``body``; its name."""
    name = f"entry_{abs(hash(body)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(
        "import argparse\nimport torch\nimport buddy\n\n"
        "def main(argv):\n"
        "    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--x')\n"
        "    parser.parse_args(argv)\n" + textwrap.indent(textwrap.dedent(body), "    ")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@no_gpu_here
def test_a_call_missing_its_argument_before_cuda_fails_the_dry_run(tmp_path, monkeypatch):
    """What the step phase would have hit on its first GPU run: ``CudaEngine()`` without its codec."""
    name = _entry(tmp_path, monkeypatch, "buddy.engines.cuda.CudaEngine()\ntorch.ones(2).cuda()\n")
    outcome = dry_run.run_entry(name, [])
    assert not outcome.ok
    assert outcome.stop.startswith("TypeError") and "codec" in outcome.stop


@no_gpu_here
@pytest.mark.parametrize(
    "first_call",
    [
        "torch.ones(2).cuda()",
        "torch.nn.Linear(2, 2).to(torch.device('cuda'))",
        "torch.cuda.synchronize()",
        "torch.cuda.Stream()",
        "torch.cuda.Event(enable_timing=True)",
        "torch.cuda.set_per_process_memory_fraction(0.5, 0)",
        "torch.empty(8, pin_memory=True)",
        "buddy.BuddyStore(capacity_bytes=1 << 20, pin=True).allocate(64)",
    ],
)
def test_the_first_cuda_call_ends_the_dry_run_cleanly(first_call, tmp_path, monkeypatch):
    body = (
        "assert torch.cuda.is_available() and torch.cuda.device_count() == 1\n"
        "assert torch.cuda.get_device_properties(0).total_memory > 0\n"
        "name = torch.cuda.get_device_name(torch.device('cuda'))\n"
        f"{first_call}\n"
        "raise AssertionError('went past the first CUDA call')\n"
    )
    real = (torch.cuda.is_available, torch.cuda._lazy_init, torch.cuda.Stream)
    outcome = dry_run.run_entry(_entry(tmp_path, monkeypatch, body), [])
    assert outcome.ok, outcome.stop
    assert "CUDA" in outcome.stop
    assert (torch.cuda.is_available, torch.cuda._lazy_init, torch.cuda.Stream) == real  # the pretence is gone


@no_gpu_here
def test_only_gpu_only_packages_may_be_missing(tmp_path, monkeypatch):
    gpu_only = "raise SystemExit('x') from buddy.MissingDependencyError(\"f needs 'cupy', which is not importable\")\n"
    other = "raise buddy.MissingDependencyError(\"f needs 'zstandard', which is not importable\")\n"
    assert dry_run.run_entry(_entry(tmp_path, monkeypatch, gpu_only), []).ok
    outcome = dry_run.run_entry(_entry(tmp_path, monkeypatch, other), [])
    assert not outcome.ok and "zstandard" in outcome.stop


def test_bad_arguments_fail_the_dry_run():
    outcome = dry_run.run_entry("experiments.bench_cuda", ["--no-such-option"])
    assert not outcome.ok and outcome.stop == "SystemExit(2)"


@no_gpu_here
def test_step_time_goes_as_far_as_it_can_without_a_gpu(tmp_path):
    """The step phase's entry point with a backend that needs no CuPy: it builds both models and stops at
    moving the first to the device."""
    argv = ["--device", "cuda", "--backend", "reference", "--no-plot", "--no-progress", "--out", str(tmp_path)]
    outcome = dry_run.run_entry("experiments.step_time", argv)
    assert outcome.ok, outcome.stop + outcome.output
    assert outcome.stop.startswith("no CUDA") and outcome.where.startswith("experiments/step_time.py")
    assert buddy.defaults().backend == "auto"  # what the entry point set ("reference") is undone
    assert not list(tmp_path.iterdir())


# ---- the phases --------------------------------------------------------------------------------
def test_every_phase_fits_one_call():
    for phase in gpu_session.PHASES:
        steps = gpu_session.plan(phase)
        assert steps and sum(s.timeout_s for s in steps) <= gpu_session.PHASE_BUDGET_S <= 480, phase


def test_the_plans_name_what_the_issue_asks_for(tmp_path):
    values = gpu_session._values(tmp_path / "out", tmp_path / "work")
    commands = {p: [gpu_session.command_of(s, values) for s in gpu_session.plan(p)] for p in gpu_session.PHASES}
    for phase, cmds in commands.items():
        for cmd in cmds:
            assert not any("{" in a and "}" in a and "regex" not in a for a in cmd), (phase, cmd)
    sanitize = gpu_session.plan("sanitize")
    tools = [s.wrapper[2] for s in sanitize if isinstance(s, gpu_session.Pytest)]
    assert tools == ["memcheck", "racecheck", "synccheck", "initcheck"]
    assert all(s.env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1" for s in sanitize if isinstance(s, gpu_session.Pytest))
    (bench,) = [s for s in gpu_session.plan("bench") if s.name == "bench_cuda"]
    assert "--codecs" not in bench.args and "--no-nvcomp" not in bench.args  # every codec, nvcomp required
    for step in gpu_session.plan("step")[1:]:  # step_time and max_batch: the backend said, not assumed
        assert step.args[step.args.index("--backend") + 1] == "cuda", step.name
    (ncu,) = [s for s in gpu_session.plan("ncu") if s.name == "ncu"]
    assert ",".join(gpu_session.NCU_METRICS) in ncu.wrapper
    tests = [s for s in gpu_session.plan("tests", "2/3") if isinstance(s, gpu_session.Pytest)]
    assert "2/3" in tests[0].args and "--timeout" in tests[0].args


def test_a_phase_writes_what_ran_and_why_it_failed(tmp_path, monkeypatch):
    """The runner on the host: a passing step, a failing pytest step summarised from its junit XML, and a
    step past its time limit, stopped."""
    (tmp_path / "test_tiny.py").write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skips(): pass\n"
    )
    steps = [
        gpu_session.Python("help", "json.tool", ("--help",), 60),
        gpu_session.Pytest(
            "pytest",
            ("-q", "-p", "no:cacheprovider", "--junitxml", "{work}/junit.xml", str(tmp_path / "test_tiny.py")),
            120,
            junit="{work}/junit.xml",
        ),  # fmt: skip
        gpu_session.Python("sleeps", "timeit", ("-n", "1", "import time; time.sleep(60)"), 2),
    ]
    monkeypatch.setattr(gpu_session, "preflight", lambda phase: [])
    monkeypatch.setattr(gpu_session, "plan", lambda phase, shard=None: steps)
    out = tmp_path / "out"
    assert gpu_session.run_phase("check", out, command="bash experiments/gpu_session.sh check") == 1
    record = json.loads((out / "check.json").read_text())
    assert record["command"] == "bash experiments/gpu_session.sh check" and not record["passed"]
    assert {"gpu", "torch", "cupy", "nvcomp", "cuda"} <= record["environment"].keys()
    help_step, pytest_step, slow = record["steps"]
    assert help_step["rc"] == 0 and "json.tool" in help_step["command"]
    assert pytest_step["rc"] == 1 and pytest_step["tests"]["tests"] == 3
    assert [f["test"].split("::")[-1] for f in pytest_step["tests"]["failed"]] == ["test_fails"]
    assert pytest_step["tests"]["skipped"] == {"not here": 1}
    assert slow["rc"] == 124 and slow["timed_out"] and slow["seconds"] < 40


def test_a_lease_cuts_each_step_to_its_deadline_and_records_what_it_could_not_start(tmp_path, monkeypatch):
    """A lease's phases share one deadline: a step's limit is what is left (less the 30 s a stopped step gets to
    write its report), and a step with too little left is recorded as not started."""
    steps = {
        "essentials": [gpu_session.Python("sleeps", "timeit", ("-n", "1", "import time; time.sleep(60)"), 300)],
        "tests": [gpu_session.Python("help", "json.tool", ("--help",), 60)],
        "sanitize": [gpu_session.Python("help", "json.tool", ("--help",), 60)],
    }
    monkeypatch.setattr(gpu_session, "preflight", lambda phase: [])
    monkeypatch.setattr(gpu_session, "plan", lambda phase, shard=None: steps[phase])
    monkeypatch.setattr(gpu_session, "_LEAST_S", 1)
    out = tmp_path / "out"
    assert gpu_session.main(["lease", "--out", str(out), "--deadline-s", "33"]) == 1
    first = json.loads((out / "essentials.json").read_text())["steps"][0]
    assert first["timed_out"] and first["timeout_s"] <= 3 and first["seconds"] < 30
    later = [json.loads((out / name).read_text())["steps"][0] for name in ("tests-1of1.json", "sanitize.json")]
    assert all(s["rc"] == 125 and "deadline" in s["not_started"] for s in later)
    assert [p for p, _ in gpu_session.LEASE] == ["essentials", "tests", "sanitize"]


def test_a_phase_missing_what_it_needs_fails_saying_so(tmp_path, monkeypatch):
    monkeypatch.setenv("BUDDY_WHEELS_MISSING", "nvidia_libnvcomp_cu13; lz4")
    monkeypatch.setattr(gpu_session, "plan", lambda phase, shard=None: pytest.fail("nothing may run"))
    assert gpu_session.run_phase("bench", tmp_path) == 1
    record = json.loads((tmp_path / "bench.json").read_text())
    assert not record["passed"] and not record["steps"]
    assert "wheel: nvidia_libnvcomp_cu13" in record["missing"] and "wheel: lz4" in record["missing"]
    if not torch.cuda.is_available():
        assert any("CUDA device" in m for m in record["missing"])


# ---- the curated subsets -----------------------------------------------------------------------
def _collect(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "gpu_subset", "-p", "no:cacheprovider", "--collect-only", "-q", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_tests_subset_holds_every_kernel_at_512_and_4096_on_four_dtypes_and_shards_it():
    files = ("tests/test_gpu_cuda.py", "tests/test_codec_nvcomp.py")
    subset = _collect("--gpu-subset", "tests", *files)
    kernels = [n for n in subset if "test_kernels_write_the_reference_buffers" in n]
    for codec in buddy.engines.sources.KERNEL_CODECS:
        for e in (512, 4096):
            for dtype in ("f32", "bf16", "u8", "f64"):
                assert any(f"codec={codec}-dtype={dtype}-" in n and f"E={e}]" in n for n in kernels), (codec, e, dtype)
    assert not any("E=32]" in n or "E=65536]" in n for n in kernels)
    for name in ("test_training_with_the_kernels_is_bit_exact", "test_compress_free_cycles_return_device_memory"):
        assert any(name in n for n in subset)
    assert any("test_gpu_round_trip" in n for n in subset), "nvcomp's codecs run on the GPU too"
    shards = [_collect("--gpu-subset", "tests", "--shard", f"{i}/2", *files) for i in (1, 2)]
    assert sorted(shards[0] + shards[1]) == sorted(subset) and not set(shards[0]) & set(shards[1])
    assert abs(len(shards[0]) - len(shards[1])) <= 1


# ---- the golden check, on the host -------------------------------------------------------------
def test_the_golden_check_passes_on_the_reference(tmp_path):
    result = gpu_check.main(
        ["--device", "cpu", "--backend", "reference", "--numel", "20001", "--json", str(tmp_path / "c.json")]
    )
    assert result["passed"] and json.loads((tmp_path / "c.json").read_text())["passed"]
    checks = {c["name"]: c for c in result["checks"]}
    for name in ("format_v1", "format_v2", "format_v2_table2"):
        cases = json.loads((gpu_check.GOLDEN / f"{name}.json").read_text())["cases"]
        assert checks[f"golden {name} decode"]["checked"] == sum(len(c["slots"]) for c in cases)
    assert checks["golden format_v1 encode"]["checked"] == checks["golden format_v1 decode"]["checked"]
    assert checks["golden format_v2 encode"]["checked"] == 0  # table format 1: no longer written, decoded only
    assert checks["tables"]["checked"] == 16 and checks["codecs"]["checked"] == 24


def test_the_golden_check_names_a_damaged_vector(tmp_path):
    folder = tmp_path / "golden"
    folder.mkdir()
    shutil.copy(gpu_check.GOLDEN / "format_v1.json", folder)
    with np.load(gpu_check.GOLDEN / "format_v1.npz") as data:
        vectors = {k: data[k].copy() for k in data.files}
    vectors["float32-E128-relu/zvc/s2/slots"][5] ^= 0x10
    np.savez(folder / "format_v1.npz", **vectors)
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--backend", "reference", "--golden", str(folder), "--numel", "2001"])
    checks = gpu_check.run_checks(torch.device("cpu"), "reference", golden=folder, numel=2001, log=lambda _: None)
    differ = {c.name: c.differ for c in checks}
    assert differ["golden format_v1 decode"] == ["format_v1/float32-E128-relu/zvc/s2"]
    assert differ["golden format_v1 encode"] == ["format_v1/float32-E128-relu/zvc/s2"]


# ---- what travels ------------------------------------------------------------------------------
def test_travel_size_counts_tracked_untracked_and_carried(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / ".whl").mkdir(parents=True)
    (repo / ".gitignore").write_text("/.whl/\n/ignored.bin\n")
    (repo / "tracked.bin").write_bytes(b"t" * 3000)
    (repo / "untracked.txt").write_bytes(b"u" * 500)
    (repo / "ignored.bin").write_bytes(b"i" * 7000)
    (repo / ".whl" / "a.whl").write_bytes(b"w" * 20000)
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", ".gitignore", "tracked.bin"], check=True)
    subprocess.run([*git, "commit", "-qm", "t"], check=True)
    gitignore = (repo / ".gitignore").stat().st_size
    sizes = travel_size.sizes(travel_size.travelling_files(repo, (".whl",)))
    assert sizes == {"tracked": 3000 + gitignore, "untracked": 500, "carried": 20000}
    limit = (sum(sizes.values()) - 1) / (1 << 20)
    assert travel_size.main(["--root", str(repo), "--limit-mib", str(limit)]) == 1
    assert travel_size.main(["--root", str(repo), "--limit-mib", str(limit * 2)]) == 0
    assert "TOO LARGE" in capsys.readouterr().out
    shutil.rmtree(repo / ".git")  # as on the GPU machine: every file that arrived
    arrived = travel_size.sizes(travel_size.travelling_files(repo))
    assert sum(arrived.values()) == 3000 + 500 + 7000 + 20000 + gitignore


def test_the_tests_phase_runs_every_file_of_the_curated_subset():
    """A file the curated subset names but the tests phase does not pass to pytest never runs on a lent GPU (and
    one passed but not named runs none of its tests)."""
    from gpu_subset import SUBSETS

    assert sorted(f"tests/{name}" for name in SUBSETS["tests"]) == sorted(gpu_session.TEST_FILES)
