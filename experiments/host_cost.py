"""What buddy's host work costs per saved tensor, and how the step's plan grows with the tensors a step saves.

A synthetic step saves ``N`` small activations (``x = relu(x * w)``, ``N`` times: each multiply saves its input,
each ReLU its output; a few KiB each, so the kernels take little and the rest is buddy's host work -- Python and
torch operations around them) and runs backward, alternately plain and inside ``buddy.compressed_activations()``.
Per tensor compressed, the wall time the session adds and its compress and decompress times (the session's own
counters); then the tracker's per-step plan (:meth:`buddy.OverflowBudget.plan`, the default policy's) on the
histories those steps left, timed alone. On a GPU (``--device cuda``) the same numbers are the per-tensor floor
of a training step's overhead. With fewer warm-up steps than the tracker's count warm-up
(:attr:`buddy.Tracker.count_warmup`, 32), every timed compress also counts its tensor's symbols, which a learned
key's does one step in four after it: the compress figure is the warm-up's, an upper bound of the steady state's
(``--warmup 40`` times the steady state). Then where a step packed ahead spends its host time, stage by stage, in
the steady state (:func:`stage_times`: the plan, the engine, each kernel launch, forward's end, the unpack). Last,
what a save costs that buddy does not take (most of an LSTM's: small ones, and weights), against autograd's own
cost of Python hooks (:func:`skipped_saves`).

Each row times the session sized first (``strict=True``: each tensor sized first, a read of the device a tensor) and
the step that reads the device at most twice (``strict=False``, the default, "ahead": slots from the tracker's plan),
with each one's reads a step. Then two small models trained a step at a time the same three ways
(:func:`model_steps`): a 16-layer MLP under bf16 autocast and a 7-layer CNN, with the library's defaults -- a step's
wall time against the plain step's, its reads, and the torch operators that allocate or compute which a compressed
tensor adds (views and detaches apart, and the cast of each weight made again in backward), counted with a
``TorchDispatchMode``. Their inputs are random, like the chain's: these rows measure the host's work, not
compression.

    python -m experiments.host_cost                              # 32, 128 and 256 tensors a step, on the CPU
    python -m experiments.host_cost --tensors 64 --numel 65536
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import buddy
from experiments import cli
from experiments.common import format_table, progress
from experiments.operators import OperatorCount

__all__ = ["STAGES", "chain_step", "measure", "stage_times", "main"]


def chain_step(n: int, *, numel: int, device: str, seed: int, tracker: buddy.Tracker) -> Callable[[str], buddy.Session]:
    """The synthetic step of the module doc: ``step(kind)`` runs one (``kind``: ``"none"``, plain; ``"buddy"``, sized
    first; ``"ahead"``, packed ahead) of ``n`` links of ``numel`` float32 values, histories on ``tracker``, and
    returns its session."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(numel, generator=gen).to(device).requires_grad_() for _ in range(n)]
    start = torch.randn(numel, generator=gen).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step(kind: str) -> buddy.Session:
        enabled, strict = kind != "none", kind != "ahead"
        with buddy.compressed_activations(tracker=tracker, min_bytes=1024, enabled=enabled, strict=strict) as session:
            x = start
            for w in weights:
                x = torch.relu(x * w)
            loss = x.sum()
        loss.backward()
        sync()
        return session

    return step


def measure(n: int, *, numel: int, steps: int, warmup: int, device: str, seed: int) -> dict:
    """One row: ``n`` tensors a step of ``numel`` float32 values each (see the module doc)."""
    tracker = buddy.Tracker()  # this row's own history
    step = chain_step(n, numel=numel, device=device, seed=seed, tracker=tracker)

    kinds = ("buddy", "ahead", "none")
    walls: dict[str, list[float]] = {kind: [] for kind in kinds}
    compress: dict[str, list[float]] = {"buddy": [], "ahead": []}
    decompress: dict[str, list[float]] = {"buddy": [], "ahead": []}
    reads: dict[str, list[int]] = {"buddy": [], "ahead": []}
    tensors = 0
    for i in range(warmup + steps):
        for kind in kinds:  # alternating, so that a slow stretch of the machine hits each alike
            began = time.perf_counter()
            session = step(kind)
            took = time.perf_counter() - began
            if i < warmup:
                continue
            walls[kind].append(took)
            if kind != "none":
                st = session.stats()
                tensors = sum(r.codec != "kept" for r in st.rows)
                compress[kind].append(st.compress_seconds / max(tensors, 1))
                decompress[kind].append(st.decompress_seconds / max(st.decompressions, 1))
                reads[kind].append(st.host_reads)
    plans = []
    plan = getattr(tracker.policy, "plan", None)  # (the default policy's; a policy without one: no column)
    if plan is not None:
        for _ in range(max(steps, 3)):  # the plan of the histories the steps left, alone
            began = time.perf_counter()
            plan(tracker)
            plans.append(time.perf_counter() - began)
    buddy_s, plain_s, ahead_s = (statistics.median(walls[k]) for k in ("buddy", "none", "ahead"))
    return {
        "tensors_asked": n,
        "tensors": tensors,
        "numel": numel,
        "device": device,
        "steps": steps,
        "plain_step_s": plain_s,
        "buddy_step_s": buddy_s,
        "added_per_tensor_us": (buddy_s - plain_s) / max(tensors, 1) * 1e6,
        "compress_us": statistics.median(compress["buddy"]) * 1e6,
        "decompress_us": statistics.median(decompress["buddy"]) * 1e6,
        "host_reads": statistics.median(reads["buddy"]),
        # the step that reads the device at most twice (strict=False)
        "ahead_step_s": ahead_s,
        "ahead_added_per_tensor_us": (ahead_s - plain_s) / max(tensors, 1) * 1e6,
        "ahead_compress_us": statistics.median(compress["ahead"]) * 1e6,
        "ahead_decompress_us": statistics.median(decompress["ahead"]) * 1e6,
        "ahead_host_reads": statistics.median(reads["ahead"]),
        "plan_ms": statistics.median(plans) * 1e3 if plans else None,
    }


