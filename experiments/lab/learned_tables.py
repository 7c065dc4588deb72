"""What a learned table costs: a codec with a table fitted to each tensor against one fitted to earlier steps.

The experiments size every captured tensor with a table fitted to the tensor
itself (what :func:`buddy.compress` does). A training session instead fits
a key's table to the symbol statistics its tracker learned over earlier
steps (:meth:`buddy.Tracker.prior`), which spares a GPU a device-to-host
read per compress. This measures the difference on the captures: every
tensor seen at the previous capture point under the same key is sized again
with a table fitted to that earlier tensor's statistics. The captures lie
10-20 training steps apart (quick), a session's statistics one step, so
this is an upper bound on what learning costs.

    python -m experiments.lab.learned_tables            # quick, tuning and check sets, the default codec
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import buddy
from experiments import cli
from experiments.analysis import compacted_bytes, ratio, tensor_bytes
from experiments.common import format_table, progress

__all__ = ["analyse", "format_rows", "main"]

TABLE_CODECS = ("fpe", "auto2")


def analyse(captures: dict, *, codec: str, entry_bytes: int, show: bool = True) -> list[dict]:
    """One row per workload: ideal ratio with each tensor's own table and with the previous point's."""
    rows = []
    for workload, caps in progress(captures.items(), desc=f"learned tables ({codec}, E={entry_bytes})", enabled=show):
        earlier: dict[str, tuple] = {}  # key -> (dtype, statistics) at the previous point
        original = tensors = 0
        own = learned = 0.0
        for cap in caps:
            now = {}
            for saved in cap.tensors:
                t = saved.tensor
                measured = buddy.measure(t, codec, entry_bytes=entry_bytes)
                now[saved.key] = (t.dtype, measured.statistics)
                before = earlier.get(saved.key)
                if before is None or before[0] != t.dtype:
                    continue  # a new key: a session fits its first step to the tensor too
                prior = buddy.measure(t, codec, entry_bytes=entry_bytes, prior=before[1].double())
                original += tensor_bytes(t)
                own += compacted_bytes(measured.histogram)
                learned += compacted_bytes(prior.histogram)
                tensors += 1
            earlier = now
        rows.append(
            {
                "workload": workload,
                "codec": codec,
                "entry_bytes": entry_bytes,
                "tensors": tensors,
                "original_bytes": original,
                "own_ratio": ratio(original, own),
                "learned_ratio": ratio(original, learned),
                "cost": learned / own - 1 if own else 0.0,
            }
        )
    return rows


COLUMNS = [
    ("workload", "workload", ""),
    ("tensors", "tensors", "d"),
    ("own_ratio", "own table", ".3f"),
    ("learned_ratio", "previous point's table", ".3f"),
    ("cost", "more bytes", "+.2%"),
]


def format_rows(rows: list[dict]) -> str:
    first = rows[0]
    title = (
        f"Ideal ratio of {first['codec']}@{first['entry_bytes']} with each tensor's own table and with the table "
        f"fitted to the same key at the previous capture point"
    )
    return "\n".join([title, format_table(rows, COLUMNS)])


def parse_args(argv):
    from experiments.workloads import CHECK_WORKLOADS, TUNING_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_size_argument(p)
    cli.add_workloads_argument(p, [*TUNING_WORKLOADS, *CHECK_WORKLOADS], nargs="*")
    default = buddy.defaults().codec
    cli.add_codec_arguments(
        p,
        default=default if default in TABLE_CODECS else "auto2",
        choices=TABLE_CODECS,
        help="a codec with a table (default: the default codec if it has one, else auto2)",
    )
    cli.add_common_arguments(p, out="results/learned_tables")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args, header = cli.begin("lab.learned_tables", parse_args, argv)
    points, captures = cli.capture_workloads(args)
    rows = analyse(captures, codec=args.codec, entry_bytes=args.entry_bytes, show=not args.no_progress)
    print()
    print(format_rows(rows))
    cli.finish(args, header, rows, experiment="learned_tables", size=args.size, points=list(points))
    return rows


if __name__ == "__main__":
    main()
