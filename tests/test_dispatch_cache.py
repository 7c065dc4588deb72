"""The engines dispatch makes are kept: one per codec object, device, backend, preference and tuning.

Each call gets a copy of the engine kept (its codec, reads and device tables
its own), so nothing one tensor does to its engine reaches another's; what the
choice read that can change unseen (whether an implementation can run here,
the self-test's verdict) is asked at every call; registering an implementation
forgets every engine kept; and what ``backend="auto"`` ran is recorded at
every call, a kept engine's too.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import assert_bitexact, make_data

import buddy
from buddy import dispatch, selftest
from buddy.codecs import fpe_device
from buddy.codecs.zvc import ZVCCodec
from buddy.engines import native
from buddy.engines.reference import BlockEngine
from buddy.engines.tuning import current, tuned

needs_native = pytest.mark.skipif(native.why_unusable() is not None, reason=f"{native.why_unusable()}")


class _Named(ZVCCodec):
    name = "kept-zvc"


@pytest.fixture
def counted(temporary_codec):
    """A codec of its own (``kept-zvc``), its CPU default the reference made by a factory that counts its calls:
    ``(codec, made)``, ``made`` the engines the factory made."""
    codec = temporary_codec(_Named())
    made: list[BlockEngine] = []

    def factory(c):
        made.append(BlockEngine(c))
        return made[-1]

    dispatch.register(codec.name, "cpu", "reference", factory, default=True, replace=True)
    return codec, made


def test_repeated_calls_make_the_engine_once(counted, store, gen):
    codec, made = counted
    t = make_data("relu", 20_000, torch.float32, gen)
    for _ in range(3):
        bt = buddy.compress(t, 2.0, codec.name, store=store)
        assert_bitexact(bt.decompress(), t)  # decompress: the backend recorded, asked explicitly
        bt.free()
    assert len(made) == 2  # one for "auto" (compress), one for "reference" (decompress)
    engines = [dispatch.engine(codec, "cpu") for _ in range(3)]
    assert len(made) == 2 and len({id(e) for e in engines}) == 3  # a copy per call of the one kept
    assert all(type(e) is BlockEngine and e.codec is codec and e.backend == "reference" for e in engines)


def test_another_codec_object_tuning_or_preference_makes_another(counted):
    codec, made = counted
    dispatch.engine(codec, "cpu")
    assert len(made) == 1
    same_name = _Named()  # another object of the same name: never taken for the registered one
    assert dispatch.engine(same_name, "cpu").codec is same_name and len(made) == 2
    with tuned(unpack_warps=8):
        dispatch.engine(codec, "cpu")
        assert len(made) == 3
        dispatch.engine(codec, "cpu")
        assert len(made) == 3
    dispatch.engine(codec, "cpu")  # the settings of before: the engine kept for them
    assert len(made) == 3
    dispatch.engine(codec, "cpu", "reference")
    assert len(made) == 4


@needs_native
def test_a_tuned_block_gets_an_engine_of_its_settings():
    auto2 = buddy.get_codec("auto2")
    before = dispatch.engine(auto2, "cpu")
    with tuned(unpack_warps=8) as settings:
        inside = dispatch.engine(auto2, "cpu")
    after = dispatch.engine(auto2, "cpu")
    assert inside.kernels.tuning is settings and after.kernels.tuning == current()
    assert before.kernels is after.kernels and inside.kernels is not before.kernels


def test_registering_an_implementation_forgets_the_engines(counted):
    codec, made = counted
    dispatch.engine(codec, "cpu")
    dispatch.register(codec.name, "cpu", "nvcomp", BlockEngine)  # any change of the table
    dispatch.engine(codec, "cpu")
    assert len(made) == 2
    dispatch.unregister(codec.name, "cpu", "nvcomp")
    dispatch.engine(codec, "cpu")
    assert len(made) == 3


def test_what_auto_ran_is_recorded_at_every_call(counted, monkeypatch):
    codec, _ = counted
    dispatch.engine(codec, "cpu")
    (row,) = dispatch.chosen(codec.name)
    assert (row.device, row.backend, row.why) == ("cpu", "reference", "the default on cpu tensors")
    monkeypatch.setattr(dispatch, "_CHOSEN", {})  # as tests clear it
    dispatch.engine(codec, "cpu")
    assert dispatch.chosen(codec.name) == [row]


def test_whether_an_implementation_can_run_is_asked_at_every_call(counted):
    codec, made = counted
    why: list[str | None] = [None]
    dispatch.register(codec.name, "cpu", "nvcomp", BlockEngine, requires=lambda: why[0])
    assert dispatch.engine(codec, "cpu", "nvcomp").backend == "nvcomp"
    why[0] = "its library is gone"
    with pytest.raises(buddy.MissingDependencyError, match="its library is gone"):
        dispatch.engine(codec, "cpu", "nvcomp")
    why[0] = None
    assert dispatch.engine(codec, "cpu", "nvcomp").backend == "nvcomp"


@needs_native
def test_the_native_switch_and_the_self_test_are_asked_at_every_call(monkeypatch):
    auto2 = buddy.get_codec("auto2")
    assert dispatch.engine(auto2, "cpu").backend == "native"
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert dispatch.engine(auto2, "cpu").backend == "reference"
    assert dispatch.chosen("auto2", device="cpu")[0].why == "BUDDY_NATIVE=0"
    monkeypatch.delenv(native.ENV_SWITCH)
    runs: list[str] = []
    run = selftest.run
    monkeypatch.setattr(selftest, "run", lambda codec, *rest: runs.append(codec) or run(codec, *rest))
    selftest.reset()  # the verdicts forgotten: the kept engine's is asked again, and the test runs again
    try:
        assert dispatch.engine(auto2, "cpu").backend == "native"
        assert dispatch.engine(auto2, "cpu").backend == "native"
    finally:
        selftest.reset()
    assert runs == ["auto2"]


@needs_native
def test_a_kept_engine_launches_through_the_launcher_there_now(monkeypatch, store):
    t = torch.relu(torch.randn(5000, generator=torch.Generator().manual_seed(2)))
    buddy.compress(t, 2.0, "zvc", store=store).free()  # its engine kept
    launched: list[str] = []
    real = native.launch
    monkeypatch.setattr(native, "launch", lambda codec, op, *rest: launched.append(op) or real(codec, op, *rest))
    buddy.compress(t, 2.0, "zvc", store=store).free()
    assert launched == ["measure", "ends", "pack"]


@pytest.mark.parametrize("backend", ["reference", pytest.param("native", marks=needs_native)])
def test_each_call_gets_an_engine_of_its_own(backend, store, gen):
    """A fit replaces the codec of the engine that ran it, and a kernel engine keeps the fitted table: two tensors
    measured before either is packed each pack with their own table."""
    first, second = make_data("relu", 30_000, torch.float32, gen), make_data("special", 30_000, torch.float32, gen)
    measured = [buddy.measure(x, "fpe", entry_bytes=512, backend=backend) for x in (first, second)]
    assert measured[0].engine is not measured[1].engine
    assert measured[0].engine.codec is measured[0].codec and measured[1].engine.codec is measured[1].codec
    assert measured[0].codec.fitted is not measured[1].codec.fitted
    for m, x in zip(measured, (first, second)):
        assert m.engine.readbacks == 1  # its own read alone (the fit's, with the histogram where it is the kernels')
        bt = buddy.pack(m, 4, store=store)
        assert_bitexact(bt.decompress(), x)
        bt.free()
    assert dispatch.engine(buddy.get_codec("fpe"), "cpu", backend).codec is buddy.get_codec("fpe")


def test_codecs_fitted_to_a_tensor_are_not_kept_and_the_kept_are_bounded(counted, store, gen):
    t = make_data("relu", 20_000, torch.float32, gen)
    bt = buddy.compress(t, 2.0, "fpe", backend="reference", store=store)
    assert_bitexact(bt.decompress(), t)
    bt.free()
    assert not any(made.codec.table_bytes for made in dispatch._MADE.values())
    codec, made = counted
    first = _Named()
    dispatch.engine(first, "cpu")
    held = weakref.ref(first)
    del first
    for _ in range(dispatch.MADE_KEPT):
        dispatch.engine(_Named(), "cpu")
    made.clear()  # (the factory's list of what it made holds them too)
    gc.collect()
    assert len(dispatch._MADE) <= dispatch.MADE_KEPT and held() is None


@needs_native
def test_a_kept_table_is_laid_out_once(monkeypatch, store, gen):
    """A key's table kept from step to step (a prior that it still codes well): its device table is laid out and
    copied once, whatever the compresses and decompresses that code with it."""
    t = make_data("relu", 30_000, torch.float32, gen)
    first = buddy.measure(t, "fpe", entry_bytes=512, backend="native")
    prior = first.statistics.to(torch.float64) / 3 + 0.5
    fitted = buddy.measure(t, "fpe", entry_bytes=512, backend="native", prior=prior).codec
    laid_out: list[object] = []
    lay_out = fpe_device.device_table
    monkeypatch.setattr(fpe_device, "device_table", lambda table: laid_out.append(table) or lay_out(table))
    for _ in range(4):
        kept = buddy.measure(t, "fpe", entry_bytes=512, backend="native", prior=prior, keep=fitted)
        assert kept.codec.fitted is fitted.fitted  # the table kept, not fitted again
        bt = buddy.pack(kept, 4, store=store)
        assert_bitexact(bt.decompress(), t)
        bt.free()
    assert laid_out == [fitted.fitted]


def test_get_codec_asks_the_table_again_when_it_changes(temporary_codec):
    """get_codec scans the implementations once per codec, not once a compress; a change to the table (an
    implementation registered or removed, a codec registered) is seen at the next call."""
    codec = temporary_codec(_Named())
    assert buddy.codecs.get_codec(codec.name) is codec
    assert codec.name in buddy.codecs._usable  # remembered: the next compress does not scan
    dispatch.unregister(codec.name)
    dispatch.register(codec.name, "cpu", "reference", BlockEngine, requires=lambda: "a library is missing")
    with pytest.raises(buddy.MissingDependencyError, match="not available here"):
        buddy.codecs.get_codec(codec.name)
    dispatch.register(codec.name, "cpu", "reference", BlockEngine, default=True, replace=True)
    assert buddy.codecs.get_codec(codec.name) is codec
