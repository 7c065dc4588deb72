"""Golden vectors of each format version: every codec writes exactly the bytes it wrote when they were made.

``tests/golden/<set>.npz`` holds inputs and, per codec and slot, the
metadata, slot and overflow bytes, and from version 2 on the table
(``tests/golden/make_golden.py`` wrote them; version 1's before version 2
existed). The sets: ``format_v1``; ``format_v2`` and ``format_v2_table2``,
whose tables are of table formats 1 and 2 (the serial payload layout), which
fits no longer make, so they are only decoded; and ``format_v3``, tables of
format 3 (the split layout). A change that moves one byte of a format still
written fails here, and one that stops any set decoding.
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
#: set -> whether today's codecs still write it (else it is only decoded)
SETS = {"format_v1": True, "format_v2": False, "format_v2_table2": False, "format_v3": True}
_INDEX = {name: json.loads((GOLDEN / f"{name}.json").read_text()) for name in SETS}
CASES = [dict(case, set=name, version=_INDEX[name]["format_version"]) for name in SETS for case in _INDEX[name]["cases"]]


def load_vectors() -> dict[str, torch.Tensor]:
    """Every set's arrays, by ``<set>/<name in the set>``."""
    out = {}
    for name in SETS:
        with np.load(GOLDEN / f"{name}.npz") as data:
            out.update({f"{name}/{k}": torch.from_numpy(data[k].copy()) for k in data.files})
    return out


@pytest.fixture(scope="module")
def vectors():
    return load_vectors()


def _case_id(case: dict) -> str:
    return f"{case['set']}-{case['input']}-codec={case['codec']}"


def test_the_vectors_cover_every_version_and_table_format():
    assert spec.FORMAT_VERSION == 3
    assert [_INDEX[name]["format_version"] for name in SETS] == [1, 2, 2, 3]
    assert [len(_INDEX[name]["cases"]) for name in SETS] == [175, 70, 70, 70]
    assert {c["codec"] for c in _INDEX["format_v1"]["cases"]} == {"raw", "zvc", "fpx", "bpc", "auto"}
    for name in ("format_v2", "format_v2_table2", "format_v3"):
        assert {c["codec"] for c in _INDEX[name]["cases"]} == {"fpe", "auto2"}
    for name, table_format in (("format_v2", 1), ("format_v2_table2", 2), ("format_v3", 3)):
        with np.load(GOLDEN / f"{name}.npz") as data:
            assert {int(data[k][0]) for k in data.files if k.endswith("/table")} == {table_format}
    for codec in ("raw", "zvc", "fpx", "bpc", "auto"):
        assert buddy.get_codec(codec).format_version == 1, "a version 1 codec still writes version 1"
    for codec in ("fpe", "auto2"):
        assert buddy.get_codec(codec).format_version == 3


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in CASES if SETS[c["set"]]])
def test_compress_writes_the_golden_bytes(case, vectors, store):
    dtype = getattr(torch, case["dtype"])
    v = case["set"]
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
    v = case["set"]
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
