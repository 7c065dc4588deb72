"""Max batch under a memory budget: no compression, buddy, save_on_cpu, activation checkpointing.

For every workload and method: the largest batch whose training step fits a
fixed device-memory budget, and the step time at that batch.

* On a GPU: real ``torch.cuda`` memory. The process is limited to the budget
  (``torch.cuda.set_per_process_memory_fraction``) and the largest batch that
  trains without running out of memory is found by search; each row also
  gives the step's peak of allocated device memory
  (``torch.cuda.max_memory_allocated``). buddy runs its CUDA kernels there
  (``--backend``).
* Without a GPU: an **accounting run**. The bytes that would stay on the
  device are added up -- parameters, gradients and optimizer state, plus the
  activations as each method holds them at the end of the forward pass:

  - ``none``: every unique saved storage (parameters aside);
  - ``buddy``: slots + metadata of what buddy compressed, plus what it kept
    as is (small tensors);
  - ``save_on_cpu``: nothing (every saved tensor goes to host memory);
  - ``checkpoint``: the model's longest ``nn.Sequential`` is cut into
    ``ceil(sqrt(n))`` segments: their inputs, the saves outside them, and the
    largest segment's saves (recomputed one at a time in backward);

  and, for every method, the largest saved activation once more: its
  gradient is live during backward whatever the method (this is what bounds
  ``save_on_cpu``).

  Activation bytes grow linearly with the batch; two measured batches fix
  the line and the largest fitting batch is then measured to confirm it.

The default budget is what the workload's own batch needs without
compression, so ``none`` reaches exactly that batch: on a GPU, the peak of a
plain step's allocated memory at that batch, plus :data:`CUDA_HEADROOM` for
the allocator's rounding (a cap at exactly that peak can refuse the very
batch that set it).

On a GPU, ``--step-models`` searches :mod:`experiments.step_time`'s models
instead (a ResNet-50 at 224 px, fp32, from 128 images; a GPT-2-small
decoder at 1024 tokens, bf16 autocast, from 16 sequences), each step its
``measure`` (one warm-up step, one measured): the workloads' models are
small enough that a step's transient buffers, not its saved activations,
set its peak (on the H200, 2026-11-28, every method of resnet-fp32 stopped
at the same batch).

    python -m experiments.max_batch                 # quick, CPU (accounting)
    python -m experiments.max_batch --device cuda --budget-mib 2048
    python -m experiments.max_batch --device cuda --step-models resnet50 gpt2
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

import buddy
from buddy.autograd import is_parameter
from experiments import cli
from experiments.common import choose_backend, format_table, host_peak_bytes, progress, reset_host_peak

__all__ = ["METHODS", "measure", "max_batch", "main"]

METHODS = ("none", "buddy", "save_on_cpu", "checkpoint")
#: the search stops at this multiple of the workload's own batch
MAX_BATCH_FACTOR = 16
#: an accounting run searches at most this many times the base batch: it trains on the host, and some
#: models (lstm-fp32 at full size) need far more host memory than their saved tensors at 16x
ACCOUNTING_FACTOR = 4
#: an accounting run (no GPU) holds every saved tensor in host memory whatever the method, plus the
#: accounting forward's: it measures no batch whose saved bytes would pass this share of physical memory
HOST_MEMORY_SHARE = 0.25
#: nor one whose peak resident memory, on the line through two measured batches, would pass this share:
#: the reference codecs' working memory on the host is several times a tensor's (the saved bytes alone
#: let minilm-fp32's buddy step at full size run 24 GiB out of memory)
HOST_PEAK_SHARE = 0.6
#: on a GPU the default budget is a plain step's peak allocated bytes at the base batch times this
CUDA_HEADROOM = 1.05


# ---- a training step at a given batch, under a method ---------------------------------------
def _stack(model: nn.Module) -> nn.Sequential | None:
    """The longest ``nn.Sequential`` in the model (what checkpointing cuts), if it has 2+ children."""
    seqs = [m for m in model.modules() if isinstance(m, nn.Sequential) and len(m) >= 2]
    return max(seqs, key=len, default=None)


def _segments(stack: nn.Sequential) -> list[nn.Sequential]:
    n = len(stack)
    per = math.ceil(n / math.ceil(math.sqrt(n)))
    return [stack[i : i + per] for i in range(0, n, per)]  # type: ignore[misc]  # a slice of a Sequential is one


class _Account:
    """Saved-tensor hooks that add up unique non-parameter storages, by segment."""

    def __init__(self):
        self.seen: set[int] = set()
        self.segment: int | None = None
        self.outside = 0
        self.largest = 0  # the biggest saved storage: its gradient is live in backward whatever the method
        self.per_segment: dict[int, int] = {}

    def pack(self, t):
        storage = t.untyped_storage()
        if not is_parameter(t) and storage._cdata not in self.seen:
            self.seen.add(storage._cdata)
            self.largest = max(self.largest, storage.nbytes())
            if self.segment is None:
                self.outside += storage.nbytes()
            else:
                self.per_segment[self.segment] = self.per_segment.get(self.segment, 0) + storage.nbytes()
        # never ``t`` itself: an op that saves its own output (exp, tanh, ...) would then hold its output's
        # Python object from inside its graph, a cycle the garbage collector cannot see, and the accounting
        # forward (never run backward) would keep its whole graph: a --full run grew ~1 GiB per measurement
        return t.detach()

    @staticmethod
    def unpack(t):
        return t


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return params + grads + state


@dataclasses.dataclass
class Measurement:
    workload: str
    method: str
    batch: int
    state_bytes: int
    activation_bytes: int
    seconds: float
    saved_bytes: int = 0  # every unique saved storage of the step (what an accounting run holds in host memory)
    peak_bytes: int | None = None  # the process's peak resident memory during the measurement (None: unknown)
    host_cap: int | None = None  # the largest batch the accounting search would measure (host memory)
    device_peak_bytes: int | None = None  # CUDA: max_memory_allocated over the timed step

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


def _run(workload, size: str, batch: int, device: str, seed: int):
    from experiments.workloads import WORKLOADS, Run

    w = WORKLOADS[workload]
    config = dataclasses.replace(w.size(size), batch=batch)
    model = w.build_model(size, device, seed)
    return Run(w, size, model, w.build_optimizer(model), w.batches_fn(config, torch.device(device), seed))


def _checkpoint_bytes(run, stack: nn.Sequential, batch) -> int:
    """Activation bytes checkpointing holds, from one plain forward with saves attributed to segments."""
    segments = _segments(stack)
    account, inputs = _Account(), []

    def attributed(x):
        for i, seg in enumerate(segments):
            inputs.append(x.untyped_storage().nbytes())
            account.segment = i
            x = seg(x)
        account.segment = None
        return x

    stack.forward = attributed  # type: ignore[method-assign]  # an instance attribute: this module's forward only
    try:
        with saved_tensors_hooks(account.pack, account.unpack):
            run.workload.loss(run.model, batch).detach()  # this graph is dropped at once
    finally:
        del stack.forward
    return account.outside + sum(inputs) + max(account.per_segment.values(), default=0)


def _checkpointed(stack: nn.Sequential):
    segments = _segments(stack)

    def forward(x):
        for seg in segments:
            x = checkpoint(seg, x, use_reentrant=False)  # recomputed in backward, one segment at a time
        return x

    return forward


def measure(workload: str, method: str, *, size: str, batch: int, device: str = "cpu", seed: int = 0) -> Measurement:
    """A warm-up step, then one timed step under ``method``: the device bytes it holds, and its time."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    reset_host_peak()
    run = _run(workload, size, batch, device, seed)
    run.step(run.forward_loss())  # warm-up: optimizer state exists from now on
    data = next(run.batches)
    plain = _Account()
    with saved_tensors_hooks(plain.pack, plain.unpack):
        run.workload.loss(run.model, data).detach()  # accounting only, untimed; this graph is dropped
    stack = _stack(run.model)
    if method == "checkpoint":
        if stack is None:
            raise ValueError(f"{workload} has no nn.Sequential stack to checkpoint")
        activation = _checkpoint_bytes(run, stack, data)
        stack.forward = _checkpointed(stack)  # type: ignore[method-assign]  # this module's forward only
    account = _Account()
    session = None
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start_s = time.perf_counter()
    if method == "none":
        with saved_tensors_hooks(account.pack, account.unpack):
            loss = run.workload.loss(run.model, data)
        activation = account.outside
    elif method == "buddy":
        store = buddy.BuddyStore(pin=False if device == "cpu" else None)
        min_bytes = run.workload.min_bytes(size)
        with buddy.compressed_activations(tracker=buddy.Tracker(), store=store, min_bytes=min_bytes) as session:
            loss = run.workload.loss(run.model, data)
    elif method == "save_on_cpu":
        with save_on_cpu(pin_memory=device != "cpu"):
            loss = run.workload.loss(run.model, data)
        activation = 0
    else:
        loss = run.workload.loss(run.model, data)
    run.step(loss)
    device_peak = None
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        device_peak = torch.cuda.max_memory_allocated()
    seconds = time.perf_counter() - start_s
    if session is not None:
        stats = session.stats()
        activation = stats.device_bytes + stats.kept_bytes
    activation += plain.largest
    state = _state_bytes(run.model, run.optimizer)
    host_peak = host_peak_bytes()
    return Measurement(
        workload, method, batch, state, activation, seconds, plain.outside, host_peak, device_peak_bytes=device_peak
    )


