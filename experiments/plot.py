"""Plots from the experiments' results files (a separate step: measure once, plot often).

python -m experiments.plot results/capacity/results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["open_results", "save_figure", "plot_capacity", "plot_over_training", "plot_max_batch", "plot_decision", "main"]

_FAMILY_STYLE = {
    "FixedRatio": dict(marker="s", linestyle="--", color="tab:gray"),
    "BuddyThreshold": dict(marker="o", linestyle="-", color="tab:blue"),
    "OverflowBudget": dict(marker="D", linestyle=":", color="tab:green"),
    "DeviceBudget": dict(marker="^", linestyle="-.", color="tab:orange"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def open_results(results_path: Path):
    """``(pyplot, results)``: pyplot drawing to files, and a results file read."""
    return _pyplot(), json.loads(Path(results_path).read_text())


def _caption(results: dict) -> str:
    env = results["environment"]
    device = env.get("gpu") or env.get("cpu")
    return f"{results['command']}  |  {device}, torch {env['torch']}, buddy {results.get('buddy', env.get('buddy', '?'))}"


def save_figure(plt, fig, results: dict, path: Path, *, dpi: int, fontsize: int = 5, bottom: float = 0.02) -> Path:
    """Caption the figure with the command and machine, lay it out, write it and close it."""
    fig.text(0.01, 0.005, _caption(results), fontsize=fontsize, alpha=0.7)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


#: the region of the capacity-vs-traffic plots that matters: buddy traffic up to this (%) ...
TRAFFIC_LIMIT = 30.0
#: ... and capacity up to this (x); points beyond are counted in a note, not drawn
CAPACITY_LIMIT = 4.0
#: Buddy Compression's headline for deep learning: 1.5x capacity at a 1-2 % slowdown
PAPER_DL = 1.5
#: the tracker's default policy, marked in every plot
DEFAULT_POLICY = ("OverflowBudget", "10%")


def _overlaps(box, placed) -> bool:
    return any(box.overlaps(other) for other in placed)


def _marker_boxes(ax, xys, pad: float = 3.0) -> list:
    """Display-space boxes around data points, so that labels keep off the markers."""
    from matplotlib.transforms import Bbox

    out = []
    for x, y in xys:
        px, py = ax.transData.transform((x, y))
        out.append(Bbox.from_extents(px - pad, py - pad, px + pad, py + pad))
    return out


def _label(ax, text, xy, placed, renderer, *, fontsize=6, color="0.25", weight="normal") -> bool:
    """Annotate ``xy`` with ``text`` at the first offset where it overlaps no placed label nor leaves the axes."""
    frame = ax.get_window_extent(renderer)
    for dx, dy in ((5, 2), (5, -9), (-5, 2), (-5, -9), (5, 9), (-5, 9), (5, -15), (-5, -15)):
        note = ax.annotate(
            text,
            xy,
            xytext=(dx, dy),
            textcoords="offset points",
            fontsize=fontsize,
            color=color,
            weight=weight,
            ha="left" if dx > 0 else "right",
        )
        box = note.get_window_extent(renderer)
        if not _overlaps(box, placed) and frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1):
            placed.append(box)
            return True
        note.remove()
    return False


#: at most this many labelled points per policy family and plot (a family can have a point per slot size)
LABELS_PER_FAMILY = 8


def _sparse(rows: list[dict]) -> list[dict]:
    """Per family, at most :data:`LABELS_PER_FAMILY` of its points, spread evenly along its line."""
    out = []
    for family in dict.fromkeys(r["family"] for r in rows):
        pts = sorted((r for r in rows if r["family"] == family), key=lambda r: r["overflow_fraction"])
        step = max(1, -(-len(pts) // LABELS_PER_FAMILY))
        out += pts[::step]
    return out


def _reference_lines(ax):
    """The paper's deep-learning point (as a capacity line) and the tracker's 10 % overflow bound."""
    ax.axhline(PAPER_DL, color="tab:red", linewidth=0.8, linestyle=":", label="paper, DL: 1.5x at 1-2 % slowdown")
    ax.axvline(10, color="black", linewidth=0.6, linestyle=":", label="10 % overflow (the default bound)")


def _capacity_axes(ax, rows, workload, *, fontsize=6):
    """Capacity against buddy traffic, one line per policy family, clipped to the region that matters.

    Axes stop at :data:`TRAFFIC_LIMIT` % traffic and :data:`CAPACITY_LIMIT`
    x capacity (the points beyond are counted in a note); the default
    policy's point is ringed; labels are drawn only where they overlap
    nothing, the default's first.
    """
    fig = ax.figure
    visible = [r for r in rows if 100 * r["overflow_fraction"] <= TRAFFIC_LIMIT and r["capacity"] <= CAPACITY_LIMIT]
    top = max([PAPER_DL, *(r["capacity"] for r in visible)]) * 1.08
    ax.set_xlim(-0.5, TRAFFIC_LIMIT)
    ax.set_ylim(min(0.95, min((r["capacity"] for r in visible), default=1.0) - 0.03), min(CAPACITY_LIMIT, top))
    for family, style in _FAMILY_STYLE.items():
        pts = sorted((r for r in rows if r["family"] == family), key=lambda r: r["overflow_fraction"])
        if pts:
            xs, ys = [100 * r["overflow_fraction"] for r in pts], [r["capacity"] for r in pts]
            ax.plot(xs, ys, label=family, markersize=4, linewidth=1.0, **style)
    _reference_lines(ax)
    default = next((r for r in rows if (r["family"], r["policy"]) == DEFAULT_POLICY), None)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    placed = _marker_boxes(ax, [(100 * r["overflow_fraction"], r["capacity"]) for r in visible])
    if default is not None:
        xy = (100 * default["overflow_fraction"], default["capacity"])
        color = _FAMILY_STYLE[DEFAULT_POLICY[0]]["color"]
        ax.plot(*xy, marker="o", markersize=11, markerfacecolor="none", markeredgecolor=color, linewidth=0)
        _label(
            ax, f"default: {default['capacity']:.2f}x", xy, placed, renderer, fontsize=fontsize + 1, color=color,
            weight="bold",
        )  # fmt: skip
    order = {"OverflowBudget": 0, "BuddyThreshold": 1, "FixedRatio": 2, "DeviceBudget": 3}
    for r in sorted(_sparse(visible), key=lambda r: order.get(r["family"], 4)):
        if r is default:
            continue
        prefix = {"BuddyThreshold": "<=", "OverflowBudget": "step <=", "DeviceBudget": "budget "}.get(r["family"], "")
        _label(
            ax, prefix + r["policy"], (100 * r["overflow_fraction"], r["capacity"]), placed, renderer, fontsize=fontsize
        )
    hidden = [r for r in rows if r not in visible]
    if hidden:
        far = max(hidden, key=lambda r: r["capacity"])
        ax.text(
            0.99,
            0.02,
            f"{len(hidden)} points beyond the axes (up to {far['capacity']:.1f}x at {100 * far['overflow_fraction']:.0f} % traffic)",
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=fontsize,
            color="0.4",
        )
    ax.set_title(f"{workload} ({rows[0]['codec']}, E={rows[0]['entry_bytes']} B)", fontsize=9)
    ax.set_xlabel("buddy traffic: overflow bytes / activation bytes (%)")
    ax.set_ylabel("effective capacity (x)")
    ax.grid(alpha=0.3)


def _sets_axes(ax, headline: list[dict], codec: str, entry_bytes: int):
    """Every workload's capacity under the default policy, a row each, the tuning and check sets apart.

    The default policy spends its overflow budget, so every workload's traffic
    lies just under the bound: it is written beside each point instead of
    being an axis that would stack the points on one another. Each set's
    geometric mean is a dashed line over that set's rows.
    """
    colors = {"tuning": "tab:blue", "check": "tab:orange"}
    points = [r for r in headline if not r.get("summary")]
    summary = {r["set"]: r for r in headline if r.get("summary")}
    rows, y = [], 0.0
    for name in dict.fromkeys(r.get("set", "other") for r in points):
        mine = sorted((r for r in points if r.get("set", "other") == name), key=lambda r: -r["capacity"])
        rows.append((name, [(y - i, r) for i, r in enumerate(mine)]))
        y -= len(mine) + 0.8  # a gap between the sets
    right = max(PAPER_DL, *(r["capacity"] for r in points))
    for name, placed in rows:
        color = colors.get(name, "tab:gray")
        ys = [at for at, _ in placed]
        caps = [r["capacity"] for _, r in placed]
        ax.hlines(ys, 1.0, caps, color=color, linewidth=2.0, alpha=0.35)
        ax.scatter(caps, ys, s=30, color=color, zorder=3)
        for at, r in placed:
            text = f"{r['capacity']:.2f}x at {100 * r['overflow_fraction']:.1f} % traffic"
            ax.annotate(text, (r["capacity"], at), xytext=(6, 0), textcoords="offset points", va="center", fontsize=7)
        label = f"{name} set"
        if name in summary:
            s = summary[name]
            label += f": geomean {s['capacity']:.2f}x, worst overflow {100 * s['overflow_fraction']:.1f} %"
            ax.vlines(s["capacity"], min(ys) - 0.4, max(ys) + 0.4, color=color, linewidth=1.0, linestyle="--", alpha=0.7)
        ax.plot([], [], color=color, marker="o", linestyle="--", linewidth=1.0, label=label)
    ax.axvline(PAPER_DL, color="tab:red", linewidth=0.8, linestyle=":", label="paper, DL: 1.5x at 1-2 % slowdown")
    ticks = [(at, r["workload"], name) for name, placed in rows for at, r in placed]
    ax.set_yticks([at for at, _, _ in ticks], [workload for _, workload, _ in ticks], fontsize=8)
    for tick, (_, _, name) in zip(ax.get_yticklabels(), ticks):
        tick.set_color(colors.get(name, "black"))
    ax.set_ylim(min(at for at, _, _ in ticks) - 0.6, 0.6)
    ax.set_xlim(0.95, 1.0 + (right - 1.0) * 1.45)  # room for the text right of the longest row
    ax.set_title(
        f"{codec}, E={entry_bytes} B, {DEFAULT_POLICY[0]} {DEFAULT_POLICY[1].replace('%', ' %')}: chosen on the "
        "tuning set, checked on the check set",
        fontsize=9,
    )
    ax.set_xlabel("effective capacity (x): original bytes / device bytes (slots + metadata)")
    ax.grid(alpha=0.3, axis="x")


def plot_capacity(results_path: Path, out_dir: Path) -> list[Path]:
    """One PNG per workload (capacity against buddy traffic, a line per policy), an overview, and the two sets."""
    plt, results = open_results(results_path)
    rows = results["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    written = []
    # legends go below the axes: inside, they hid lines and the labels placed beside points
    for workload in workloads:
        fig, ax = plt.subplots(figsize=(6, 4.8))
        _capacity_axes(ax, [r for r in rows if r["workload"] == workload], workload)
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)
        path = save_figure(plt, fig, results, Path(out_dir) / f"capacity_{workload}.png", dpi=130)
        written.append(path)
    cols = min(3, len(workloads))
    nrows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.8 * nrows + 0.5), squeeze=False)
    for ax, workload in zip(axes.flat, workloads):
        _capacity_axes(ax, [r for r in rows if r["workload"] == workload], workload, fontsize=5.5)
    for ax in list(axes.flat)[len(workloads) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.012), ncol=6, fontsize=7, frameon=False)
    bottom = 0.5 / (3.8 * nrows + 0.5)
    written.append(save_figure(plt, fig, results, Path(out_dir) / "capacity_overview.png", dpi=110, fontsize=6, bottom=bottom))
    headline = results.get("headline")
    if headline and any(r.get("summary") for r in headline):
        points = sum(1 for r in headline if not r.get("summary"))
        height = 1.8 + 0.32 * points
        fig, ax = plt.subplots(figsize=(7.5, height))
        _sets_axes(ax, headline, rows[0]["codec"], rows[0]["entry_bytes"])
        handles, labels = ax.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.03), ncol=2, fontsize=7, frameon=False)
        path = Path(out_dir) / "capacity_sets.png"
        written.append(save_figure(plt, fig, results, path, dpi=130, bottom=0.6 / height))
    return written


def plot_over_training(results_path: Path, out_dir: Path) -> list[Path]:
    """Per workload: ideal ratio and the tracker's chosen target per key across training."""
    plt, results = open_results(results_path)
    rows = results["rows"]
    written = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        for key in dict.fromkeys(r["key"] for r in mine):
            series = sorted((r for r in mine if r["key"] == key), key=lambda r: r["step"])
            steps = [r["step"] for r in series]
            # float(): the results file writes an infinite ratio (the zero slot) as "inf"
            top.plot(steps, [float(r["ideal_ratio"]) for r in series], linewidth=0.8)
            bottom.step(steps, [min(float(r["target_ratio"]), 8) for r in series], where="post", linewidth=0.8)
        top.set_ylabel("ideal ratio per key (x)")
        bottom.set_ylabel("tracker's target (x, zero slot drawn at 8)")
        bottom.set_xlabel("training step")
        top.set_title(f"{workload}: compressibility and the tracker's choices over training", fontsize=9)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        path = save_figure(plt, fig, results, Path(out_dir) / f"over_training_{workload}.png", dpi=120)
        written.append(path)
    return written


