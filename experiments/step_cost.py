"""What a training step costs on the CPU with buddy's session, against the same step without it.

Each workload trains one run, its steps alternately plain and inside ``buddy.compressed_activations()`` with
buddy's defaults (codec, entry size, the tracker's policy; on the CPU the default codec runs the native engine, the
kernel sources built for the host, or with ``--backend reference`` the torch reference). Every step's
**CPU time** is measured -- the process's, all its threads -- so other work on the machine does not stretch it the
way it stretches wall time; the wall time is recorded beside it, and the **main thread's** CPU time: the step's
critical path (the thread that runs the model and buddy's host work, and takes part in every parallel region), which
counts neither other work on the machine nor the spin-waits of torch's OpenMP threads between parallel regions
(they count in the process's CPU time, and buddy's host work between its kernels lengthens them). Medians over
the timed steps, after warm-up steps in which the tracker learns: first the tracker's count warm-up
(:attr:`buddy.Tracker.count_warmup` compressed steps, in which every key's symbols are counted every step; after
it, every :attr:`~buddy.Tracker.count_every` steps: the steady state timed), then ``--warmup`` of each kind. Of the wall time buddy adds, what its native
kernels took (:func:`buddy.engines.native.kernel_seconds`, also by operation in the JSON) and the rest, the host's
work, also per tensor compressed (each tensor is compressed once and decompressed once a step).

Each run times three kinds of step: ``none`` (no session), ``buddy`` (the session sized first, ``strict=True``:
every tensor sized before its slot is chosen, a read per tensor) and ``ahead`` (``strict=False``, the default:
slots from the tracker's plan, at most two reads a step); each kind's host reads a step are in the table (a read
costs nothing on the CPU, but it is what a GPU waits for, and the host code is the GPU's).

    python -m experiments.step_cost                       # the tuning set, quick size
    python -m experiments.step_cost --workloads resnet-fp32 --steps 3
    python -m experiments.step_cost --backend reference     # the torch reference instead of the native engine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import buddy
from experiments import cli
from experiments.common import format_table, progress

__all__ = ["measure", "main"]

METHODS = ("none", "buddy", "ahead")
#: the session's ``strict`` of each kind of compressed step
_STRICT = {"buddy": True, "ahead": False}


def measure(name: str, *, size: str, steps: int, warmup: int, seed: int, learn: int | None = None) -> dict:
    """One workload's row: median CPU and wall seconds of a plain and of a compressed step, and their ratios.
    ``learn``: compressed steps first, untimed (default: the tracker's :attr:`~buddy.Tracker.count_warmup`)."""
    from experiments.workloads import make_run

    from buddy.engines import native

    run = make_run(name, size, seed=seed)
    tracker = buddy.Tracker()  # this run's own history
    min_bytes = run.workload.min_bytes(size)
    learn = tracker.count_warmup if learn is None else learn
    for i in range(learn):  # the tracker's count warm-up: what follows is the steady state
        with buddy.compressed_activations(tracker=tracker, min_bytes=min_bytes, strict=i % 2 == 0):
            loss = run.forward_loss()
        run.step(loss)
    seconds: dict[str, list[tuple[float, float, float]]] = {m: [] for m in METHODS}  # CPU, wall, main thread's CPU
    kernels: list[dict[str, float]] = []  # per timed buddy step: its native launches' wall seconds, by operation
    calls: list[float] = []  # per timed buddy step: the wall seconds of its compresses and decompresses (the session's)
    capacity, tensors = None, 0
    reads: dict[str, list[int]] = {m: [] for m in _STRICT}  # per timed step of each compressed kind: host reads
    ahead_capacity = None
    for i in range(warmup + steps):
        for method in METHODS:  # alternating, so that a slow stretch of the machine hits each alike
            before = native.kernel_seconds()
            cpu0, wall0, main0 = time.process_time(), time.perf_counter(), time.thread_time()
            with buddy.compressed_activations(
                tracker=tracker, min_bytes=min_bytes, enabled=method != "none", strict=_STRICT.get(method, True)
            ) as s:  # fmt: skip
                loss = run.forward_loss()
            run.step(loss)
            cpu, wall, main = time.process_time() - cpu0, time.perf_counter() - wall0, time.thread_time() - main0
            if i >= warmup:
                seconds[method].append((cpu, wall, main))
                if method in reads:
                    reads[method].append(s.stats().host_reads)
            if method == "ahead":
                ahead_capacity = s.stats().effective_capacity
            if method == "buddy":
                done = s.stats()
                capacity = done.effective_capacity
                tensors = sum(r.codec != "kept" for r in done.rows)
                if i >= warmup:
                    after = native.kernel_seconds()
                    kernels.append({op: t - before.get(op, 0.0) for op, t in after.items()})
                    calls.append(done.compress_seconds + done.decompress_seconds)
    cpus = {m: statistics.median(c for c, _, _ in seconds[m]) for m in METHODS}
    walls = {m: statistics.median(w for _, w, _ in seconds[m]) for m in METHODS}
    mains = {m: statistics.median(t for _, _, t in seconds[m]) for m in METHODS}
    in_kernels = statistics.median(sum(k.values()) for k in kernels)
    added = walls["buddy"] - walls["none"]  # the wall time buddy adds to a step
    codec = buddy.defaults().codec
    ran = buddy.dispatch.chosen(codec, device="cpu")
    return {
        "workload": name,
        "size": size,
        "codec": codec,
        "entry_bytes": buddy.defaults().entry_bytes,
        "backend": ran[0].backend if ran else "?",
        "steps": steps,
        "learn_steps": learn,
        "count_every": tracker.count_every,
        "none_cpu_s": cpus["none"],
        "buddy_cpu_s": cpus["buddy"],
        "cpu_ratio": cpus["buddy"] / cpus["none"],
        "none_wall_s": walls["none"],
        "buddy_wall_s": walls["buddy"],
        "wall_ratio": walls["buddy"] / walls["none"],
        "none_main_s": mains["none"],
        "buddy_main_s": mains["buddy"],
        "main_ratio": mains["buddy"] / mains["none"],
        # the read-free step (strict=False): slots from the tracker's plan
        "ahead_cpu_s": cpus["ahead"],
        "ahead_cpu_ratio": cpus["ahead"] / cpus["none"],
        "ahead_wall_s": walls["ahead"],
        "ahead_wall_ratio": walls["ahead"] / walls["none"],
        "ahead_main_s": mains["ahead"],
        "ahead_main_ratio": mains["ahead"] / mains["none"],
        "ahead_capacity": ahead_capacity,
        # host reads a step (median over the timed steps): what a GPU would wait for
        "host_reads": statistics.median(reads["buddy"]),
        "ahead_host_reads": statistics.median(reads["ahead"]),
        "tensors": tensors,
        # the buddy step's wall time in the native engine's kernels (median), by operation; the rest of what buddy
        # adds to the wall time is the host's work around them
        "kernels_s": in_kernels,
        "kernels_by_op_s": {
            op: statistics.median(k.get(op, 0.0) for k in kernels) for op in sorted(set().union(*kernels))
        },
        "host_s": added - in_kernels,
        # of the wall time buddy adds, what its compresses and decompresses took (kernels included; the rest is
        # outside them: the hooks' choice of what to take, and the model's own operations run slower beside buddy)
        "calls_s": statistics.median(calls),
        "calls_share": statistics.median(calls) / added if added > 0 else None,
        "host_per_tensor_us": (added - in_kernels) / max(tensors, 1) * 1e6,
        "capacity": capacity,
    }


COLUMNS = [
    ("workload", "workload", ""),
    ("backend", "backend", ""),
    ("none_cpu_s", "plain step (CPU s)", ".3f"),
    ("buddy_cpu_s", "buddy step (CPU s)", ".3f"),
    ("cpu_ratio", "buddy / plain (CPU)", ".1f"),
    ("wall_ratio", "buddy / plain (wall)", ".1f"),
    ("main_ratio", "buddy / plain (main thread's CPU)", ".2f"),
    ("ahead_cpu_ratio", "ahead / plain (CPU)", ".2f"),
    ("ahead_main_ratio", "ahead / plain (main thread's CPU)", ".2f"),
    ("host_reads", "reads a step (strict)", ".0f"),
    ("ahead_host_reads", "reads a step (ahead)", ".0f"),
    ("kernels_s", "kernels (wall s)", ".3f"),
    ("host_s", "host's work (wall s)", ".3f"),
    ("tensors", "tensors compressed", "d"),
    ("host_per_tensor_us", "host's work a tensor (us)", ".0f"),
    ("calls_share", "added wall time in buddy's calls", ".0%"),
    ("capacity", "capacity", ".2f"),
    ("ahead_capacity", "capacity (ahead)", ".2f"),
]


def parse_args(argv):
    from experiments.workloads import TUNING_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_workloads_argument(p, TUNING_WORKLOADS)
    cli.add_size_argument(p)
    p.add_argument("--steps", type=int, default=5, help="timed steps of each kind")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each kind first")
    p.add_argument(
        "--learn", type=int, default=None,
        help="untimed compressed steps before those (default: the tracker's count warm-up, 32)",
    )  # fmt: skip
    p.add_argument(
        "--backend", choices=["auto", "reference", "native"], default="auto",
        help="what runs the codec: buddy's choice (auto: the native engine for the default codec), or one",
    )  # fmt: skip
    cli.add_common_arguments(p, out="results/step_cost")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args, header = cli.begin("step_cost", parse_args, argv)
    buddy.set_defaults(backend=args.backend)
    rows = []
    for name in progress(args.workloads, desc="workloads", enabled=not args.no_progress):
        rows.append(
            measure(name, size=args.size, steps=args.steps, warmup=args.warmup, seed=args.seed, learn=args.learn)
        )
        print(f"  {name}: buddy {rows[-1]['cpu_ratio']:.1f}x the plain step's CPU time", flush=True)
    defaults = buddy.defaults()
    print(f"\nCPU time of a training step with buddy's session ({defaults.codec} @ {defaults.entry_bytes} B, the "
          f"tracker's default policy) against without; medians of {args.steps} steps")  # fmt: skip
    print(format_table(rows, COLUMNS))
    cli.finish(args, header, rows, mention_csv=False, experiment="step_cost", size=args.size)
    return rows


if __name__ == "__main__":
    main()
