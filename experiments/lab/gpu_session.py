"""The phases of a session on a lent GPU machine -- what each runs, with which arguments and limits -- and
their dry run on a machine without a GPU.

A lent machine gives 30 minutes of GPU time in calls of at most 10 minutes,
each on a bare machine; ``experiments/gpu_session.sh PHASE`` installs the
carried wheels and runs one phase here. Each phase fits one call (at most 8
minutes, installs included; ``experiments/lab/README.md`` gives the expected
times):

* ``check``: the kernel modules compiled in parallel (timed), then golden
  vectors through every kernel both ways (:mod:`experiments.lab.gpu_check`);
* ``tests I/N``: the I-th of N shards of the curated GPU subset
  (``tests/gpu_subset.py``) on every core, each test under a time limit;
* ``sanitize``: compute-sanitizer's memcheck, racecheck, synccheck and
  initcheck over the kernel tests' sanitize subset, PyTorch's caching
  allocator off (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``) so that an access
  past a buffer is past an allocation;
* ``bench``: :mod:`experiments.bench_cuda` (every codec with kernels, 256 MiB
  of real activations in fp32 and bf16, against nvcomp and memcpy), and
  :mod:`experiments.host_cost` (the host's work per saved tensor, the plan);
* ``step``: :mod:`experiments.step_time` and :mod:`experiments.max_batch` on
  the GPU under a real per-process memory cap;
* ``frontier``: :mod:`experiments.frontier`: step time against capacity on
  ResNet-50 and GPT-2-small for every method, buddy's memory targets and time
  budgets among them;
* ``ncu`` (optional): Nsight Compute over the default codec's kernels, the
  metrics of :data:`NCU_METRICS`;
* ``essentials``: check, step time (fewer methods, the step with no read per
  tensor among them and one more of it under sync debug mode "error", each
  compressed step profiled), bench (fewer repeats; the table codecs also
  with their tables in global memory, with count's ballots, pack's fields, and
  unpack at fewer warps an SM), ncu and unpack reading the overflow in place in one phase; and ``lease``, for a lease
  of 15 minutes: :data:`LEASE`'s phases in one call, each step's limit cut to
  what is left before the call's deadline.

Every phase writes ``<phase>.json`` to ``--out`` (the environment -- device,
driver, CUDA, torch, CuPy, nvcomp --, the commit, the exact command of the
phase and of each step, what each step returned, and its results) and stops
with the reason when something it needs is missing: nothing is skipped
silently.

``--dry-run`` runs every phase's Python entry points with their real
arguments on this machine, up to their first CUDA call
(:mod:`experiments.lab.dry_run`), and collects each pytest step's tests with its
real arguments: a call with a missing argument, a bad option or an empty
test selection fails here rather than on the GPU.

    python -m experiments.lab.gpu_session check --out results/gpu      # on the GPU machine (via the .sh)
    python -m experiments.lab.gpu_session --dry-run                      # anywhere: every phase
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

__all__ = [
    "PHASES",
    "NCU_METRICS",
    "TEST_SHARDS",
    "PHASE_BUDGET_S",
    "SANITIZERS",
    "Python",
    "Pytest",
    "plan",
    "preflight",
    "run_phase",
    "dry_run",
    "main",
]

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("essentials", "check", "tests", "sanitize", "bench", "step", "frontier", "ncu")
#: a lease of 15 minutes in one call (a start, one call of at most 10 minutes): these phases in this order, each
#: step's limit cut to what is left before the call's deadline (``--deadline-s``), so the call ends in time
LEASE = (("essentials", None), ("tests", "1/1"), ("sanitize", None))
#: the seconds a lease's phases may take together (the call's 10 minutes less a start's installs and margin)
LEASE_DEADLINE_S = 540
#: shards of the ``tests`` phase: each is one call (see experiments/lab/README.md for the expected times)
TEST_SHARDS = 2
#: compute-sanitizer's tools, each run over the sanitize subset
SANITIZERS = ("memcheck", "racecheck", "synccheck", "initcheck")
#: what ``ncu`` reads of each kernel launch (one row per launch: the launch count is the number of rows).
#: The one place the list lives; ``BUDDY_NCU_METRICS`` (comma separated) replaces it for a run.
NCU_METRICS = (
    "gpu__time_duration.sum",  # duration
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",  # DRAM throughput, % of peak
    "dram__bytes.sum",  # bytes moved to and from DRAM
    "sm__warps_active.avg.pct_of_peak_sustained_active",  # achieved occupancy
    "launch__registers_per_thread",  # registers
    "smsp__inst_executed.sum",  # instructions executed
    "launch__grid_size",  # blocks of the launch
    "launch__shared_mem_per_block_dynamic",  # its dynamic shared memory: tells a kernel's layouts apart (--global-table)
    "smsp__issue_active.avg.pct_of_peak_sustained_active",  # issue slots used: low with many warps is latency
    "sm__cycles_elapsed.avg.per_second",  # the SM clock the launch ran at (the clocks are left alone)
    # where a warp's cycles between two instructions go (the latency bound of docs/kernel_budget.md): all of them,
    # waiting on L1TEX (global loads: the table's rows, the gathers), waiting on shared memory; the L1 hit rate
    "smsp__average_warps_active_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
    "l1tex__t_sector_hit_rate.pct",
)
#: files of the curated GPU subset (tests/gpu_subset.py): passed explicitly so only they are collected
TEST_FILES = (
    "tests/test_gpu_cuda.py",
    "tests/test_gpu.py",
    "tests/test_codec_nvcomp.py",
    "tests/test_concurrency.py",
    "tests/test_experiments.py",
    "tests/test_workloads.py",
    "tests/test_api.py",
    "tests/test_selftest.py",
    "tests/test_autograd_checks.py",
    "tests/test_rederive.py",
)
#: the longest one test may run before pytest-timeout ends it (the thread method: a hung launch included)
TEST_TIMEOUT_S = 120
#: the most a phase's steps may take together (their time limits added up): a call is at most 10 minutes,
#: a phase at most 8, and the installs before the steps take well under 30 s
PHASE_BUDGET_S = 480


# ---- the steps of a phase ----------------------------------------------------------------------
@dataclass(frozen=True)
class Python:
    """``python -m <module> <args>``: an experiment's entry point (its ``main(argv)``)."""

    name: str
    module: str
    args: tuple[str, ...]
    timeout_s: int
    #: the JSON file it writes (a template), embedded in the phase's JSON
    result: str | None = None
    #: more argument lists the dry run appends, to reach code the real arguments stop before without a GPU
    dry_variants: tuple[tuple[str, ...], ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    #: a tool the process runs under (ncu), before ``python``
    wrapper: tuple[str, ...] = ()
    #: a failure stops the phase (later steps need what this one makes)
    required: bool = False


@dataclass(frozen=True)
class Pytest:
    """``python -m pytest <args>``, optionally under a tool (compute-sanitizer)."""

    name: str
    args: tuple[str, ...]
    timeout_s: int
    env: Mapping[str, str] = field(default_factory=dict)
    wrapper: tuple[str, ...] = ()
    #: where the run writes its junit XML (a template), summarised in the phase's JSON
    junit: str | None = None


Step = Python | Pytest


def _compile(
    codecs: Sequence[str] | None = None, entry_bytes: Sequence[int] | None = None, timeout_s: int = 150
) -> Python:
    """Compile the kernel modules a phase needs, in parallel processes, before anything launches them."""
    args = ["--compile-only", "--jobs", "{jobs}", "--json", "{work}/compile.json"]
    if codecs:
        args += ["--codecs", *codecs]
    if entry_bytes:
        args += ["--entry-bytes", *map(str, entry_bytes)]
    return Python("compile", "experiments.lab.gpu_check", tuple(args), timeout_s, "{work}/compile.json", required=True)


def _ncu(timeout_s: int, unpack_warps: tuple[str, ...] = ()) -> Python:
    """The bench of the default codec (64 MiB, once) under Nsight Compute, a row per launch in ``ncu.csv``
    (``unpack_warps``: also unpack at so many warps an SM, ``bench_cuda --unpack-warps``)."""
    metrics = os.environ.get("BUDDY_NCU_METRICS") or ",".join(NCU_METRICS)
    wrapper = ("{ncu}", "--metrics", metrics, "--kernel-name", "regex:^buddy_", "--clock-control", "none",
               "--target-processes", "all", "--csv", "--log-file", "{out}/ncu.csv")  # fmt: skip
    # (--global-table: unpack once more reading the table in global memory, beside its copy in shared memory;
    # --pack-fields: pack once more with its table of whole fields in shared memory, beside reading the table in
    # global memory; ncu.csv tells a kernel's layouts apart by their dynamic shared memory)
    args = ("--mib", "64", "--codecs", _default_codec(), "--repeats", "1", "--warmup", "0", "--no-nvcomp",
            "--global-table", "--pack-fields", "--out", "{work}/ncu",
            *(("--unpack-warps", *unpack_warps) if unpack_warps else ()))  # fmt: skip
    return Python("ncu", "experiments.bench_cuda", args, timeout_s, "{work}/ncu/results.json", wrapper=wrapper)


def _default_codec() -> str:
    from buddy.config import defaults

    return defaults().codec


def _pytest_common() -> tuple[str, ...]:
    return ("-p", "gpu_subset", "-p", "no:cacheprovider", "-q", "-ra", "-o", "junit_family=xunit1")


_PYTEST_ENV = {"PYTHONPATH": "tests", "OMP_NUM_THREADS": "1"}


def plan(phase: str, shard: str | None = None) -> list[Step]:
    """The steps of ``phase`` (``shard``: ``I/N`` of the tests phase; default ``1/TEST_SHARDS``)."""
    args: tuple[str, ...]
    wrapper: tuple[str, ...]
    if phase == "essentials":
        # What a first look at a GPU needs most, in one phase: the golden check, every codec's speed against
        # nvcomp and memcpy (fewer repeats), step time (fewer methods) with one compressed step profiled,
        # Nsight Compute over the default's kernels (64 MiB), and unpack reading the overflow in place; the table
        # codecs also with their tables in global memory (--global-table) and with the count kernel's ballots
        # or matches (--other-count: the form the word size does not take by default), and pack with its table of
        # whole fields in shared memory (--pack-fields), and unpack at 8 and 16 warps an SM beside its default 24
        # (--unpack-warps: how its speed grows with its warps, what a layout of more would buy). The lease runs it
        # first (LEASE).
        bench_args = ("--out", "{work}/bench", "--repeats", "5", "--warmup", "1", "--global-table", "--other-count",
                      "--pack-fields", "--unpack-warps", "8", "16")  # fmt: skip
        # (--memory-peak: one more step of each method under the allocator's history, what it held at its peak;
        # buddy, the step with no read per tensor: one more step of it under sync debug mode "error"; buddy-overlap:
        # its packs beside forward on a side stream; buddy-ring: its overflow staged on the device and drained by
        # the copy stream; buddy-strict: every tensor sized first; the loss outside the block, buddy-model, in the
        # step phase)
        step_args = ("--device", "cuda", "--backend", "cuda", "--no-plot", "--no-progress", "--steps", "4",
                     "--warmup", "2", "--methods", "none", "buddy", "buddy-overlap", "buddy-ring", "buddy-strict",
                     "save_on_cpu", "checkpoint",
                     "--profile", "--memory-peak", "--out", "{work}/step_time")  # fmt: skip
        return [
            _compile(timeout_s=100),
            Python("check", "experiments.lab.gpu_check", ("--json", "{work}/check.json"), 60, "{work}/check.json"),
            # the step first among the measurements: what a user pays
            Python("step_time", "experiments.step_time", step_args, 150, "{work}/step_time/results.json",
                   (("--backend", "reference"),)),  # fmt: skip
            # (every codec with kernels: 23 s on the H200)
            Python("bench_cuda", "experiments.bench_cuda", bench_args, 70, "{work}/bench/results.json",
                   (("--no-nvcomp",),)),  # fmt: skip
            _ncu(timeout_s=60),
            # unpack reading the overflow in pinned host memory (tuned zero_copy=True) beside the copy first: last,
            # in its own process, since an unmapped overflow would end the process with an illegal access
            Python("bench_zero_copy", "experiments.bench_cuda", ("--codecs", _default_codec(), "zvc", "--no-nvcomp",
                   "--zero-copy", "--repeats", "5", "--warmup", "1", "--out", "{work}/bench_zero_copy"), 40,
                   "{work}/bench_zero_copy/results.json"),  # fmt: skip
        ]
    if phase == "check":
        return [
            _compile(),
            Python("check", "experiments.lab.gpu_check", ("--json", "{work}/check.json"), 240, "{work}/check.json"),
        ]
    if phase == "tests":
        args = (
            *_pytest_common(),
            "--gpu-subset", "tests", "--shard", shard or f"1/{TEST_SHARDS}",
            "-n", "{workers}", "--dist", "load", "--max-worker-restart", "8",
            "--timeout", str(TEST_TIMEOUT_S), "--timeout-method", "thread",
            "--maxfail", "25", "--junitxml", "{work}/junit.xml",
            *TEST_FILES,
        )  # fmt: skip
        return [
            _compile(entry_bytes=(128, 256, 512, 4096)),
            Pytest("pytest", args, 300, _PYTEST_ENV, junit="{work}/junit.xml"),
        ]
    if phase == "sanitize":
        steps: list[Step] = [_compile(entry_bytes=(128, 512, 4096), timeout_s=120)]
        for tool in SANITIZERS:
            wrapper = ("{compute-sanitizer}", "--tool", tool, "--error-exitcode", "99", "--print-limit", "30",
                       "--target-processes", "all")  # fmt: skip
            args = (*_pytest_common(), "--gpu-subset", "sanitize", "--timeout", "60", "-x", "tests/test_gpu_cuda.py")
            env = {**_PYTEST_ENV, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}  # every allocation its own, to be checked
            steps.append(Pytest(f"sanitize-{tool}", args, 75, env, wrapper))
        return steps
    if phase == "bench":
        args = ("--out", "{work}/bench", "--repeats", "10", "--warmup", "2")
        bench = Python(
            "bench_cuda", "experiments.bench_cuda", args, 360, "{work}/bench/results.json", (("--no-nvcomp",),)
        )
        # buddy's host work per saved tensor and the tracker's plan as the tensors a step saves grow: the floor of a
        # step's overhead (on the CPU the plan took 46 ms a step at 256 tensors)
        host_cost = Python(
            "host_cost", "experiments.host_cost", ("--device", "cuda", "--no-progress", "--out", "{work}/host_cost"),
            55, "{work}/host_cost/results.json",
        )  # fmt: skip
        return [_compile(entry_bytes=(4096,), timeout_s=60), bench, host_cost]
    if phase == "step":
        common = ("--device", "cuda", "--backend", "cuda", "--no-plot", "--no-progress")
        step_time = Python(
            "step_time", "experiments.step_time", (*common, "--memory-peak", "--out", "{work}/step_time"), 180,
            "{work}/step_time/results.json", (("--backend", "reference"),),
        )  # fmt: skip
        # (step_time's models at their GPU size: the workloads' are small enough that a step's transient buffers set
        # its peak, and every method of resnet-fp32 stopped at one batch on the H200)
        max_batch = Python(
            "max_batch", "experiments.max_batch",
            (*common, "--step-models", "resnet50", "gpt2", "--out", "{work}/max_batch"), 240,
            "{work}/max_batch/results.json", (("--backend", "reference"),),
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},  # the cap counts what is allocated, not slack
        )  # fmt: skip
        return [_compile(codecs=(_default_codec(),), entry_bytes=(4096,), timeout_s=60), step_time, max_batch]
    if phase == "frontier":
        # step time against capacity for every method on ResNet-50 and GPT-2-small, the buddy budgets among them
        args = ("--device", "cuda", "--backend", "cuda", "--no-plot", "--no-progress", "--out", "{work}/frontier")
        frontier = Python(
            "frontier", "experiments.frontier", args, 360, "{work}/frontier/results.json", (("--backend", "reference"),)
        )
        return [_compile(codecs=(_default_codec(),), entry_bytes=(4096,), timeout_s=60), frontier]
    if phase == "ncu":
        # (unpack also at 8 and 16 warps an SM: each layout's cycles an instruction and its waits)
        ncu = _ncu(timeout_s=390, unpack_warps=("8", "16"))
        return [_compile(codecs=(_default_codec(),), entry_bytes=(4096,), timeout_s=60), ncu]
    raise ValueError(f"unknown phase {phase!r}: {', '.join(PHASES)}")


