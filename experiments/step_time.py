"""Step time and peak device memory: buddy against what users would pick instead.

For a ResNet-50-class CNN at 224 px (fp32) and a GPT-2-small-class decoder
(bf16 autocast, sequence 1024), one training step -- forward, backward,
optimizer -- under each method, on the same model, data and device:

* ``none``: plain PyTorch;
* ``buddy``: ``buddy.compressed_activations()`` with the tracker's default
  policy (after warm-up steps, so the tracker has history): slots from the
  tracker's plan, nothing read back per tensor (at most two reads a step).
  On a CUDA device one more step of it runs under
  ``torch.cuda.set_sync_debug_mode("error")``: any wait of the host for the
  device but buddy's counted reads raises, and the row's ``sync`` says what
  that step found (``silent``, or the error);
* ``buddy-overlap``: the same with ``overlap=True``: each pack on a side
  stream beside forward's next kernels, originals held in a bounded stash
  until packed (:mod:`buddy.overlap`; on the CPU the same as ``buddy``);
* ``buddy-ring``: the same with an overflow ring (:data:`RING_BYTES`): each
  pack writes its overflow on the device, a drain kernel on the copy stream
  takes it to buddy memory (:mod:`buddy.ring`), instead of the pack writing
  it over the bus;
* ``buddy-strict``: the same with ``strict=True``: every tensor sized before
  its slot is chosen, a read of the device a tensor;
* ``buddy-casts``: the same with ``rederive_casts=False``: the weights'
  copies autocast saves compressed too, not made again in backward (what
  making them again saves; on an fp32 model the same as ``buddy``);
* ``buddy-model``: the same around the model's forward alone, the loss
  outside the block (its saved tensors kept as they are: see "When the step's
  peak is at the loss" in docs/training.md);
* ``buddy-offload``: ``buddy.CompressedOffload()``: every saved activation
  compressed to buddy memory, brought back by backward's look-ahead;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``side-stream``: an offload in the style of torchtune's
  ``OffloadActivations``: copies to pinned memory on a side stream, one
  tensor prefetched ahead in backward (:class:`SideStreamOffload`);
* ``checkpoint``: ``torch.utils.checkpoint`` around every block.

Per row: ``step_ms`` (median of the timed steps), ``peak_bytes``
(``torch.cuda.max_memory_allocated`` over a step), ``capacity`` (the memory
a plain step adds above the model's state -- parameters and optimizer
state -- divided by what this method's step adds: how many times more
activations fit), ``device``.

    python -m experiments.step_time --device cuda          # the real measurement (a GPU)
    python -m experiments.step_time                        # small, on the CPU: runs, measures nothing real

On the CPU the models are shrunk so a step takes about a second, there is no
device memory to measure (``peak_bytes`` is empty), the offloads have nothing
to overlap with, and the times are CPU times: they say nothing about a GPU.
There ``capacity`` comes from ``host_peak_bytes``: after every timing, one more
step of each method, the process's peak resident memory during it above its
resident memory at its start (Linux; large blocks handed back at once,
:func:`fix_mmap_threshold`). It counts what a step holds at its peak, its
transient buffers too: on the CPU models a buddy step of the GPT-2 decoder
peaks higher than a plain one (2026-11-28: the loss's log-softmax output, the
largest saved tensor by far, is compressed while it is alive, its slots beside
it, and decompressed beside them in backward), which an account of the bytes
saved (``max_batch``'s accounting run) does not see.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import buddy
from buddy.tracker import COUNT_WARMUP
from buddy.autograd import is_parameter
from experiments import cli
from experiments.common import choose_backend, format_table, host_peak_bytes, progress, reset_host_peak
from experiments.workloads import GPT, TextSize

__all__ = ["METHODS", "MODELS", "SideStreamOffload", "measure", "measured_line", "rows_vs_none", "main"]

METHODS = ("none", "buddy", "buddy-overlap", "buddy-ring", "buddy-strict", "buddy-casts", "buddy-model", "buddy-offload", "save_on_cpu", "side-stream", "checkpoint")
MIN_BYTES = buddy.hooks.DEFAULT_MIN_BYTES
#: ``buddy-ring``'s overflow ring per device: a few of the models' largest worst cases (a guess the runbook
#: measures); for the CPU's shrunk models, whose activations compressed hold about 9 MiB a step and the largest 1
#: MiB, 1 MiB (the ring's bytes count against capacity: 256 MiB would outweigh every activation)
RING_BYTES = {"cuda": 256 << 20, "cpu": 1 << 20}


# ---- models -------------------------------------------------------------------------------
class _Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 down, 3x3 (strided), 1x1 up (4x), batch norm after each, projected shortcut."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet50(nn.Module):
    """ResNet-50 (stages of 3, 4, 6, 3 bottlenecks; 25.6 M parameters at 1000 classes)."""

    def __init__(self, classes: int = 1000, stages=(3, 4, 6, 3)):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, padding=1),
        )
        blocks, cin = [], 64
        for stage, count in enumerate(stages):
            width = 64 << stage
            for i in range(count):
                blocks.append(_Bottleneck(cin, width, 2 if stage and not i else 1))
                cin = 4 * width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


@dataclasses.dataclass(frozen=True)
class Model:
    """A model at one size, its batch and its loss."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    autocast: torch.dtype | None
    #: tokens a chunk of a language model's loss (:func:`chunked_cross_entropy`), ``None``: the loss of the model's
    #: output whole
    loss_chunk: int | None = None


