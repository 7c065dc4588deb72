"""Models trained one after another in one process, on one tracker: does every step keep its bound?

A notebook, a sweep, a teacher and a student, a GAN's two nets: one process
trains several models, and the default tracker sees them all. Each sequence
below runs compressed training steps of its workloads in order, on one
tracker with the default policy (``OverflowBudget(10 %)``), and reports every
step's overflow against the policy's bound, how many slots the bound
corrected from the history's plan, and the effective capacity.

    python -m experiments.model_sequence                       # the three default sequences, quick size
    python -m experiments.model_sequence --sequence gpt-bf16:1 lstm-fp32:3

A sequence item is ``workload[@bf16|@fp32]:steps``: ``@bf16`` trains it under
bf16 autocast, ``@fp32`` without autocast, whatever the workload's own
setting; an item naming the same workload as the one before it goes on
training the same model (a fine-tune in fp32, then in bf16 autocast).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import buddy
from experiments import cli
from experiments.common import format_table, progress

__all__ = ["DEFAULT_SEQUENCES", "parse_item", "run_sequence", "main"]

#: the issue's three cases: a decoder then an LM, three models, one encoder in fp32 then in bf16 autocast
DEFAULT_SEQUENCES = (
    ("gpt-bf16:1", "lstm-fp32:3"),
    ("resnet-fp32:2", "vgg-fp32:2", "gpt-bf16:2"),
    ("minilm-fp32:2", "minilm-fp32@bf16:3"),
)
_AUTOCAST = {"bf16": torch.bfloat16, "fp32": None}


def parse_item(item: str) -> tuple[str, str | None, int]:
    """``"name[@bf16|@fp32]:steps"`` -> ``(name, "bf16" | "fp32" | None, steps)``."""
    from experiments.workloads import WORKLOADS

    head, _, steps = item.rpartition(":")
    name, _, autocast = head.partition("@")
    if not head or not steps.isdigit() or int(steps) < 1:
        raise argparse.ArgumentTypeError(f"{item!r}: a sequence item is workload[@bf16|@fp32]:steps (steps >= 1)")
    if name not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"{item!r}: unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if autocast and autocast not in _AUTOCAST:
        raise argparse.ArgumentTypeError(f"{item!r}: autocast is @bf16 or @fp32, got @{autocast}")
    return name, autocast or None, int(steps)


def run_sequence(items, *, size: str, min_bytes: int, seed: int, show: bool) -> list[dict]:
    """Every compressed step of the sequence on one fresh tracker and store: a row each."""
    from experiments.workloads import make_run

    tracker, store = buddy.Tracker(), buddy.BuddyStore()
    rows: list[dict] = []
    label = " ".join(items)
    previous = None
    for item in items:
        name, autocast, steps = parse_item(item)
        if name != previous:
            run = make_run(name, size, "cpu", seed)  # the same workload again goes on training the same model
        previous = name
        if autocast is not None:
            run.workload = dataclasses.replace(run.workload, autocast_dtype=_AUTOCAST[autocast])
        for step in progress(range(steps), desc=item, enabled=show):
            with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=min_bytes) as session:
                loss = run.forward_loss()
            run.step(loss)
            st = session.stats()
            rows.append(
                {
                    "sequence": label,
                    "item": item,
                    "step": step,
                    "overflow": st.overflow_fraction,
                    "bound": getattr(st, "overflow_bound", None),
                    "within": st.buddy_bytes <= 0.10 * st.original_bytes,
                    "corrected": getattr(st, "corrected", None),
                    "capacity": st.effective_capacity,
                    "tensors": len(st.rows),
                    "models": len({r.key.rpartition("/")[0] for r in st.rows}),
                }
            )
    return rows


COLUMNS = [
    ("item", "model", ""),
    ("step", "step", "d"),
    ("overflow", "overflow", ".1%"),
    ("within", "within 10 %", ""),
    ("corrected", "corrected", "d"),
    ("capacity", "capacity", ".2f"),
    ("tensors", "tensors", "d"),
]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequence", nargs="+", action="append", help="one sequence (repeat for several)")
    cli.add_size_argument(p)
    p.add_argument("--min-bytes", type=int, default=64 << 10, help="the sessions' min_bytes (default 64 KiB)")
    cli.add_common_arguments(p, out="results/model_sequence")
    args = p.parse_args(argv)
    for sequence in args.sequence or ():
        for item in sequence:
            try:
                parse_item(item)
            except argparse.ArgumentTypeError as exc:
                p.error(str(exc))
    return args


def main(argv=None) -> list[dict]:
    args, header = cli.begin("model_sequence", parse_args, argv)
    rows = []
    for items in args.sequence or DEFAULT_SEQUENCES:
        part = run_sequence(items, size=args.size, min_bytes=args.min_bytes, seed=args.seed, show=not args.no_progress)
        print(f"\n{' -> '.join(items)} (one tracker, OverflowBudget 10 %)")
        print(format_table(part, COLUMNS))
        rows += part
    worst = max(r["overflow"] for r in rows)
    print(f"\nworst step: {worst:.1%} overflow ({'within' if worst <= 0.10 else 'PAST'} the 10 % bound)")
    cli.finish(args, header, rows, experiment="model_sequence", size=args.size)
    return rows


if __name__ == "__main__":
    main()
