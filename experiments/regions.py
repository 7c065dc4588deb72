"""Within-tensor variance: one slot size per tensor against one slot size per 64 KiB region.

buddy gives every entry of a tensor the same slot. If a tensor's
compressibility varies along it (sparse rows here, dense ones there), a slot
size per region could hold the same bytes in less device memory. This
measures how much, on the captured tensors, before anything is built:

* **per tensor**   ``BuddyThreshold(10 %)`` on the tensor's own histogram
  (its slot from the size pass, as the tracker picks a new key's);
* **per region, each within 10 %**  the same rule on every 64 KiB region's
  own histogram;
* **per region, same traffic**  the regions share the overflow the
  per-tensor slot spilled: the slots with the fewest device bytes whose
  overflow together is no more (the fair comparison: equal buddy traffic).

Device bytes count slots, every entry's metadata and, per region, one byte
of region table. Effective capacity = original / device bytes over all
tensors and training points; the gain is the same-traffic capacity over the
per-tensor one. Per-region slots would be built only if the gain on the
check set reached :data:`BUILD_THRESHOLD`.

    python -m experiments.regions                  # quick, tuning and check sets
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import buddy
from experiments import cli
from experiments.analysis import REGION_BYTES, entry_sectors, place_per_region, place_per_tensor, ratio, tensor_bytes
from experiments.common import by_set, format_table, geomean, progress

__all__ = ["MAX_OVERFLOW", "BUILD_THRESHOLD", "analyse", "summarise", "format_rows", "main"]

MAX_OVERFLOW = 0.10
#: the check-set gain (same traffic) that would justify building per-region slots
BUILD_THRESHOLD = 0.05


def analyse(
    captures: dict,
    *,
    codec: str,
    entry_bytes: int,
    max_overflow: float = MAX_OVERFLOW,
    region_bytes: int = REGION_BYTES,
    show: bool = True,
) -> list[dict]:
    """One row per workload: capacity and overflow per tensor, per region (each), per region (same traffic)."""
    rows = []
    for workload, caps in progress(captures.items(), desc=f"regions ({codec}, E={entry_bytes})", enabled=show):
        sums = dict.fromkeys(
            ("original", "tensor_dev", "tensor_buddy", "each_dev", "each_buddy", "same_dev", "same_buddy"), 0
        )
        regions = 0
        for cap in caps:
            for saved in cap.tensors:
                t = saved.tensor
                nbytes = tensor_bytes(t)
                k = entry_sectors(t, codec, entry_bytes)
                one = place_per_tensor(k, nbytes, entry_bytes, max_overflow)
                each = place_per_region(k, nbytes, entry_bytes, max_overflow, region_bytes)
                same = place_per_region(k, nbytes, entry_bytes, region_bytes=region_bytes, budget_bytes=one.buddy_bytes)
                sums["original"] += nbytes
                for name, placed in (("tensor", one), ("each", each), ("same", same)):
                    sums[f"{name}_dev"] += placed.device_bytes
                    sums[f"{name}_buddy"] += placed.buddy_bytes
                regions += -(-nbytes // region_bytes)
        original = sums["original"]
        row = {"workload": workload, "codec": codec, "entry_bytes": entry_bytes, "region_bytes": region_bytes}
        row.update(original_bytes=original, regions=regions)
        for name in ("tensor", "each", "same"):
            row[f"{name}_device_bytes"] = sums[f"{name}_dev"]
            row[f"{name}_capacity"] = ratio(original, sums[f"{name}_dev"])
            row[f"{name}_overflow"] = sums[f"{name}_buddy"] / original if original else 0.0
        row["gain"] = row["same_capacity"] / row["tensor_capacity"] - 1
        rows.append(row)
    return rows


def _set_summary(name: str, mine: list[dict]) -> dict:
    """A set's geometric-mean capacity each way, the gain of their geomeans, its worst overflow each way."""
    row = {"workload": f"{name} set", "codec": mine[0]["codec"], "entry_bytes": mine[0]["entry_bytes"]}
    for way in ("tensor", "each", "same"):
        row[f"{way}_capacity"] = geomean([r[f"{way}_capacity"] for r in mine])
        row[f"{way}_overflow"] = max(r[f"{way}_overflow"] for r in mine)
    row["gain"] = row["same_capacity"] / row["tensor_capacity"] - 1
    return row


def summarise(rows: list[dict], sets: dict[str, list[str]]) -> list[dict]:
    """Per set: geometric-mean capacity each way, the gain of their geomeans, worst overflow each way."""
    return [_set_summary(name, mine) for name, mine in by_set(rows, sets)]


COLUMNS = [
    ("workload", "workload", ""),
    ("tensor_capacity", "per tensor", ".3f"),
    ("tensor_overflow", "overflow", ".1%"),
    ("each_capacity", "per region (each <=10%)", ".3f"),
    ("each_overflow", "overflow", ".1%"),
    ("same_capacity", "per region (same traffic)", ".3f"),
    ("same_overflow", "overflow", ".1%"),
    ("gain", "gain", "+.1%"),
]


def format_rows(rows: list[dict], summary: list[dict], region_bytes: int = REGION_BYTES) -> str:
    first = (rows or summary)[0]
    title = (
        f"One slot per tensor vs one per {region_bytes >> 10} KiB region, codec {first['codec']}, "
        f"E = {first['entry_bytes']} B, each slot from its own histogram "
        f"(set rows: geomean capacity, worst overflow; gain = same traffic / per tensor)"
    )
    return "\n".join([title, format_table([*rows, *summary], COLUMNS)])


def parse_args(argv):
    from experiments.workloads import CHECK_WORKLOADS, TUNING_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_size_argument(p)
    cli.add_workloads_argument(p, TUNING_WORKLOADS, nargs="*")
    cli.add_workloads_argument(p, CHECK_WORKLOADS, flag="--check", nargs="*")
    cli.add_codec_arguments(p, choices=buddy.available_codecs())
    p.add_argument("--region-bytes", type=int, default=REGION_BYTES)
    cli.add_common_arguments(p, out="results/regions")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args, header = cli.begin("regions", parse_args, argv)
    sets = {"tuning": list(args.workloads), "check": list(args.check)}
    points, captures = cli.capture_workloads(args, list(dict.fromkeys(args.workloads + args.check)))
    show = not args.no_progress
    rows = analyse(captures, codec=args.codec, entry_bytes=args.entry_bytes, region_bytes=args.region_bytes, show=show)
    summary = summarise(rows, sets)
    print()
    print(format_rows(rows, summary, args.region_bytes))
    cli.finish(args, header, rows, summary=summary, experiment="regions", size=args.size, points=list(points))
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    main()
