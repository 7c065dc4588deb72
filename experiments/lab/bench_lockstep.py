"""The lockstep layout's decoder against fpe's unpack on a GPU: what the shared memory it saves buys.

docs/format-v3.md ("A layout for one walk") weighs a layout whose decoder
(``buddy_fpe_lockstep_decode``, codec_fpe.h's ``decode_lockstep``) runs as
many instructions as the split layout's unpack but needs half its shared
memory a warp (no output staging), so about twice the warps fit an SM. Only
a GPU says what that is worth; this measures it.

On ``--mib`` MiB of real activations of each dtype (those of
:func:`experiments.bench_cuda.activation_bytes`), the coded entries at 4 KiB
(the fpe table fitted to the whole tensor):

* **split:** ``buddy.compress(..., codec="fpe")`` of those entries on the
  GPU, then ``decompress`` timed -- fpe's unpack, and the engine's few small
  launches around it;
* **lockstep:** the same entries in the lockstep layout (their streams made on
  the CPU by :func:`experiments.lab.fpe_lanes.lockstep_payloads`), decoded by
  ``buddy_fpe_lockstep_decode`` with as many warps a block as its shared
  memory allows (32 at most) and a block an SM, the kernel alone timed.

Both are checked byte for byte against the entries. Timing: CUDA events, the
median of ``--repeats`` after ``--warmup``. GPU only: without one it says
so after preparing the streams (which need no GPU) and exits.

    python -m experiments.lab.bench_lockstep --mib 32 --out results/lockstep
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

import buddy
from buddy.codecs import fpe, fpe_device
from buddy.engines import cuda as bcuda
from buddy.engines import sources as bsources
from buddy.engines.tuning import Tuning
from experiments.bench_codecs import timed
from experiments.common import start
from experiments.lab.fpe_lanes import lockstep_payloads

__all__ = ["Prepared", "main"]

ENTRY = 4096
GB = 1e9


class Prepared:
    """A dtype's coded entries (``(n, E)`` uint8), its fpe table, and their lockstep payloads and sectors; made on
    the CPU (no GPU needed)."""

    def __init__(self, x: torch.Tensor, chunk: int = 1024):
        self.dtype, self.word = x.dtype, x.element_size()
        word = self.word
        flat = x.detach().reshape(-1).view(torch.uint8).cpu()
        everything = flat[: flat.numel() // ENTRY * ENTRY].view(-1, ENTRY)
        self.table = fpe.Table.from_counts(fpe.symbol_counts(flat, word), word)
        codec = fpe.FPECodec(self.table)
        sectors = codec.analyse(everything, word).sectors
        coded = (sectors > 0) & (sectors < ENTRY // 32) & (everything != 0).any(1)  # (the format's zero entries: none)
        self.entries = everything[coded].contiguous()
        parts, ks = [], []
        for at in range(0, self.entries.shape[0], chunk):  # (the simulation holds a chunk's bits at a time)
            analysis = codec.analyse(self.entries[at : at + chunk], word)
            parts.append(lockstep_payloads(analysis, self.table))
            ks.append(analysis.sectors.to(torch.int32))
        empty = np.zeros((0, ENTRY + 32), np.uint8)
        self.payloads = torch.from_numpy(np.concatenate(parts) if parts else empty)
        self.sectors = torch.cat(ks) if ks else torch.zeros(0, dtype=torch.int32)


def _gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / GB


def _lockstep_kernel(word: int, device: torch.device, shared: int):
    """``buddy_fpe_lockstep_decode`` of fpe's module for ``word``-byte words, compiled for ``device`` (NVRTC through
    CuPy, as the loader compiles its kernels: the same source and options) and allowed ``shared`` bytes."""
    import cupy

    options = bsources.compile_options(ENTRY, "fpe", word, shared_tables=True)
    with cupy.cuda.Device(device.index):
        module = cupy.RawModule(code=bsources.translation_unit(), options=options)
        kernel = module.get_function("buddy_fpe_lockstep_decode")
        if shared > 48 << 10:  # beyond the default a block may ask for: opt in
            kernel.max_dynamic_shared_size_bytes = shared
    return kernel


def time_lockstep(prep: Prepared, device: torch.device, repeats: int, warmup: int) -> dict[str, Any]:
    """``buddy_fpe_lockstep_decode`` on the prepared payloads: its GB/s (of decoded bytes) and launch."""
    import cupy

    limits = bcuda.device_shared_memory(device, Tuning())
    if limits is None:
        raise RuntimeError(f"no shared memory figures for {device}")
    warps = max(1, min(32, (limits.per_block - fpe_device.DECODE_ROWS_BYTES) // (ENTRY + 32)))
    shared = fpe_device.DECODE_ROWS_BYTES + warps * (ENTRY + 32)
    blocks = limits.sms * max(1, limits.blocks_per_sm(shared, warps))
    kernel = _lockstep_kernel(prep.word, device, shared)
    payloads, sectors = prep.payloads.to(device), prep.sectors.to(device)
    table = fpe_device.device_table(prep.table).to(device)
    out = torch.empty_like(prep.entries, device=device)
    error = torch.zeros(1, dtype=torch.int32, device=device)
    args = (np.uint64(payloads.data_ptr()), np.uint64(sectors.data_ptr()), np.int64(prep.entries.shape[0]),
            np.uint64(out.data_ptr()), np.uint64(error.data_ptr()), np.uint64(table.data_ptr()), np.int32(prep.word))

    def run() -> None:
        with cupy.cuda.Device(device.index), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (CuPy 14: ExternalStream)
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device.index)
            kernel((blocks,), (warps * 32,), args, stream=stream, shared_mem=shared)

    times = timed(run, repeats, device, warmup=warmup)
    exact = bool(torch.equal(out.cpu(), prep.entries)) and int(error.item()) == 0
    return {"gbps": _gbps(prep.entries.numel(), times), "warps_a_block": warps, "blocks": blocks,
            "shared_bytes": shared, "exact": exact}  # fmt: skip


def time_split(prep: Prepared, device: torch.device, repeats: int, warmup: int) -> dict[str, Any]:
    """fpe's compress of the same entries on the GPU, then its decompress timed (unpack and the engine around it)."""
    x = prep.entries.to(device).view(-1).view(prep.dtype)
    bt = buddy.compress(x, codec="fpe")
    exact = bool(torch.equal(bt.decompress(check=True).view(-1).view(torch.uint8).cpu(), prep.entries.view(-1)))
    times = timed(lambda: bt.decompress(check=False), repeats, device, warmup=warmup)
    return {"gbps": _gbps(prep.entries.numel(), times), "backend": bt.backend, "exact": exact}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_lockstep", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=32, help="MiB of activations per dtype (default 32)")
    p.add_argument("--size", default="quick", help="workload size the activations come from (default quick)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("results/lockstep"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from experiments.bench_cuda import activation_bytes

    args = parse_args(argv)
    header = start("lab.bench_lockstep", sys.argv[1:] if argv is None else list(argv))
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    rows: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        prep = Prepared(activation_bytes(dtype, args.mib, device, size=args.size))
        name = str(dtype).removeprefix("torch.")
        print(f"{name}: {prep.entries.shape[0]} coded entries of 4 KiB, their lockstep streams made", flush=True)
        if not gpu:
            continue
        row: dict[str, Any] = {"dtype": name, "entries": prep.entries.shape[0],
               "split": time_split(prep, device, args.repeats, args.warmup),
               "lockstep": time_lockstep(prep, device, args.repeats, args.warmup)}  # fmt: skip
        print(f"  split (fpe unpack, engine) {row['split']['gbps']:.0f} GB/s, exact {row['split']['exact']}; "
              f"lockstep kernel {row['lockstep']['gbps']:.0f} GB/s ({row['lockstep']['warps_a_block']} warps a "
              f"block), exact {row['lockstep']['exact']}", flush=True)  # fmt: skip
        rows.append(row)
    if not gpu:
        raise SystemExit("bench_lockstep: no CUDA GPU: the streams are made; timing them needs a GPU")
    result = {**header, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    if not all(r["split"]["exact"] and r["lockstep"]["exact"] for r in rows):
        raise SystemExit("bench_lockstep: a decode was not exact (results written)")
    return result


if __name__ == "__main__":
    main()