def _resnet(batch: int, side: int) -> Model:
    def make(device, gen):
        images = torch.randn(batch, 3, side, side, generator=gen).to(device)
        return images, torch.randint(0, 1000, (batch,), generator=gen).to(device)

    return Model("resnet50", f"ResNet-50, {batch}x3x{side}x{side}, fp32", ResNet50, make, None)


def _gpt(batch: int, seq: int, width: int, layers: int, heads: int, vocab: int = 50304) -> Model:
    size = TextSize(batch=batch, seq_len=seq, width=width, layers=layers, heads=heads)

    def make(device, gen):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    chunk = max(1, batch * seq // 8)
    description = (
        f"GPT-2-class decoder, {layers}x{width}, {batch}x{seq} tokens, vocabulary {vocab}, bf16 autocast, its loss "
        f"in chunks of {chunk} tokens"
    )
    return Model("gpt2", description, lambda: GPT(size, vocab=vocab), make, torch.bfloat16, chunk)


#: per device kind and model, the batch a step is measured at
BATCH: dict[str, dict[str, int]] = {"cuda": {"resnet50": 128, "gpt2": 16}, "cpu": {"resnet50": 4, "gpt2": 4}}
#: per device kind: what fills an 80 GB GPU, and what takes about a second per step on a CPU
MODELS: dict[str, dict[str, Callable[[int | None], Model]]] = {
    "cuda": {
        "resnet50": lambda b: _resnet(b or BATCH["cuda"]["resnet50"], 224),
        "gpt2": lambda b: _gpt(b or BATCH["cuda"]["gpt2"], 1024, 768, 12, 12),
    },
    "cpu": {
        "resnet50": lambda b: _resnet(b or BATCH["cpu"]["resnet50"], 64),
        "gpt2": lambda b: _gpt(b or BATCH["cpu"]["gpt2"], 128, 128, 2, 4),
    },
}


def _chunk_loss(features: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(features, weight).float(), targets, reduction="sum")


def chunked_cross_entropy(features: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
    """The mean cross-entropy of the logits ``features @ weight.T`` against ``targets``, ``chunk`` tokens at a time,
    each chunk's logits made again in backward (``torch.utils.checkpoint``): what a step holds for the loss is one
    chunk's logits, not the whole vocabulary's for every token (as language-model training computes it)."""
    features, targets = features.flatten(0, -2), targets.flatten()
    total = features.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(_chunk_loss, features[part], weight, targets[part], use_reentrant=False)
    return total / targets.numel()


def _loss(model: nn.Module, spec: Model, batch, around_model=None) -> torch.Tensor:
    """The step's loss; ``around_model``: a context opened around the model's forward alone, not the loss. A model
    with a ``loss_chunk`` computes it from its features a chunk at a time (:func:`chunked_cross_entropy`)."""
    inputs, targets = batch
    with torch.autocast(inputs.device.type, dtype=spec.autocast, enabled=spec.autocast is not None):
        with around_model if around_model is not None else contextlib.nullcontext():
            out = getattr(model, "features")(inputs) if spec.loss_chunk else model(inputs)
        if spec.loss_chunk:
            head = getattr(model.get_submodule("tokens"), "weight")  # (the head, tied to the embedding)
            return chunked_cross_entropy(out, head, targets, spec.loss_chunk)
        return F.cross_entropy(out.flatten(0, -2).float(), targets.flatten())


# ---- the side-stream offload ---------------------------------------------------------------
class _Offloaded:
    """One saved tensor in pinned host memory; ``ready`` completes when its copy there has."""

    __slots__ = ("host", "ready", "device", "position", "back", "__weakref__")

    def __init__(self, host, ready, device, position):
        self.host, self.ready, self.device, self.position = host, ready, device, position
        self.back = None  # (device tensor, event) when prefetched


class SideStreamOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved activations to pinned host memory on a side stream; in backward, the next one prefetched.

    What a user would write after torchtune's ``OffloadActivations``: forward
    never waits for a copy (the device tensor's memory is kept for the side
    stream with ``record_stream``), and while autograd uses one tensor the
    next is copied back. Parameters and tensors under ``min_bytes`` stay on
    the device.
    """

    def __init__(self, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self.stream = torch.cuda.Stream()
        self.order: list[weakref.ref] = []
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if not t.is_cuda or is_parameter(t) or t.numel() * t.element_size() < self.min_bytes:
            return t
        self.stream.wait_stream(torch.cuda.current_stream())  # t is written on the compute stream
        with torch.cuda.stream(self.stream):
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            ready = self.stream.record_event()
        t.record_stream(self.stream)  # its memory is not reused before the copy has read it
        item = _Offloaded(host, ready, t.device, len(self.order))
        self.order.append(weakref.ref(item))
        return item

    def _bring_back(self, item: _Offloaded) -> None:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(item.ready)
            back = item.host.to(item.device, non_blocking=True)
            item.back = (back, self.stream.record_event())

    def _unpack(self, item):
        if not isinstance(item, _Offloaded):
            return item
        if item.back is None:
            self._bring_back(item)
        if item.position > 0:  # the next one backward will want
            following = self.order[item.position - 1]()
            if following is not None and following.back is None:
                self._bring_back(following)
        assert item.back is not None  # brought back just above, or by the prefetch before
        (t, arrived), item.back = item.back, None
        compute = torch.cuda.current_stream()
        compute.wait_event(arrived)
        t.record_stream(compute)  # allocated on the side stream, used on the compute stream
        return t


# ---- one method's steps ----------------------------------------------------------------------
class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def _context(
    method: str, device: torch.device, store: buddy.BuddyStore | None, tracker: buddy.Tracker, policy=None,
    min_bytes: int = MIN_BYTES,
):  # fmt: skip
    if method == "buddy":
        return buddy.compressed_activations(policy, tracker=tracker, store=store, min_bytes=min_bytes)
    if method == "buddy-overlap":
        return buddy.compressed_activations(policy, tracker=tracker, store=store, min_bytes=min_bytes, overlap=True)
    if method == "buddy-ring":
        return buddy.compressed_activations(
            policy, tracker=tracker, store=store, min_bytes=min_bytes, overflow_ring=RING_BYTES[device.type]
        )  # fmt: skip
    if method == "buddy-strict":
        return buddy.compressed_activations(tracker=tracker, store=store, min_bytes=min_bytes, strict=True)
    if method == "buddy-casts":
        return buddy.compressed_activations(
            policy, tracker=tracker, store=store, min_bytes=min_bytes, rederive_casts=False
        )  # fmt: skip
    if method == "buddy-offload":
        return buddy.compressed_activations(
            buddy.CompressedOffload(), tracker=tracker, store=store, min_bytes=min_bytes
        )
    if method == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
    if method == "side-stream":
        if device.type != "cuda":
            return contextlib.nullcontext()  # nothing to overlap on the host: the same as none
        return SideStreamOffload()
    return contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Measurement:
    method: str
    model: str
    step_ms: float
    step_ms_all: list[float]
    peak_bytes: int | None
    state_bytes: int | None
    device: str
    buddy: dict | None = None  # what the last buddy session held
    profile: dict | None = None  # where one more step's time went (--profile): see profile_step
    memory_peak: dict | None = None  # what one more step held at its peak (--memory-peak): experiments.memory_peak
    host_peak_bytes: int | None = None  # a CPU run: one more step's peak resident bytes above its start (host_peak)
    sync: str | None = None  # buddy on CUDA: one more step under sync debug mode "error": "silent", or the error


def profile_step(step: Callable[[], object], device: torch.device, top: int = 25) -> dict:
    """Where one step's time goes: host Python functions (cProfile, by own time) and PyTorch ops (the profiler,
    by device time where there is a device, else by host time), the ``top`` of each, in milliseconds."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _sync(device)
    python = cProfile.Profile()
    start_s = time.perf_counter()
    python.enable()
    step()
    _sync(device)
    python.disable()
    wall_ms = (time.perf_counter() - start_s) * 1e3
    stats = pstats.Stats(python).stats  # type: ignore[attr-defined]
    functions = sorted(
        ({"function": f"{Path(f).name}:{line}:{name}", "calls": nc, "own_ms": tt * 1e3, "cumulative_ms": ct * 1e3}
         for (f, line, name), (_, nc, tt, ct, _) in stats.items()),
        key=lambda r: -r["own_ms"],
    )[:top]  # fmt: skip
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        step()
        _sync(device)

    def device_us(event) -> float:
        return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)) or 0.0)

    events = prof.key_averages()
    ops = sorted(
        ({"op": e.key, "calls": e.count, "host_ms": e.self_cpu_time_total / 1e3, "device_ms": device_us(e) / 1e3}
         for e in events),
        key=lambda r: -(r["device_ms"] if device.type == "cuda" else r["host_ms"]),
    )[:top]  # fmt: skip
    return {"wall_ms_under_cprofile": wall_ms, "python": functions, "ops": ops}