# ---- what a phase needs --------------------------------------------------------------------------
def find_tool(name: str) -> str | None:
    """``compute-sanitizer`` or ``ncu``: on the PATH, else where CUDA and Nsight Compute install them."""
    found = shutil.which(name)
    if found:
        return found
    patterns = [
        f"/usr/local/cuda*/bin/{name}",
        f"/usr/local/cuda*/compute-sanitizer/{name}",
        f"/opt/nvidia/nsight-compute/*/{name}",
    ]
    for pattern in patterns:
        hits = sorted(Path("/").glob(pattern.lstrip("/")), reverse=True)
        if hits:
            return str(hits[0])
    return None


def preflight(phase: str) -> list[str]:
    """What ``phase`` needs and this machine lacks, one reason each (empty: nothing)."""
    import torch

    from buddy.engines import cuda as bcuda
    from buddy.engines import nvcomp
    from buddy.deps import available

    missing = []
    if not torch.cuda.is_available():
        missing.append(f"PyTorch sees no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    elif (why := bcuda.why_unusable()) is not None:
        missing.append(f"buddy's CUDA kernels cannot run: {why}")
    if phase == "tests":
        for module, wheel in (("pytest_timeout", "pytest-timeout"), ("xdist", "pytest-xdist")):
            if not available(module):
                missing.append(f"{module} is not importable: carry the {wheel} wheel in .whl/")
    if phase in ("tests", "bench") and (why := nvcomp.why_unusable()) is not None:
        missing.append(f"buddy's nvcomp codecs cannot run: {why}")
    if phase == "bench" and not available("nvidia.nvcomp"):
        missing.append("nvcomp's Python API (nvidia.nvcomp) is not importable: carry nvidia-nvcomp-cu<major>")
    if phase == "sanitize":
        if find_tool("compute-sanitizer") is None:
            missing.append("compute-sanitizer is neither on the PATH nor under /usr/local/cuda*/")
        if not available("pytest_timeout"):
            missing.append("pytest_timeout is not importable: carry the pytest-timeout wheel in .whl/")
    if phase == "ncu" and find_tool("ncu") is None:
        missing.append("ncu is neither on the PATH nor under /opt/nvidia/nsight-compute/")
    return missing


# ---- running a phase ------------------------------------------------------------------------------
#: the fewest seconds a step of a lease is started with
_LEAST_S = 20

def _fill(template: str, values: Mapping[str, str]) -> str:
    return re.sub(r"\{([a-z-]+)\}", lambda m: values[m.group(1)] if m.group(1) in values else m.group(0), template)


def command_of(step: Step, values: Mapping[str, str]) -> list[str]:
    """The exact command line of ``step`` with its placeholders filled."""
    module = step.module if isinstance(step, Python) else "pytest"
    return [_fill(a, values) for a in (*step.wrapper, sys.executable, "-m", module, *step.args)]


def _run(cmd: list[str], env: Mapping[str, str], timeout_s: int, tail: int = 60) -> dict[str, Any]:
    """Run ``cmd`` (its output passed through); on timeout SIGINT, then SIGKILL 30 s later. rc 124: timed out."""
    start = time.perf_counter()
    lines: collections.deque[str] = collections.deque(maxlen=tail)
    summary: list[str] = []
    merged = {**os.environ, **env}
    if "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):  # a step's own path first, the session's kept
        merged["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{os.environ['PYTHONPATH']}"
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=merged, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        errors="replace", start_new_session=True,
    )  # fmt: skip
    timed_out = threading.Event()

    def stop() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)  # pytest writes its report on SIGINT
        killer = threading.Timer(30, lambda: _kill(proc.pid))
        killer.daemon = True
        killer.start()

    timer = threading.Timer(timeout_s, stop)
    timer.daemon = True
    timer.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
        if "ERROR SUMMARY" in line:
            summary.append(line.strip())
    rc = proc.wait()
    timer.cancel()
    _kill(proc.pid)  # nothing it started outlives it
    return {
        "command": shlex.join(cmd),
        "rc": 124 if timed_out.is_set() else rc,
        "timed_out": timed_out.is_set(),
        "timeout_s": timeout_s,
        "seconds": round(time.perf_counter() - start, 2),
        "error_summary": summary,
        "tail": list(lines),
    }


