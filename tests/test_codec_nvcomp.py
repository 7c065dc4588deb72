"""nvcomp chunk codecs: a clear refusal without a GPU, bit-exact round trips with one.

The GPU half is marked ``gpu`` and skips without CUDA and nvcomp.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_roundtrip, ids, make_data

import buddy
from buddy.codecs import nvcomp

CHUNK_ENTRIES = (4096, 65536)


def test_names_map_to_nvcomp_algorithms():
    assert set(nvcomp.NAMES) == {f"nvcomp-{a.lower()}" for a in nvcomp.ALGORITHMS.values()}
    with pytest.raises(ValueError, match="one of"):
        nvcomp.NvcompCodec("nvcomp-brotli")


@pytest.mark.skipif(nvcomp.usable(), reason="checks the refusal where nvcomp cannot run")
def test_unusable_here_is_refused_by_name_with_the_reason():
    assert not set(nvcomp.NAMES) & set(buddy.available_codecs())
    with pytest.raises(buddy.MissingDependencyError, match="not available here") as info:
        buddy.get_codec("nvcomp-lz4")
    assert nvcomp.why_unusable() in str(info.value)
    with pytest.raises(buddy.MissingDependencyError):
        buddy.compress(torch.zeros(64), codec="nvcomp-ans")


@pytest.mark.parametrize("name", nvcomp.NAMES)
def test_cpu_tensors_are_refused_before_any_work(name, store):
    codec = nvcomp.NvcompCodec(name)
    assert {(i.device, i.backend) for i in buddy.implementations(name)} == {("cuda", "nvcomp")}
    with pytest.raises(buddy.MissingDependencyError, match="GPU"):
        buddy.compress(torch.randn(4096), codec=codec, entry_bytes=4096, store=store)
    assert store.bytes_held == 0
    with pytest.raises(buddy.MissingDependencyError):
        buddy.unpack(
            torch.full((2,), 1, dtype=torch.uint8),
            torch.zeros(4096, dtype=torch.uint8),
            torch.zeros(0, dtype=torch.uint8),
            codec=codec,
            entry_bytes=4096,
            slot_sectors=128,
            shape=(1024,),
            dtype=torch.float32,
        )
    with pytest.raises(buddy.MissingDependencyError, match="GPU"):  # the codec itself refuses CPU tensors too
        codec.analyse(torch.ones(1, 4096, dtype=torch.uint8), 4)


def test_device_filter_of_the_registry():
    cpu = buddy.available_codecs("cpu")
    assert set(cpu) <= set(buddy.available_codecs())
    assert {"raw", "zvc", "auto"} <= set(cpu)
    assert not any(name.startswith("nvcomp-") for name in cpu)
    assert buddy.available_codecs(torch.device("cpu")) == cpu


@pytest.mark.gpu
@pytest.mark.skipif(not nvcomp.usable(), reason=f"nvcomp codecs cannot run here: {nvcomp.why_unusable()}")
@pytest.mark.parametrize("name", nvcomp.NAMES)
@pytest.mark.parametrize("entry_bytes", ids("E", CHUNK_ENTRIES))
@pytest.mark.parametrize("kind", ids("data", ("zeros", "relu", "random_bytes", "special")))
@pytest.mark.parametrize("ratio", ids("ratio", (math.inf, 2.0, 1.0)))
def test_gpu_round_trip(name, entry_bytes, kind, ratio):
    g = torch.Generator().manual_seed(7)
    x = make_data(kind, 3 * entry_bytes // 4 + 1000, torch.float32, g).cuda()
    store = buddy.BuddyStore(capacity_bytes=64 << 20)
    bt = buddy.compress(x, ratio, name, entry_bytes=entry_bytes, store=store)
    try:
        assert_roundtrip(bt, x)
    finally:
        bt.free()
    assert store.bytes_held == 0
