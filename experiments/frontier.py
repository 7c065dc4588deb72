"""Step time against capacity: every way to trade time for activation memory, on the same models and data.

Per model (:mod:`experiments.step_time`'s ResNet-50 and GPT-2-small classes),
one training step under each method:

* ``none``: plain PyTorch;
* ``checkpoint``: ``torch.utils.checkpoint`` around every block;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu``;
* ``buddy``: ``buddy.compressed_activations()``: every saved tensor;
* ``buddy-target-F``: :class:`buddy.budget.MemoryTarget` with ``fraction=F``:
  the fewest modeled seconds that bring the saved tensors' peak to ``F`` of
  what it is uncompressed;
* ``buddy-time-F``: :class:`buddy.budget.TimeBudget` ``(F)``: the lowest peak
  within ``F`` of a plain step's time (modeled);
* ``buddy+checkpoint``: every block checkpointed, buddy compressing what
  checkpointing keeps.

Each method's ``step_ms`` (median of the timed steps) and ``capacity``: the
memory a plain step adds at its peak divided by what this method's step adds
(on a GPU the allocator's peak less the model's state; on the CPU the
process's peak resident memory above its start, the least of two more steps after the
timings: :func:`experiments.step_time.host_peak`). The plot draws each method
as a point, time against capacity, the buddy budgets joined as curves. For
the buddy methods also the session's own model of its saved tensors' peak
(:mod:`buddy.peak`): the peak they would make uncompressed over the peak
they made as the step compressed them (a model, with no transient buffers).

    python -m experiments.frontier                          # the CPU: small models, CPU times
    python -m experiments.frontier --device cuda            # a GPU: the real measurement

On the CPU the models are small, every method runs on the host, and the times
are CPU times: the plot's shape (which methods buy how much memory for how
much time) carries over, its numbers do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import buddy
from buddy import MemoryTarget, TimeBudget
from experiments import cli, step_time
from experiments.common import format_table, progress

__all__ = ["Method", "METHODS", "methods", "main"]


@dataclasses.dataclass(frozen=True)
class Method:
    """A point of the frontier: a :mod:`experiments.step_time` method, a buddy policy made fresh per run, and
    whether every block is checkpointed."""

    name: str
    base: str
    policy: Callable[[], buddy.Policy] | None = None
    checkpointed: bool = False
    family: str = ""  # the curve it is drawn on (empty: a point of its own)


#: buddy's min_bytes on the CPU: the CPU models' activations are tens to hundreds of KiB
CPU_MIN_BYTES = 64 << 10

#: CPU runs: each method's host peak is the least of this many steps, each after its own warm-up (the process's
#: resident memory moves by a few MiB from run to run with the allocator's arenas)
PEAK_REPEATS = 2

#: the memory targets and time budgets a default run draws its curves through
TARGETS = (0.75, 0.5, 0.3)
BUDGETS = (0.05, 0.15)


def _target(fraction: float) -> Callable[[], buddy.Policy]:
    return lambda: MemoryTarget(fraction=fraction)


def _budget(fraction: float) -> Callable[[], buddy.Policy]:
    return lambda: TimeBudget(fraction)


def methods(targets=TARGETS, budgets=BUDGETS) -> list[Method]:
    found = [
        Method("none", "none"),
        Method("checkpoint", "checkpoint"),
        Method("save_on_cpu", "save_on_cpu"),
        Method("buddy", "buddy", family="buddy: memory target"),
    ]
    found += [Method(f"buddy-target-{f:g}", "buddy", _target(f), family="buddy: memory target") for f in targets]
    found += [Method(f"buddy-time-{f:g}", "buddy", _budget(f), family="buddy: time budget") for f in budgets]
    found.append(Method("buddy+checkpoint", "buddy", checkpointed=True))
    return found


METHODS = {m.name: m for m in methods()}


def _measure(spec, method: Method, args, *, peak_on_host: bool = False) -> step_time.Measurement:
    m = step_time.measure(
        spec, method.base, device=args.device, steps=1 if peak_on_host else args.steps, warmup=args.warmup,
        seed=args.seed, peak_on_host=peak_on_host, policy=method.policy() if method.policy else None,
        checkpointed=method.checkpointed or method.base == "checkpoint", min_bytes=args.min_bytes,
    )  # fmt: skip
    m.method = method.name
    if args.no_progress and not peak_on_host:  # (the runbook's way): kept in the log if a later one stops the run
        print(step_time.measured_line(m), flush=True)
    return m


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", choices=sorted(step_time.MODELS["cuda"]),
                   default=sorted(step_time.MODELS["cuda"]))  # fmt: skip
    cli.add_methods_argument(p, METHODS)
    p.add_argument("--batch", type=int, default=None, help="batch size (default: per model and device kind)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per method")
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps first (the tracker learns; the budget policies plan from the step before)",
    )
    p.add_argument("--min-bytes", type=int, default=None,
                   help="buddy's min_bytes (default: the library's on a GPU; 64 KiB on the CPU, where the models are "
                        "small enough that most of their activations are under the library's default)")  # fmt: skip
    cli.add_common_arguments(p, out="results/frontier", backend=True, plot=True)
    args = p.parse_args(argv)
    if args.min_bytes is None:
        args.min_bytes = step_time.MIN_BYTES if torch.device(args.device).type == "cuda" else CPU_MIN_BYTES
    return args


COLUMNS = [
    ("model", "model", ""),
    ("method", "method", ""),
    ("step_ms", "step ms", ".1f"),
    ("vs_none", "time vs none", ".3f"),
    ("capacity", "capacity", ".2f"),
    ("buddy_capacity", "buddy ratio", ".2f"),
    ("modeled_capacity", "saved peak (modeled)", ".2f"),
]


def plot(results_path: Path, out_dir: Path) -> list[Path]:
    """One PNG: per model, step time (x none) against capacity (x none), every method a point."""
    from experiments.plot import open_results, save_figure

    plt, results = open_results(results_path)
    rows = [r for r in results["rows"] if r.get("capacity") and r.get("vs_none")]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5.2 * max(1, len(models)), 4.2), squeeze=False)
    families = {m.name: m.family for m in methods()}
    colors = {family: f"C{i}" for i, family in enumerate(dict.fromkeys(f for f in families.values() if f))}
    for ax, model in zip(axes[0], models):
        pts = [r for r in rows if r["model"] == model]
        for family, color in colors.items():  # each curve in its methods' order: the budget loosening or tightening
            curve = [r for r in pts if families.get(r["method"]) == family]
            ax.plot([r["vs_none"] for r in curve], [r["capacity"] for r in curve], "-", color=color, alpha=0.5,
                    label=family)  # fmt: skip
        for r in pts:
            family = families.get(r["method"], "")
            buddy_point = r["method"].startswith("buddy")
            color = colors.get(family, f"C{len(colors)}" if buddy_point else "k")
            ax.plot(r["vs_none"], r["capacity"], "o" if buddy_point else "s", color=color, markersize=5)
            if r.get("modeled_capacity"):  # the session's model of its saved tensors' peak, hollow, at the same time
                ax.plot(r["vs_none"], r["modeled_capacity"], "o", mfc="none", color=color, markersize=6, alpha=0.7)
            ax.annotate(r["method"], (r["vs_none"], r["capacity"]), fontsize=6, xytext=(4, 2),
                        textcoords="offset points")  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.axvline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("step time (x a plain step)")
        ax.plot([], [], "o", mfc="none", color="grey", label="saved peak (modeled), buddy")
        ax.set_ylabel("capacity (x a plain step's added memory)")
        ax.set_title(model, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    if results.get("cpu_run"):
        fig.suptitle("CPU run: small models, CPU times -- the shape carries over, the numbers do not", fontsize=9,
                     color="tab:red")  # fmt: skip
    path = save_figure(plt, fig, results, Path(out_dir) / "frontier.png", dpi=150, bottom=0.04)
    return [path]


def main(argv=None) -> list[dict]:
    args, header = cli.begin("frontier", parse_args, argv)
    device, backend, kind, specs = step_time.setup("frontier", args)
    chosen = [METHODS[name] for name in args.methods]
    if "none" not in args.methods:
        chosen.insert(0, METHODS["none"])  # what every method is set against
    if kind == "cpu":
        print("  CPU RUN: small models, CPU times; capacity from each step's peak resident memory above its start")
    for spec in specs:
        print(f"  {spec.name}: {spec.description}")
    print(f"  buddy backend: {backend}; {args.warmup} warm-up + {args.steps} timed steps per method")
    jobs = [(s, m) for s in specs for m in chosen]
    measurements = [_measure(s, m, args) for s, m in progress(jobs, desc="frontier", enabled=not args.no_progress)]
    if kind == "cpu":  # after every timing (the threshold stays for the process): each method's step once more
        step_time.fix_mmap_threshold()
        for (spec, method), m in zip(jobs, measurements, strict=True):
            peaks = [_measure(spec, method, args, peak_on_host=True).host_peak_bytes for _ in range(PEAK_REPEATS)]
            m.host_peak_bytes = min((p for p in peaks if p is not None), default=None)
    rows = step_time.rows_vs_none(measurements)
    for r in rows:  # the session's own account of its saved tensors' peak: uncompressed over as compressed
        b = r["buddy"] or {}
        r["modeled_capacity"] = b["saved_peak_plain"] / b["saved_peak"] if b.get("saved_peak") else None
    print()
    print(format_table(rows, COLUMNS))
    cli.finish(
        args, header, rows, plot=plot, mention_csv=False, experiment="frontier", backend=backend,
        models={s.name: s.description for s in specs}, cpu_run=kind == "cpu",
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