def _kill(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def junit_summary(path: Path, slowest: int = 15) -> dict[str, Any]:
    """Counts, failures (with the first line of their message), skip reasons and the slowest tests of a run."""
    if not path.exists():
        return {"missing": f"no junit XML at {path.name} (the run was killed before it wrote one)"}
    cases = list(ElementTree.parse(path).getroot().iter("testcase"))
    failed: list[dict[str, str]] = []
    skips: collections.Counter[str] = collections.Counter()
    times: list[tuple[float, str]] = []
    for case in cases:
        name = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
        times.append((float(case.get("time") or 0.0), name))
        for kind in ("failure", "error"):
            for node in case.findall(kind):
                failed.append({"test": name, "kind": kind, "message": (node.get("message") or "").split("\n")[0][:300]})
        for node in case.findall("skipped"):
            skips[(node.get("message") or "").split("\n")[0][:200]] += 1
    return {
        "tests": len(cases),
        "failed": failed,
        "skipped": dict(skips),
        "test_seconds": round(sum(t for t, _ in times), 1),
        "slowest": [{"test": n, "seconds": round(t, 2)} for t, n in sorted(times, reverse=True)[:slowest]],
    }


def _values(out: Path, work: Path) -> dict[str, str]:
    cpus = os.cpu_count() or 1
    return {
        "out": str(out),
        "work": str(work),
        "jobs": str(cpus),
        "workers": str(max(1, min(16, cpus))),
        "compute-sanitizer": find_tool("compute-sanitizer") or "compute-sanitizer",
        "ncu": find_tool("ncu") or "ncu",
    }


def _commit() -> str:
    if os.environ.get("BUDDY_COMMIT"):  # said by the caller: a copied tree's .git may name an older commit
        return os.environ["BUDDY_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        return sha.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("BUDDY_COMMIT", "unknown (no .git on this machine; set BUDDY_COMMIT)")


def _tool_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for tool, flag in (("nvcc", "--version"), ("compute-sanitizer", "--version"), ("ncu", "--version")):
        path = shutil.which(tool) if tool == "nvcc" else find_tool(tool)
        if path is None:
            versions[tool] = None
            continue
        try:
            done = subprocess.run([path, flag], capture_output=True, text=True, timeout=60)
            lines = [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]
            versions[tool] = lines[-1] if lines else None
        except (OSError, subprocess.SubprocessError):
            versions[tool] = None
    return versions


def label_of(phase: str, shard: str | None) -> str:
    """The flat file stem of a phase's outputs: ``tests-1of2`` for a shard."""
    return phase if not shard else f"{phase}-{shard.replace('/', 'of')}"


def run_phase(
    phase: str, out: Path, shard: str | None = None, command: str | None = None, deadline: float | None = None
) -> int:
    """Run ``phase`` and write ``<label>.json`` under ``out``; 0 when every step passed.

    ``deadline`` (a ``time.perf_counter()`` instant): each step's limit is cut to the time left before it, and a
    step with under :data:`_LEAST_S` left is not started (recorded as such, rc 125).
    """
    from buddy import env

    if phase == "tests":
        shard = shard or f"1/{TEST_SHARDS}"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"buddy-{phase}-"))
    values = _values(out, work)
    environment = env.environment()
    record: dict[str, Any] = {
        "phase": phase,
        "shard": shard,
        "command": command or shlex.join([sys.executable, "-m", "experiments.lab.gpu_session", *sys.argv[1:]]),
        "commit": _commit(),
        "environment": environment,
        "device": environment.get("gpu"),
        "tools": _tool_versions(),
        "wheels": {
            "installed": [w for w in os.environ.get("BUDDY_WHEELS_INSTALLED", "").split("; ") if w],
            "missing": [w for w in os.environ.get("BUDDY_WHEELS_MISSING", "").split("; ") if w],
        },
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "steps": [],
    }
    start = time.perf_counter()
    missing = preflight(phase) + [f"wheel: {w}" for w in record["wheels"]["missing"]]
    record["missing"] = missing
    path = out / f"{label_of(phase, shard)}.json"
    if missing:
        print(f"{phase}: cannot run here:\n  " + "\n  ".join(missing), flush=True)
    else:
        for step in plan(phase, shard):
            limit = step.timeout_s
            if deadline is not None:
                # a step stopped at its limit gets 30 s to write its report before it is killed
                limit = min(limit, int(deadline - time.perf_counter()) - 30)
                if limit < _LEAST_S:
                    print(f"\n=== {phase}: {step.name}: not started, {limit + 30} s left before the deadline")
                    record["steps"].append({
                        "name": step.name, "command": shlex.join(command_of(step, values)), "rc": 125,
                        "timed_out": False, "timeout_s": 0, "seconds": 0.0, "error_summary": [],
                        "not_started": "too little time left before the lease's deadline",
                    })  # fmt: skip
                    continue
            print(f"\n=== {phase}: {step.name}", flush=True)
            done = _run(command_of(step, values), step.env, limit)
            done["name"] = step.name
            if isinstance(step, Python) and step.result:
                result = Path(_fill(step.result, values))
                done["result"] = json.loads(result.read_text()) if result.exists() else None
            if isinstance(step, Pytest) and step.junit:
                done["tests"] = junit_summary(Path(_fill(step.junit, values)))
            if done["rc"] == 0:
                done.pop("tail")  # the log has it all; keep the JSON small
            record["steps"].append(done)
            path.write_text(json.dumps(record, indent=1, default=str) + "\n")  # what ran so far, if the call is cut
            print(f"=== {phase}: {step.name}: rc {done['rc']} in {done['seconds']:.0f} s", flush=True)
            if done["rc"] != 0 and isinstance(step, Python) and step.required:
                break
    record["seconds"] = round(time.perf_counter() - start, 1)
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    record["passed"] = not missing and bool(record["steps"]) and all(s["rc"] == 0 for s in record["steps"])
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    _print_summary(record, path)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if record["passed"] else 1


