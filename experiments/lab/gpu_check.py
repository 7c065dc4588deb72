"""The GPU session's first check: golden vectors through every kernel both ways, bytes compared.

Run on a CUDA machine with the kernels (``--backend cuda``, the default):

* **decode**: every golden set in ``tests/golden/`` (``format_v1``,
  ``format_v2`` with table format 1, ``format_v2_table2``): the kernels
  decode the buffers the reference wrote -- metadata, slots and table on the
  device, overflow in host memory -- and must give back the input, byte for
  byte;
* **encode**: the kernels compress each golden input at each golden slot and
  must write the golden metadata, slots, overflow and (fitted on the device)
  table, byte for byte -- for every set today's codecs still write (a set
  whose tables are of an older table format is decoded only);
* **tables**: the table ``fpe`` and ``auto2`` fit on the device, and the
  histogram, against the host reference's, on every word size;
* **codecs**: a compress of real-looking data (ReLU of a normal sample, fp32
  and bf16) per codec with kernels, against the host reference's buffers, and
  its round trip with ``check=True``.

``raw`` has no kernels: its golden cases run on the reference (on the device),
and say so. ``--device cpu --backend reference`` runs every check with the
torch reference on the host: what the tests use to check this script.

``--compile-only`` compiles (or loads from CuPy's on-disk cache) the kernel
modules a GPU session needs, in parallel processes, and reports the seconds:
later processes of the session then find them compiled.

    python -m experiments.lab.gpu_check --json results/gpu/check.json
    python -m experiments.lab.gpu_check --compile-only --jobs 16

Writes JSON (``--json``): environment, command, every check's counts and
what differed; exits 1 when anything differed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy
import torch

import buddy
from buddy.engines import cuda as bcuda
from buddy.engines import sources as bsources
from buddy import env, spec
from buddy.codecs.fpe import TABLE_FORMAT
from buddy.deps import require, require_cuda
from buddy.errors import MissingDependencyError
from buddy.layout import WORD_SIZES
from experiments.common import command_line

__all__ = ["GOLDEN", "COMPILE_ENTRY_BYTES", "Check", "golden_sets", "run_checks", "compile_modules", "main"]

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden"
#: the entry sizes whose modules a session compiles up front: the golden vectors' (which include the
#: tests' 128, 512 and the default 4096)
COMPILE_ENTRY_BYTES = (32, 128, 256, 512, 1024, 4096)
MiB = 1 << 20


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bytes (dtype, shape and device aside)."""
    x = a.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    y = b.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return x.numel() == y.numel() and torch.equal(x, y)


@dataclass
class Check:
    """One kind of check: how many comparisons ran, and which differed (or failed)."""

    name: str
    checked: int = 0
    differ: list[str] = field(default_factory=list)
    backends: dict[str, int] = field(default_factory=dict)

    def compare(self, what: str, ok: bool, backend: str) -> None:
        self.checked += 1
        self.backends[backend] = self.backends.get(backend, 0) + 1
        if not ok:
            self.differ.append(what)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "checked": self.checked, "differ": self.differ, "backends": self.backends}


# ---- golden vectors ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GoldenSet:
    name: str
    format_version: int
    cases: list[dict[str, Any]]
    vectors: dict[str, numpy.ndarray]

    def get(self, key: str) -> torch.Tensor:
        return torch.from_numpy(self.vectors[key].copy())


def golden_sets(folder: Path = GOLDEN) -> list[GoldenSet]:
    """Every ``<set>.json`` + ``<set>.npz`` pair in ``folder``, by name."""
    sets = []
    for index in sorted(folder.glob("*.json")):
        meta = json.loads(index.read_text())
        with numpy.load(index.with_suffix(".npz")) as data:
            vectors = {k: data[k] for k in data.files}
        sets.append(GoldenSet(index.stem, meta["format_version"], meta["cases"], vectors))
    if not sets:
        raise FileNotFoundError(f"no golden vectors (<set>.json and <set>.npz) in {folder}")
    return sets


def _backend_for(codec: str, backend: str) -> str:
    """``backend``, except for a codec without kernels when the kernels were asked for: the reference."""
    return backend if backend != "cuda" or codec in bsources.KERNEL_CODECS else "reference"


def _case_slots(golden: GoldenSet, case: dict[str, Any]) -> Iterator[tuple[str, int, str, torch.Tensor | None]]:
    """``(id, slot, key, table)`` of each slot of a case."""
    key = f"{case['input']}/{case['codec']}"
    table = golden.get(f"{key}/table") if f"{key}/table" in golden.vectors else None
    for slot in case["slots"]:
        yield f"{golden.name}/{key}/s{slot}", slot, key, table


def written_today(golden: GoldenSet, case: dict[str, Any]) -> bool:
    """Whether today's codecs write this case's bytes: no table, or a table of today's table format."""
    key = f"{case['input']}/{case['codec']}/table"
    return key not in golden.vectors or int(golden.vectors[key][0]) == TABLE_FORMAT