def host_peak(step: Callable[[], object]) -> int | None:
    """One call of ``step``: the process's peak resident bytes during it above its resident bytes at its start
    (Linux: VmHWM after ``clear_refs``; ``None`` elsewhere) -- on the CPU, what a step adds at its peak, the
    counterpart of ``max_memory_allocated`` less the state. Call :func:`fix_mmap_threshold` first, or freed large
    blocks may stay resident and hide the step's own peak."""
    import gc

    gc.collect()
    reset_host_peak()
    start = host_peak_bytes()
    if start is None:
        return None
    step()
    end = host_peak_bytes()
    return None if end is None else end - start


def fix_mmap_threshold(nbytes: int = 64 << 10) -> bool:
    """glibc: allocate blocks of ``nbytes`` and more with ``mmap`` from now on, so that freeing one hands its
    memory back at once (by default the threshold rises after large frees, and the freed blocks stay resident in
    the heap). For the whole process: timings taken after it are not comparable with timings before."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def measure(
    spec: Model, method: str, *, device, steps: int, warmup: int, seed: int = 0, profile: bool = False,
    memory_peak: bool = False, peak_on_host: bool = False, policy: buddy.Policy | None = None,
    checkpointed: bool | None = None, min_bytes: int = MIN_BYTES,
) -> Measurement:  # fmt: skip
    """``warmup`` untimed steps, then ``steps`` timed ones, each synchronised; peak memory over the timed ones.

    ``policy``: the ``buddy`` method's (default: the tracker's own). ``checkpointed``: every block of the model
    under ``torch.utils.checkpoint`` (default: for the ``checkpoint`` method only; with ``buddy``: buddy takes what
    checkpointing keeps). ``min_bytes``: the buddy methods' (smaller tensors are kept as they are).

    ``profile``: for a buddy method, one more step under the profilers (:func:`profile_step`), not timed.
    ``memory_peak``: on a CUDA device, one more step under the allocator's history: what it held at its peak
    and who allocated it (:func:`experiments.memory_peak.record_step`), not timed. ``peak_on_host``: on the CPU,
    one more step's :func:`host_peak`, not timed."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.build().to(device).train()
    if checkpointed if checkpointed is not None else method == "checkpoint":
        model.blocks = nn.Sequential(*(_Checkpointed(b) for b in model.get_submodule("blocks").children()))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    batch = spec.batch(device, gen)
    store = buddy.BuddyStore() if method.startswith("buddy") else None
    # the tracker's count warm-up (every step counts a key's symbols: its first 32 by default) within the warm-up
    # steps: the timed steps are the steady state of a longer run, a learned key counted one step in count_every
    tracker = buddy.Tracker(count_warmup=min(warmup, COUNT_WARMUP))
    times, peak, state = [], None, None

    def step():
        """One training step; its session (a buddy.Session, or what another method's context gave)."""
        optimizer.zero_grad(set_to_none=True)
        if method == "buddy-model":
            session = buddy.compressed_activations(tracker=tracker, store=store, min_bytes=min_bytes)
            loss = _loss(model, spec, batch, around_model=session)
        else:
            with _context(method, device, store, tracker, policy, min_bytes) as session:
                loss = _loss(model, spec, batch)
        loss.backward()
        optimizer.step()
        return session

    for i in range(warmup + steps):
        _sync(device)
        if device.type == "cuda" and i == warmup:
            torch.cuda.reset_peak_memory_stats(device)
            state = torch.cuda.memory_allocated(device)  # parameters and optimizer state
        start_s = time.perf_counter()
        session = step()
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start_s) * 1e3)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    held = session.stats().to_dict() if isinstance(session, buddy.Session) else None
    if held is not None:
        kept = ("original_bytes", "device_bytes", "buddy_bytes", "effective_capacity", "host_reads", "within_bound")
        # the overflow ring's and overlap's counts, where the method has them
        counted = ("ring_bytes", "ring_drained", "ring_waits", "ring_too_large", "overlapped", "stash_waits")
        held = {k: held[k] for k in kept} | {k: held[k] for k in counted if held[k]}
        saves = tracker.last_profile  # the last step's saves and uses (buddy.peak): its saved tensors' peak, modeled
        if saves is not None and saves.events:
            held["saved_peak_plain"] = float(saves.held(set()).max())
            held["saved_peak"] = float(saves.held().max())
    where = profile_step(step, device) if profile and method.startswith("buddy") else None
    held_at_peak = memory_peak_of(step, device) if memory_peak else None
    on_host = host_peak(step) if peak_on_host and device.type == "cpu" else None
    sync = sync_check(step) if method in ("buddy", "buddy-overlap", "buddy-ring") and device.type == "cuda" else None
    return Measurement(
        method, spec.name, statistics.median(times), times, peak, state, str(device), held, where, held_at_peak,
        on_host, sync,
    )