def _print_summary(record: dict[str, Any], path: Path) -> None:
    print(f"\n{label_of(record['phase'], record['shard'])}: {'PASSED' if record['passed'] else 'FAILED'} "
          f"in {record['seconds']:.0f} s; wrote {path.name}")  # fmt: skip
    for reason in record["missing"]:
        print(f"  missing: {reason}")
    for s in record["steps"]:
        extra = " (timed out)" if s["timed_out"] else ""
        tests = s.get("tests") or {}
        if "tests" in tests:
            extra += f"; {tests['tests']} tests, {len(tests['failed'])} failed, skipped {tests['skipped'] or 0}"
        if s["error_summary"]:
            extra += f"; {' / '.join(s['error_summary'])}"
        print(f"  {s['name']:<22} rc {s['rc']:>3} {s['seconds']:7.1f} s{extra}")


# ---- the dry run ----------------------------------------------------------------------------------
class _Count:
    """A pytest plugin that counts the collected items."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def pytest_collection_finish(self, session: Any) -> None:
        self.items = [item.nodeid for item in session.items]


def _collect(step: Pytest, values: Mapping[str, str]) -> tuple[bool, str]:
    """Collect ``step``'s tests with its real arguments (no workers): whether that worked, and how many."""
    import pytest

    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)  # the plugin (-p gpu_subset) lives there; the real run sets PYTHONPATH
    args = [_fill(a, values) for a in step.args]
    if "-n" in args:
        args += ["-n", "0"]  # collection only: no workers
    counter = _Count()
    here = os.getcwd()
    os.chdir(ROOT)  # the arguments name files from the repository's root, as the real run does
    try:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            rc = pytest.main([*args, "--collect-only"], plugins=[counter])
    finally:
        os.chdir(here)
    if rc != 0 or not counter.items:
        return False, f"collection failed (pytest exit {rc}, {len(counter.items)} tests)"
    return True, f"{len(counter.items)} tests collected"