def plot_max_batch(results_path: Path, out_dir: Path) -> list[Path]:
    """Largest batch under the budget and its step time, per workload and method."""
    plt, results = open_results(results_path)
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
    path = save_figure(plt, fig, results, Path(out_dir) / "max_batch.png", dpi=120, bottom=0.03)
    return [path]


def _entry_size_lines(ax, rows: list[dict], methods: list[str], field: str, policies: Sequence[str]) -> None:
    """``field`` against the entry size, a line per method and policy (BuddyThreshold solid, the others dotted in
    the colour of the line before; zstd dashed black)."""
    for method in methods:
        for policy in policies:
            pts = sorted(
                (r for r in rows if r["method"] == method and field in r and r.get("policy", "BuddyThreshold") == policy),
                key=lambda r: r["entry_bytes"],
            )
            if not pts:
                continue
            style = dict(linestyle="--", color="black", linewidth=0.9) if method.startswith("zstd") else {}
            if policy != "BuddyThreshold":
                style = dict(style, linestyle=":", color=ax.lines[-1].get_color() if ax.lines else None)
            ax.plot(
                [r["entry_bytes"] for r in pts],
                [r[field] for r in pts],
                marker="o" if policy == "BuddyThreshold" else ".",
                markersize=3,
                label=method if policy == "BuddyThreshold" else None,
                **style,
            )