def sync_check(step: Callable[[], object]) -> str:
    """One more step under ``torch.cuda.set_sync_debug_mode("error")``: ``"silent"`` when nothing in it made the
    host wait for the device but buddy's counted reads (:func:`buddy.engines.to_host`), else the error raised."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"[:500]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "silent"


def memory_peak_of(step: Callable[[], object], device: torch.device) -> dict | None:
    from experiments.memory_peak import record_step

    return record_step(step, device)


# ---- the run -----------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS["cuda"]), default=sorted(MODELS["cuda"]))
    cli.add_methods_argument(p, METHODS)
    p.add_argument("--batch", type=int, default=None, help="batch size (default: per model and device kind)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the tracker learns; kernels compile)")
    p.add_argument("--profile", action="store_true",
                   help="buddy's methods: one more step under cProfile and the PyTorch profiler, its top functions "
                        "and ops kept in the results (not timed)")  # fmt: skip
    p.add_argument("--memory-peak", action="store_true",
                   help="a CUDA device: one more step of each method under the allocator's history, what it held "
                        "at its peak by where it was allocated (experiments.memory_peak; not timed)")  # fmt: skip
    cli.add_common_arguments(p, out="results/step_time", backend=True, plot=True)
    return p.parse_args(argv)


COLUMNS = [
    ("model", "model", ""),
    ("method", "method", ""),
    ("step_ms", "step ms", ".1f"),
    ("vs_none", "time vs none", ".3f"),
    ("peak_gib", "peak GiB", ".2f"),
    ("host_peak_mib", "host peak MiB", ".1f"),
    ("capacity", "capacity", ".2f"),
    ("buddy_capacity", "buddy ratio", ".2f"),
]


def rows_vs_none(measurements: list[Measurement]) -> list[dict]:
    """Rows with each method set against ``none`` on the same model."""
    rows = [dataclasses.asdict(m) for m in measurements]
    for r in rows:
        none = next((x for x in rows if x["model"] == r["model"] and x["method"] == "none"), None)
        r["vs_none"] = r["step_ms"] / none["step_ms"] if none else None
        r["peak_gib"] = r["peak_bytes"] / 2**30 if r["peak_bytes"] is not None else None
        added = r["peak_bytes"] - r["state_bytes"] if r["peak_bytes"] is not None else None
        base = none["peak_bytes"] - none["state_bytes"] if none and none["peak_bytes"] is not None else None
        if r["peak_bytes"] is None:  # a CPU run: what a step adds to the process's resident memory at its peak
            added, base = r["host_peak_bytes"], none["host_peak_bytes"] if none else None
        r["host_peak_mib"] = r["host_peak_bytes"] / 2**20 if r["host_peak_bytes"] is not None else None
        r["capacity"] = base / added if added and base else None
        r["buddy_capacity"] = r["buddy"]["effective_capacity"] if r["buddy"] else None
    return rows


def format_profile(row: dict, top: int = 12) -> str:
    """The profiled step of ``row``: its top host functions and ops."""
    p = row["profile"]
    lines = [f"\n  {row['model']} / {row['method']}: one step under cProfile {p['wall_ms_under_cprofile']:.0f} ms "
             f"(timed steps {row['step_ms']:.0f} ms); own time of the top functions:"]  # fmt: skip
    lines += [f"    {f['own_ms']:9.1f} ms {f['calls']:7d} calls  {f['function']}" for f in p["python"][:top]]
    lines.append("  the top ops (host ms / device ms, calls):")
    lines += [f"    {o['host_ms']:9.1f} / {o['device_ms']:9.1f} ms {o['calls']:7d}  {o['op'][:80]}" for o in p["ops"][:top]]
    return "\n".join(lines)


def _verdicts(rows: list[dict]) -> list[str]:
    """The targets, checked on this run's numbers."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["method"]: r for r in rows if r["model"] == model}
        offload, soc = by.get("buddy-offload"), by.get("save_on_cpu")
        for name in ("buddy", "buddy-overlap", "buddy-ring", "buddy-strict", "buddy-casts"):
            b = by.get(name)
            if b and b["vs_none"] is not None:
                ok = b["vs_none"] <= 1.3 and (b["capacity"] or 0) >= 1.4
                reads = f", {b['buddy']['host_reads']} host reads a step" if b.get("buddy") else ""
                sync = f", sync check {b['sync']}" if b.get("sync") else ""
                lines.append(
                    f"  {model}: {name} {b['vs_none']:.2f}x a plain step, capacity {b['capacity'] or float('nan'):.2f}x"
                    f"{reads}{sync} (target <= 1.3x, >= 1.4x): {'met' if ok else 'NOT met'}"
                )
        if offload and soc:
            faster = offload["step_ms"] < soc["step_ms"]
            lines.append(
                f"  {model}: compressed offload {offload['step_ms']:.1f} ms vs save_on_cpu {soc['step_ms']:.1f} ms: "
                f"{'faster' if faster else 'NOT faster'}"
            )
    return lines


