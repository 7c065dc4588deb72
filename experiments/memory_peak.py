"""What a training step holds on the device at its peak, and who allocated it.

``step_time --memory-peak`` runs one more step of a method under PyTorch's
allocator history (``torch.cuda.memory._record_memory_history``: every
allocation and free with the Python stack that made it), then replays the
history here: the step's peak of allocated bytes, when it came (the share of
the step's allocations before it), and the allocations alive at that moment,
grouped by where they were made:

* ``buddy <file>:<function>`` -- the innermost frame in the package (its
  kernels' buffers, slots, staging, tables);
* ``<file>:<line> <function>`` -- else the innermost frame outside torch (the
  model's code, the loss);
* ``autograd (no Python frame)`` -- else: backward's own allocations (the
  autograd engine runs without a Python stack), gradients included.

Memory allocated before the step (parameters, optimizer state, buffers kept
from the step before) is one line, ``before the step``. The capacity of
``step_time`` is read from the peak alone; this says what made it, so that a
method that holds little between steps but peaks high (a compress's working
buffers beside the tensor it compresses, decompressed copies waiting for
backward) shows where.

Needs a CUDA device; elsewhere nothing is recorded.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import PurePath

import torch

import buddy

__all__ = ["record_step", "peak_breakdown", "site", "format_breakdown"]

#: allocator events kept (each a few KiB with its stack): a step of GPT-2-small at 16 x 1024 makes about 20,000
MAX_ENTRIES = 200_000


#: the package's folder: a frame whose file is under it is buddy's
_PACKAGE = str(PurePath(buddy.__file__).parent) + "/"


def site(frames: Sequence[dict]) -> str:
    """Where an allocation was made, from its Python frames (innermost first, as the allocator records them)."""
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if filename.startswith(_PACKAGE):
            return f"buddy {PurePath(filename).name}:{frame.get('name', '?')}"
    for frame in frames:
        path = PurePath(str(frame.get("filename", "")))
        inside = {"torch", "importlib"} & set(path.parts) or path.name.startswith("<")
        if not inside and path.name:
            return f"{path.name}:{frame.get('line', '?')} {frame.get('name', '?')}"
    return "autograd (no Python frame)"


def peak_breakdown(events: Iterable[dict], before_bytes: int = 0, top: int = 12) -> dict:
    """The peak of allocated bytes over ``events`` (the allocator's trace: ``alloc`` and ``free_completed``
    events with ``addr``, ``size`` and ``frames``; others ignored) on top of ``before_bytes`` already allocated,
    and what was alive then, by :func:`site`: the ``top`` sites by bytes, the rest as one line.

    A free of an allocation the trace did not see (made before it) counts against ``before_bytes``."""
    events = [e for e in events if e.get("action") in ("alloc", "free_completed")]
    allocated, peak, at = before_bytes, before_bytes, -1
    for i, e in enumerate(events):
        allocated += e["size"] if e["action"] == "alloc" else -e["size"]
        if allocated > peak:
            peak, at = allocated, i
    live: dict[int, dict] = {}
    before = before_bytes
    for e in events[: at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif live.pop(e["addr"], None) is None:
            before -= e["size"]
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        entry = sites[site(e.get("frames") or ())]
        entry[0] += e["size"]
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    rows = [{"site": "before the step", "bytes": before, "allocations": None}] if before else []
    rows += [{"site": s, "bytes": b, "allocations": n} for s, (b, n) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        rows.append({"site": f"{len(rest)} other sites", "bytes": sum(b for _, (b, _) in rest),
                     "allocations": sum(n for _, (_, n) in rest)})  # fmt: skip
    allocs = sum(1 for e in events if e["action"] == "alloc")
    before_peak = sum(1 for e in events[: at + 1] if e["action"] == "alloc")
    trigger = site(events[at].get("frames") or ()) if at >= 0 else None
    return {
        "peak_bytes": peak,
        "before_bytes": before_bytes,
        "allocations": allocs,
        "at": before_peak / allocs if allocs else None,  # the share of the step's allocations made by the peak
        "trigger": trigger,  # where the allocation that made the peak came from
        "sites": rows,
    }


def record_step(step: Callable[[], object], device: torch.device, top: int = 12) -> dict | None:
    """:func:`peak_breakdown` of one call of ``step`` on ``device`` (a CUDA device; else ``None``), its
    allocations recorded with their Python stacks; the history is switched off again afterwards."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    memory = torch.cuda.memory
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = memory._snapshot()
    finally:
        memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    traces = snapshot.get("device_traces") or []
    events = traces[index] if index < len(traces) else []
    out = peak_breakdown(events, before, top)
    out["events"] = len(events)
    out["truncated"] = len(events) >= MAX_ENTRIES  # the ring kept only the last MAX_ENTRIES: the peak may be lost
    return out


def format_breakdown(label: str, breakdown: dict) -> str:
    """A few lines: the peak, when it came, and what was alive then."""
    gib = 2**30
    at = breakdown.get("at")
    lines = [
        f"  {label}: peak {breakdown['peak_bytes'] / gib:.2f} GiB"
        + (f" after {at:.0%} of the step's {breakdown['allocations']:,} allocations" if at is not None else "")
        + (f"; the peak's allocation: {breakdown['trigger']}" if breakdown.get("trigger") else "")
        + (" (the history was truncated)" if breakdown.get("truncated") else "")
    ]
    for row in breakdown["sites"]:
        count = f" ({row['allocations']:,})" if row["allocations"] else ""
        lines.append(f"    {row['bytes'] / gib:7.2f} GiB  {row['site']}{count}")
    return "\n".join(lines)
