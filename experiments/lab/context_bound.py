"""What context could add to the float-field bound: is there more to code than each value's own fields?

``fpe`` with a table of format 1 codes each word's sign and exponent and
passes its mantissa through, so the order-0 **float-field entropy** (sign and exponent
as one symbol, the mantissa in pieces of up to 16 bits, each on its own:
:func:`experiments.analysis.field_entropy_bits`) bounds what a coder of
that kind reaches. This measures two contexts a richer codec could use,
each an ideal (conditional entropy, no table cost) on every float tensor
the workloads save:

* **previous symbol**: a word's sign and exponent given the previous word's
  (neighbours in memory: a row of a feature map, a hidden vector);
* **+ mantissa top**: in addition, the mantissa's top 4 bits given the
  word's own sign and exponent (the rest of the mantissa as before). Table
  format 2 takes this part: its symbols are sign, exponent and the
  mantissa's top 3 bits.

A ratio here is the tensor's bits over the bound's. If neither context adds
much over order-0, no coder of single values and their neighbours gets
further, and a higher capacity has to come from elsewhere (larger entries,
overflow).

    python -m experiments.lab.context_bound             # quick, tuning and check sets
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from experiments import cli
from experiments.analysis import FLOAT_FIELDS, field_entropy_bits, order0_bits, ratio
from experiments.common import by_set, format_table, geomean, progress

__all__ = ["context_bits", "analyse", "main"]

#: mantissa bits the second context codes given the word's sign and exponent
TOP_BITS = 4


def _conditional_bits(a: torch.Tensor, b: torch.Tensor, na: int, nb: int) -> float:
    """Total bits of ``a`` given ``b`` (symbols in ``[0, na)`` and ``[0, nb)``): H(a, b) - H(b), order 0."""
    return order0_bits(b * na + a, na * nb) - order0_bits(b, nb)


def context_bits(t: torch.Tensor) -> dict[str, float] | None:
    """Total bits of a float tensor under the order-0 field bound and the two contexts (``None``: not a float)."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype not in FLOAT_FIELDS or t.numel() == 0:
        return None
    e, m = FLOAT_FIELDS[t.dtype]
    word = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    w = t.view(word).to(torch.int64)
    n_sym = 1 << (1 + e)
    sym = (w >> m) & (n_sym - 1)
    order0 = field_entropy_bits(t) * t.numel()
    symbol0 = order0_bits(sym, n_sym)
    previous = torch.cat([sym.new_zeros(1), sym[:-1]])
    with_previous = order0 - symbol0 + _conditional_bits(sym, previous, n_sym, n_sym)
    # the bound codes the mantissa's top piece P (up to 16 bits) at H(P) = H(top) + H(rest of P | top): given
    # the symbol, the top bits cost H(top | symbol) instead of H(top), the rest the same
    top = (w >> (m - TOP_BITS)) & ((1 << TOP_BITS) - 1)
    with_top = with_previous - order0_bits(top, 1 << TOP_BITS) + _conditional_bits(top, sym, 1 << TOP_BITS, n_sym)
    return {"order0": order0, "previous": with_previous, "top": with_top}


def analyse(captures: dict, *, show: bool = True) -> list[dict]:
    """One row per workload: the tensors' ratio under each bound (float tensors only)."""
    rows = []
    for workload, caps in progress(captures.items(), desc="context bounds", enabled=show):
        total = {"bits": 0.0, "order0": 0.0, "previous": 0.0, "top": 0.0}
        for cap in caps:
            for saved in cap.tensors:
                bits = context_bits(saved.tensor)
                if bits is None:
                    continue
                total["bits"] += saved.tensor.numel() * saved.tensor.element_size() * 8
                for k, v in bits.items():
                    total[k] += v
        rows.append(
            {
                "workload": workload,
                "order0_ratio": ratio(total["bits"], total["order0"]),
                "previous_ratio": ratio(total["bits"], total["previous"]),
                "top_ratio": ratio(total["bits"], total["top"]),
                "gain": total["order0"] / total["top"] - 1 if total["top"] else 0.0,
            }
        )
    return rows


def _set_row(name: str, mine: list[dict]) -> dict:
    """The geometric means of a set's rows."""
    row: dict[str, Any] = {"workload": f"{name} set"}
    for k in ("order0_ratio", "previous_ratio", "top_ratio"):
        row[k] = geomean([r[k] for r in mine])
    row["gain"] = row["top_ratio"] / row["order0_ratio"] - 1
    return row


def with_sets(rows: list[dict], sets: dict[str, list[str]]) -> list[dict]:
    """``rows`` and a geometric-mean row per set (of the workloads it has)."""
    return [*rows, *(_set_row(name, mine) for name, mine in by_set(rows, sets))]


COLUMNS = [
    ("workload", "workload", ""),
    ("order0_ratio", "order-0 fields", ".3f"),
    ("previous_ratio", "+ previous symbol", ".3f"),
    ("top_ratio", f"+ mantissa top {TOP_BITS} | symbol", ".3f"),
    ("gain", "gain", "+.1%"),
]


def parse_args(argv):
    from experiments.workloads import CHECK_WORKLOADS, TUNING_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_size_argument(p)
    cli.add_workloads_argument(p, [*TUNING_WORKLOADS, *CHECK_WORKLOADS], nargs="*")
    cli.add_common_arguments(p, out="results/context_bound")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    from experiments.workloads import CHECK_WORKLOADS, TUNING_WORKLOADS

    args, header = cli.begin("lab.context_bound", parse_args, argv)
    points, captures = cli.capture_workloads(args)
    rows = analyse(captures, show=not args.no_progress)
    rows = with_sets(rows, {"tuning": list(TUNING_WORKLOADS), "check": list(CHECK_WORKLOADS)})
    print()
    print("Ratio of an ideal coder of the float tensors' fields, without and with context (bits / conditional entropy)")
    print(format_table(rows, COLUMNS))
    cli.finish(args, header, rows, experiment="context_bound", size=args.size, points=list(points))
    return rows


if __name__ == "__main__":
    main()