#: the stages :func:`stage_times` times: (where, the method, what it is); a stage's time holds those it calls
STAGES = (
    ("buddy.hooks", "_SavedTensorHooks._pack", "the pack hook, every save"),
    ("buddy.autograd", "Session._take_ahead", "a tensor packed ahead"),
    ("buddy.tracker", "Tracker.plan_ahead", "  its slot, from the plan"),
    ("buddy.engines.kernel_engine", "KernelEngine.pack_ahead", "  the engine's pack ahead"),
    ("buddy.engines.kernel_engine", "KernelEngine._fit_ahead", "    its table, fitted to the prior"),
    ("buddy.step", "AheadStep.settle", "forward's end: the read, the sizes settled"),
    ("buddy.tracker", "Tracker.record", "  the tracker learning each"),
    ("buddy.saved", "_Compressed.unpack", "backward's unpack, every use"),
    ("buddy.tensor", "BuddyTensor.decompress", "  a decompression"),
    ("buddy.engines.kernel_engine", "KernelEngine.unpack", "    the engine's unpack"),
)


@contextlib.contextmanager
def _timed(spent: dict[str, float], calls: dict[str, int]):
    """Within the block, each of :data:`STAGES`, and :meth:`buddy.engines.kernels.Kernels.launch` by operation, adds
    its wall time and calls to ``spent`` and ``calls`` (by stage name); everything is restored after."""
    import functools
    import importlib

    def timing(fn, name_of):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name = name_of(args)
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - began
                calls[name] = calls.get(name, 0) + 1

        return timed

    launches = ("buddy.engines.kernels", "Kernels.launch", lambda args: f"launches of {args[2]} (their host work, run)")
    patched = []
    for module, qualname, name_of in [*((m, q, lambda args, what=what: what) for m, q, what in STAGES), launches]:
        owner_name, attr = qualname.split(".")
        owner = getattr(importlib.import_module(module), owner_name)
        fn = owner.__dict__[attr]
        patched.append((owner, attr, fn))
        setattr(owner, attr, timing(fn, name_of))
    try:
        yield
    finally:
        for owner, attr, fn in patched:
            setattr(owner, attr, fn)


def stage_times(n: int, *, numel: int, steps: int, warmup: int, device: str, seed: int) -> list[dict]:
    """Where a step packed ahead spends its host time: the synthetic step of :func:`measure` (``n`` tensors of
    ``numel`` float32 values), its :data:`STAGES` and kernel launches timed over ``steps`` steps after ``warmup``:
    per stage its microseconds per compressed tensor (inclusive) and calls a step. The timers add about a microsecond
    a call. On the CPU a launch's time holds its kernel's run (the native build runs it as it is launched)."""
    # the steady state: symbols counted one step in count_every
    step = chain_step(n, numel=numel, device=device, seed=seed, tracker=buddy.Tracker(count_warmup=0))
    for _ in range(warmup):
        step("ahead")
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    with _timed(spent, calls):
        began = time.perf_counter()
        for _ in range(steps):
            session = step("ahead")
        wall = time.perf_counter() - began
    tensors = max(sum(r.codec != "kept" for r in session.stats().rows), 1)
    order = [what for _, _, what in STAGES]
    rows = [{"stage": "the step, all of it", "us_per_tensor": wall / steps / tensors * 1e6, "calls_per_step": 1.0,
             "tensors": tensors}]  # fmt: skip
    for name in sorted(spent, key=lambda k: (order.index(k) if k in order else len(order), k)):
        rows.append({"stage": name, "us_per_tensor": spent[name] / steps / tensors * 1e6,
                     "calls_per_step": calls[name] / steps})  # fmt: skip
    return rows


