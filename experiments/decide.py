"""The decision table: which codec and entry size buddy uses by default, measured.

On the tensors every workload saves for backward (captured at several points
of training), for every codec x entry size E:

* ideal ratio      original bytes / compacted sectors (no slot rounding, no
                   metadata): the most any slot choice could give;
* capacity         original / device bytes (slots + metadata) under each of
                   the tracker's policies at 10 % -- BuddyThreshold (each
                   tensor's overflow within 10 % of it) and OverflowBudget
                   (each step's within 10 % of the step) -- run over the
                   training points exactly as in training; with its overflow
                   (buddy traffic / original bytes);
* CPU GB/s         ``buddy.compress`` / ``decompress`` of the reference path
                   on a sample of each workload's tensors (input bytes per
                   second, median of ``--repeats``);

next to what a user would pick instead, on the same bytes: zstd level 3 and
lz4 on whole tensors (ratio, CPU GB/s); zstd-3 run on every E-byte entry
alone in buddy's slot format (``zstd-3@E``: what a general-purpose coder
reaches with the random access slots need); and two entropy bounds: order-0
bytes, and order-0 float fields (sign+exponent, mantissa pieces), the bound
of an entry-local coder that codes each value alone.

The default is the codec x E x policy with the highest geometric-mean
capacity over the **tuning set** among those whose overflow stayed within
10 % on every tuning workload; candidates within 1 % of the best are taken
as equal, and among them the smaller entry (finer spills), then
BuddyThreshold (a bound per tensor, not only per step), then the faster
compressor wins. The **check set** (workloads the choice never sees) is
measured the same way and reported in its own columns -- its geometric mean
and worst overflow, and what it would have chosen -- so that a choice that
only fits the tuning set shows. The script prints that choice next to the
library's current defaults.

    python -m experiments.decide                       # quick, CPU (~10 min on 2 cores)
    python -m experiments.decide --size tiny --entry-bytes 128 512 --no-speed
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import buddy
from experiments import cli
from experiments.analysis import (
    byte_entropy_bits,
    compacted_bytes,
    entry_zstd_histogram,
    field_entropy_bits,
    general_purpose_sizes,
    histogram,
    ratio,
    simulate_policy,
    tensor_bytes,
)
from experiments.common import DEFAULT_POINTS, format_table, geomean, progress

__all__ = ["CODECS", "ENTRY_SIZES", "POLICIES", "POLICY_OVERFLOW", "analyse", "speeds", "decide", "main"]

CODECS = ("zvc", "bpc", "fpx", "fpe", "auto", "auto2")
ENTRY_SIZES = (128, 256, 512, 1024, 2048, 4096)
#: the overflow limit of the policies the capacity columns run
POLICY_OVERFLOW = 0.10
#: the tracker's policies the capacity columns run, each at POLICY_OVERFLOW (the first: preferred on a tie)
POLICIES = {"BuddyThreshold": buddy.BuddyThreshold, "OverflowBudget": buddy.OverflowBudget}
#: the per-entry general-purpose baseline, sized like a codec
ZSTD_ENTRY = "zstd-3@E"
#: candidates within this fraction of the best capacity count as equal
TIE = 0.01
#: bytes of each workload's tensors the speed columns are measured on
SAMPLE_BYTES = 1 << 20


def _histogram(t: torch.Tensor, method: str, entry_bytes: int) -> list[int]:
    if method == ZSTD_ENTRY:
        return entry_zstd_histogram(t, entry_bytes)
    return histogram(t, method, entry_bytes)


def _entry_rows(captures: dict, methods, entry_sizes, policies, show: bool) -> list[dict]:
    """Ideal ratio and tracker capacity per workload x method x E x policy."""
    rows = []
    jobs = [(w, m, e) for w in captures for m in methods for e in entry_sizes]
    for workload, method, entry_bytes in progress(jobs, desc="codec x entry size", enabled=show):
        points = [
            (c.point, [(t.key, _histogram(t.tensor, method, entry_bytes), tensor_bytes(t.tensor)) for t in c.tensors])
            for c in captures[workload]
        ]
        compacted = sum(compacted_bytes(h) for _, ts in points for _, h, _ in ts)
        for policy in policies:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", buddy.BudgetExceededWarning)
                outcomes = simulate_policy(points, POLICIES[policy](POLICY_OVERFLOW), entry_bytes)
            original = sum(o.original_bytes for o in outcomes)
            device = sum(o.device_bytes for o in outcomes)
            buddy_bytes = sum(o.buddy_bytes for o in outcomes)
            rows.append(
                {
                    "workload": workload,
                    "method": method,
                    "entry_bytes": entry_bytes,
                    "policy": policy,
                    "original_bytes": original,
                    "compacted_bytes": compacted,
                    "device_bytes": device,
                    "buddy_bytes": buddy_bytes,
                    "ideal_ratio": ratio(original, compacted),
                    "capacity": ratio(original, device),
                    "overflow": buddy_bytes / original if original else 0.0,
                }
            )
    return rows


def _whole_rows(captures: dict, show: bool) -> list[dict]:
    """zstd-3 and lz4 on whole tensors, and the two entropy bounds, per workload."""
    sums: dict[tuple[str, str], list[float]] = {}
    tensors = [(w, t.tensor) for w, caps in captures.items() for c in caps for t in c.tensors]
    for workload, t in progress(tensors, desc="baselines and bounds", enabled=show):
        original = tensor_bytes(t)
        sizes: dict[str, float] = dict(general_purpose_sizes(t))
        sizes["entropy (bytes)"] = original * byte_entropy_bits(t) / 8
        sizes["entropy (fields)"] = t.numel() * field_entropy_bits(t) / 8
        for method, size in sizes.items():
            acc = sums.setdefault((workload, method), [0, 0])
            acc[0] += original
            acc[1] += size
    return [
        {
            "workload": w,
            "method": m,
            "entry_bytes": None,
            "original_bytes": o,
            "compacted_bytes": c,
            "ideal_ratio": ratio(o, c),
        }
        for (w, m), (o, c) in sums.items()
    ]


def analyse(
    captures: dict, *, codecs=CODECS, entry_sizes=ENTRY_SIZES, policies=tuple(POLICIES), zstd_entries=True, show=True
):
    """Every ratio and capacity row of the decision (no timings)."""
    methods = list(codecs) + ([ZSTD_ENTRY] if zstd_entries else [])
    return _entry_rows(captures, methods, entry_sizes, policies, show) + _whole_rows(captures, show)


def sample(captures: list, nbytes: int = SAMPLE_BYTES) -> list[torch.Tensor]:
    """The last point's tensors in saving order, cut to ``nbytes`` in all (whole values)."""
    out, left = [], nbytes
    for saved in captures[-1].tensors:
        if left <= 0:
            break
        t = saved.tensor.reshape(-1)
        t = t[: max(1, left // t.element_size())]
        out.append(t.clone())
        left -= tensor_bytes(t)
    return out


def speeds(captures: dict, *, codecs=CODECS, entry_sizes=ENTRY_SIZES, repeats: int = 3, show=True) -> list[dict]:
    """CPU GB/s of buddy's reference path and of zstd-3 / lz4 on each workload's sample.

    Every round trip is checked byte for byte before it is timed. Rates are
    sample bytes / summed median seconds over the sample's tensors.
    """
    from experiments.bench_codecs import bench_baseline, bench_buddy, cpu_baselines

    baselines = cpu_baselines()
    jobs = [(w, ("buddy", c, e)) for w in captures for c in codecs for e in entry_sizes]
    jobs += [(w, ("baseline", b, None)) for w in captures for b in baselines]
    samples = {w: sample(caps) for w, caps in captures.items()}
    rows = []
    for workload, (kind, what, entry_bytes) in progress(jobs, desc="CPU speed", enabled=show):
        measured = [
            bench_buddy(f"{workload}[{i}]", x, what, entry_bytes, repeats)
            if kind == "buddy"
            else bench_baseline(f"{workload}[{i}]", x, what, repeats)
            for i, x in enumerate(samples[workload])
        ]
        nbytes = sum(r.original_bytes for r in measured)
        rows.append(
            {
                "workload": workload,
                "method": what if kind == "buddy" else what.method,
                "entry_bytes": entry_bytes,
                "sample_bytes": nbytes,
                "compress_gbps": nbytes / sum(r.comp_s for r in measured) / 1e9,
                "decompress_gbps": nbytes / sum(r.decomp_s for r in measured) / 1e9,
            }
        )
    return rows


def _label(method: str, entry_bytes: int | None, policy: str | None = None) -> str:
    if entry_bytes is None:
        return method
    label = f"zstd-3@{entry_bytes}" if method == ZSTD_ENTRY else f"{method}@{entry_bytes}"
    return label if policy in (None, next(iter(POLICIES))) else f"{label} {policy}"


def table(rows: list[dict], speed_rows: list[dict], check: Sequence[str] = ()) -> list[dict]:
    """One row per method: per-workload ideal ratio and capacity, per-set geomeans and worst overflow, CPU GB/s.

    Workloads in ``check`` form the check set (columns ``check:...``); every
    other workload is the tuning set (``ratio:geomean``,
    ``capacity:geomean``, ``overflow:max``: what :func:`decide` reads).
    """
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    by_method: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_method.setdefault((r["method"], r["entry_bytes"], r.get("policy")), {})[r["workload"]] = r
    speed: dict[tuple, list[dict]] = {}
    for r in speed_rows:
        speed.setdefault((r["method"], r["entry_bytes"]), []).append(r)
    out = []
    for (method, entry_bytes, policy), per in by_method.items():
        row = {"method": _label(method, entry_bytes, policy), "codec": method, "entry_bytes": entry_bytes}
        row["policy"] = policy
        for w in workloads:
            row[f"ratio:{w}"] = per[w]["ideal_ratio"] if w in per else None
        for prefix, members in (("", [w for w in per if w not in check]), ("check:", [w for w in per if w in check])):
            if not members:
                continue
            row[f"{prefix}ratio:geomean"] = geomean([per[w]["ideal_ratio"] for w in members])
            if all("capacity" in per[w] for w in members):
                row[f"{prefix}capacity:geomean"] = geomean([per[w]["capacity"] for w in members])
                row[f"{prefix}overflow:max"] = max(per[w]["overflow"] for w in members)
        if all("capacity" in r for r in per.values()):
            for w in workloads:
                row[f"capacity:{w}"] = per[w]["capacity"] if w in per else None
        key = (method, entry_bytes)
        if key in speed:
            row["compress_gbps"] = statistics.geometric_mean([r["compress_gbps"] for r in speed[key]])
            row["decompress_gbps"] = statistics.geometric_mean([r["decompress_gbps"] for r in speed[key]])
        out.append(row)
    return out


def decide(decision_rows: list[dict], codecs=CODECS, prefix: str = "") -> dict:
    """The default: best geometric-mean capacity with every workload's overflow within the policy's limit.

    Within ``TIE`` of the best, the smaller E wins, then the faster compressor.
    ``prefix``: ``""`` decides on the tuning set (the rule), ``"check:"`` on
    the check set (for the report only: what the check set alone would pick).
    """
    candidates = [
        r
        for r in decision_rows
        if r["codec"] in codecs
        and r.get(f"{prefix}capacity:geomean") is not None
        and r.get(f"{prefix}overflow:max", 0.0) <= POLICY_OVERFLOW
    ]
    if not candidates:
        raise ValueError(f"no buddy codec row kept overflow within {POLICY_OVERFLOW:.0%} on every workload")
    best = max(r[f"{prefix}capacity:geomean"] for r in candidates)
    close = [r for r in candidates if r[f"{prefix}capacity:geomean"] >= best * (1 - TIE)]
    rank = {name: i for i, name in enumerate(POLICIES)}
    close.sort(key=lambda r: (r["entry_bytes"], rank.get(r.get("policy") or "", 0), -(r.get("compress_gbps") or 0.0)))
    return close[0]


def _fmt_tables(decision: list[dict], workloads: list[str], check: Sequence[str] = ()) -> str:
    short = {w: w.split("-")[0][:6] + "-" + w.split("-")[-1] if "-" in w else w for w in workloads}
    tuning = [w for w in workloads if w not in check]
    checked = [w for w in workloads if w in check]
    parts = [
        "Ideal compacted ratio (original / compacted sectors; whole-tensor rows: original / compressed bytes); "
        "tuning set, then check set"
    ]
    cols = [("method", "method", "")] + [(f"ratio:{w}", short[w], ".2f") for w in tuning]
    cols.append(("ratio:geomean", "tuning", ".2f"))
    if checked:
        cols += [(f"ratio:{w}", short[w], ".2f") for w in checked] + [("check:ratio:geomean", "check", ".2f")]
    parts.append(format_table(decision, cols))
    with_cap = [r for r in decision if "capacity:geomean" in r or "check:capacity:geomean" in r]
    parts.append("")
    parts.append(
        f"Effective capacity (slots + metadata) under BuddyThreshold({POLICY_OVERFLOW:.0%}), and under "
        f"OverflowBudget({POLICY_OVERFLOW:.0%}) where the row says so: the tuning set (the choice is made on its "
        "geomean and max overflow), then the check set (never used to choose)"
    )
    cols = [("method", "method", "")] + [(f"capacity:{w}", short[w], ".2f") for w in tuning]
    cols += [("capacity:geomean", "tuning", ".2f"), ("overflow:max", "max overflow", ".1%")]
    if checked:
        cols += [(f"capacity:{w}", short[w], ".2f") for w in checked]
        cols += [("check:capacity:geomean", "check", ".2f"), ("check:overflow:max", "max overflow", ".1%")]
    parts.append(format_table(with_cap, cols))
    timed = [r for r in decision if "compress_gbps" in r]
    if timed:
        parts.append("")
        parts.append("CPU GB/s, input bytes (geometric mean over the workloads' samples)")
        cols = [
            ("method", "method", ""),
            ("compress_gbps", "compress", ".3f"),
            ("decompress_gbps", "decompress", ".3f"),
        ]
        parts.append(format_table(timed, cols))
    return "\n".join(parts)


def parse_args(argv):
    from experiments.workloads import CHECK_WORKLOADS, TUNING_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_size_argument(p)
    cli.add_workloads_argument(p, TUNING_WORKLOADS, help="the tuning set: the choice is made on these")
    cli.add_workloads_argument(
        p,
        CHECK_WORKLOADS,
        flag="--check",
        nargs="*",
        help="the check set: measured and reported, never used to choose (--check alone: none)",
    )
    p.add_argument(
        "--codecs", nargs="+", choices=[c for c in buddy.available_codecs("cpu") if c != "raw"], default=CODECS
    )
    p.add_argument("--entry-bytes", type=int, nargs="+", default=list(ENTRY_SIZES))
    p.add_argument(
        "--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES), help="tracker policies, each at 10 %%"
    )
    cli.add_points_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per speed measurement (median)")
    p.add_argument("--no-speed", action="store_true", help="skip the CPU GB/s columns")
    p.add_argument("--no-zstd-entries", action="store_true", help="skip zstd-3 run per entry (slow at small E)")
    cli.add_cache_argument(p)
    cli.add_common_arguments(p, out="results/decision", seed=False, plot=True)
    args = p.parse_args(argv)
    for e in args.entry_bytes:
        try:
            buddy.spec.check_entry_bytes(e)
        except (TypeError, ValueError) as exc:
            p.error(str(exc))
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    args.points = args.points or DEFAULT_POINTS[args.size]
    return args


def _measure(args, check: list[str]) -> tuple[list[dict], list[dict], list[str]]:
    """``(rows, speed_rows, workloads)``: every codec x E x policy on the captures of the tuning and check sets, and
    the speeds on the tuning set's."""
    show = not args.no_progress
    _, captures = cli.capture_workloads(args, [*args.workloads, *check], points=args.points, cache=args.cache)
    rows = analyse(
        captures,
        codecs=args.codecs,
        entry_sizes=args.entry_bytes,
        policies=args.policies,
        zstd_entries=not args.no_zstd_entries,
        show=show,
    )
    tuning_captures = {w: captures[w] for w in args.workloads}  # speeds break ties of the choice: tuning set only
    speed_rows = (
        []
        if args.no_speed
        else speeds(tuning_captures, codecs=args.codecs, entry_sizes=args.entry_bytes, repeats=args.repeats, show=show)
    )
    return rows, speed_rows, list(captures)


def _format_choice(chosen: dict) -> str:
    """The choice next to the library's current defaults."""
    current = buddy.defaults()
    default_policy = type(buddy.Tracker().policy).__name__
    same = (chosen["codec"], chosen["entry_bytes"], chosen["policy"]) == (
        current.codec, current.entry_bytes, default_policy
    )  # fmt: skip
    return (
        f"\nchosen by measurement on the tuning set: codec {chosen['codec']!r}, E = {chosen['entry_bytes']} B, "
        f"{chosen['policy']}({POLICY_OVERFLOW}) (capacity {chosen['capacity:geomean']:.2f}x geomean, ideal "
        f"{chosen['ratio:geomean']:.2f}x); library default: codec {current.codec!r}, E = {current.entry_bytes} B, "
        f"{default_policy}" + ("" if same else "  <- differs")
    )


def main(argv=None) -> dict:
    from experiments.plot import plot_decision

    args, header = cli.begin("decide", parse_args, argv)
    check = [w for w in args.check if w not in args.workloads]
    rows, speed_rows, workloads = _measure(args, check)
    decision = table(rows, speed_rows, check)
    chosen = decide(decision, args.codecs)
    print()
    print(_fmt_tables(decision, workloads, check))
    print(_format_choice(chosen))
    check_view = _check_view(decision, chosen, args.codecs) if check else None
    if check_view:
        print(check_view["text"])
    cli.finish(
        args,
        header,
        rows + speed_rows,
        plot=plot_decision,
        decision=decision,
        chosen={"codec": chosen["codec"], "entry_bytes": chosen["entry_bytes"], "policy": chosen["policy"]},
        sets={"tuning": list(args.workloads), "check": check},
        check={k: v for k, v in (check_view or {}).items() if k != "text"},
        experiment="decide",
        size=args.size,
        points=list(args.points),
        policies=[f"{p}({POLICY_OVERFLOW})" for p in args.policies],
    )
    return {"decision": decision, "chosen": chosen, "check": check_view}


def _check_view(decision: list[dict], chosen: dict, codecs) -> dict | None:
    """The chosen default on the check set, and what the check set alone would have chosen."""
    if chosen.get("check:capacity:geomean") is None:
        return None
    view = {
        "capacity": chosen["check:capacity:geomean"],
        "worst_overflow": chosen["check:overflow:max"],
        "ideal_ratio": chosen["check:ratio:geomean"],
    }
    text = (
        f"on the check set (never used to choose) it gives {view['capacity']:.2f}x geomean at worst "
        f"{view['worst_overflow']:.1%} overflow (tuning set: {chosen['capacity:geomean']:.2f}x)"
    )
    try:
        own = decide(decision, codecs, prefix="check:")
    except ValueError:
        text += "; no codec x E kept the check set within the overflow limit"
    else:
        view["own_choice"] = {"codec": own["codec"], "entry_bytes": own["entry_bytes"], "policy": own["policy"]}
        view["own_capacity"] = own["check:capacity:geomean"]
        text += (
            f"; the check set alone would choose {own['codec']!r} at E = {own['entry_bytes']} B with "
            f"{own['policy']} ({own['check:capacity:geomean']:.2f}x)"
        )
    view["text"] = text
    return view


if __name__ == "__main__":
    main()
