"""Plumbing shared by the experiment scripts: environment, captures, results files, tables, the host's peak memory."""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

import buddy.hooks
import buddy.keys
import buddy.recording
from buddy import env
from buddy.config import DEFAULT_BACKENDS
from buddy.deps import require, require_cuda
from buddy.errors import MissingDependencyError

__all__ = [
    "SIZES",
    "DEFAULT_POINTS",
    "start",
    "command_line",
    "add_backend_argument",
    "choose_backend",
    "capture_all",
    "CACHE_ENV",
    "write_results",
    "format_table",
    "geomean",
    "by_set",
    "progress",
    "reset_host_peak",
    "host_peak_bytes",
]


#: the workload sizes every script takes (``--size``)
SIZES = ("tiny", "quick", "full")

#: training steps before each capture, by size (``--points`` overrides them where a script has it)
DEFAULT_POINTS = {"tiny": (0, 2), "quick": (0, 10, 30), "full": (0, 50, 200, 500)}


def start(script: str, argv: Sequence[str]) -> dict:
    """Print the environment and return the run's header (for the results file)."""
    environment = env.environment()
    print(env.format_environment(environment), flush=True)
    if environment["gpu"] is None:
        print(
            "  (no GPU: every number below comes from the CPU: the native engine for the codecs it is the default "
            "of, the reference path for the others)",
            flush=True,
        )
    return {
        "environment": environment,
        "buddy": environment["buddy"],
        "command": command_line(script, argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        # other work on the machine stretches wall times: the 1-minute load average says how much there was
        "load_average": _load_average(),
    }


def command_line(script: str, argv: Sequence[str], *, python: str = "python") -> str:
    """The command a run records: ``python -m experiments.<script> <argv>`` (``script`` dotted below
    ``experiments``, e.g. ``"lab.gpu_check"``), quoted for a shell."""
    return shlex.join([python, "-m", f"experiments.{script}", *argv])


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # not every OS has one
        return None


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """``--backend``: who runs buddy's codecs (see :func:`choose_backend`)."""
    parser.add_argument(
        "--backend",
        choices=DEFAULT_BACKENDS,
        default=None,
        help="buddy's backend (default: the CUDA kernels on a GPU where they can run, else the reference; on the "
        "CPU 'auto', the native engine where it is the default); 'cuda' where the kernels cannot run is an error, "
        "not a fallback",
    )


def choose_backend(script: str, requested: str | None, device: torch.device | str) -> str:
    """The backend an experiment's buddy methods run: ``requested``; else the CUDA kernels on a GPU that can run
    them, the reference on a GPU that cannot, and on the CPU ``"auto"``: what buddy runs there by default (the
    native engine for the codecs it is the default of).

    An explicit ``"cuda"`` that cannot run here exits with the reason: the
    process-wide default would otherwise fall back to the reference with a
    warning, and the run would time the wrong thing.
    """
    device = torch.device(device)
    if requested is None:
        if device.type != "cuda":
            return "auto"
        if buddy.engines.cuda.why_unusable() is not None:
            return "reference"
        requested = "cuda"
    elif requested == "cuda":
        if device.type != "cuda":
            raise SystemExit(f"{script}: --backend cuda needs --device cuda, got {device}")
        try:
            require_cuda(f"experiments.{script} --backend cuda")
            require("cupy", f"experiments.{script} --backend cuda")
        except MissingDependencyError as exc:
            raise SystemExit(f"{script}: {exc}") from exc
    if requested == "cuda":
        kernels_pass(script, device)
    return requested


def kernels_pass(script: str, device: torch.device | str, codec: str | None = None) -> None:
    """Exit with the reason unless ``codec``'s (default: the default codec's) CUDA kernels pass their self-test on
    ``device``: where they fail, every buddy method would run the torch reference instead (one warning), and a run
    would spend its time -- on a lent GPU, all of it -- timing the wrong thing."""
    codec, device = codec or buddy.defaults().codec, torch.device(device)
    if device.index is None:  # the device a tensor on "cuda" is on
        device = torch.device(device.type, torch.cuda.current_device())
    buddy.dispatch.engine(buddy.codecs.get_codec(codec), device, "auto")  # as a first compress: the self-test
    ran = buddy.dispatch.chosen(codec, device=str(device))
    if not ran or ran[-1].backend != "cuda":
        why = ran[-1].why if ran else "nothing was chosen"
        raise SystemExit(f"{script}: the CUDA kernels of codec {codec!r} cannot run on {device} ({why})")


def progress(iterable, *, desc: str, total: int | None = None, enabled: bool = True):
    """tqdm when installed and wanted, the plain iterable otherwise."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False)


def reset_host_peak() -> None:
    """Restart the process's peak resident memory (Linux: /proc/self/clear_refs); elsewhere nothing.

    Freed heap the C allocator keeps counts as resident and would hide how the
    next measurement grows, so it is handed back first (glibc ``malloc_trim``):
    without that, a --full run measured minilm-fp32's buddy step at the level
    an earlier, larger step had left and ran the host out of memory.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def host_peak_bytes() -> int | None:
    """The process's peak resident bytes since :func:`reset_host_peak` (Linux: VmHWM), ``None`` where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


#: environment variable naming a folder where :func:`capture_all` keeps captures between runs
CACHE_ENV = "BUDDY_CAPTURE_CACHE"


def _cache_path(cache: Path, name: str, size: str, points: Sequence[int], device: str, seed: int) -> Path:
    """Where one workload's captures are cached: keyed on everything that changes them.

    The key covers the arguments, torch's version, the source of the
    modules that build the workloads and their data and of buddy's recorder
    (its skip, dedup and key rules), and the pretrained package's version, so
    an edit to a model, its data, its training loop or what is recorded never
    reads a stale capture.
    """
    from importlib.metadata import PackageNotFoundError, version

    from experiments import data, pretrained, workloads

    try:
        weights = version(pretrained.MINILM_PACKAGE)
    except PackageNotFoundError:
        weights = None
    h = hashlib.sha256()
    for part in (name, size, tuple(points), device, seed, torch.__version__, weights):
        h.update(repr(part).encode())
    # (the recorder's rules: what is taken, once, under which key)
    for module in (data, workloads, pretrained, buddy.hooks, buddy.keys, buddy.recording):
        assert module.__file__ is not None  # modules of source files
        h.update(Path(module.__file__).read_bytes())
    return cache / f"{name}-{size}-{h.hexdigest()[:16]}.pt"


def capture_all(
    workloads: Sequence[str],
    *,
    size: str,
    points: Sequence[int],
    device: str,
    seed: int,
    show: bool,
    cache: Path | str | None = None,
):
    """``{workload: [Capture, ...]}``: each workload trained and captured at ``points``.

    ``cache`` (default: the folder named by ``$BUDDY_CAPTURE_CACHE``, else
    none) keeps each workload's captures on disk, so scripts run one after
    the other train each workload once. Only CPU captures are cached.
    """
    from experiments.workloads import capture

    cache = cache if cache is not None else os.environ.get(CACHE_ENV) or None
    captures = {}
    for name in progress(workloads, desc="capturing workloads", enabled=show):
        t0 = time.perf_counter()
        path = None if cache is None or device != "cpu" else _cache_path(Path(cache), name, size, points, device, seed)
        if path is not None and path.exists():
            captures[name] = torch.load(path, weights_only=False)
            how = f"read from {path}"
        else:
            captures[name] = capture(name, size=size, points=tuple(points), device=device, seed=seed)
            how = f"captured in {time.perf_counter() - t0:.1f} s"
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                torch.save(captures[name], tmp)
                tmp.replace(path)  # a crash mid-write never leaves a truncated cache entry
        saved = sum(sum(t.tensor.numel() * t.tensor.element_size() for t in c.tensors) for c in captures[name])
        print(f"  {name}: {len(captures[name])} points, {saved / 2**20:,.1f} MiB saved in all, {how}", flush=True)
    return captures


def _plain(value):
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_results(out: Path, header: dict, rows: Sequence[dict], **extra) -> Path:
    """``results.json`` (header, rows, extra) and ``results.csv`` (rows) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    header = dict(header, finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    (out / "results.json").write_text(json.dumps(_plain({**header, **extra, "rows": list(rows)}), indent=1))
    if rows:
        columns = list(dict.fromkeys(k for r in rows for k in r))
        with (out / "results.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(_plain(list(rows)))
    return out / "results.json"


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]], *, left: Collection[str] = ()) -> str:
    """A fixed-width table; ``columns`` are ``(key, title, format spec)``, a missing value ``-``. The first column
    and those whose key is in ``left`` are aligned left (text), the others right (numbers)."""
    cells = [[format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns] for r in rows]
    widths = [max([len(title)] + [len(c[i]) for c in cells]) for i, (_, title, _) in enumerate(columns)]
    lefts = [i == 0 or key in left for i, (key, _, _) in enumerate(columns)]
    line = lambda items: "  ".join(f"{x:<{w}}" if lt else f"{x:>{w}}" for x, w, lt in zip(items, widths, lefts))  # noqa: E731
    out = [line([t for _, t, _ in columns]), line(["-" * w for w in widths])]
    out += [line(c) for c in cells]
    return "\n".join(out)


def geomean(values: Sequence[float]) -> float:
    """Geometric mean of positive values."""
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def by_set(rows: Sequence[dict], sets: dict[str, list[str]]) -> list[tuple[str, list[dict]]]:
    """``[(set name, its workloads' rows), ...]`` for each set with rows in ``rows``."""
    mine = {name: [r for r in rows if r["workload"] in members] for name, members in sets.items()}
    return [(name, members_rows) for name, members_rows in mine.items() if members_rows]