def check_decode(golden: GoldenSet, device: torch.device, backend: str, check: Check) -> None:
    """The golden buffers decoded on ``device``: the input, byte for byte."""
    for case in golden.cases:
        dtype = getattr(torch, case["dtype"])
        want = golden.get(f"{case['input']}/input").view(dtype)
        run_on = _backend_for(case["codec"], backend)
        for what, slot, key, table in _case_slots(golden, case):
            out = buddy.unpack(
                golden.get(f"{key}/meta").to(device),
                golden.get(f"{key}/s{slot}/slots").to(device),
                golden.get(f"{key}/s{slot}/overflow"),  # buddy memory: the host
                codec=case["codec"],
                entry_bytes=case["entry_bytes"],
                slot_sectors=slot,
                shape=want.shape,
                dtype=dtype,
                table=None if table is None else table.to(device),
                backend=run_on,
            )
            check.compare(what, _same(out, want), run_on)


def check_encode(golden: GoldenSet, device: torch.device, backend: str, store: buddy.BuddyStore, check: Check) -> None:
    """Each golden input compressed on ``device`` at each golden slot: the golden buffers, byte for byte."""
    for case in golden.cases:
        if not written_today(golden, case):
            continue
        dtype = getattr(torch, case["dtype"])
        t = golden.get(f"{case['input']}/input").view(dtype).to(device)
        run_on = _backend_for(case["codec"], backend)
        for what, slot, key, table in _case_slots(golden, case):
            ratio = spec.ratio_for_slot(slot, case["entry_bytes"])
            bt = buddy.compress(t, ratio, case["codec"], entry_bytes=case["entry_bytes"], store=store, backend=run_on)
            meta, slots, overflow = bt.buffers()
            ok = (
                bt.slot_sectors == slot
                and _same(meta, golden.get(f"{key}/meta"))
                and _same(slots, golden.get(f"{key}/s{slot}/slots"))
                and _same(overflow, golden.get(f"{key}/s{slot}/overflow"))
                and (table is None) == (bt.table is None)
                and (table is None or bt.table is None or _same(bt.table, table))
            )
            check.compare(what, ok, run_on)
            bt.free()


# ---- tables and codecs against the host reference ------------------------------------------------
def _relu(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(numel, generator=g, dtype=torch.float64)).to(dtype)


def check_tables(device: torch.device, backend: str, check: Check, numel: int) -> None:
    """Tables and histograms measured on ``device`` against the host reference's, per word size."""
    for i, dtype in enumerate((torch.bfloat16, torch.float32, torch.float64, torch.uint8)):
        host = _relu(numel, dtype, seed=i)
        on_device = host.to(device)
        for codec in ("fpe", "auto2"):
            m = buddy.measure(on_device, codec, backend=backend)
            r = buddy.measure(host, codec, backend="reference")
            name = f"{codec}/{str(dtype).removeprefix('torch.')}"
            ok = m.table is not None and r.table is not None and _same(m.table, r.table)
            check.compare(f"{name}: table", ok, backend)
            check.compare(f"{name}: histogram", m.histogram == r.histogram, backend)
            reads = getattr(m.engine, "readbacks", None)
            if backend == "cuda":
                check.compare(f"{name}: one host read per measure (made {reads})", reads == 1, backend)


def check_codecs(device: torch.device, backend: str, store: buddy.BuddyStore, check: Check, numel: int) -> None:
    """Each codec with kernels on ReLU data: the host reference's buffers, and an exact round trip."""
    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        host = _relu(numel, dtype, seed=10 + i)
        x = host.to(device)
        for codec in bsources.KERNEL_CODECS:
            name = f"{codec}/{str(dtype).removeprefix('torch.')}"
            bt = buddy.compress(x, codec=codec, store=store, backend=backend)
            ref = buddy.compress(host, codec=codec, store=store, backend="reference")
            same = bt.slot_sectors == ref.slot_sectors and all(_same(a, b) for a, b in zip(bt.buffers(), ref.buffers()))
            same = same and (bt.table is None) == (ref.table is None)
            same = same and (bt.table is None or ref.table is None or _same(bt.table, ref.table))
            check.compare(f"{name}: buffers", same, backend)
            check.compare(f"{name}: round trip", _same(bt.decompress(check=True), x), backend)
            bt.free()
            ref.free()


