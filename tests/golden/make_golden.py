"""Write a set of golden vectors: ``python tests/golden/make_golden.py 1|2|2t2|3``.

The vectors pin the bytes every codec writes: for each input (a dtype, an
entry size and a kind of data) and each codec of the version, the metadata,
the table (format version 2), and for two slots the slot and overflow bytes. ``tests/test_golden.py`` compresses the
stored inputs again and compares byte for byte, and decodes the stored
buffers back to the inputs. Run this only to add a set: regenerating an
existing one after a change to a codec would hide that the format moved.

The sets: ``1`` (``format_v1``: format version 1's codecs), ``2``
(``format_v2``: version 2's, written when their tables were of table format
1 -- decoded still, no longer written), ``2t2`` (``format_v2_table2``:
version 2 with tables of format 2 -- decoded still, no longer written) and
``3`` (``format_v3``: version 3, tables of format 3 and the split payload
layout, what a fit makes now).

The inputs are made with NumPy's seeded generator and stored, so the
vectors do not depend on how any library draws random numbers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import buddy  # noqa: E402
from buddy import spec  # noqa: E402

#: the codecs of each format version (version 1's file was written before version 2 existed)
CODECS = {1: ("raw", "zvc", "fpx", "bpc", "auto"), 2: ("fpe", "auto2"), 3: ("fpe", "auto2")}
#: set -> (file stem, format version)
SETS = {"1": ("format_v1", 1), "2": ("format_v2", 2), "2t2": ("format_v2_table2", 2), "3": ("format_v3", 3)}
#: (dtype name, entry bytes): every word size, E from 32 B to 4 KiB
LAYOUTS = (
    ("float32", 128),
    ("float32", 512),
    ("bfloat16", 512),
    ("float16", 256),
    ("float64", 4096),
    ("uint8", 32),
    ("int32", 1024),
)
KINDS = ("relu", "dense", "special", "random", "structured")
#: bytes of each input: never a multiple of the entry size (the last entry is padded)
INPUT_BYTES = 2072


def _floats(rng: np.random.Generator, n: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    x = rng.standard_normal(n) * 3.0
    if kind == "relu":
        x = np.maximum(x, 0.0)
    t = torch.from_numpy(x).to(dtype)
    if kind == "special":
        bits = torch.empty((), dtype=dtype).element_size() * 8
        ints = t.view({16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]).clone()
        mant = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}[dtype]
        inf = ((1 << (bits - 1 - mant)) - 1) << mant
        sign = -(1 << (bits - 1))
        patterns = [inf, sign | inf, inf | 1, inf | (1 << (mant - 1)) | 5, sign, 1, (1 << mant) - 1, sign | 1]
        where = torch.from_numpy(rng.choice(n, size=n // 4, replace=False))
        ints[where] = torch.tensor(patterns, dtype=ints.dtype)[torch.arange(where.numel()) % len(patterns)]
        t = ints.view(dtype)
    return t


def make_input(dtype_name: str, kind: str, seed: int) -> torch.Tensor:
    """A deterministic 1-D tensor of about :data:`INPUT_BYTES` bytes."""
    dtype = getattr(torch, dtype_name)
    size = torch.empty((), dtype=dtype).element_size()
    n = INPUT_BYTES // size
    rng = np.random.default_rng(seed)
    if kind == "random":
        return torch.from_numpy(rng.integers(0, 256, n * size, dtype=np.uint8)).view(dtype)
    if kind == "structured":  # zero runs, constants and ramps: every bpc code, zvc's sparse entries
        ramp = np.arange(n) % 97
        block = (np.arange(n) // 37) % 4
        values = np.where(block == 0, 0, np.where(block == 1, 7, np.where(block == 2, ramp, -ramp)))
        if dtype.is_floating_point:
            return torch.from_numpy(values.astype(np.float64) / 8).to(dtype)
        return torch.from_numpy(values).to(dtype)
    if dtype.is_floating_point:
        return _floats(rng, n, dtype, kind)
    x = rng.standard_normal(n) * 1000
    if kind == "relu":
        x = np.maximum(x, 0)
    return torch.from_numpy(x.astype(np.int64)).to(dtype)


def slots_for(entry_bytes: int) -> tuple[int, int]:
    """Two slots per case: half an entry (moderate overflow) and one sector (heavy overflow)."""
    return spec.sectors_per_entry(entry_bytes) // 2, 1


def main(which: str) -> None:
    stem, version = SETS[which]
    store = buddy.BuddyStore(capacity_bytes=1 << 30, pin=False)
    arrays: dict[str, np.ndarray] = {}
    cases = []
    seed = 0
    for dtype_name, entry_bytes in LAYOUTS:
        for kind in KINDS:
            seed += 1
            name = f"{dtype_name}-E{entry_bytes}-{kind}"
            t = make_input(dtype_name, kind, seed)
            arrays[f"{name}/input"] = t.view(torch.uint8).numpy().copy()
            for codec in CODECS[version]:
                case = {"input": name, "dtype": dtype_name, "entry_bytes": entry_bytes, "codec": codec, "slots": []}
                for slot in slots_for(entry_bytes):
                    ratio = spec.ratio_for_slot(slot, entry_bytes)
                    bt = buddy.compress(t, target_ratio=ratio, codec=codec, entry_bytes=entry_bytes, store=store)
                    assert bt.slot_sectors == slot and bt.format_version == version
                    meta, slots, overflow = (b.clone().numpy() for b in bt.buffers())
                    key = f"{name}/{codec}"
                    arrays[f"{key}/meta"] = meta
                    if bt.table is not None:
                        arrays[f"{key}/table"] = bt.table.clone().numpy()
                    arrays[f"{key}/s{slot}/slots"] = slots
                    arrays[f"{key}/s{slot}/overflow"] = overflow
                    case["slots"].append(slot)
                    bt.free()
                cases.append(case)
    np.savez_compressed(HERE / f"{stem}.npz", **arrays)
    (HERE / f"{stem}.json").write_text(json.dumps({"format_version": version, "cases": cases}, indent=1) + "\n")
    print(f"{len(cases)} cases, {sum(a.nbytes for a in arrays.values()):,} bytes")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in SETS:
        sys.exit("usage: python tests/golden/make_golden.py 1|2|2t2|3  (the set of vectors to write)")
    main(sys.argv[1])
