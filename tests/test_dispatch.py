"""One dispatch place: (codec, device, backend) -> an engine, selected through the public registry.

The CUDA kernels are the default on CUDA devices (behind their self-test:
tests/test_selftest.py); an explicit backend that does not exist is an
error, never a silent fallback; a BuddyTensor records what ran; and
everything the pipeline does goes through the engine the registry picked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import MiB, assert_roundtrip, ids, make_data

import buddy
from buddy import dispatch
from buddy.codecs.zvc import ZVCCodec
from buddy.engines.reference import BlockEngine

ROOT = Path(__file__).resolve().parents[1]
ZVC = buddy.get_codec("zvc")


@pytest.fixture
def restore_defaults():
    previous = buddy.defaults()
    yield
    buddy.set_defaults(codec=previous.codec, entry_bytes=previous.entry_bytes, backend=previous.backend)


@pytest.fixture
def temporary_implementation():
    """``temporary_implementation(codec, device, backend, factory, **kw)``: registered for one test only."""
    added = []

    def register(codec, device, backend, factory, **kwargs):
        before = dispatch.implementations(codec, device=device)
        added.append(((codec, device, backend), before))
        return buddy.dispatch.register(codec, device, backend, factory, replace=True, **kwargs)

    yield register
    for (codec, device, backend), before in reversed(added):
        buddy.dispatch.unregister(codec, device, backend)
        for impl in before:  # the defaults as they were
            buddy.dispatch.register(
                impl.codec, impl.device, impl.backend, impl.factory, default=impl.default, requires=impl.requires,
                replace=True,
            )  # fmt: skip


def test_the_table_by_default():
    assert buddy.defaults().backend == "auto"
    kernels = ("zvc", "fpx", "bpc", "auto", "fpe", "auto2")
    for codec in ("raw", "zvc", "fpx", "bpc", "auto", "fpe", "auto2"):
        for device in ("cpu", "cuda"):
            (impl,) = [i for i in buddy.dispatch.implementations(codec, device=device) if i.default]
            if device == "cuda" and codec in kernels:  # the kernels, behind their self-test
                assert impl.backend == "cuda" and impl.factory is buddy.engines.cuda.CudaEngine
            elif device == "cpu" and codec in buddy.engines.native.DEFAULT_CODECS:  # the same kernels, natively
                assert impl.backend == "native" and impl.factory is buddy.engines.native.NativeEngine
            else:
                assert impl.backend == "reference" and impl.factory is BlockEngine
            (reference,) = buddy.dispatch.implementations(codec, device=device, backend="reference")
            assert reference.factory is BlockEngine  # what the kernels fall back to
    cuda = buddy.dispatch.implementations(backend="cuda")
    assert [(i.codec, i.device, i.default) for i in cuda] == [(name, "cuda", True) for name in kernels]
    native = buddy.dispatch.implementations(backend="native")
    assert [(i.codec, i.device, i.default) for i in native] == [
        (name, "cpu", name in buddy.engines.native.DEFAULT_CODECS) for name in kernels
    ]
    nvcomp = buddy.dispatch.implementations(backend="nvcomp")
    assert {i.codec for i in nvcomp} == set(buddy.engines.nvcomp.NAMES)
    assert all(i.device == "cuda" and i.default for i in nvcomp)


def test_auto_picks_the_default_and_explicit_picks_that_one():
    raw = buddy.get_codec("raw")  # no kernels: the reference is its CPU default
    assert isinstance(dispatch.engine(raw, "cpu"), BlockEngine)
    assert dispatch.engine(raw, "cpu").backend == "reference"
    assert dispatch.engine(raw, torch.device("cpu"), "auto").backend == "reference"
    native_or_reference = "native" if buddy.engines.native.why_unusable() is None else "reference"
    assert dispatch.engine(ZVC, "cpu").backend == native_or_reference  # the kernels natively, where they build
    assert dispatch.engine(ZVC, "cpu", "reference").backend == "reference"
    assert isinstance(dispatch.engine(ZVC, "cpu", "reference"), BlockEngine)


def test_reference_backend_round_trip(store, gen):
    t = make_data("relu", 50_001, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=2.0, store=store, backend="reference")
    assert bt.backend == "reference"
    assert_roundtrip(bt, t)
    assert torch.equal(bt.decompress(backend="reference"), bt.decompress(backend="auto"))
    meta, slots, overflow = bt.buffers()
    kw = dict(codec="zvc", entry_bytes=128, slot_sectors=bt.slot_sectors, shape=t.shape, dtype=t.dtype)
    assert torch.equal(buddy.unpack(meta, slots, overflow, backend="reference", **kw), t)


def test_cuda_backend_rejects_cpu_tensors(store):
    t = torch.ones(1000)
    with pytest.raises(ValueError, match="CUDA device"):
        buddy.compress(t, store=store, backend="cuda")
    with pytest.raises(ValueError, match="CUDA device"):
        buddy.measure(t, backend="cuda")
    bt = buddy.compress(t, store=store)
    with pytest.raises(ValueError, match="CUDA device"):
        bt.decompress(backend="cuda")
    with pytest.raises(ValueError, match="CUDA device"):
        dispatch.engine(ZVC, "cpu", "cuda")
    assert store.bytes_held == bt.buddy_bytes  # nothing leaked by the failed calls


def test_cuda_backend_needs_a_codec_with_kernels():
    with pytest.raises(ValueError, match="no CUDA kernels"):
        dispatch.engine(buddy.get_codec("raw"), "cuda", "cuda")

    class Tweaked(ZVCCodec):
        name = "zvc"

    # the name has kernels, but they reproduce ZVCCodec only: the engine refuses a subclass
    with pytest.raises(ValueError, match="no CUDA kernels"):
        buddy.engines.cuda.CudaEngine(Tweaked())
    with pytest.raises(ValueError, match="no CUDA kernels"):
        buddy.engines.cuda.CudaEngine(buddy.get_codec("raw"))


@pytest.mark.parametrize("bad", ids("bad", ["gpu", "CUDA", "", 1], repr))
def test_unknown_backend_rejected(bad, store, restore_defaults):
    t = torch.ones(100)
    with pytest.raises(ValueError, match="backend"):
        buddy.compress(t, store=store, backend=bad)
    with pytest.raises(ValueError, match="backend"):
        dispatch.engine(ZVC, "cpu", bad)
    with pytest.raises(ValueError, match="backend"):
        buddy.set_defaults(backend=bad if bad else "nvcomp")
    bt = buddy.compress(t, store=store)
    with pytest.raises(ValueError, match="backend"):
        bt.decompress(backend=bad)
    assert store.bytes_held == bt.buddy_bytes


def test_default_cuda_backend_prefers_kernels_only_where_they_exist(store, gen, restore_defaults):
    previous = buddy.set_defaults(backend="cuda")
    assert previous.backend == "auto" and buddy.defaults().backend == "cuda"
    t = make_data("relu", 10_000, torch.float32, gen)
    bt = buddy.compress(t, store=store)  # a CPU tensor: no kernels here, the default runs, no error
    assert bt.backend == buddy.dispatch.chosen(bt.codec, device="cpu")[0].backend  # the CPU default
    assert bt.backend != "cuda"
    assert_roundtrip(bt, t)
    assert dispatch.engine(buddy.get_codec("raw"), "cuda").backend == "reference"  # raw has no kernels


class _Spy(BlockEngine):
    """The reference, counting which format operations the pipeline asked for."""

    calls: list[str] = []

    def measure(self, *args):
        self.calls.append("measure")
        return super().measure(*args)

    def pack(self, *args):
        self.calls.append("pack")
        return super().pack(*args)

    def unpack(self, *args, **kwargs):
        self.calls.append("unpack")
        return super().unpack(*args, **kwargs)


def test_the_pipeline_runs_the_registered_engine(store, gen, temporary_implementation, monkeypatch):
    """measure, pack and decompress all go through the engine the registry gives; the tensor records it."""
    _Spy.calls = []
    temporary_implementation("zvc", "cpu", "reference", _Spy, default=True)
    monkeypatch.setattr(buddy.format, "BLOCK_BYTES", 64 * 1024)  # several blocks
    t = make_data("relu", 100_000, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=2.0, store=store)
    assert bt.backend == "reference" and _Spy.calls == ["measure", "pack"]
    assert_roundtrip(bt, t)  # decompress: the backend it recorded, the engine registered for it
    assert _Spy.calls == ["measure", "pack", "unpack"]


def test_one_default_per_codec_and_device(temporary_implementation):
    temporary_implementation("zvc", "cpu", "cuda", BlockEngine, default=True)
    defaults = [i for i in buddy.dispatch.implementations("zvc", device="cpu") if i.default]
    assert [i.backend for i in defaults] == ["cuda"]  # the reference stopped being the default
    assert dispatch.engine(ZVC, "cpu").backend == "cuda"  # an engine carries the registry's name for it


def test_registering_checks_its_arguments():
    with pytest.raises(ValueError, match="device"):
        buddy.dispatch.register("zvc", "tpu", "reference", BlockEngine)
    with pytest.raises(ValueError, match="backend"):
        buddy.dispatch.register("zvc", "cpu", "auto", BlockEngine)
    with pytest.raises(ValueError, match="already registered"):
        buddy.dispatch.register("zvc", "cpu", "reference", BlockEngine)
    with pytest.raises(TypeError, match="factory"):
        buddy.dispatch.register("zvc", "cpu", "nvcomp", "not callable")


def test_an_implementation_that_cannot_run_here_says_why(temporary_implementation):
    temporary_implementation("zvc", "cpu", "nvcomp", BlockEngine, requires=lambda: "no such library: pip install it")
    with pytest.raises(buddy.MissingDependencyError, match="no such library"):
        dispatch.engine(ZVC, "cpu", "nvcomp")


def test_codecs_without_an_implementation_here(store):
    cpu = buddy.available_codecs("cpu")
    assert {"raw", "zvc", "fpx", "bpc", "auto"} <= set(cpu)
    assert not any(name.startswith("nvcomp-") for name in cpu)
    assert buddy.available_codecs(torch.device("cpu")) == cpu
    codec = buddy.engines.nvcomp.chunk_codec("nvcomp-lz4")
    with pytest.raises(buddy.MissingDependencyError, match="GPU"):  # no implementation for CPU tensors
        buddy.compress(torch.randn(4096), codec=codec, entry_bytes=4096, store=store)
    assert store.bytes_held == 0


def test_import_without_cupy_then_cuda_backend_raises():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["cupy"] = None  # CuPy not importable
        import torch, buddy
        assert "cupy" not in [m for m in sys.modules if sys.modules[m] is not None]
        t = torch.relu(torch.randn(10_000))
        assert torch.equal(buddy.compress(t).decompress(), t)
        try:
            buddy.dispatch.engine(buddy.get_codec("zvc"), torch.device("cuda"), "cuda")
        except buddy.MissingDependencyError as exc:
            message = str(exc)
        else:
            raise SystemExit("no MissingDependencyError")
        assert "CuPy" in message and "pip install" in message, message
        try:
            buddy.engines.cuda._cupy()
        except buddy.MissingDependencyError:
            pass
        else:
            raise SystemExit("no MissingDependencyError from the loader")
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_default_store_untouched_by_dispatch_errors(fresh_default_store):
    with pytest.raises(ValueError):
        buddy.compress(torch.ones(2 * MiB // 4), backend="cuda")
    assert buddy.default_store().bytes_held == 0
