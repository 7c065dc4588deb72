"""CUDA benchmark: every codec's kernels next to the torch reference, memcpy and nvcomp, on real activations.

GPU only (exits with a message without one). On ``--mib`` MiB (default 256)
of real activations per dtype -- what the experiment workloads save for
backward at full size (``resnet-fp32`` for fp32, ``gpt-bf16`` for bf16),
concatenated in saving order and repeated up to the size -- it measures, in
GB/s of input bytes:

* ``buddy:<codec>/cuda`` for every codec with kernels (zvc, fpx, bpc, auto,
  fpe, auto2: :data:`buddy.engines.sources.KERNEL_CODECS`) at the default entry size, and ``buddy:<codec>/reference`` (the torch
  reference on the GPU, ``--reference``): ``buddy.compress`` (measure, the
  slot the default policy picks, pack, the overflow's copy to pinned memory)
  and ``decompress``; the CUDA path's buffers must equal the reference's byte
  for byte and both must round trip, or the run stops; each row also counts
  the kernel launches and host synchronisations of one compress and one
  decompress (torch profiler, CUDA activity);
* ``memcpy``: a device-to-device copy of the same bytes (the floor);
* every lossless algorithm of nvcomp's Python API on the same bytes
  (``experiments.bench_codecs.nvcomp_baselines``). nvcomp is required: without
  it the run stops before measuring anything, saying why (``--no-nvcomp``
  measures without it); an algorithm that fails is recorded with its error,
  the others are measured, and the run exits non-zero after writing;

and the PCIe rate of a pinned host <-> device copy of each overflow size.
Timing: CUDA events on the current stream, ``--warmup`` untimed runs, the
median of ``--repeats``.

    python -m experiments.bench_cuda
    python -m experiments.bench_cuda --mib 64 --repeats 5 --reference

Prints the environment first; writes ``results.json`` to ``--out`` (default
``results/bench_cuda/``): rows with ``method``, ``dtype``, ``ratio``,
``compress_gbps``, ``decompress_gbps`` (and more), the device, the library
versions and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import buddy
from buddy import env
from buddy.deps import require_cuda
from buddy.engines.tuning import current, tuned
from buddy.errors import MissingDependencyError
from experiments.bench_codecs import Baseline, RoundTripError, timed
from experiments.common import command_line

__all__ = ["main", "run", "pcie_rates", "activation_bytes"]

GB = 1e9  # decimal GB/s
MiB = 1 << 20
#: the codecs measured: every codec with kernels, the default (auto2) among them
CODECS = tuple(buddy.engines.sources.KERNEL_CODECS)
#: the workload whose saved activations make each dtype's tensor
WORKLOADS = {torch.float32: "resnet-fp32", torch.bfloat16: "gpt-bf16"}


def _summary(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else math.inf


def _row(
    name: str, x: torch.Tensor, method: str, comp: list[float], decomp: list[float], **extra: Any
) -> dict[str, Any]:
    nbytes = x.numel() * x.element_size()
    c, d = _summary(comp), _summary(decomp)
    return {
        "tensor": name,
        "dtype": str(x.dtype).removeprefix("torch."),
        "shape": list(x.shape),
        "bytes": nbytes,
        "method": method,
        "device": str(x.device),
        "comp": c,
        "decomp": d,
        "compress_gbps": _gbps(nbytes, c["median_s"]),
        "decompress_gbps": _gbps(nbytes, d["median_s"]),
        **extra,
    }


@contextlib.contextmanager
def _max_blocks(n: int) -> Iterator[None]:
    """At most ``n`` blocks a launch of the CUDA kernels for the block: their warps loop over the entries (by
    default a launch has a warp per entry)."""
    before = buddy.engines.launch.MAX_BLOCKS
    buddy.engines.launch.MAX_BLOCKS = n
    try:
        yield
    finally:
        buddy.engines.launch.MAX_BLOCKS = before


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    a = x.detach().contiguous().reshape(-1).view(torch.uint8)
    b = y.detach().contiguous().reshape(-1).view(torch.uint8).to(a.device)
    return a.numel() == b.numel() and torch.equal(a, b)


def launches_and_syncs(fn: Callable[[], Any], device: torch.device) -> dict[str, int] | None:
    """Kernel launches and host synchronisations of one call of ``fn`` (CUDA only; ``None`` elsewhere)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize(device)  # (the profiler's own: not counted below, it is the last one)
    names = [e.name for e in prof.events()]
    syncs = sum("Synchronize" in n for n in names) - 1
    return {"launches": sum("LaunchKernel" in n for n in names), "syncs": max(0, syncs)}


