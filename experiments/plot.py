"""Plots from the experiments' results files (a separate step: measure once, plot often).

python -m experiments.plot results/capacity/results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["plot_capacity", "plot_over_training", "plot_max_batch", "plot_decision", "main"]

_FAMILY_STYLE = {
    "FixedRatio": dict(marker="s", linestyle="--", color="tab:gray"),
    "BuddyThreshold": dict(marker="o", linestyle="-", color="tab:blue"),
    "DeviceBudget": dict(marker="^", linestyle="-.", color="tab:orange"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def _caption(results: dict) -> str:
    env = results["environment"]
    device = env.get("gpu") or env.get("cpu")
    return f"{results['command']}  |  {device}, torch {env['torch']}, buddy {results.get('buddy', '?')}"


def _save(plt, fig, results: dict, path: Path, *, dpi: int, fontsize: int = 5, bottom: float = 0.02) -> Path:
    """Caption the figure with the command and machine, lay it out, write it and close it."""
    fig.text(0.01, 0.005, _caption(results), fontsize=fontsize, alpha=0.7)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _capacity_axes(ax, rows, workload):
    for family, style in _FAMILY_STYLE.items():
        pts = [r for r in rows if r["family"] == family]
        if not pts:
            continue
        pts.sort(key=lambda r: r["overflow_fraction"])
        ax.plot([100 * r["overflow_fraction"] for r in pts], [r["capacity"] for r in pts], label=family, **style)
        for r in pts:
            ax.annotate(
                r["policy"],
                (100 * r["overflow_fraction"], r["capacity"]),
                fontsize=6,
                alpha=0.7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.axhline(1.5, color="tab:red", linewidth=0.8, linestyle=":", label="paper, DL (1.5x)")
    ax.axvline(10, color="black", linewidth=0.6, linestyle=":", label="10 % overflow")
    ax.set_title(f"{workload} ({rows[0]['codec']}, E={rows[0]['entry_bytes']} B)", fontsize=9)
    ax.set_xlabel("buddy traffic: overflow bytes / activation bytes (%)")
    ax.set_ylabel("effective capacity (x)")
    ax.grid(alpha=0.3)


def plot_capacity(results_path: Path, out_dir: Path) -> list[Path]:
    """One PNG per workload (capacity against buddy traffic, a line per policy) and an overview."""
    plt = _pyplot()
    results = json.loads(Path(results_path).read_text())
    rows = results["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    written = []
    for workload in workloads:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        _capacity_axes(ax, [r for r in rows if r["workload"] == workload], workload)
        ax.legend(fontsize=7)
        path = _save(plt, fig, results, Path(out_dir) / f"capacity_{workload}.png", dpi=130)
        written.append(path)
    cols = min(3, len(workloads))
    nrows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.8 * nrows), squeeze=False)
    for ax, workload in zip(axes.flat, workloads):
        _capacity_axes(ax, [r for r in rows if r["workload"] == workload], workload)
    for ax in list(axes.flat)[len(workloads) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    path = _save(plt, fig, results, Path(out_dir) / "capacity_overview.png", dpi=110, fontsize=6)
    return written + [path]


def plot_over_training(results_path: Path, out_dir: Path) -> list[Path]:
    """Per workload: ideal ratio and the tracker's chosen target per key across training."""
    plt = _pyplot()
    results = json.loads(Path(results_path).read_text())
    rows = results["rows"]
    written = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        for key in dict.fromkeys(r["key"] for r in mine):
            series = sorted((r for r in mine if r["key"] == key), key=lambda r: r["step"])
            steps = [r["step"] for r in series]
            top.plot(steps, [r["ideal_ratio"] for r in series], linewidth=0.8)
            bottom.step(steps, [min(r["target_ratio"], 8) for r in series], where="post", linewidth=0.8)
        top.set_ylabel("ideal ratio per key (x)")
        bottom.set_ylabel("tracker's target (x, zero slot drawn at 8)")
        bottom.set_xlabel("training step")
        top.set_title(f"{workload}: compressibility and the tracker's choices over training", fontsize=9)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        path = _save(plt, fig, results, Path(out_dir) / f"over_training_{workload}.png", dpi=120)
        written.append(path)
    return written


