"""Over training: compressibility and the tracker's choices per key as a model learns.

Each workload trains with ``buddy.compressed_activations`` on every step (the
real pipeline: its own tracker and store, the tracker's default policy
``OverflowBudget(10 %)`` unless ``--policy`` says otherwise). Per step and key it records the ideal ratio, the target the tracker
chose, the overflow it predicted from history and the overflow that
happened. The summary says how often the prediction missed by more than 1 %
of the tensor's bytes, by how much, and what capacity and traffic resulted.

    python -m experiments.over_training                 # quick, CPU
    python -m experiments.over_training --size full --steps 500 --every 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import buddy
from buddy.tracker import COUNT_EVERY, COUNT_WARMUP
from experiments import cli
from experiments.analysis import ratio
from experiments.common import format_table, progress, write_results

__all__ = ["track", "summarise", "main"]

DEFAULT_STEPS = {"tiny": 4, "quick": 30, "full": 400}
MISS = 0.01  # a prediction "missed" when it is off by more than this fraction of the tensor's bytes


def track(
    name: str, *, size: str, steps: int, every: int, policy, device: str, seed: int, show: bool,
    count_every: int = COUNT_EVERY, count_warmup: int = COUNT_WARMUP,
) -> list[dict]:  # fmt: skip
    """Train ``name`` for ``steps`` steps, compressing every ``every``-th; one row per compressed key and step.
    ``count_every``, ``count_warmup``: the tracker's."""
    from experiments.workloads import make_run

    run = make_run(name, size=size, device=device, seed=seed)
    tracker = buddy.Tracker(policy, count_every=count_every, count_warmup=count_warmup)
    store = buddy.BuddyStore(pin=False if device == "cpu" else None)
    min_bytes = run.workload.min_bytes(size)
    rows = []
    for step in progress(range(steps), desc=f"{name} over training", enabled=show):
        if step % every:
            run.step(run.forward_loss())
            continue
        with buddy.compressed_activations(policy, tracker=tracker, store=store, min_bytes=min_bytes) as session:
            loss = run.forward_loss()
        run.step(loss)
        for r in session.stats().rows:
            rows.append(
                {
                    "workload": name,
                    "step": step,
                    "loss": loss.item(),
                    "key": r.key,
                    "original_bytes": r.original_bytes,
                    "ideal_ratio": ratio(r.original_bytes, r.ideal_bytes),
                    "target_ratio": r.target_ratio,
                    "device_bytes": r.device_bytes,
                    "buddy_bytes": r.buddy_bytes,
                    "predicted_overflow_bytes": r.predicted_overflow_bytes,
                }
            )
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Per workload: capacity, traffic, target changes and prediction misses over training."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        predicted = [r for r in mine if r["predicted_overflow_bytes"] is not None]
        errors = [abs(r["buddy_bytes"] - r["predicted_overflow_bytes"]) / r["original_bytes"] for r in predicted]
        targets: dict[str, list[float]] = {}
        for r in mine:
            targets.setdefault(r["key"], []).append(r["target_ratio"])
        changes = sum(sum(a != b for a, b in zip(t, t[1:])) for t in targets.values())
        original = sum(r["original_bytes"] for r in mine)
        out.append(
            {
                "workload": workload,
                "keys": len(targets),
                "steps": len({r["step"] for r in mine}),
                "capacity": ratio(original, sum(r["device_bytes"] for r in mine)),
                "overflow_fraction": sum(r["buddy_bytes"] for r in mine) / original if original else 0.0,
                "ideal_first": _ideal(mine, min(r["step"] for r in mine)),
                "ideal_last": _ideal(mine, max(r["step"] for r in mine)),
                "target_changes": changes,
                "predictions": len(predicted),
                "missed": sum(e > MISS for e in errors),
                "mean_abs_error": statistics.fmean(errors) if errors else 0.0,
                "max_abs_error": max(errors, default=0.0),
            }
        )
    return out


def _resumed(out: Path, settings: dict, workloads: list[str]) -> list[dict]:
    """The rows of the workloads an earlier run with these ``settings`` finished under ``out`` (none if it differs)."""
    import json

    path = out / "results.json"
    if not path.is_file():
        return []
    earlier = json.loads(path.read_text())
    if earlier.get("settings") != settings:
        print(f"not resuming: {path} was written with {earlier.get('settings')}, this run has {settings}")
        return []
    finished = set(earlier.get("workloads_done", ())) & set(workloads)
    numbers = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}  # JSON wrote them as strings
    return [
        {k: numbers.get(v, v) if isinstance(v, str) and k != "workload" and k != "key" else v for k, v in r.items()}
        for r in earlier["rows"]
        if r["workload"] in finished
    ]