def _whole_tensor_lines(ax, rows: list[dict]) -> None:
    """Whole-tensor zstd-3 (solid) and the field-entropy bound (dotted) as horizontal lines."""
    for r in rows:
        if r["entry_bytes"] is None and r["method"] in ("zstd-3", "entropy (fields)"):
            dotted = r["method"] != "zstd-3"
            ax.axhline(
                r["ideal_ratio"],
                color="tab:gray" if dotted else "black",
                linewidth=0.8,
                linestyle=":" if dotted else "-",
                label=r["method"] + " (whole tensor)" if not dotted else r["method"],
            )


def plot_decision(results_path: Path, out_dir: Path) -> list[Path]:
    """The entry-size study: ideal ratio and tracker capacity against E, a line per codec, per workload.

    Capacity under BuddyThreshold is drawn solid, under OverflowBudget dotted in the same colour.

    Whole-tensor zstd-3 and the field-entropy bound are drawn as horizontal
    lines, zstd-3 run per entry as a dashed line.
    """
    plt, results = open_results(results_path)
    rows = [r for r in results["rows"] if "ideal_ratio" in r]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    per_entry = list(dict.fromkeys(r["method"] for r in rows if r["entry_bytes"] is not None))
    check = set(results.get("sets", {}).get("check", ()))
    fig, axes = plt.subplots(2, len(workloads), figsize=(3.3 * len(workloads), 6.4), squeeze=False, sharex=True)
    for col, workload in enumerate(workloads):
        mine = [r for r in rows if r["workload"] == workload]
        for row, (field, label) in enumerate(
            (("ideal_ratio", "ideal ratio (x)"), ("capacity", "capacity at <=10 % overflow (x)"))
        ):
            ax = axes[row][col]
            # the ideal ratio does not depend on the policy; capacity: BuddyThreshold solid, OverflowBudget dotted
            policies = ("BuddyThreshold", "OverflowBudget") if row else ("BuddyThreshold",)
            _entry_size_lines(ax, mine, per_entry, field, policies)
            _whole_tensor_lines(ax, mine)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel(label)
            if row == 0:
                ax.set_title(workload + (" (check set)" if workload in check else ""), fontsize=9)
            else:
                ax.set_xlabel("entry size E (bytes)")
    axes[0][0].legend(fontsize=6)
    if any(r.get("policy") == "OverflowBudget" for r in rows):
        axes[1][0].plot([], [], linestyle=":", color="black", label="dotted: OverflowBudget(10 %)")
        axes[1][0].legend(fontsize=6)
    path = save_figure(plt, fig, results, Path(out_dir) / "entry_size.png", dpi=120)
    return [path]