def _search(fits, start: int, cap: int) -> Measurement | None:
    """Largest batch in [1, cap] for which ``fits(batch)`` returns a measurement (``None``: does not fit).

    Doubles from ``start`` while it fits, then bisects; assumes that a batch
    that fits means every smaller one fits too.
    """
    lo, hi, best = 0, None, None
    batch = max(1, min(start, cap))
    while batch <= cap:
        m = fits(batch)
        if m is None:
            hi = batch
            break
        lo, best, batch = batch, m, batch * 2
    if hi is None:
        return best  # fits all the way to the cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        m = fits(mid)
        if m is None:
            hi = mid
        else:
            lo, best = mid, m
    return best


def _largest_accounted(workload, method, *, size, base, budget, device, seed) -> Measurement | None:
    """Largest batch whose accounted bytes fit ``budget``; a line through two batches gives the first guess."""
    a = measure(workload, method, size=size, batch=base, device=device, seed=seed)
    b = measure(workload, method, size=size, batch=2 * base, device=device, seed=seed)
    per_sample = max((b.activation_bytes - a.activation_bytes) / base, 1.0)
    guess = int((budget - a.state_bytes - (a.activation_bytes - per_sample * base)) // per_sample)

    def fits(batch):
        m = measure(workload, method, size=size, batch=batch, device=device, seed=seed)
        return m if m.total_bytes <= budget else None

    cap = host_batch_cap(b, smaller=a)
    best = _search(fits, guess, min(ACCOUNTING_FACTOR * base, cap))
    return None if best is None else dataclasses.replace(best, host_cap=cap)


def host_batch_cap(m: Measurement, memory: int | None = None, *, smaller: Measurement | None = None) -> int:
    """The largest batch an accounting run measures, from ``m``, a measurement at some batch.

    Its saved bytes (which grow with the batch in proportion) within
    :data:`HOST_MEMORY_SHARE` of ``memory`` (default: this machine's
    physical memory), and, given a measurement at a ``smaller`` batch, the
    peak resident memory on the line through the two within
    :data:`HOST_PEAK_SHARE`. Never below ``m``'s batch.
    """
    if memory is None:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_sample = max(m.saved_bytes / m.batch, 1.0)
    cap = int(HOST_MEMORY_SHARE * memory // per_sample)
    peak, smaller_peak = m.peak_bytes, smaller.peak_bytes if smaller is not None else None
    if smaller is not None and peak is not None and smaller_peak is not None and m.batch > smaller.batch:
        per_sample = max((peak - smaller_peak) / (m.batch - smaller.batch), 1.0)
        cap = min(cap, m.batch + int((HOST_PEAK_SHARE * memory - peak) // per_sample))
    return max(m.batch, cap)


def _cap_cuda(device: str, budget: int | None) -> None:
    """Limit this process's CUDA memory to ``budget`` bytes (``None``: lift the limit).

    The limit is set on a device named with its index: ``set_per_process_memory_fraction`` refuses a plain
    ``cuda`` (on the H200, 2026-11-28, every search stopped there).
    """
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device(dev.type, torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if budget is None else min(1.0, budget / total), dev)


def _largest_cuda(workload, method, *, size, base, budget, device, seed) -> Measurement | None:
    """Largest batch that trains under a real per-process CUDA memory limit (lifted again afterwards)."""

    def fits(batch):
        gc.collect()  # the graph of a batch that ran out of memory, held by its traceback's frames
        torch.cuda.empty_cache()
        try:
            return measure(workload, method, size=size, batch=batch, device=device, seed=seed)
        except torch.cuda.OutOfMemoryError:
            return None

    _cap_cuda(device, budget)
    try:
        return _search(fits, base, MAX_BATCH_FACTOR * base)
    finally:
        _cap_cuda(device, None)


def default_budget(workload: str, *, size: str, device: str, seed: int) -> int:
    """What the workload's base batch needs uncompressed: accounted bytes, or on a GPU its peak allocated bytes
    (with :data:`CUDA_HEADROOM`)."""
    from experiments.workloads import WORKLOADS

    base = WORKLOADS[workload].size(size).batch
    m = measure(workload, "none", size=size, batch=base, device=device, seed=seed)
    if m.device_peak_bytes is None:
        return m.total_bytes
    return int(CUDA_HEADROOM * m.device_peak_bytes)


def max_batch(workload: str, method: str, *, size: str, budget: int, device: str, seed: int) -> Measurement | None:
    """The largest batch of ``workload`` under ``method`` within ``budget`` bytes (``None``: not even one)."""
    from experiments.workloads import WORKLOADS

    base = WORKLOADS[workload].size(size).batch
    search = _largest_cuda if device.startswith("cuda") else _largest_accounted
    return search(workload, method, size=size, base=base, budget=budget, device=device, seed=seed)


def step_model_step(name: str, method: str, batch: int, device: str):
    """One measured step (after one warm-up) of :mod:`experiments.step_time`'s model ``name`` at ``batch`` under
    ``method``: its ``Measurement`` (step time, peak and state bytes)."""
    from experiments import step_time

    spec = step_time.MODELS["cuda"][name](batch)
    return step_time.measure(spec, method, device=device, steps=1, warmup=1)


def _step_model_row(name: str, method: str, *, budget: int, device: str, known: dict | None = None) -> dict:
    """The largest batch of step_time's ``name`` under ``method`` that trains within ``budget`` bytes of CUDA
    memory (a per-process cap), searched from the model's own batch. ``known``: steps of this method measured
    already, by batch, that fit the budget (the plain step the budget was made from): not run again."""
    from experiments import step_time

    base = step_time.BATCH["cuda"][name]
    found: dict[int, Any] = dict(known or {})  # batch -> step_time.Measurement

    def fits(batch):
        if batch in found:
            return found[batch]
        gc.collect()
        torch.cuda.empty_cache()
        try:
            found[batch] = step_model_step(name, method, batch, device)
        except torch.cuda.OutOfMemoryError:
            return None
        return found[batch]

    _cap_cuda(device, budget)
    try:
        m: Any = _search(fits, base, MAX_BATCH_FACTOR * base)
    finally:
        _cap_cuda(device, None)
    batch = next((b for b, x in found.items() if x is m), 0) if m is not None else 0
    note = "no batch fits" if m is None else ""
    if batch >= MAX_BATCH_FACTOR * base:
        note = f"search capped at {MAX_BATCH_FACTOR}x the base batch"
    peak = m.peak_bytes if m else None
    state = m.state_bytes if m else None
    return {
        "workload": f"{name} (step_time)", "method": method, "accounting": False, "budget_mib": budget / 2**20,
        "max_batch": batch, "total_mib": peak / 2**20 if peak is not None else None,
        "activation_mib": (peak - state) / 2**20 if peak is not None and state is not None else None,
        "state_mib": state / 2**20 if state is not None else None, "step_seconds": m.step_ms / 1e3 if m else None,
        "device_peak_mib": peak / 2**20 if peak is not None else None, "note": note,
    }  # fmt: skip


def _step_model_budget(name: str, device: str) -> tuple[int, dict]:
    """A plain step's peak allocated bytes of step_time's ``name`` at its own batch, with :data:`CUDA_HEADROOM`; and
    that step, by its batch (``known`` of the ``none`` method's :func:`_step_model_row`: it fits the budget)."""
    from experiments import step_time

    base = step_time.BATCH["cuda"][name]
    m = step_model_step(name, "none", base, device)
    return int(CUDA_HEADROOM * m.peak_bytes), {base: m}


def parse_args(argv):
    from experiments.step_time import MODELS as STEP_MODELS
    from experiments.workloads import DEFAULT_WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_size_argument(p)
    cli.add_workloads_argument(p, DEFAULT_WORKLOADS)
    p.add_argument("--step-models", nargs="+", choices=sorted(STEP_MODELS["cuda"]), default=[],
                   help="a CUDA device: step_time's models at their GPU size instead of the workloads")  # fmt: skip
    cli.add_methods_argument(p, METHODS)
    p.add_argument(
        "--budget-mib", type=float, default=None, help="device budget (default: what the base batch needs uncompressed)"
    )
    cli.add_common_arguments(p, out="results/max_batch", device="cpu", backend=True, plot=True)
    return p.parse_args(argv)


COLUMNS = [
    ("workload", "workload", ""),
    ("method", "method", ""),
    ("budget_mib", "budget MiB", ".1f"),
    ("max_batch", "max batch", "d"),
    ("vs_none", "vs none", ".2f"),
    ("total_mib", "held MiB", ".1f"),
    ("activation_mib", "activations MiB", ".1f"),
    ("step_seconds", "step s", ".3f"),
    ("device_peak_mib", "device peak MiB", ".1f"),
]


def _row(workload: str, method: str, *, args, budget: int, accounting: bool) -> dict:
    """The largest batch of ``workload`` under ``method`` within ``budget``, with a note where the search stopped
    short of it."""
    from experiments.workloads import WORKLOADS

    try:
        m = max_batch(workload, method, size=args.size, budget=budget, device=args.device, seed=args.seed)
        note = "" if m else "no batch fits"
        factor = ACCOUNTING_FACTOR if accounting else MAX_BATCH_FACTOR
        if m and m.batch >= factor * WORKLOADS[workload].size(args.size).batch:
            note = f"search capped at {factor}x the base batch"
        elif m and m.host_cap is not None and m.batch >= m.host_cap:
            note = "search capped by host memory (see HOST_MEMORY_SHARE, HOST_PEAK_SHARE)"
    except ValueError as exc:  # e.g. no stack to checkpoint
        m, note = None, str(exc)
    return {
        "workload": workload,
        "method": method,
        "accounting": accounting,
        "budget_mib": budget / 2**20,
        "max_batch": m.batch if m else 0,
        "total_mib": m.total_bytes / 2**20 if m else None,
        "activation_mib": m.activation_bytes / 2**20 if m else None,
        "state_mib": m.state_bytes / 2**20 if m else None,
        "step_seconds": m.seconds if m else None,
        "device_peak_mib": m.device_peak_bytes / 2**20 if m and m.device_peak_bytes is not None else None,
        "note": note,
    }


def _rows(args, accounting: bool) -> list[dict]:
    """A row per workload and method, each with its batch against the ``none`` method's on the same workload."""
    rows = []
    step_models = list(args.step_models)
    jobs = [(w, m) for w in (step_models or args.workloads) for m in args.methods]
    budgets, plain = {}, {}  # plain: per step model, the plain step its budget was made from (none's first try)
    for workload, method in progress(jobs, desc="max batch", enabled=not args.no_progress):
        if workload not in budgets:
            if args.budget_mib:
                budgets[workload] = int(args.budget_mib * 2**20)
            elif step_models:
                budgets[workload], plain[workload] = _step_model_budget(workload, args.device)
            else:
                budgets[workload] = default_budget(workload, size=args.size, device=args.device, seed=args.seed)
        if step_models:  # minutes a row on a GPU: each said as it comes, so a run cut short still says it
            known = plain.get(workload) if method == "none" else None
            rows.append(_step_model_row(workload, method, budget=budgets[workload], device=args.device, known=known))
            r = rows[-1]
            peak = f"{r['device_peak_mib']:,.0f}" if r["device_peak_mib"] is not None else "-"
            print(f"  {workload} / {method}: max batch {r['max_batch']} under {r['budget_mib']:,.0f} MiB (peak {peak} "
                  f"MiB) {r['note']}".rstrip(), flush=True)  # fmt: skip
        else:
            rows.append(_row(workload, method, args=args, budget=budgets[workload], accounting=accounting))
    none = {r["workload"]: r["max_batch"] for r in rows if r["method"] == "none"}
    for r in rows:
        r["vs_none"] = r["max_batch"] / none[r["workload"]] if none.get(r["workload"]) else None
    return rows


def main(argv=None) -> list[dict]:
    from experiments.plot import plot_max_batch

    args, header = cli.begin("max_batch", parse_args, argv)
    accounting = not args.device.startswith("cuda")
    if args.step_models and accounting:
        raise SystemExit("max_batch: --step-models measures real CUDA memory: it needs --device cuda")
    backend = choose_backend("max_batch", args.backend, args.device)
    buddy.set_defaults(backend=backend)
    print(f"  buddy backend: {backend}")
    if accounting:
        print("  ACCOUNTING RUN: no GPU, so device bytes are added up, not measured (see the module docstring)")
    rows = _rows(args, accounting)
    print()
    kind = "accounting run (CPU)" if accounting else f"real CUDA memory on {header['environment']['gpu']}"
    print(f"Largest batch under the budget ({kind}); step time at that batch")
    print(format_table(rows, COLUMNS))
    for r in rows:
        if r["note"]:
            print(f"  {r['workload']} / {r['method']}: {r['note']}")
    cli.finish(
        args, header, rows, plot=plot_max_batch,
        experiment="max_batch", size=args.size, accounting=accounting, backend=backend,
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