def run_checks(
    device: torch.device,
    backend: str,
    *,
    golden: Path = GOLDEN,
    numel: int = 262_147,
    log: Callable[[str], None] = print,
) -> list[Check]:
    """Every check on ``device`` with ``backend``; each :class:`Check` lists what differed."""
    store = buddy.BuddyStore(capacity_bytes=512 * MiB, pin=device.type == "cuda")
    work: list[tuple[str, Callable[[Check], None]]] = []
    for g in golden_sets(golden):
        work.append((f"golden {g.name} decode", functools.partial(check_decode, g, device, backend)))
        work.append((f"golden {g.name} encode", functools.partial(check_encode, g, device, backend, store)))
    work.append(("tables", lambda c: check_tables(device, backend, c, numel)))
    work.append(("codecs", lambda c: check_codecs(device, backend, store, c, numel)))
    checks = []
    for name, run in work:
        check = Check(name)
        start = time.perf_counter()
        run(check)
        checks.append(check)
        log(_summary(check, time.perf_counter() - start))
    return checks


def _summary(check: Check, seconds: float) -> str:
    on = ", ".join(f"{n} on {b}" for b, n in check.backends.items())
    bad = f"{len(check.differ)} DIFFER: {', '.join(check.differ[:5])}" if check.differ else "all equal"
    if not check.checked:
        bad = "nothing to compare (a set today's codecs no longer write)"
    return f"  {check.name:<34} {check.checked:5d} compared ({on}): {bad}  [{seconds:.1f} s]"


# ---- compiling the modules up front -------------------------------------------------------------
def _compile_one(job: tuple[str, int, int]) -> tuple[str, int, int, float]:
    codec, entry_bytes, word_bytes = job
    start = time.perf_counter()
    bcuda.compile_module(codec, entry_bytes, torch.device("cuda", 0), word_sizes=(word_bytes,))
    return codec, entry_bytes, word_bytes, time.perf_counter() - start


def compile_modules(codecs: Sequence[str], entry_sizes: Sequence[int], jobs: int) -> list[dict[str, Any]]:
    """Compile every (codec, entry size, word size) module, ``jobs`` processes at once; rows with the seconds each
    took.

    CuPy keeps what it compiled in its on-disk cache (``CUPY_CACHE_DIR``), so
    later processes on this machine load the modules instead of compiling
    them. The first module is compiled here, in this process, so that a
    machine without CUDA or CuPy fails before any worker starts.
    """
    work = [(c, e, w) for c in codecs for e in entry_sizes for w in WORD_SIZES]  # a module each, as the loader
    if not work:
        return []
    rows = [_compile_one(work[0])]
    if len(work) > 1:
        with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=get_context("spawn")) as pool:
            rows += list(pool.map(_compile_one, work[1:]))
    return [{"codec": c, "entry_bytes": e, "word_bytes": w, "seconds": s} for c, e, w, s in rows]


# ---- the command line ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="where the checks run (default cuda)")
    p.add_argument(
        "--backend", choices=("cuda", "reference"), default="cuda", help="what runs the codecs (default cuda)"
    )
    p.add_argument("--golden", type=Path, default=GOLDEN, help="folder of golden vectors (default tests/golden)")
    p.add_argument("--numel", type=int, default=262_147, help="elements of the table and codec checks' tensors")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--compile-only", action="store_true", help="only compile the kernel modules (and time them)")
    p.add_argument("--codecs", nargs="+", choices=list(bsources.KERNEL_CODECS), default=list(bsources.KERNEL_CODECS))
    p.add_argument("--entry-bytes", nargs="+", type=int, default=list(COMPILE_ENTRY_BYTES))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes compiling at once")
    args = p.parse_args(argv)
    if args.backend == "cuda" and torch.device(args.device).type != "cuda":
        p.error("--backend cuda needs a CUDA --device")
    for e in args.entry_bytes:
        spec.check_entry_bytes(e)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    environment = env.environment()
    print(env.format_environment(environment), flush=True)
    device = torch.device(args.device)
    if device.type == "cuda":
        try:
            require_cuda("experiments.lab.gpu_check")
            if args.backend == "cuda" or args.compile_only:
                require("cupy", "experiments.lab.gpu_check (the CUDA kernels)")
        except MissingDependencyError as exc:
            raise SystemExit(f"gpu_check: {exc}") from exc
    payload: dict[str, Any] = {
        "command": command_line("lab.gpu_check", argv),
        "environment": environment,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": args.backend,
    }
    start = time.perf_counter()
    if args.compile_only:
        rows = compile_modules(args.codecs, args.entry_bytes, args.jobs)
        for r in rows:
            line = f"  compiled {r['codec']:>6} E={r['entry_bytes']:<6} words of {r['word_bytes']} B"
            print(f"{line} {r['seconds']:6.2f} s", flush=True)
        payload.update(compiled=rows, passed=True)
    else:
        checks = run_checks(device, args.backend, golden=args.golden, numel=args.numel)
        payload.update(checks=[c.as_dict() for c in checks], passed=not any(c.differ for c in checks))
    payload["seconds"] = time.perf_counter() - start
    print(f"{'passed' if payload['passed'] else 'FAILED'} in {payload['seconds']:.1f} s", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")
    if not payload["passed"]:
        raise SystemExit(1)
    return payload


if __name__ == "__main__":
    main()
