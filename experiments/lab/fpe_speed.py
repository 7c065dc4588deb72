"""CPU speed of fpe's torch reference (the oracle and the CPU path) on real activations, by table format.

For each tensor of :func:`experiments.data.activation_tensors` (float32, and
the same values as bfloat16) it fits the fpe table, encodes every entry of E
bytes (:func:`buddy.format.encode`: measure and encode) and decodes them
again (:func:`buddy.format.decode_entries`), checks the round trip byte for
byte, and prints input bytes per second (decimal MB/s, the fastest of
``--repeats`` timed runs after a warm-up: the machines these run on are
shared) for each table format asked for.

    python -m experiments.lab.fpe_speed                    # every format of 12-bit symbols (2 and 3)
    python -m experiments.lab.fpe_speed --formats 2 --mib 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import buddy
from buddy import env
from buddy.codecs import fpe
from experiments.data import activation_tensors

__all__ = ["main"]


def _time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` runs after a warm-up: on a shared machine, the run least slowed by others."""
    fn()  # warm-up: lookup tables, allocator
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entry-bytes", type=int, default=4096)
    p.add_argument("--mib", type=float, default=2.0, help="MiB of each tensor timed (its first bytes)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--formats", type=int, nargs="+", default=None, help="table formats (default: those a fit makes)")
    args = p.parse_args(argv)
    formats = args.formats or [f for f in fpe.TABLE_FORMATS if f >= 2]
    print({k: v for k, v in env.environment().items() if k in ("torch", "python", "cpu", "torch_threads")})
    rows = []
    for name, t in activation_tensors("quick").items():
        for dtype in (torch.float32, torch.bfloat16):
            flat = t.to(dtype).reshape(-1).view(torch.uint8)
            n = int(args.mib * 2**20) // args.entry_bytes
            entries = flat[: n * args.entry_bytes].view(n, args.entry_bytes)
            word = buddy.spec.word_bytes(dtype)
            counts = fpe.symbol_counts(entries.reshape(-1), word)
            for table_format in formats:
                codec = fpe.FPECodec(fpe.Table.from_counts(counts, word, table_format=table_format))
                payload, k, modes = buddy.format.encode(codec, entries, word)
                out = buddy.format.decode_entries(codec, payload, k, modes, word)
                if not torch.equal(out, entries):
                    raise RuntimeError(f"{name} {dtype} format {table_format}: the round trip differs")
                enc = _time(lambda c=codec: buddy.format.encode(c, entries, word), args.repeats)
                dec = _time(lambda c=codec, p=payload, k=k, m=modes: buddy.format.decode_entries(c, p, k, m, word),
                            args.repeats)  # fmt: skip
                row = {
                    "tensor": name, "dtype": str(dtype).removeprefix("torch."), "table_format": table_format,
                    "ratio": entries.numel() / (32 * float(k.sum())), "encode_MBps": entries.numel() / enc / 1e6,
                    "decode_MBps": entries.numel() / dec / 1e6,
                }  # fmt: skip
                rows.append(row)
                print(f"{name:>10} {row['dtype']:>8} format {table_format}: ratio {row['ratio']:.3f}  "
                      f"encode {row['encode_MBps']:.1f} MB/s  decode {row['decode_MBps']:.1f} MB/s", flush=True)  # fmt: skip
    for table_format in formats:
        mine = [r for r in rows if r["table_format"] == table_format]
        enc = statistics.geometric_mean(r["encode_MBps"] for r in mine)
        dec = statistics.geometric_mean(r["decode_MBps"] for r in mine)
        print(f"format {table_format}: geometric mean encode {enc:.1f} MB/s, decode {dec:.1f} MB/s")
    return rows


if __name__ == "__main__":
    main()