def plot_max_batch(results_path: Path, out_dir: Path) -> list[Path]:
    """Largest batch under the budget and its step time, per workload and method."""
    plt = _pyplot()
    results = json.loads(Path(results_path).read_text())
    rows = results["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        xs = [w + i * width for w in range(len(workloads))]
        by = {r["workload"]: r for r in rows if r["method"] == method}
        left.bar(xs, [by[w]["max_batch"] if w in by else 0 for w in workloads], width, label=method)
        right.bar(
            xs,
            [by[w]["step_seconds"] * 1e3 if w in by and by[w]["step_seconds"] else 0 for w in workloads],
            width,
            label=method,
        )
    for ax, label in ((left, "largest batch under the budget"), (right, "step time at that batch (ms)")):
        ax.set_xticks([w + 0.4 - width / 2 for w in range(len(workloads))], workloads, fontsize=7, rotation=15)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    left.legend(fontsize=7)
    path = _save(plt, fig, results, Path(out_dir) / "max_batch.png", dpi=120, bottom=0.03)
    return [path]


def plot_decision(results_path: Path, out_dir: Path) -> list[Path]:
    """The entry-size study: ideal ratio and tracker capacity against E, a line per codec, per workload.

    Whole-tensor zstd-3 and the field-entropy bound are drawn as horizontal
    lines, zstd-3 run per entry as a dashed line.
    """
    plt = _pyplot()
    results = json.loads(Path(results_path).read_text())
    rows = [r for r in results["rows"] if "ideal_ratio" in r]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    per_entry = list(dict.fromkeys(r["method"] for r in rows if r["entry_bytes"] is not None))
    fig, axes = plt.subplots(2, len(workloads), figsize=(3.3 * len(workloads), 6.4), squeeze=False, sharex=True)
    for col, workload in enumerate(workloads):
        mine = [r for r in rows if r["workload"] == workload]
        for row, (field, label) in enumerate(
            (("ideal_ratio", "ideal ratio (x)"), ("capacity", "capacity at <=10 % overflow (x)"))
        ):
            ax = axes[row][col]
            for method in per_entry:
                pts = sorted((r for r in mine if r["method"] == method and field in r), key=lambda r: r["entry_bytes"])
                style = dict(linestyle="--", color="black", linewidth=0.9) if method.startswith("zstd") else {}
                ax.plot(
                    [r["entry_bytes"] for r in pts],
                    [r[field] for r in pts],
                    marker="o",
                    markersize=3,
                    label=method,
                    **style,
                )
            for r in mine:
                if r["entry_bytes"] is None and r["method"] in ("zstd-3", "entropy (fields)"):
                    dotted = r["method"] != "zstd-3"
                    ax.axhline(
                        r["ideal_ratio"],
                        color="tab:gray" if dotted else "black",
                        linewidth=0.8,
                        linestyle=":" if dotted else "-",
                        label=r["method"] + " (whole tensor)" if not dotted else r["method"],
                    )
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel(label)
            if row == 0:
                ax.set_title(workload, fontsize=9)
            else:
                ax.set_xlabel("entry size E (bytes)")
    axes[0][0].legend(fontsize=6)
    path = _save(plt, fig, results, Path(out_dir) / "entry_size.png", dpi=120)
    return [path]


_PLOTTERS = {
    "capacity": plot_capacity,
    "over_training": plot_over_training,
    "max_batch": plot_max_batch,
    "decide": plot_decision,
}


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(description="Turn an experiment's results.json into PNGs beside it.")
    p.add_argument("results", type=Path, nargs="+")
    args = p.parse_args(argv)
    written = []
    for path in args.results:
        kind = json.loads(path.read_text()).get("experiment") or path.parent.name
        if kind not in _PLOTTERS:
            raise SystemExit(f"{path}: unknown experiment {kind!r}; expected one of {sorted(_PLOTTERS)}")
        written += _PLOTTERS[kind](path, path.parent)
    for png in written:
        print(f"wrote {png}")
    return written


if __name__ == "__main__":
    main()
