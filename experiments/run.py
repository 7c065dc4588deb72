"""The main job: how far buddy stretches GPU memory on the experiment workloads.

Quick (default; about a minute on 2 idle CPU cores): train every default workload
briefly on real data, capture what autograd saves at a few points of
training, then report each codec's ideal ratio next to zstd-3, lz4 and the
byte-entropy bound (compressibility) and every policy's effective capacity
against its buddy traffic (capacity), print the headline table and write
plots. ``--full`` runs every experiment at full size for the record:
compressibility over all entry sizes, capacity, the tracker over training,
and the largest batch under a memory budget.

    python -m experiments.run                 # quick
    python -m experiments.run --full          # everything, for the record
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import buddy
from experiments import capacity, compressibility
from experiments.common import capture_all, start, write_results

__all__ = ["main"]

FULL_ENTRY_SIZES = (128, 256, 512, 1024, 4096)


def parse_args(argv):
    from experiments.workloads import DEFAULT_WORKLOADS, WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="every experiment at full size (takes long on a CPU)")
    p.add_argument("--size", choices=("tiny", "quick", "full"), default=None, help="override the workload size")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(DEFAULT_WORKLOADS))
    # the default codec, and zvc (the paper's codec) beside it at the same entry size
    default_codecs = list(dict.fromkeys([buddy.defaults().codec, "zvc"]))
    p.add_argument(
        "--codecs",
        nargs="+",
        default=default_codecs,
        choices=buddy.available_codecs(),
        help="codecs of the capacity runs",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    size = args.size or ("full" if args.full else "quick")
    header = start("run", argv)
    show = not args.no_progress
    t0 = time.perf_counter()
    points = capacity.DEFAULT_POINTS[size]
    captures = capture_all(args.workloads, size=size, points=points, device=args.device, seed=args.seed, show=show)

    codecs = [c for c in buddy.available_codecs("cpu") if c != "raw"]
    entry_sizes = FULL_ENTRY_SIZES if args.full else (buddy.defaults().entry_bytes,)
    comp_rows = compressibility.analyse(captures, codecs=codecs, entry_sizes=entry_sizes, show=show)
    summary = compressibility.summarise(comp_rows)
    print("\nIdeal compacted ratio per workload (byte-weighted over its saved tensors and training points)")
    print(compressibility.format_summary(summary))
    write_results(
        args.out / "compressibility",
        header,
        comp_rows,
        summary=summary,
        experiment="compressibility",
        size=size,
        points=list(points),
    )

    headlines, written = {}, []
    for codec in args.codecs:
        cap_rows = capacity.analyse(captures, codec=codec, entry_bytes=buddy.defaults().entry_bytes, show=show)
        headlines[codec] = capacity.headline(cap_rows)
        print()
        print(capacity.format_headline(cap_rows, codec, buddy.defaults().entry_bytes))
        cap_path = write_results(
            args.out / f"capacity-{codec}",
            header,
            cap_rows,
            headline=headlines[codec],
            experiment="capacity",
            size=size,
            points=list(points),
        )
        if not args.no_plot:
            from experiments.plot import plot_capacity

            written += plot_capacity(cap_path, cap_path.parent)

    if args.full:
        from experiments import max_batch, over_training

        common = ["--size", size, "--device", args.device, "--seed", str(args.seed), "--workloads", *args.workloads]
        common += ["--no-progress"] if not show else []
        over_training.main(
            [*common, "--out", str(args.out / "over_training")] + (["--no-plot"] if args.no_plot else [])
        )
        max_batch.main([*common, "--out", str(args.out / "max_batch")] + (["--no-plot"] if args.no_plot else []))

    print(f"\nresults under {args.out}/ ({time.perf_counter() - t0:.0f} s)")
    for png in written:
        print(f"wrote {png}")
    return {"compressibility": summary, "capacity": headlines}


if __name__ == "__main__":
    main()
