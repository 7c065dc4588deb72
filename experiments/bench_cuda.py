"""CUDA benchmark: buddy's zvc kernels next to the torch reference on the GPU, memcpy and nvcomp.

GPU only (exits with a message without one). On the activations of
:func:`experiments.data.activation_tensors` (fp32 and bf16, moved to the GPU)
and one large tensor (``--big-mib``, default 256 MiB: the ``cnn.relu``
activation tiled), it measures, in GB/s of input bytes:

* ``buddy:zvc/cuda`` and ``buddy:zvc/reference``: ``buddy.compress`` (size
  pass, pack, overflow D2H) and ``decompress`` with each backend; the CUDA
  path's buffers must equal the reference's byte for byte and both must round
  trip, or the run stops;
* ``memcpy``: a device-to-device copy of the same bytes (the floor);
* nvcomp's ANS, Bitcomp, Cascaded and LZ4 (``experiments.bench_codecs.nvcomp_baselines``)
  when nvcomp is importable;

and, for the overflow path, the PCIe rate of a pinned host <-> device copy of
each tensor's overflow size (D2H and H2D; the staging-copy design is kept
for now). Timing: CUDA events on the current stream, ``--warmup`` untimed
runs, the median of ``--repeats``.

    python -m experiments.bench_cuda
    python experiments/bench_cuda.py --scale quick --repeats 5

Prints the environment first; writes ``results.json`` to ``--out``
(default ``results/bench_cuda/``).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import buddy
from buddy import env
from buddy.deps import require_cuda
from buddy.errors import MissingDependencyError
from experiments.bench_codecs import RoundTripError, timed

__all__ = ["main", "run", "pcie_rates"]

GB = 1e9  # decimal GB/s
MiB = 1 << 20
BACKENDS = ("cuda", "reference")
#: the codec whose CUDA kernels are measured (the library's default codec has none)
CODEC = "zvc"


def _summary(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else math.inf


def _row(name: str, x: torch.Tensor, method: str, comp: list[float], decomp: list[float], **extra) -> dict[str, Any]:
    nbytes = x.numel() * x.element_size()
    c, d = _summary(comp), _summary(decomp)
    return {
        "tensor": name,
        "dtype": str(x.dtype).removeprefix("torch."),
        "shape": list(x.shape),
        "bytes": nbytes,
        "method": method,
        "comp": c,
        "decomp": d,
        "comp_gbps": _gbps(nbytes, c["median_s"]),
        "decomp_gbps": _gbps(nbytes, d["median_s"]),
        **extra,
    }


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    a = x.detach().contiguous().reshape(-1).view(torch.uint8)
    b = y.detach().contiguous().reshape(-1).view(torch.uint8).to(a.device)
    return a.numel() == b.numel() and torch.equal(a, b)


# ---- methods ------------------------------------------------------------------------------
def bench_memcpy(name: str, x: torch.Tensor, repeats: int, warmup: int) -> dict[str, Any]:
    """Device-to-device copy of the same bytes into a preallocated buffer (fills both columns)."""
    dst = torch.empty_like(x)
    times = timed(lambda: dst.copy_(x), repeats, x.device, warmup=warmup)
    return _row(name, x, "memcpy", times, times, ratio=1.0)


def bench_buddy(
    name: str, x: torch.Tensor, backend: str, entry_bytes: int, store: buddy.BuddyStore, repeats: int, warmup: int
) -> tuple[dict[str, Any], buddy.BuddyTensor]:
    """compress / decompress with :data:`CODEC`, ``backend`` and the default slot; returns the row and one tensor."""

    def compress():
        return buddy.compress(x, codec=CODEC, entry_bytes=entry_bytes, store=store, backend=backend)

    bt = compress()
    if not _same_bytes(bt.decompress(), x):
        raise RoundTripError(f"buddy backend {backend!r} on {name!r}: round trip is not exact")
    comp = timed(compress, repeats, x.device, after=lambda b: b.free(), warmup=warmup)
    decomp = timed(bt.decompress, repeats, x.device, warmup=warmup)
    row = _row(
        name,
        x,
        f"buddy:{CODEC}/{backend}",
        comp,
        decomp,
        ratio=bt.original_bytes / max(1, bt.compressed_bytes),
        eff_ratio=bt.effective_ratio,
        target_ratio=bt.target_ratio,
        device_bytes=bt.device_bytes,
        buddy_bytes=bt.buddy_bytes,
        backend=bt.backend,
    )
    return row, bt


def check_backends_agree(name: str, a: buddy.BuddyTensor, b: buddy.BuddyTensor) -> None:
    """The CUDA path's buffers are the reference's, byte for byte."""
    if a.slot_sectors != b.slot_sectors or a.histogram != b.histogram:
        raise RoundTripError(f"{name!r}: backends chose different slots or histograms")
    for part, x, y in zip(("metadata", "slots", "overflow"), a.buffers(), b.buffers()):
        if not _same_bytes(x, y):
            raise RoundTripError(f"{name!r}: the {a.backend} and {b.backend} backends wrote different {part}")


def bench_nvcomp(name: str, x: torch.Tensor, baseline, repeats: int, warmup: int) -> dict[str, Any]:
    data = x.detach().contiguous().reshape(-1).view(torch.uint8)
    blob = baseline.compress(data)
    if not _same_bytes(baseline.as_bytes(baseline.decompress(blob)), data):
        raise RoundTripError(f"{baseline.method} on {name!r}: round trip is not exact")
    comp = timed(lambda: baseline.compress(data), repeats, x.device, warmup=warmup)
    decomp = timed(lambda: baseline.decompress(blob), repeats, x.device, warmup=warmup)
    return _row(name, x, baseline.method, comp, decomp, ratio=data.numel() / max(1, baseline.size(blob)))


def nvcomp_or_none(device: torch.device) -> tuple[list, str | None]:
    """nvcomp's baselines, or ``([], why not)``."""
    try:
        from experiments.bench_codecs import nvcomp_baselines

        return nvcomp_baselines(device), None
    except (MissingDependencyError, ImportError, RuntimeError) as exc:
        return [], f"nvcomp skipped: {exc}"


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
    backends: tuple[str, ...] = BACKENDS,
    entry_bytes: int = 128,
    repeats: int = 10,
    warmup: int = 2,
    nvcomp: bool = True,
    pcie: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Benchmark every tensor (all on one device) with every method; ``{"rows", "pcie", "notes"}``."""
    rows: list[dict[str, Any]] = []
    pcie_rows: list[dict[str, Any]] = []
    notes: list[str] = []
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    baselines: list = []
    if nvcomp and device.type == "cuda":
        baselines, why = nvcomp_or_none(device)
        if why:
            notes.append(why)
            log(why)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    store = buddy.BuddyStore(capacity_bytes=max(1 << 30, 2 * total), pin=device.type == "cuda")
    for name, x in tensors.items():
        rows.append(bench_memcpy(name, x, repeats, warmup))
        kept = {}
        for backend in backends:
            row, kept[backend] = bench_buddy(name, x, backend, entry_bytes, store, repeats, warmup)
            rows.append(row)
            log(_line(rows[-1]))
        if len(kept) > 1:
            first, *others = kept.values()
            for other in others:
                check_backends_agree(name, first, other)
        overflow = max(bt.buddy_bytes for bt in kept.values()) if kept else 0
        for bt in kept.values():
            bt.free()
        for baseline in baselines:
            rows.append(bench_nvcomp(name, x, baseline, repeats, warmup))
            log(_line(rows[-1]))
        if pcie and device.type == "cuda" and overflow:
            rates = {"tensor": name, **pcie_rates(overflow, device, repeats, warmup)}
            pcie_rows.append(rates)
            log(
                f"{name:>22}  PCIe pinned copy of the overflow ({overflow / MiB:.2f} MiB): "
                f"D2H {rates['d2h_gbps']:.2f} GB/s, H2D {rates['h2d_gbps']:.2f} GB/s"
            )
    return {"rows": rows, "pcie": pcie_rows, "notes": notes}


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['tensor']:>22} {row['dtype']:>9} {row['method']:>22}  "
        f"comp {row['comp_gbps']:8.2f} GB/s  decomp {row['decomp_gbps']:8.2f} GB/s  ratio {row['ratio']:.3f}"
    )


def format_table(result: dict[str, Any]) -> str:
    """Rows as a fixed-width table, then the PCIe rates."""
    head = f"{'tensor':>22} {'dtype':>9} {'MiB':>8} {'method':>22} {'ratio':>7} {'comp GB/s':>10} {'decomp GB/s':>12}"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(
            f"{r['tensor']:>22} {r['dtype']:>9} {r['bytes'] / MiB:8.1f} {r['method']:>22} {r['ratio']:7.3f} "
            f"{r['comp_gbps']:10.2f} {r['decomp_gbps']:12.2f}"
        )
    if result["pcie"]:
        lines += ["", f"{'PCIe, pinned, overflow size':>40} {'MiB':>8} {'D2H GB/s':>9} {'H2D GB/s':>9}"]
        for p in result["pcie"]:
            lines.append(f"{p['tensor']:>40} {p['bytes'] / MiB:8.2f} {p['d2h_gbps']:9.2f} {p['h2d_gbps']:9.2f}")
    return "\n".join(lines)


def gpu_tensors(scale: str, big_mib: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The fp32/bf16 activations on ``device``, and ``cnn.relu`` tiled to ``big_mib`` MiB."""
    from experiments.data import activation_tensors

    acts = activation_tensors(scale)
    out = {n: t.to(device) for n, t in acts.items() if t.dtype in (torch.float32, torch.bfloat16)}
    if big_mib > 0:
        base = acts["cnn.relu"].reshape(-1)
        reps = -(-big_mib * MiB // (base.numel() * base.element_size()))
        big = base.to(device).repeat(reps)[: big_mib * MiB // base.element_size()]
        out[f"cnn.relu.x{reps}"] = big.contiguous()
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_cuda", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default="full", help="activation scale (experiments.data.SCALES; default full)")
    p.add_argument("--big-mib", type=int, default=256, help="size of the large tensor in MiB (0: none)")
    p.add_argument("--entry-bytes", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before the timed ones")
    p.add_argument("--no-nvcomp", action="store_true", help="skip nvcomp's codecs")
    p.add_argument("--out", type=Path, default=Path("results/bench_cuda"))
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
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
    tensors = gpu_tensors(args.scale, args.big_mib, device)
    result = run(
        tensors,
        entry_bytes=args.entry_bytes,
        repeats=args.repeats,
        warmup=args.warmup,
        nvcomp=not args.no_nvcomp,
    )
    print()
    print(format_table(result))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    payload = {
        "environment": env.environment(),
        "command": shlex.join([sys.executable, "-m", "experiments.bench_cuda", *(argv or sys.argv[1:])]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **result,
    }
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