STAGE_COLUMNS = [
    ("stage", "stage", ""),
    ("us_per_tensor", "us a compressed tensor", ",.1f"),
    ("calls_per_step", "calls a step", ",.1f"),
]


def _mlp(device: str):
    torch.manual_seed(0)
    layers = [m for _ in range(16) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10)).to(device), torch.randn(512, 1024, device=device)


def _cnn(device: str):
    torch.manual_seed(0)
    layers, width = [], 3
    for out in (32, 32, 64, 64, 64, 64, 64):
        layers += [torch.nn.Conv2d(width, out, 3, padding=1), torch.nn.BatchNorm2d(out), torch.nn.ReLU()]
        width = out
    head = [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, 10)]
    return torch.nn.Sequential(*layers, *head).to(device), torch.randn(16, 3, 64, 64, device=device)


#: the models of :func:`model_steps`: (builder, under bf16 autocast)
MODELS = {"mlp16-bf16": (_mlp, True), "cnn7-fp32": (_cnn, False)}


def model_steps(name: str, *, steps: int, warmup: int, device: str) -> dict:
    """One row of a model of :data:`MODELS`: its step plain, sized first and ahead (see the module doc)."""
    build, autocast = MODELS[name]
    model, x = build(device)
    y = torch.randint(0, 10, (x.shape[0],), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # the steady state from the start: a key's symbols counted one step in count_every, not every step of a warm-up
    tracker = buddy.Tracker(count_warmup=0)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    kinds = ("none", "buddy", "ahead")

    def step(kind: str):
        opt.zero_grad()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            with buddy.compressed_activations(tracker=tracker, enabled=kind != "none", strict=kind != "ahead") as s:
                loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.float().backward()
        opt.step()
        sync()
        return s

    walls: dict[str, list[float]] = {kind: [] for kind in kinds}
    for i in range(warmup + steps):
        for kind in kinds:  # alternating, so that a slow stretch of the machine hits each alike
            began = time.perf_counter()
            step(kind)
            if i >= warmup:
                walls[kind].append(time.perf_counter() - began)
    row: dict = {"model": name, "device": device, "steps": steps}
    operators = {}
    for kind in kinds:  # over count_every steps: a key's symbols counted in one of them, as in the steady state
        with OperatorCount() as counted:
            for _ in range(tracker.count_every):
                session = step(kind)
        operators[kind] = counted.count / tracker.count_every
        if kind != "none":
            st = session.stats()
            tensors, taken = sum(r.codec != "kept" for r in st.rows), len(st.rows)  # (taken: kept whole too)
            row[f"{kind}_host_reads"] = st.host_reads
            row[f"{kind}_capacity"] = st.effective_capacity
            row[f"{kind}_rederived"] = st.rederived
    plain = statistics.median(walls["none"])
    row.update(tensors=tensors, taken=taken, plain_step_s=plain)
    for kind in ("buddy", "ahead"):
        row[f"{kind}_ratio"] = statistics.median(walls[kind]) / plain
        # a weight's copy made again in backward is one operator (its cast), not a compressed tensor's
        extra = operators[kind] - operators["none"] - row[f"{kind}_rederived"]
        row[f"{kind}_operators_per_tensor"] = extra / max(tensors, 1)
    return row


MODEL_COLUMNS = [
    ("model", "model", ""),
    ("tensors", "tensors compressed", "d"),
    ("plain_step_s", "plain step (s)", ".3f"),
    ("buddy_ratio", "sized / plain", ".2f"),
    ("buddy_host_reads", "sized: reads", "d"),
    ("buddy_operators_per_tensor", "sized: operators a tensor", ".1f"),
    ("ahead_ratio", "ahead / plain", ".2f"),
    ("ahead_host_reads", "ahead: reads", "d"),
    ("ahead_operators_per_tensor", "ahead: operators a tensor", ".1f"),
    ("buddy_capacity", "capacity", ".2f"),
    ("ahead_rederived", "weights' casts made again", "d"),
]


def skipped_saves(saves: int, *, repeats: int, device: str) -> dict:
    """What a save costs that buddy does not take: ``saves`` tanh links of 64 values (each saves its output, small),
    timed alternately without hooks, with hooks that return the tensor or detach it (autograd's own cost of Python
    hooks), and inside ``buddy.compressed_activations()`` disabled and enabled; medians of ``repeats``, per save,
    above the step without hooks (microseconds)."""
    x0 = torch.randn(64, device=device, requires_grad=True)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def chain(context) -> float:
        began = time.perf_counter()
        with context:
            x = x0
            for _ in range(saves):
                x = torch.tanh(x)
            loss = x.sum()
        loss.backward()
        sync()
        return time.perf_counter() - began

    kinds: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "none": contextlib.nullcontext,
        "identity_hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        "detach_hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t),
        "buddy_disabled": lambda: buddy.compressed_activations(enabled=False),
        "buddy_small": lambda: buddy.compressed_activations(),  # every save below min_bytes: none taken
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(repeats + 1):  # the first round warms up
        for kind, make in kinds.items():
            took = chain(make())
            if i:
                times[kind].append(took)
    base = statistics.median(times["none"])
    return {f"{k}_us": (statistics.median(v) - base) / saves * 1e6 for k, v in times.items() if k != "none"}