def plot(results_path: Path, out_dir: Path) -> list[Path]:
    """One PNG: per model, step time (bars) and peak memory (bars) for each method."""
    from experiments.plot import open_results, save_figure

    plt, results = open_results(results_path)
    rows = results["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    with_memory = any(r["peak_bytes"] for r in rows)
    fig, axes = plt.subplots(len(models), 2 if with_memory else 1, figsize=(9, 2.8 * len(models)), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}
    for row_axes, model in zip(axes, models):
        pts = [r for r in rows if r["model"] == model]
        names = [r["method"] for r in pts]
        ax = row_axes[0]
        ax.barh(names, [r["step_ms"] for r in pts], color=[colors[n] for n in names])
        for i, r in enumerate(pts):
            label = f" {r['step_ms']:.0f} ms" + (f" ({r['vs_none']:.2f}x)" if r.get("vs_none") else "")
            ax.annotate(label, (r["step_ms"], i), va="center", fontsize=7)
        ax.set_xlabel("step time (ms, median)")
        ax.set_title(f"{model}: step time", fontsize=9)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        if with_memory:
            ax = row_axes[1]
            ax.barh(names, [(r["peak_bytes"] or 0) / 2**30 for r in pts], color=[colors[n] for n in names])
            for i, r in enumerate(pts):
                if r["capacity"]:
                    ax.annotate(f" {r['capacity']:.2f}x", ((r["peak_bytes"] or 0) / 2**30, i), va="center", fontsize=7)
            ax.set_xlabel("peak device memory (GiB); label: capacity vs none")
            ax.set_title(f"{model}: peak memory", fontsize=9)
            ax.invert_yaxis()
            ax.grid(axis="x", alpha=0.3)
    if results.get("cpu_run"):
        fig.suptitle("CPU run: small models, CPU times -- not GPU times, no device memory", fontsize=9, color="tab:red")
    path = save_figure(plt, fig, results, Path(out_dir) / "step_time.png", dpi=150, bottom=0.04)
    return [path]


def setup(experiment: str, args) -> tuple[torch.device, str, str, list[Model]]:
    """A run's device, buddy backend (made the default), device kind and models, from its arguments (``--device``,
    ``--backend``, ``--models``, ``--batch``)."""
    device = torch.device(args.device)
    backend = choose_backend(experiment, args.backend, device)
    buddy.set_defaults(backend=backend)
    kind = "cuda" if device.type == "cuda" else "cpu"
    return device, backend, kind, [MODELS[kind][name](args.batch) for name in args.models]


def measured_line(m: Measurement) -> str:
    """One measurement as a line of the log, printed as it is made."""
    peak = f", peak {m.peak_bytes / 2**30:.2f} GiB" if m.peak_bytes is not None else ""
    sync = f", sync check {m.sync}" if m.sync else ""
    return f"  measured {m.model} / {m.method}: {m.step_ms:.1f} ms a step{peak}{sync}"


def main(argv=None) -> list[dict]:
    args, header = cli.begin("step_time", parse_args, argv)
    device, backend, kind, specs = setup("step_time", args)
    if kind == "cpu":
        print("  CPU RUN: small models, CPU times (not GPU times), no device memory to measure; capacity from each "
              "step's peak resident memory above its start (host peak), one more step after the timings")
    for spec in specs:
        print(f"  {spec.name}: {spec.description}")
    print(f"  buddy backend: {backend}; {args.warmup} warm-up + {args.steps} timed steps per method")
    measurements = []
    jobs = [(s, m) for s in specs for m in args.methods]
    for spec, method in progress(jobs, desc="step time", enabled=not args.no_progress):
        measurements.append(
            measure(spec, method, device=device, steps=args.steps, warmup=args.warmup, seed=args.seed,
                    profile=args.profile, memory_peak=args.memory_peak)
        )  # fmt: skip
        if args.no_progress:  # (the runbook's way): a line as each is measured, kept in the log if a later one stops
            print(measured_line(measurements[-1]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if kind == "cpu":  # after every timing (the threshold stays for the process): each method's step once more
        fix_mmap_threshold()
        for (spec, method), m in zip(jobs, measurements):
            again = measure(spec, method, device=device, steps=1, warmup=args.warmup, seed=args.seed, peak_on_host=True)
            m.host_peak_bytes = again.host_peak_bytes
    rows = rows_vs_none(measurements)
    print()
    print(format_table(rows, COLUMNS))
    verdicts = _verdicts(rows) if kind == "cuda" else ["  (targets are checked on a GPU only)"]
    print("\n".join(verdicts))
    for r in rows:
        if r["profile"]:
            print(format_profile(r))
    if args.memory_peak:
        from experiments.memory_peak import format_breakdown

        print("\nWhat each step held at its peak (one more step under the allocator's history):")
        for r in rows:
            label = f"{r['model']} / {r['method']}"
            print(format_breakdown(label, r["memory_peak"]) if r["memory_peak"] else f"  {label}: needs a CUDA device")
    cli.finish(
        args, header, rows, plot=plot, mention_csv=False,
        experiment="step_time", backend=backend, models={s.name: s.description for s in specs},
        cpu_run=kind == "cpu", verdicts=verdicts,
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