def _ideal(rows: list[dict], step: int) -> float:
    at = [r for r in rows if r["step"] == step]
    return ratio(sum(r["original_bytes"] for r in at), sum(r["original_bytes"] / r["ideal_ratio"] for r in at))


SUMMARY_COLUMNS = [
    ("workload", "workload", ""),
    ("keys", "keys", "d"),
    ("steps", "steps", "d"),
    ("ideal_first", "ideal (first)", ".2f"),
    ("ideal_last", "ideal (last)", ".2f"),
    ("capacity", "capacity", ".2f"),
    ("overflow_fraction", "overflow", ".1%"),
    ("target_changes", "target changes", "d"),
    ("missed", "missed", "d"),
    ("predictions", "of", "d"),
    ("mean_abs_error", "mean |error|", ".2%"),
    ("max_abs_error", "max |error|", ".1%"),
]


def parse_args(argv):
    from experiments.workloads import DEFAULT_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_size_argument(p)
    cli.add_workloads_argument(p, DEFAULT_WORKLOADS)
    p.add_argument("--steps", type=int, default=None, help="training steps (default by size)")
    p.add_argument("--every", type=int, default=1, help="compress every n-th step (the others train plainly)")
    p.add_argument("--max-overflow", type=float, default=0.10, help="the policy's overflow limit")
    p.add_argument(
        "--policy",
        choices=("OverflowBudget", "BuddyThreshold"),
        default="OverflowBudget",
        help="the tracker's policy (default: the tracker's default, OverflowBudget)",
    )
    p.add_argument(
        "--count-every", type=int, default=COUNT_EVERY,
        help=f"the tracker's count_every: a learned key's symbols counted every n-th step (default {COUNT_EVERY})",
    )  # fmt: skip
    p.add_argument(
        "--count-warmup", type=int, default=COUNT_WARMUP,
        help=f"the tracker's count_warmup: a key's first n steps all counted (default {COUNT_WARMUP})",
    )  # fmt: skip
    cli.add_common_arguments(p, out="results/over_training", device="cpu", plot=True)
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the workloads an earlier, interrupted run with the same settings wrote to --out; run the rest",
    )
    args = p.parse_args(argv)
    if args.every < 1:
        p.error("--every must be at least 1")
    if args.count_every < 1 or args.count_warmup < 0:
        p.error("--count-every must be at least 1, --count-warmup at least 0")
    return args


def main(argv=None) -> list[dict]:
    from experiments.plot import plot_over_training

    args, header = cli.begin("over_training", parse_args, argv)
    steps = args.steps or DEFAULT_STEPS[args.size]
    policy = getattr(buddy, args.policy)(args.max_overflow)
    settings = {"size": args.size, "steps": steps, "every": args.every, "seed": args.seed, "policy": str(policy)}
    # (part of the settings --resume compares: a run with other counting is not resumed)
    settings.update(count_every=args.count_every, count_warmup=args.count_warmup)
    settings.update(codec=buddy.defaults().codec, entry_bytes=buddy.defaults().entry_bytes)  # what the session uses

    def written(rows: list[dict], done: list[str]) -> dict:
        """What results.json holds beside the rows."""
        return dict(
            summary=summarise(rows), experiment="over_training", settings=settings, workloads_done=done,
            complete=len(done) == len(args.workloads), size=args.size, steps=steps,
        )  # fmt: skip

    rows = _resumed(args.out, settings, args.workloads) if args.resume else []
    done = list(dict.fromkeys(r["workload"] for r in rows))
    if done:
        print(f"resumed from {args.out / 'results.json'}: {', '.join(done)}")
    for name in args.workloads:
        if name in done:
            continue
        rows += track(
            name,
            size=args.size,
            steps=steps,
            every=args.every,
            policy=policy,
            device=args.device,
            seed=args.seed,
            show=not args.no_progress,
            count_every=args.count_every,
            count_warmup=args.count_warmup,
        )
        done.append(name)
        # after every workload: an interrupted run keeps what it finished (--resume goes on from it)
        write_results(args.out, header, rows, **written(rows, done))
    rows = [r for r in rows if r["workload"] in args.workloads]
    extra = written(rows, list(args.workloads))
    print()
    print(
        f"The tracker over {steps} training steps ({policy}); 'missed' = predicted overflow off by > {MISS:.0%} of the tensor"
    )
    print(format_table(extra["summary"], SUMMARY_COLUMNS))
    cli.finish(args, header, rows, plot=plot_over_training, **extra)
    return rows


if __name__ == "__main__":
    main()
