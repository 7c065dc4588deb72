"""Codec benchmark: buddy's codecs next to memcpy, zstd and lz4 on real activations.

For every tensor of :func:`experiments.data.activation_tensors` and every
method, the round trip is checked byte for byte first (the run aborts on any
difference); then one warm-up, then compress and decompress are timed as the
median of ``--repeats`` runs. buddy uses its default slot choice
(``target_ratio=None``).

    python -m experiments.bench_codecs --scale quick
    python -m experiments.bench_codecs --entry-bytes 4096 --backends reference native   # the CPU engines
    python experiments/bench_codecs.py --scale full --device cuda --nvcomp

Writes ``results.json`` (environment, command line, rows) and
``results.csv`` to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import buddy
from buddy import env
from buddy.deps import require, require_cuda
from experiments import common
from experiments.common import command_line
from experiments.data import SCALES, activation_tensors
from experiments.plot import plot_bench_codecs

__all__ = ["Row", "RoundTripError", "main"]

GB = 1e9  # throughputs are in decimal GB/s
MiB = 1 << 20
WARMUP = 1  # untimed runs before the timed ones (allocator, caches, lazy init)


class RoundTripError(RuntimeError):
    """A method did not give back the exact bytes it was given."""


@dataclass(frozen=True)
class Row:
    """One tensor x method result.

    Sizes in bytes; times in seconds: the median (``comp_s``, ``decomp_s``)
    and the extremes of the timed runs, so noisy measurements show.

    ``eff_ratio``, ``buddy_fraction``, ``target_ratio`` and ``slot_sectors``
    are ``None`` for methods other than buddy's.
    """

    tensor: str
    dtype: str
    shape: str
    device: str
    method: str
    original_bytes: int
    compressed_bytes: int
    device_bytes: int | None
    buddy_bytes: int | None
    target_ratio: float | None
    slot_sectors: int | None
    comp_s: float
    comp_s_min: float
    comp_s_max: float
    decomp_s: float
    decomp_s_min: float
    decomp_s_max: float
    ratio: float
    eff_ratio: float | None
    buddy_fraction: float | None
    comp_gbps: float
    decomp_gbps: float


# ---- the one place where sizes and times become ratios and GB/s ---------------
def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's data."""
    return t.numel() * t.element_size()


def _div(num: float, den: float) -> float:
    return num / den if den else math.inf


def make_row(
    name: str,
    x: torch.Tensor,
    method: str,
    *,
    compressed_bytes: int,
    comp_times: Sequence[float],
    decomp_times: Sequence[float],
    bt: buddy.BuddyTensor | None = None,
) -> Row:
    """A :class:`Row` for ``method`` on tensor ``x``; derives every ratio and rate.

    ``comp_times`` / ``decomp_times``: seconds of each timed run.
    ``ratio`` = original / compressed bytes; GB/s = original bytes / median
    seconds (input throughput, both directions). With ``bt`` (a BuddyTensor
    of ``x``) the buddy columns come from its attributes.
    """
    original = nbytes(x)
    comp_s, decomp_s = statistics.median(comp_times), statistics.median(decomp_times)
    return Row(
        tensor=name,
        dtype=str(x.dtype).removeprefix("torch."),
        shape="x".join(map(str, x.shape)),
        device=str(x.device),
        method=method,
        original_bytes=original,
        compressed_bytes=compressed_bytes,
        device_bytes=None if bt is None else bt.device_bytes,
        buddy_bytes=None if bt is None else bt.buddy_bytes,
        target_ratio=None if bt is None else bt.target_ratio,
        slot_sectors=None if bt is None else bt.slot_sectors,
        comp_s=comp_s,
        comp_s_min=min(comp_times),
        comp_s_max=max(comp_times),
        decomp_s=decomp_s,
        decomp_s_min=min(decomp_times),
        decomp_s_max=max(decomp_times),
        ratio=_div(original, compressed_bytes),
        eff_ratio=None if bt is None else bt.effective_ratio,
        buddy_fraction=None if bt is None else _div(bt.buddy_bytes, original),
        comp_gbps=_div(original, comp_s) / GB,
        decomp_gbps=_div(original, decomp_s) / GB,
    )