SKIPPED_COLUMNS = [
    ("identity_hooks_us", "hooks returning it (us)", ".2f"),
    ("detach_hooks_us", "hooks detaching it (us)", ".2f"),
    ("buddy_disabled_us", "buddy, disabled (us)", ".2f"),
    ("buddy_small_us", "buddy, a small save (us)", ".2f"),
]


COLUMNS = [
    ("tensors", "tensors compressed a step", "d"),
    ("plain_step_s", "plain step (s)", ".4f"),
    ("buddy_step_s", "buddy step (s)", ".4f"),
    ("added_per_tensor_us", "added a tensor (us)", ",.0f"),
    ("compress_us", "compress a tensor (us)", ",.0f"),
    ("decompress_us", "decompress a tensor (us)", ",.0f"),
    ("host_reads", "reads a step", ".0f"),
    ("ahead_added_per_tensor_us", "ahead: added a tensor (us)", ",.0f"),
    ("ahead_compress_us", "ahead: compress (us)", ",.0f"),
    ("ahead_decompress_us", "ahead: decompress (us)", ",.0f"),
    ("ahead_host_reads", "ahead: reads a step", ".0f"),
    ("plan_ms", "the step's plan (ms)", ".2f"),
]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, nargs="+", default=[32, 128, 256], help="tensors a step saves")
    p.add_argument("--numel", type=int, default=4096, help="float32 values of each (4096: 16 KiB, 4 entries)")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each kind")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each kind first (the tracker learns)")
    p.add_argument("--saves", type=int, default=2000, help="small saves a step of the skipped-save timing")
    p.add_argument("--models", nargs="*", choices=sorted(MODELS), default=sorted(MODELS),
                   help="small models whose step is timed plain, sized and ahead (none: skip them)")  # fmt: skip
    cli.add_common_arguments(p, out="results/host_cost", device="cpu")
    args = p.parse_args(argv)
    if min(args.tensors) < 1 or args.numel < 1 or args.steps < 1 or args.saves < 1 or args.warmup < 0:
        p.error("--tensors, --numel, --steps and --saves must be at least 1, --warmup at least 0")
    return args


def main(argv=None) -> list[dict]:
    args, header = cli.begin("host_cost", parse_args, argv)
    rows = []
    for n in progress(args.tensors, desc="tensors a step", enabled=not args.no_progress):
        rows.append(measure(n, numel=args.numel, steps=args.steps, warmup=args.warmup, device=args.device,
                            seed=args.seed))  # fmt: skip
    print(f"\nbuddy's host work per tensor ({args.numel} float32 values each, {buddy.defaults().codec}, the "
          f"tracker's default policy, {args.device}); medians of {args.steps} steps")  # fmt: skip
    print(format_table(rows, COLUMNS))
    stages = stage_times(max(args.tensors), numel=args.numel, steps=args.steps, warmup=max(args.warmup, 3),
                         device=args.device, seed=args.seed)  # fmt: skip
    print(f"\nWhere a step packed ahead spends its host time ({max(args.tensors)} tensors, the steady state), per "
          "tensor compressed; a stage's time holds the indented ones below it, and the launches made "
          "in it:")  # fmt: skip
    print(format_table(stages, STAGE_COLUMNS))
    models = [
        model_steps(name, steps=args.steps, warmup=max(args.warmup, 3), device=args.device)
        for name in progress(args.models, desc="models", enabled=not args.no_progress)
    ]
    if models:
        print("\nA training step of small models (random inputs), the library's defaults, against the plain step "
              "(wall time); operators that allocate or compute a compressed tensor adds, views apart:")  # fmt: skip
        print(format_table(models, MODEL_COLUMNS))
    skipped = skipped_saves(args.saves, repeats=max(args.steps, 3), device=args.device)
    print(f"\nA save buddy does not take ({args.saves} tanh saves of 64 values a step), over the step without hooks, "
          "per save:")  # fmt: skip
    print(format_table([skipped], SKIPPED_COLUMNS))
    cli.finish(args, header, rows, mention_csv=False, experiment="host_cost", skipped_saves=skipped, models=models,
               stages=stages)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