# ---- methods ------------------------------------------------------------------------------
def bench_memcpy(name: str, x: torch.Tensor, repeats: int, warmup: int) -> dict[str, Any]:
    """Device-to-device copy of the same bytes into a preallocated buffer (fills both columns)."""
    dst = torch.empty_like(x)
    times = timed(lambda: dst.copy_(x), repeats, x.device, warmup=warmup)
    return _row(name, x, "memcpy", times, times, ratio=1.0)


def bench_buddy(
    name: str, x: torch.Tensor, codec: str, backend: str, store: buddy.BuddyStore, repeats: int, warmup: int
) -> tuple[dict[str, Any], buddy.BuddyTensor]:
    """compress / decompress with ``codec`` and ``backend`` at the default entry size and policy."""

    def compress() -> buddy.BuddyTensor:
        return buddy.compress(x, codec=codec, store=store, backend=backend)

    bt = compress()
    if not _same_bytes(bt.decompress(check=True), x):
        raise RoundTripError(f"buddy {codec}/{backend} on {name!r}: round trip is not exact")
    comp = timed(compress, repeats, x.device, after=lambda b: b.free(), warmup=warmup)
    decomp = timed(bt.decompress, repeats, x.device, warmup=warmup)
    row = _row(
        name,
        x,
        f"buddy:{codec}/{backend}",
        comp,
        decomp,
        ratio=bt.original_bytes / max(1, bt.compressed_bytes),
        eff_ratio=bt.effective_ratio,
        target_ratio=bt.target_ratio,
        entry_bytes=bt.entry_bytes,
        device_bytes=bt.device_bytes,
        buddy_bytes=bt.buddy_bytes,
        backend=bt.backend,
        compress_counts=launches_and_syncs(lambda: compress().free(), x.device),
        decompress_counts=launches_and_syncs(bt.decompress, x.device),
    )
    return row, bt


def check_backends_agree(name: str, a: buddy.BuddyTensor, b: buddy.BuddyTensor) -> None:
    """The CUDA path's buffers are the reference's, byte for byte."""
    if a.slot_sectors != b.slot_sectors or a.histogram != b.histogram:
        raise RoundTripError(f"{name!r}: backends chose different slots or histograms")
    for part, x, y in zip(("metadata", "slots", "overflow"), a.buffers(), b.buffers()):
        if not _same_bytes(x, y):
            raise RoundTripError(f"{name!r}: the {a.backend} and {b.backend} backends wrote different {part}")


def bench_nvcomp(name: str, x: torch.Tensor, baseline: Baseline, repeats: int, warmup: int) -> dict[str, Any]:
    data = x.detach().contiguous().reshape(-1).view(torch.uint8)
    blob = baseline.compress(data)
    if not _same_bytes(baseline.as_bytes(baseline.decompress(blob)), data):
        raise RoundTripError(f"{baseline.method} on {name!r}: round trip is not exact")
    comp = timed(lambda: baseline.compress(data), repeats, x.device, warmup=warmup)
    decomp = timed(lambda: baseline.decompress(blob), repeats, x.device, warmup=warmup)
    return _row(name, x, baseline.method, comp, decomp, ratio=data.numel() / max(1, baseline.size(blob)))


def nvcomp_or_exit(device: torch.device) -> list[Baseline]:
    """nvcomp's baselines on ``device``; exits saying why when nvcomp cannot run (never a silent skip)."""
    from experiments.bench_codecs import nvcomp_baselines

    try:
        return nvcomp_baselines(device)
    except (MissingDependencyError, ImportError, RuntimeError) as exc:
        raise SystemExit(
            f"bench_cuda: nvcomp is required and cannot run here: {exc}\n"
            f"  (install nvidia-nvcomp-cu<CUDA major> and nvidia-libnvcomp-cu<CUDA major>, "
            f"or pass --no-nvcomp to measure without it)"
        ) from exc


