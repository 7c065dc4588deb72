"""Golden vectors of format version 1: every codec writes exactly the bytes it wrote when they were made.

``tests/golden/format_v1.npz`` holds inputs and, per codec and slot, the
metadata, slot and overflow bytes (``tests/golden/make_golden.py`` wrote
them). A change that moves one byte of the format fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_bitexact

import buddy
from buddy import spec

GOLDEN = Path(__file__).resolve().parent / "golden"
_INDEX = json.loads((GOLDEN / "format_v1.json").read_text())
CASES = _INDEX["cases"]


@pytest.fixture(scope="module")
def vectors():
    with np.load(GOLDEN / "format_v1.npz") as data:
        return {k: torch.from_numpy(data[k].copy()) for k in data.files}


def _case_id(case: dict) -> str:
    return f"{case['input']}-codec={case['codec']}"


def test_the_vectors_are_format_v1():
    assert _INDEX["format_version"] == spec.FORMAT_VERSION == 1
    assert len(CASES) == 175
    assert {c["codec"] for c in CASES} == {"raw", "zvc", "fpx", "bpc", "auto"}


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in CASES])
def test_compress_writes_the_golden_bytes(case, vectors, store):
    dtype = getattr(torch, case["dtype"])
    t = vectors[f"{case['input']}/input"].view(dtype)
    key = f"{case['input']}/{case['codec']}"
    for slot in case["slots"]:
        ratio = spec.ratio_for_slot(slot, case["entry_bytes"])
        bt = buddy.compress(t, target_ratio=ratio, codec=case["codec"], entry_bytes=case["entry_bytes"], store=store)
        meta, slots, overflow = bt.buffers()
        assert torch.equal(meta, vectors[f"{key}/meta"]), "metadata moved"
        assert torch.equal(slots, vectors[f"{key}/s{slot}/slots"]), f"slot bytes moved (slot {slot})"
        assert torch.equal(overflow, vectors[f"{key}/s{slot}/overflow"]), f"overflow bytes moved (slot {slot})"
        bt.free()


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in CASES])
def test_the_golden_buffers_decode_to_the_input(case, vectors):
    dtype = getattr(torch, case["dtype"])
    t = vectors[f"{case['input']}/input"].view(dtype)
    key = f"{case['input']}/{case['codec']}"
    for slot in case["slots"]:
        out = buddy.unpack(
            vectors[f"{key}/meta"],
            vectors[f"{key}/s{slot}/slots"],
            vectors[f"{key}/s{slot}/overflow"],
            codec=case["codec"],
            entry_bytes=case["entry_bytes"],
            slot_sectors=slot,
            shape=t.shape,
            dtype=dtype,
        )
        assert_bitexact(out, t)
