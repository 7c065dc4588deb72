"""Golden vectors of each format version: every codec writes exactly the bytes it wrote when they were made.

``tests/golden/format_v<N>.npz`` holds inputs and, per codec and slot, the
metadata, slot and overflow bytes, and for version 2 the table
(``tests/golden/make_golden.py`` wrote them; version 1's before version 2
existed). A change that moves one byte of either format fails here.
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
VERSIONS = (1, 2)
_INDEX = {v: json.loads((GOLDEN / f"format_v{v}.json").read_text()) for v in VERSIONS}
CASES = [dict(case, version=v) for v in VERSIONS for case in _INDEX[v]["cases"]]


@pytest.fixture(scope="module")
def vectors():
    out = {}
    for v in VERSIONS:
        with np.load(GOLDEN / f"format_v{v}.npz") as data:
            out.update({f"v{v}/{k}": torch.from_numpy(data[k].copy()) for k in data.files})
    return out


def _case_id(case: dict) -> str:
    return f"v{case['version']}-{case['input']}-codec={case['codec']}"


def test_the_vectors_cover_both_versions():
    assert spec.FORMAT_VERSION == 2
    assert [_INDEX[v]["format_version"] for v in VERSIONS] == [1, 2]
    assert len(_INDEX[1]["cases"]) == 175 and len(_INDEX[2]["cases"]) == 70
    assert {c["codec"] for c in _INDEX[1]["cases"]} == {"raw", "zvc", "fpx", "bpc", "auto"}
    assert {c["codec"] for c in _INDEX[2]["cases"]} == {"fpe", "auto2"}
    for codec in ("raw", "zvc", "fpx", "bpc", "auto"):
        assert buddy.get_codec(codec).format_version == 1, "a version 1 codec still writes version 1"
    for codec in ("fpe", "auto2"):
        assert buddy.get_codec(codec).format_version == 2


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in CASES])
def test_compress_writes_the_golden_bytes(case, vectors, store):
    dtype = getattr(torch, case["dtype"])
    v = f"v{case['version']}"
    t = vectors[f"{v}/{case['input']}/input"].view(dtype)
    key = f"{v}/{case['input']}/{case['codec']}"
    for slot in case["slots"]:
        ratio = spec.ratio_for_slot(slot, case["entry_bytes"])
        bt = buddy.compress(t, target_ratio=ratio, codec=case["codec"], entry_bytes=case["entry_bytes"], store=store)
        assert bt.format_version == case["version"]
        meta, slots, overflow = bt.buffers()
        assert torch.equal(meta, vectors[f"{key}/meta"]), "metadata moved"
        if case["version"] >= 2:
            assert torch.equal(bt.table, vectors[f"{key}/table"]), "table moved"
        assert torch.equal(slots, vectors[f"{key}/s{slot}/slots"]), f"slot bytes moved (slot {slot})"
        assert torch.equal(overflow, vectors[f"{key}/s{slot}/overflow"]), f"overflow bytes moved (slot {slot})"
        bt.free()


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in CASES])
def test_the_golden_buffers_decode_to_the_input(case, vectors):
    dtype = getattr(torch, case["dtype"])
    v = f"v{case['version']}"
    t = vectors[f"{v}/{case['input']}/input"].view(dtype)
    key = f"{v}/{case['input']}/{case['codec']}"
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
            table=vectors.get(f"{key}/table"),
        )
        assert_bitexact(out, t)
