"""Compressibility: how small each saved tensor could get, per codec and entry size.

For every workload, point of training and captured tensor: the ideal
compacted ratio (original bytes / sum of entry sectors, no slot rounding) of
every codec at every entry size, next to zstd level 3 and lz4 on the same
bytes (CPU), nvcomp's codecs (with ``--device cuda --nvcomp``), and the
order-0 byte-entropy bound. The summary per workload weights tensors by
their bytes (total original / total compressed).

    python -m experiments.compressibility                      # quick, CPU
    python -m experiments.compressibility --size full --entry-bytes 128 256 512 1024 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import buddy
from experiments import cli
from experiments.analysis import (
    byte_entropy_bits,
    compacted_bytes,
    data_bytes,
    general_purpose_sizes,
    histogram,
    ratio,
    tensor_bytes,
)
from experiments.common import format_table, progress

__all__ = ["analyse", "summarise", "main"]


def nvcomp_sizes(t, device) -> dict[str, int]:
    """nvcomp's compressed sizes of the tensor's bytes on the GPU (``--nvcomp``)."""
    from experiments.bench_codecs import nvcomp_baselines

    data = data_bytes(t, device)
    return {b.method: b.size(b.compress(data)) for b in nvcomp_baselines(torch.device(device))}


def analyse(
    captures: dict, *, codecs, entry_sizes, baselines: bool = True, nvcomp_device=None, show: bool = True
) -> list[dict]:
    """One row per workload x point x tensor x method; ``ratio`` = original / compressed bytes."""
    rows = []
    jobs = [(w, c, t) for w, caps in captures.items() for c in caps for t in c.tensors]
    for workload, cap, saved in progress(jobs, desc="compressibility", enabled=show):
        t = saved.tensor
        original = tensor_bytes(t)
        sizes = [
            (codec, entry_bytes, compacted_bytes(histogram(t, codec, entry_bytes)))
            for codec in codecs
            for entry_bytes in entry_sizes
        ]
        if baselines:
            sizes += [(method, None, size) for method, size in general_purpose_sizes(t).items()]
        if nvcomp_device is not None:
            sizes += [(method, None, size) for method, size in nvcomp_sizes(t, nvcomp_device).items()]
        sizes.append(("entropy-bound", None, original * byte_entropy_bits(t) / 8))
        for method, entry_bytes, compressed in sizes:
            rows.append(
                {
                    "workload": workload,
                    "point": cap.point,
                    "key": saved.key,
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "method": method,
                    "entry_bytes": entry_bytes,
                    "original_bytes": original,
                    "compressed_bytes": compressed,
                    "ratio": ratio(original, compressed),
                }
            )
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Per workload x method x entry size: byte-weighted ratio over all its tensors and points."""
    groups: dict[tuple, list[int]] = {}
    for r in rows:
        g = groups.setdefault((r["workload"], r["method"], r["entry_bytes"]), [0, 0])
        g[0] += r["original_bytes"]
        g[1] += r["compressed_bytes"]
    return [
        {"workload": w, "method": m, "entry_bytes": e, "original_bytes": o, "compressed_bytes": c, "ratio": ratio(o, c)}
        for (w, m, e), (o, c) in groups.items()
    ]


def format_summary(summary: list[dict]) -> str:
    """Workloads as rows, methods (codec@E, zstd-3, lz4, entropy bound) as columns."""
    methods = list(dict.fromkeys((r["method"], r["entry_bytes"]) for r in summary))
    label = lambda m, e: m if e is None else f"{m}@{e}"  # noqa: E731
    by = {(r["workload"], r["method"], r["entry_bytes"]): r["ratio"] for r in summary}
    table = []
    for workload in dict.fromkeys(r["workload"] for r in summary):
        row = {"workload": workload}
        row.update({label(m, e): by.get((workload, m, e)) for m, e in methods})
        table.append(row)
    columns = [("workload", "workload", "")] + [(label(m, e), label(m, e), ".2f") for m, e in methods]
    return format_table(table, columns)


def parse_args(argv):
    from experiments.workloads import DEFAULT_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_size_argument(p)
    cli.add_workloads_argument(p, DEFAULT_WORKLOADS)
    p.add_argument(
        "--codecs",
        nargs="+",
        choices=buddy.available_codecs(),
        default=[c for c in buddy.available_codecs("cpu") if c != "raw"],
    )
    p.add_argument("--entry-bytes", type=int, nargs="+", default=[buddy.defaults().entry_bytes])
    cli.add_points_argument(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--nvcomp", action="store_true", help="add nvcomp's codecs (needs --device cuda and nvcomp)")
    cli.add_common_arguments(p, out="results/compressibility")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args, header = cli.begin("compressibility", parse_args, argv)
    points, captures = cli.capture_workloads(args, points=args.points, device=args.device)
    if args.nvcomp and not args.device.startswith("cuda"):
        raise SystemExit("--nvcomp needs --device cuda: nvcomp runs on the GPU")
    rows = analyse(
        captures,
        codecs=args.codecs,
        entry_sizes=args.entry_bytes,
        nvcomp_device=args.device if args.nvcomp else None,
        show=not args.no_progress,
    )
    summary = summarise(rows)
    print()
    print("Ideal compacted ratio per workload (byte-weighted over its saved tensors and training points)")
    print(format_summary(summary))
    cli.finish(args, header, rows, summary=summary, experiment="compressibility", points=list(points), size=args.size)
    return rows


if __name__ == "__main__":
    main()