def plot_bench_codecs(results_path: Path, out_dir: Path) -> list[Path]:
    """Compress and decompress GB/s per method (buddy codec @ backend, lz4, zstd-3): the median over the tensors as a
    bar, their range as a line, on a log scale; memcpy left out (it would set the scale)."""
    plt, results = open_results(results_path)
    rows = [r for r in results["rows"] if r["method"] != "memcpy"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(8.0, 0.28 * len(methods) + 1.2), sharey=True)
    for ax, (field, title) in zip(axes, (("comp_gbps", "compress"), ("decomp_gbps", "decompress"))):
        for y, method in enumerate(methods):
            values = sorted(r[field] for r in rows if r["method"] == method)
            median = values[len(values) // 2]
            native = method.endswith("@native")
            color = "tab:green" if native else ("tab:blue" if method.startswith("buddy:") else "tab:gray")
            ax.barh(y, median, color=color, alpha=0.8)
            ax.plot([values[0], values[-1]], [y, y], color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} GB/s (log scale)")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(methods)), [m.removeprefix("buddy:") for m in methods], fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle("bar: the median over the tensors, line: their range.  green: the native CPU engine, "
                 "blue: the torch reference, grey: general-purpose compressors (one thread)", fontsize=7)  # fmt: skip
    path = save_figure(plt, fig, results, Path(out_dir) / "speed.png", dpi=120)
    return [path]


_PLOTTERS = {
    "bench_codecs": plot_bench_codecs,
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
