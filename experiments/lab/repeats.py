"""Where whole-tensor zstd-3 beats the default codec: rows that repeat exactly.

A saved tensor's **rows** are its slices along the last dimension (a hidden
vector, a row of a feature map). In a language model the same token gives
the same embedding row, and the first layer maps equal rows to equal rows,
so some tensors repeat most of their rows exactly. An LZ coder over the
whole tensor (zstd) codes a repeated row as a short back-reference; no coder
of one entry at a time can, since every entry decodes on its own. This
splits each workload's tensors into those with repeated rows (more than
:data:`REPEATED` of their rows equal an earlier one) and the rest, and gives
for each group its bytes, zstd-3's whole-tensor ratio and the ideal ratio of
the codec (compacted sectors, the default codec and entry size).

    python -m experiments.lab.repeats            # quick, tuning and check sets
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from experiments import cli
from experiments.analysis import compacted_bytes, general_purpose_sizes, histogram, ratio, tensor_bytes
from experiments.common import format_table, progress

__all__ = ["repeated_rows", "analyse", "main"]

#: share of a tensor's rows equal to an earlier row above which it counts as repeating
REPEATED = 0.01
GROUPS = ("repeated", "other")


def repeated_rows(t: torch.Tensor) -> float:
    """Share of ``t``'s rows (slices along its last dimension) equal, byte for byte, to an earlier row."""
    if t.dim() < 2 or t.numel() == 0:
        return 0.0
    rows = t.detach().contiguous().reshape(-1, t.shape[-1]).view(torch.uint8)
    return 1.0 - torch.unique(rows, dim=0).shape[0] / rows.shape[0]


def analyse(captures: dict, *, codec: str, entry_bytes: int, show: bool = True) -> list[dict]:
    """One row per workload: per group, bytes and the two ratios; and both ratios over all tensors."""
    rows = []
    for workload, caps in progress(captures.items(), desc=f"repeated rows ({codec}, E={entry_bytes})", enabled=show):
        acc = {g: [0, 0, 0.0] for g in (*GROUPS, "all")}  # original, zstd-3, compacted codec bytes
        for cap in caps:
            for saved in cap.tensors:
                t = saved.tensor
                coded = compacted_bytes(histogram(t, codec, entry_bytes))
                sizes = [tensor_bytes(t), general_purpose_sizes(t)["zstd-3"], coded]
                for g in (GROUPS[0] if repeated_rows(t) > REPEATED else GROUPS[1], "all"):
                    acc[g] = [a + b for a, b in zip(acc[g], sizes)]
        row = {"workload": workload, "codec": codec, "entry_bytes": entry_bytes}
        for g, (original, zstd, coded) in acc.items():
            row[f"{g}_bytes"] = original
            row[f"{g}_zstd"] = ratio(original, zstd) if original else None
            row[f"{g}_codec"] = ratio(original, coded) if original else None
        row["repeated_share"] = acc["repeated"][0] / acc["all"][0] if acc["all"][0] else 0.0
        rows.append(row)
    return rows


COLUMNS = [
    ("workload", "workload", ""),
    ("repeated_share", "bytes in repeating tensors", ".1%"),
    ("repeated_zstd", "zstd-3 on them", ".2f"),
    ("repeated_codec", "codec on them", ".2f"),
    ("other_zstd", "zstd-3 on the rest", ".2f"),
    ("other_codec", "codec on the rest", ".2f"),
    ("all_zstd", "zstd-3, all", ".2f"),
    ("all_codec", "codec, all", ".2f"),
]


def parse_args(argv):
    from experiments.workloads import CHECK_WORKLOADS, TUNING_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_size_argument(p)
    cli.add_workloads_argument(p, [*TUNING_WORKLOADS, *CHECK_WORKLOADS], nargs="*")
    cli.add_codec_arguments(p)
    cli.add_common_arguments(p, out="results/repeats")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args, header = cli.begin("lab.repeats", parse_args, argv)
    points, captures = cli.capture_workloads(args)
    rows = analyse(captures, codec=args.codec, entry_bytes=args.entry_bytes, show=not args.no_progress)
    print()
    print(
        f"Whole-tensor zstd-3 and the ideal ratio of {args.codec}@{args.entry_bytes}, tensors with more than "
        f"{REPEATED:.0%} of their rows repeated apart from the rest"
    )
    print(format_table(rows, COLUMNS))
    cli.finish(args, header, rows, experiment="repeats", size=args.size, points=list(points))
    return rows


if __name__ == "__main__":
    main()