def dry_run(phases: Sequence[str] = PHASES) -> bool:
    """Every step of ``phases`` as far as it goes here (see the module doc); prints one line per run."""
    from experiments.lab.dry_run import run_entry

    ok = True
    with tempfile.TemporaryDirectory(prefix="buddy-dry-run-") as tmp:
        values = _values(Path(tmp) / "out", Path(tmp) / "work")
        for phase in phases:
            # the tests' shards, and the one shard a lease runs
            shards = [f"{i}/{TEST_SHARDS}" for i in range(1, TEST_SHARDS + 1)] + ["1/1"] if phase == "tests" else [None]
            for shard in shards:
                print(f"== {label_of(phase, shard)}: would need here: {'; '.join(preflight(phase)) or 'nothing more'}")
                for step in plan(phase, shard):
                    command = shlex.join(command_of(step, values))
                    if isinstance(step, Pytest):
                        start = time.perf_counter()
                        good, what = _collect(step, values)
                        print(
                            f"{'ok  ' if good else 'FAIL'} {command}\n       {what} [{time.perf_counter() - start:.1f} s]"
                        )
                        ok &= good
                        continue
                    for variant in ((), *step.dry_variants):
                        outcome = run_entry(step.module, [_fill(a, values) for a in (*step.args, *variant)])
                        print(outcome.line())
                        if not outcome.ok:
                            print("       " + "\n       ".join(outcome.output.strip().splitlines()[-15:]))
                        ok &= outcome.ok
    print(f"dry run: {'every entry point went as far as it can without a GPU' if ok else 'FAILED'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_session", description=__doc__.split("\n\n")[0])
    p.add_argument("phase", nargs="?", choices=(*PHASES, "lease"), help="the phase to run (lease: LEASE's phases)")
    p.add_argument("shard", nargs="?", default=None, help=f"tests: I/N (default 1/{TEST_SHARDS})")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results/gpu")))
    p.add_argument("--command", default=None, help="the command that started the phase (recorded as given)")
    p.add_argument("--dry-run", nargs="*", choices=PHASES, default=None, metavar="PHASE", help="dry run (all phases)")
    p.add_argument("--deadline-s", type=int, default=LEASE_DEADLINE_S, help="lease: seconds for all its phases")
    args = p.parse_args(argv)
    if args.dry_run is not None:
        return 0 if dry_run(args.dry_run or PHASES) else 1
    if args.phase is None:
        p.error("name a phase, or --dry-run")
    if args.shard is not None:
        match = re.fullmatch(r"([1-9]\d*)/([1-9]\d*)", args.shard)
        if args.phase != "tests" or match is None or int(match.group(1)) > int(match.group(2)):
            p.error("only the tests phase takes a shard, as I/N with 1 <= I <= N")
    if args.phase == "lease":  # (a shard was refused above: only the tests phase takes one)
        deadline = time.perf_counter() + args.deadline_s
        failed = [run_phase(phase, args.out, shard, args.command, deadline) for phase, shard in LEASE]
        return 1 if any(failed) else 0
    return run_phase(args.phase, args.out, args.shard, args.command)


if __name__ == "__main__":
    sys.exit(main())
