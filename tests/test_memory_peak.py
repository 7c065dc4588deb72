"""The memory-peak analyser of step_time --memory-peak (experiments.memory_peak), on hand-made allocator traces."""

from __future__ import annotations

from pathlib import Path

import pytest

import buddy
from experiments.memory_peak import format_breakdown, peak_breakdown, record_step, site

PACKAGE = Path(buddy.__file__).parent
TORCH = "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py"


def frame(filename, name="f", line=1):
    return {"filename": str(filename), "name": name, "line": line}


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr, size):
    return {"action": "free_completed", "addr": addr, "size": size, "frames": []}


def test_a_site_is_buddys_innermost_frame_else_the_innermost_outside_torch():
    model = frame("/home/me/train.py", "forward", 42)
    assert site([frame(PACKAGE / "engines" / "cuda.py", "pack"), frame(TORCH), model]) == "buddy cuda.py:pack"
    assert site([frame(TORCH, "_call_impl"), model]) == "train.py:42 forward"
    assert site([frame(TORCH, "_call_impl")]) == "autograd (no Python frame)"
    assert site([]) == "autograd (no Python frame)"
    # a file named like the package elsewhere is not the package
    assert site([frame("/src/buddy_tools/x.py", "g", 3)]) == "x.py:3 g"


def test_the_peak_and_what_was_alive_then():
    model = frame("/home/me/train.py", "forward", 7)
    packer = frame(PACKAGE / "pipeline.py", "_pack")
    events = [
        alloc(1, 100, model),  # an activation
        alloc(2, 50, packer),  # buddy's buffer
        {"action": "free_requested", "addr": 2, "size": 50},  # not yet free: ignored
        alloc(3, 30, frame(TORCH)),  # autograd's
        free(2, 50),
        free(9, 40),  # made before the step: counts against what was there before it
        alloc(4, 10, model),
    ]
    got = peak_breakdown(events, before_bytes=1000)
    assert got["peak_bytes"] == 1000 + 180  # after the third allocation, before any free
    assert got["allocations"] == 4 and got["at"] == pytest.approx(3 / 4)
    assert got["trigger"] == "autograd (no Python frame)"
    assert got["sites"] == [
        {"site": "before the step", "bytes": 1000, "allocations": None},
        {"site": "train.py:7 forward", "bytes": 100, "allocations": 1},
        {"site": "buddy pipeline.py:_pack", "bytes": 50, "allocations": 1},
        {"site": "autograd (no Python frame)", "bytes": 30, "allocations": 1},
    ]
    assert sum(r["bytes"] for r in got["sites"]) == got["peak_bytes"]


def test_a_peak_after_frees_of_earlier_memory_counts_what_is_left_of_it():
    events = [free(9, 400), alloc(1, 100, frame("/a/m.py")), alloc(2, 200, frame("/a/m.py"))]
    got = peak_breakdown(events, before_bytes=1000)
    assert got["peak_bytes"] == 1000  # the start: nothing later passed it
    assert got["at"] == 0 and got["trigger"] is None
    got = peak_breakdown(events[1:] + [free(9, 400)], before_bytes=1000)
    assert got["peak_bytes"] == 1300
    assert got["sites"][0] == {"site": "before the step", "bytes": 1000, "allocations": None}


def test_sites_past_the_top_are_one_line():
    events = [alloc(i, 10 * (i + 1), frame(f"/a/m{i}.py", "f", i)) for i in range(5)]
    got = peak_breakdown(events, top=2)
    assert [r["site"] for r in got["sites"]] == ["m4.py:4 f", "m3.py:3 f", "3 other sites"]
    assert got["sites"][-1] == {"site": "3 other sites", "bytes": 10 + 20 + 30, "allocations": 3}
    text = format_breakdown("gpt2 / buddy", got)
    assert text.splitlines()[0].startswith("  gpt2 / buddy: peak 0.00 GiB after 100% of the step's 5 allocations")
    assert "3 other sites (3)" in text


def test_recording_needs_a_cuda_device():
    assert record_step(lambda: None, "cpu") is None