def pcie_rates(nbytes: int, device: torch.device, repeats: int, warmup: int) -> dict[str, Any]:
    """GB/s of a pinned host <-> device copy of ``nbytes`` (D2H and H2D), as the overflow path does."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), repeats, device, warmup=warmup)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), repeats, device, warmup=warmup)
    return {
        "bytes": nbytes,
        "d2h": _summary(d2h),
        "h2d": _summary(h2d),
        "d2h_gbps": _gbps(nbytes, statistics.median(d2h)),
        "h2d_gbps": _gbps(nbytes, statistics.median(h2d)),
    }


# ---- the run ------------------------------------------------------------------------------
def run(
    tensors: dict[str, torch.Tensor],
    *,
    codecs: tuple[str, ...] = CODECS,
    backends: tuple[str, ...] = ("cuda",),
    repeats: int = 10,
    warmup: int = 2,
    baselines: Sequence[Baseline] = (),
    pcie: bool = True,
    zero_copy: bool = False,
    global_table: bool = False,
    other_count: bool = False,
    pack_fields: bool = False,
    max_blocks: Sequence[int] = (),
    unpack_warps: Sequence[int] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Benchmark every tensor (all on one device) with every method; ``{"rows", "pcie", "errors"}``.

    ``zero_copy``: each codec's kernels once more tuned ``zero_copy=True`` (method ``.../cuda+zero-copy``:
    unpack reads the overflow in pinned host memory instead of copying it to the device first; compress is the
    same code either way). ``global_table``: each table codec's kernels once more with
    ``shared_tables=False`` (method ``.../cuda+global-table``: unpack reads the table in global memory through
    L1, as before each block copied it into its shared memory). ``other_count``: each table codec's kernels once
    more with the count kernel's form the tensor's word size does not take by default
    (:meth:`buddy.engines.tuning.Tuning.count_matches`; method ``.../cuda+count-ballot``: a warp's
    zero words by ballots and its other words added one by one, or ``.../cuda+count-match``: a warp's equal keys
    matched). ``pack_fields``: each table codec's kernels once more tuned ``pack_fields=True`` (method
    ``.../cuda+pack-fields``: pack reads each word's whole field from a table its block makes in shared memory).
    ``max_blocks``: each codec's kernels once more for each ``n`` with at most ``n`` blocks
    a launch (method ``.../cuda+blocks<=n``), the warps looping over the entries: whether a grid of about one wave
    keeps more warps resident than a warp per entry, whose blocks hold their shared memory until their slowest
    warp is done. ``unpack_warps``: each table codec's kernels once more for each ``n`` with
    ``unpack_warps=n`` (method ``.../cuda+unpack-warps=n``): unpack at most ``n`` warps an SM, its decompress
    against the default's, how its speed grows with the warps an SM. ``baselines``: nvcomp's
    (:func:`nvcomp_or_exit`). A baseline that fails on a tensor is recorded in ``errors`` (method, tensor, the
    error) and the run goes on; buddy's codecs must round trip or the run stops.
    """
    rows: list[dict[str, Any]] = []
    pcie_rows: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    store = buddy.BuddyStore(capacity_bytes=max(1 << 30, 2 * total), pin=device.type == "cuda")
    for name, x in tensors.items():
        rows.append(bench_memcpy(name, x, repeats, warmup))
        log(_line(rows[-1]))
        overflow = 0
        for codec in codecs:
            kept = {}
            for backend in backends:
                row, kept[backend] = bench_buddy(name, x, codec, backend, store, repeats, warmup)
                rows.append(row)
                log(_line(rows[-1]))
            if zero_copy and "cuda" in backends:
                with tuned(zero_copy=True):
                    row, in_place = bench_buddy(name, x, codec, "cuda", store, repeats, warmup)
                rows.append({**row, "method": f"{row['method']}+zero-copy", "zero_copy": True})
                log(_line(rows[-1]))
                in_place.free()
            tabled = "cuda" in backends and codec in buddy.engines.sources.TABLED_KERNELS
            match = not current().count_matches(x.element_size())  # the count's form not taken by default
            count_form = "count-match" if match else "count-ballot"
            # (wanted, the tuning's change, the method's suffix, what the row is marked with)
            variants: tuple[tuple[bool, dict[str, Any], str, dict[str, Any]], ...] = (
                (global_table, {"shared_tables": False}, "global-table", {"global_table": True}),
                (other_count, {"count_match": match}, count_form, {count_form.replace("-", "_"): True}),
                (pack_fields, {"pack_fields": True}, "pack-fields", {"pack_fields": True}),
                *((True, {"unpack_warps": n}, f"unpack-warps={n}", {"unpack_warps": n}) for n in unpack_warps),
            )  # fmt: skip
            for wanted, change, suffix, mark in variants:
                if wanted and tabled:
                    with tuned(**change):
                        row, other = bench_buddy(name, x, codec, "cuda", store, repeats, warmup)
                    rows.append({**row, "method": f"{row['method']}+{suffix}", **mark})
                    log(_line(rows[-1]))
                    other.free()
            for n in max_blocks if "cuda" in backends else ():
                with _max_blocks(n):
                    row, capped = bench_buddy(name, x, codec, "cuda", store, repeats, warmup)
                rows.append({**row, "method": f"{row['method']}+blocks<={n}", "max_blocks": n})
                log(_line(rows[-1]))
                capped.free()
            first, *others = kept.values()
            for other in others:
                check_backends_agree(name, first, other)
            overflow = max(overflow, *(bt.buddy_bytes for bt in kept.values()))
            for bt in kept.values():
                bt.free()
        for baseline in baselines:
            try:
                rows.append(bench_nvcomp(name, x, baseline, repeats, warmup))
            except (RuntimeError, ValueError) as exc:  # nvcomp raises these for an algorithm it cannot run
                errors.append({"method": baseline.method, "tensor": name, "error": f"{type(exc).__name__}: {exc}"})
                log(f"{name:>14} {baseline.method:>34}  FAILED: {errors[-1]['error']}")
                continue
            log(_line(rows[-1]))
        if pcie and device.type == "cuda" and overflow:
            pcie_rows.append({"tensor": name, **pcie_rates(overflow, device, repeats, warmup)})
    return {"rows": rows, "pcie": pcie_rows, "errors": errors}