# ---- correctness and timing --------------------------------------------------------
def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def check_round_trip(x: torch.Tensor, y: torch.Tensor, method: str, name: str, *, same_type: bool = True) -> None:
    """Raise :class:`RoundTripError` unless ``y`` holds exactly the bytes of ``x``.

    With ``same_type`` the dtype and shape must match too (buddy returns a
    tensor; the byte-stream baselines return bytes only).
    """
    if same_type and (y.dtype != x.dtype or y.shape != x.shape):
        raise RoundTripError(
            f"{method} on {name!r}: got {y.dtype} {tuple(y.shape)}, expected {x.dtype} {tuple(x.shape)}"
        )
    a, b = byte_view(x), byte_view(y).to(x.device)
    if a.numel() != b.numel():
        raise RoundTripError(f"{method} on {name!r}: got {b.numel()} bytes back, expected {a.numel()}")
    wrong = (a != b).nonzero()
    if wrong.numel():
        raise RoundTripError(
            f"{method} on {name!r}: {wrong.numel()} of {a.numel()} bytes differ (first at byte "
            f"{int(wrong[0])}); stopping, timings of a lossy round trip mean nothing"
        )


def _seconds(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Run ``fn`` once; its wall time on the device's clock, and its result."""
    if device.type == "cuda":
        # events bracket the work queued on the stream, not just its launch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out
    start_s = time.perf_counter()
    out = fn()
    return time.perf_counter() - start_s, out


def timed(
    fn: Callable[[], Any],
    repeats: int,
    device: torch.device,
    after: Callable[[Any], None] | None = None,
    *,
    warmup: int = WARMUP,
) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn()``, after ``warmup`` untimed ones.

    ``after(result)`` runs outside the timed region (e.g. to free what
    ``fn`` made, so runs do not pile up memory).
    """
    times = []
    for i in range(warmup + repeats):
        seconds, out = _seconds(fn, device)
        if after is not None:
            after(out)
        del out
        if i >= warmup:
            times.append(seconds)
    return times


# ---- methods -------------------------------------------------------------------------
def bench_memcpy(name: str, x: torch.Tensor, repeats: int) -> Row:
    """A plain copy of ``x`` on its device: the floor every method is compared to.

    One copy stands for either direction, so its rate fills both columns.
    """
    copy = lambda: torch.empty_like(x).copy_(x)  # noqa: E731
    check_round_trip(x, copy(), "memcpy", name)
    times = timed(copy, repeats, x.device)
    return make_row(name, x, "memcpy", compressed_bytes=nbytes(x), comp_times=times, decomp_times=times)


def buddy_method(codec: str, backend: str) -> str:
    """A buddy method's name in the table: ``buddy:<codec>``, with ``@<backend>`` unless buddy chose it."""
    return f"buddy:{codec}" if backend == "auto" else f"buddy:{codec}@{backend}"


def bench_buddy(
    name: str, x: torch.Tensor, codec: str, entry_bytes: int, repeats: int, backend: str = "auto"
) -> Row:
    """buddy.compress / decompress of ``x`` with ``codec``, ``backend`` and the default slot choice."""
    compress = lambda: buddy.compress(x, codec=codec, entry_bytes=entry_bytes, backend=backend)  # noqa: E731
    bt = compress()
    try:
        check_round_trip(x, bt.decompress(), f"buddy codec {codec!r}", name)
        comp_times = timed(compress, repeats, x.device, after=lambda b: b.free())
        decomp_times = timed(bt.decompress, repeats, x.device)
        return make_row(
            name,
            x,
            buddy_method(codec, backend),
            compressed_bytes=bt.compressed_bytes,
            comp_times=comp_times,
            decomp_times=decomp_times,
            bt=bt,
        )
    finally:
        bt.free()


@dataclass(frozen=True)
class Baseline:
    """A general-purpose compressor over a tensor's raw bytes.

    compress: flat uint8 tensor -> blob; decompress: blob -> the bytes in
    the compressor's own type; size: blob -> bytes; as_bytes: that output ->
    flat uint8 tensor, used only by the round-trip check so that no
    conversion is timed.
    """

    method: str
    compress: Callable[[torch.Tensor], Any]
    decompress: Callable[[Any], Any]
    size: Callable[[Any], int]
    as_bytes: Callable[[Any], torch.Tensor]


def cpu_baselines() -> list[Baseline]:
    """zstd level 3 and lz4 (frame format, default level), single-threaded, on the host."""
    zstd = require("zstandard", "the zstd baseline")
    lz4_frame = require("lz4.frame", "the lz4 baseline")
    cctx, dctx = zstd.ZstdCompressor(level=3), zstd.ZstdDecompressor()
    # .numpy() of a CPU tensor is a view: the timed region copies nothing extra
    as_bytes = lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # noqa: E731 - bytearray: writable
    return [
        Baseline("zstd-3", lambda t: cctx.compress(t.numpy()), dctx.decompress, len, as_bytes),
        Baseline("lz4", lambda t: lz4_frame.compress(t.numpy()), lz4_frame.decompress, len, as_bytes),
    ]


#: nvcomp's lossless codecs compared against (names as nvcomp's Python API spells them)
NVCOMP_ALGORITHMS = ("ANS", "Bitcomp", "Cascaded", "LZ4", "GDeflate", "Deflate", "Gzip", "Snappy", "Zstd")


def _nvcomp_encode(nvcomp: Any, codec: Any, t: torch.Tensor) -> Any:
    return codec.encode(nvcomp.as_array(t))


def nvcomp_baselines(device: torch.device) -> list[Baseline]:
    """nvcomp's codecs on the GPU (``--nvcomp``). Not run without a GPU: kept small on purpose."""
    nvcomp = require("nvidia.nvcomp", "the nvcomp baseline")
    # on the current stream, so the CUDA events of the timer bracket its work
    stream = torch.cuda.current_stream(device).cuda_stream
    as_bytes = lambda out: torch.as_tensor(out, device=device).reshape(-1).view(torch.uint8)  # noqa: E731
    baselines = []
    for algorithm in NVCOMP_ALGORITHMS:
        codec = nvcomp.Codec(algorithm=algorithm, cuda_stream=stream)
        baselines.append(
            Baseline(
                f"nvcomp-{algorithm.lower()}",
                partial(_nvcomp_encode, nvcomp, codec),
                codec.decode,
                lambda blob: int(blob.buffer_size),
                as_bytes,
            )
        )
    return baselines


def bench_baseline(name: str, x: torch.Tensor, baseline: Baseline, repeats: int) -> Row:
    """``baseline`` on the bytes of ``x``: round trip checked, then timed."""
    data = byte_view(x)
    blob = baseline.compress(data)
    check_round_trip(x, baseline.as_bytes(baseline.decompress(blob)), baseline.method, name, same_type=False)
    comp_times = timed(lambda: baseline.compress(data), repeats, x.device)
    decomp_times = timed(lambda: baseline.decompress(blob), repeats, x.device)
    return make_row(
        name, x, baseline.method, compressed_bytes=baseline.size(blob), comp_times=comp_times, decomp_times=decomp_times
    )


# ---- the run ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; exits with a usage message on bad arguments."""
    codecs = buddy.available_codecs()
    p = argparse.ArgumentParser(prog="bench_codecs", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=list(SCALES), default="quick", help="tensor sizes (tiny is for tests)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--codecs",
        nargs="+",
        choices=codecs,
        default=codecs,
        metavar="CODEC",
        help=f"buddy codecs (default: all: {' '.join(codecs)})",
    )
    p.add_argument("--entry-bytes", type=int, default=128, help="buddy entry size E (default 128)")
    p.add_argument(
        "--backends",
        nargs="+",
        choices=["auto", "reference", "native", "cuda"],
        default=["auto"],
        metavar="BACKEND",
        help="buddy backends, each a method of its own (default: auto, what buddy picks)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the median is reported")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (crops, text start, weights)")
    p.add_argument("--nvcomp", action="store_true", help="add nvcomp's codecs (CUDA only)")
    p.add_argument("--out", type=Path, default=Path("results/bench_codecs"), help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if args.nvcomp and args.device != "cuda":
        p.error("--nvcomp needs --device cuda")
    return args


def methods(
    name: str, x: torch.Tensor, args: argparse.Namespace, baselines: list[Baseline]
) -> list[tuple[str, Callable[[], Row]]]:
    """``(method, measure)`` for every method on tensor ``x``, in table order."""
    jobs: list[tuple[str, Callable[[], Row]]] = [("memcpy", partial(bench_memcpy, name, x, args.repeats))]
    jobs += [
        (buddy_method(c, b), partial(bench_buddy, name, x, c, args.entry_bytes, args.repeats, b))
        for c in args.codecs
        for b in args.backends
    ]
    jobs += [(b.method, partial(bench_baseline, name, x, b, args.repeats)) for b in baselines]
    return jobs


def run(tensors: dict[str, torch.Tensor], args: argparse.Namespace, baselines: list[Baseline]) -> list[Row]:
    """Every method on every tensor, in table order; aborts on the first bad round trip."""
    tqdm = require("tqdm", "the progress bar").tqdm
    jobs = [
        (name, method, measure) for name, x in tensors.items() for method, measure in methods(name, x, args, baselines)
    ]
    rows = []
    with tqdm(total=len(jobs), unit="run", disable=args.no_progress, file=sys.stderr) as bar:
        for name, method, measure in jobs:
            bar.set_postfix_str(f"{name} {method}")
            rows.append(measure())
            bar.update()
    return rows


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else format(value, spec)


#: the table's columns (key, title, format spec): :func:`format_table` formats the cells itself
_COLUMNS = [
    ("tensor", "tensor", ""), ("dtype", "dtype", ""), ("MiB", "MiB", ""), ("method", "method", ""),
    ("ratio", "ratio", ""), ("eff_ratio", "eff. ratio", ""), ("buddy", "buddy %", ""), ("comp", "comp GB/s", ""),
    ("decomp", "decomp GB/s", ""),
]  # fmt: skip


def format_table(rows: list[Row], repeats: int) -> str:
    """A fixed-width table, one line per tensor x method; a tensor's name only on its first line."""
    lines, previous = [], None
    for r in rows:
        first = r.tensor != previous
        previous = r.tensor
        lines.append(
            {
                "tensor": r.tensor if first else "",
                "dtype": r.dtype if first else "",
                "MiB": f"{r.original_bytes / MiB:.2f}" if first else "",
                "method": r.method,
                "ratio": _fmt(r.ratio, ".2f"),
                "eff_ratio": _fmt(r.eff_ratio, ".2f"),
                "buddy": _fmt(None if r.buddy_fraction is None else 100 * r.buddy_fraction, ".1f"),
                "comp": _fmt(r.comp_gbps, ".3f"),
                "decomp": _fmt(r.decomp_gbps, ".3f"),
            }
        )
    notes = [
        "ratio: original / compressed bytes (buddy: entries compacted to their sectors)",
        "eff. ratio: original / device bytes (slots + metadata); buddy %: overflow in buddy memory / original",
        f"GB/s: original bytes / median of {repeats} runs after {WARMUP} warm-up (1 GB = 1e9 B); memcpy: one copy in both columns",
    ]
    table = common.format_table(lines, _COLUMNS, left=("dtype", "method"))
    return "\n".join([table, "", *notes])


def _jsonable(value: Any) -> Any:
    """JSON has no infinities: write them as the string "inf"."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages, if the OS has them: other work on the machine skews CPU timings."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def warn_if_busy(load: list[float] | None, device: torch.device) -> None:
    """Say so on stderr when other work already keeps the CPUs busy.

    On a busy machine torch's worker threads wait on each other, and CPU
    timings can be many times slower than on a quiet one.
    """
    cores = os.cpu_count() or 1
    if load is not None and device.type == "cpu" and load[0] > 0.5 * cores:
        print(
            f"warning: load average {load[0]} on {cores} cores: other work is running, CPU timings will be noisy",
            file=sys.stderr,
        )


def write_results(out: Path, run_info: dict[str, Any], rows: list[Row]) -> None:
    """``results.json`` (``run_info`` and the rows) and ``results.csv`` (the rows) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    records = [{k: _jsonable(v) for k, v in asdict(r).items()} for r in rows]
    doc = {**run_info, "rows": records}
    (out / "results.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fld.name for fld in fields(Row)])
        writer.writeheader()
        writer.writerows(records)


def main(argv: list[str] | None = None) -> list[Row]:
    """Run the benchmark with command-line ``argv`` (default ``sys.argv[1:]``); returns the rows."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.device == "cuda":
        require_cuda("--device cuda")
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # before the environment, which records it
    environment = env.environment()
    print(env.format_environment(environment), flush=True)
    run_info: dict[str, Any] = {
        "experiment": "bench_codecs",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "environment": environment,
        "command": command_line("bench_codecs", argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "warmup": WARMUP,
        "load_average": {"start": _load_average()},
    }
    warn_if_busy(run_info["load_average"]["start"], device)

    # built on the CPU whatever the device, so every device sees the same bytes
    tensors = {name: t.to(device) for name, t in activation_tensors(args.scale, seed=args.seed).items()}
    # zstd and lz4 run on the host: next to GPU codecs they would measure the
    # transfer as much as the codec, so on CUDA only nvcomp stands in for them
    baselines = cpu_baselines() if device.type == "cpu" else (nvcomp_baselines(device) if args.nvcomp else [])
    rows = run(tensors, args, baselines)
    run_info["load_average"]["end"] = _load_average()
    run_info["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")

    print()
    print(format_table(rows, args.repeats))
    print(
        f"load average (1/5/15 min): {run_info['load_average']['start']} at start, {run_info['load_average']['end']} at end"
    )
    write_results(args.out, run_info, rows)
    png = plot_bench_codecs(args.out / "results.json", args.out)[0]
    print(f"\nwrote {args.out / 'results.json'}, {args.out / 'results.csv'} and {png}")
    return rows


if __name__ == "__main__":
    try:
        main()
    except (RoundTripError, buddy.MissingDependencyError) as exc:
        sys.exit(f"error: {exc}")