def _line(row: dict[str, Any]) -> str:
    counts = row.get("compress_counts")
    extra = f"  launches {counts['launches']}, syncs {counts['syncs']}" if counts else ""
    return (
        f"{row['tensor']:>14} {row['dtype']:>9} {row['method']:>24}  comp {row['compress_gbps']:8.2f} GB/s  "
        f"decomp {row['decompress_gbps']:8.2f} GB/s  ratio {row['ratio']:.3f}{extra}"
    )


def format_table(result: dict[str, Any]) -> str:
    """Rows as a fixed-width table, then the PCIe rates."""
    head = (
        f"{'tensor':>14} {'dtype':>9} {'MiB':>7} {'method':>24} {'ratio':>6} {'comp GB/s':>10} {'decomp GB/s':>12} "
        f"{'launches c/d':>13} {'syncs c/d':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        c, d = r.get("compress_counts"), r.get("decompress_counts")
        launches = f"{c['launches']}/{d['launches']}" if c and d else ""
        syncs = f"{c['syncs']}/{d['syncs']}" if c and d else ""
        lines.append(
            f"{r['tensor']:>14} {r['dtype']:>9} {r['bytes'] / MiB:7.1f} {r['method']:>24} {r['ratio']:6.3f} "
            f"{r['compress_gbps']:10.2f} {r['decompress_gbps']:12.2f} {launches:>13} {syncs:>10}"
        )
    if result["pcie"]:
        lines += ["", f"{'PCIe, pinned, overflow size':>40} {'MiB':>8} {'D2H GB/s':>9} {'H2D GB/s':>9}"]
        for p in result["pcie"]:
            lines.append(f"{p['tensor']:>40} {p['bytes'] / MiB:8.2f} {p['d2h_gbps']:9.2f} {p['h2d_gbps']:9.2f}")
    return "\n".join(lines)


def activation_bytes(
    dtype: torch.dtype, mib: int, device: torch.device | str, *, size: str = "full", point: int = 30
) -> torch.Tensor:
    """``mib`` MiB of what a workload saves for backward, ``point`` steps into training, as one ``dtype`` tensor.

    The saved tensors of one step (``WORKLOADS[dtype]``), each in the bytes
    buddy compresses, concatenated in saving order and repeated up to the
    size (the last copy cut).
    """
    from experiments.workloads import capture

    (cap,) = capture(WORKLOADS[dtype], size=size, points=(point,), device=device)
    parts = [t.tensor.detach().reshape(-1).view(torch.uint8) for t in cap.tensors if t.tensor.dtype == dtype]
    if not parts:
        raise RuntimeError(f"{WORKLOADS[dtype]} saved no {dtype} tensor")
    step = torch.cat([p.to(device) for p in parts])
    want = mib * MiB
    whole = step.repeat(-(-want // step.numel()))[:want]
    return whole.view(dtype)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_cuda", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB of activations per dtype (default 256)")
    p.add_argument("--size", default="full", help="workload size the activations come from (default full)")
    p.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS), help="codecs with kernels to measure")
    p.add_argument("--reference", action="store_true", help="also time the torch reference on the GPU (slow)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before the timed ones")
    p.add_argument("--no-nvcomp", action="store_true", help="measure without nvcomp (by default it is required)")
    p.add_argument("--zero-copy", action="store_true",
                   help="each codec once more tuned zero_copy=True (unpack reads the overflow in pinned host memory)")
    p.add_argument("--global-table", action="store_true",
                   help="each table codec once more tuned shared_tables=False (unpack reads the table in global "
                        "memory, not a copy each block makes in its shared memory)")  # fmt: skip
    p.add_argument("--other-count", action="store_true",
                   help="each table codec once more with the count kernel's form its word size does not take by "
                        "default (Tuning.count_match: a warp's zero words by ballots, or its equal keys matched)")
    p.add_argument("--pack-fields", action="store_true",
                   help="each table codec once more tuned pack_fields=True (pack reads a word's whole field from a "
                        "table each block makes in its shared memory)")  # fmt: skip
    p.add_argument("--max-blocks", type=int, nargs="+", default=[], metavar="N",
                   help="each codec once more with at most N blocks a kernel launch (the warps loop over the entries)")
    p.add_argument("--unpack-warps", type=int, nargs="+", default=[], metavar="N",
                   help="each table codec once more tuned unpack_warps=N (unpack at most N warps an SM)")
    p.add_argument("--out", type=Path, default=Path("results/bench_cuda"))
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.mib < 1 or any(n < 1 for n in args.max_blocks):
        p.error("--repeats, --mib and --max-blocks must be >= 1 and --warmup >= 0")
    if any(not 1 <= n <= 64 for n in args.unpack_warps):
        p.error("--unpack-warps takes warps an SM, 1 to 64")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    print(env.format_environment(), flush=True)
    print(flush=True)
    try:
        require_cuda("experiments.bench_cuda")
    except MissingDependencyError as exc:
        raise SystemExit(f"bench_cuda: nothing to measure without a GPU. {exc}") from None
    device = torch.device("cuda", torch.cuda.current_device())
    baselines = [] if args.no_nvcomp else nvcomp_or_exit(device)  # before anything slow: absent nvcomp stops here
    tensors = {
        f"{WORKLOADS[d]}.{args.mib}MiB": activation_bytes(d, args.mib, device, size=args.size) for d in WORKLOADS
    }
    result = run(
        tensors,
        codecs=tuple(args.codecs),
        backends=("cuda", "reference") if args.reference else ("cuda",),
        repeats=args.repeats,
        warmup=args.warmup,
        baselines=baselines,
        zero_copy=args.zero_copy,
        global_table=args.global_table,
        other_count=args.other_count,
        pack_fields=args.pack_fields,
        max_blocks=tuple(args.max_blocks),
        unpack_warps=tuple(args.unpack_warps),
    )
    print()
    print(format_table(result))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    payload = {
        "environment": env.environment(),
        "device": torch.cuda.get_device_name(device),
        "command": command_line("bench_cuda", argv or sys.argv[1:], python=sys.executable),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **result,
    }
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
    if result["errors"]:
        failed = ", ".join(sorted({e["method"] for e in result["errors"]}))
        raise SystemExit(f"bench_cuda: {len(result['errors'])} measurements failed ({failed}); see {path}")
    return result


if __name__ == "__main__":
    main()
