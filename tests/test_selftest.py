"""The kernels by default on CUDA tensors, behind a self-test (buddy/selftest.py, buddy/dispatch.py).

Without a GPU the kernels run under the block emulator: a
:class:`buddy.engines.cuda.CudaEngine` whose launches run the real kernel sources on
the host is registered as the *default* ``"cuda"`` implementation of CPU
tensors, so ``backend="auto"`` on a CPU tensor takes exactly the path a CUDA
tensor takes: the self-test on first use, then the kernels -- or, for
kernels built from a broken copy of the sources, one warning and the
reference. The same logic runs without g++ on engines that are the
reference with one byte flipped. On a GPU, ``test_gpu_kernels_pass_the_self_test``
runs the self-test of every codec's real kernels.
"""

from __future__ import annotations

import functools
import shutil
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MiB, make_data

import buddy
from buddy.engines import cuda as bcuda
from buddy.engines import sources as bsources
from buddy import dispatch, selftest
from buddy.engines.reference import BlockEngine

GOLDEN = Path(__file__).resolve().parent / "golden"
KERNELS = tuple(bsources.KERNEL_CODECS)
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """Every test starts with no verdicts and no recorded choices, and leaves none behind."""
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    selftest.reset()
    monkeypatch.setattr(dispatch, "_CHOSEN", {})
    yield
    selftest.reset()


@pytest.fixture
def kernels_on_the_cpu():
    """``kernels_on_the_cpu(factory, codecs)``: ``factory`` registered as the default "cuda" implementation of
    CPU tensors for ``codecs`` (as the kernels are for CUDA tensors), for this test only."""

    def register(factory, codecs=KERNELS):
        for name in codecs:
            buddy.dispatch.register(name, "cpu", "cuda", factory, default=True, replace=True)
            added.append(name)

    added: list[str] = []
    before = buddy.dispatch.implementations(device="cpu")
    yield register
    for name in added:  # the CPU rows as they were, each in its place in the table (the native engine the default)
        buddy.dispatch.unregister(name, "cpu", "cuda")
        for row in (r for r in before if r.codec == name and r.default):
            buddy.dispatch.register(
                name, "cpu", row.backend, row.factory, default=True, requires=row.requires, replace=True
            )


class _FlipSlotByte(BlockEngine):
    """The reference, with byte 37 of every pack's slots flipped (a kernel writing one wrong bit)."""

    packs = 0

    def pack(self, *args):
        slots, overflow = super().pack(*args)
        type(self).packs += 1
        slots = slots.clone()
        slots[37] ^= 0x01
        return slots, overflow


class _Counting(BlockEngine):
    """The reference, counting the engines made (each compress or self-test case makes some)."""

    made = 0

    def __init__(self, codec):
        super().__init__(codec)
        with _lock:
            type(self).made += 1


_lock = threading.Lock()


def _buffers_equal(a: buddy.BuddyTensor, b: buddy.BuddyTensor) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


# ---- the vectors ---------------------------------------------------------------------------------
def test_the_shipped_vectors_are_the_committed_goldens():
    """buddy/selftest_vectors.npz is exactly the subset tests/golden/make_selftest.py takes of the goldens."""
    import sys

    sys.path.insert(0, str(GOLDEN))
    try:
        import make_selftest
    finally:
        sys.path.remove(str(GOLDEN))
    want = make_selftest.subset()
    shipped = selftest.load_vectors()
    assert set(shipped) == set(want)
    for name, array in want.items():
        assert np.array_equal(shipped[name].numpy(), array), name
    for name in selftest.INPUTS:
        for codec in KERNELS:
            assert f"{name}/{codec}/meta" in shipped and f"{name}/{codec}/s{selftest.SLOT}/slots" in shipped
    assert set(selftest.SOURCES) == set(KERNELS)
    assert (Path(buddy.__file__).parent / selftest.VECTORS).stat().st_size < 32 * 1024


@pytest.mark.parametrize("codec", KERNELS)
def test_the_reference_passes_the_self_test(codec):
    """The reference writes and reads the vectors: the test itself compares the right bytes."""
    verdict = selftest.run(codec, "cpu", BlockEngine)
    assert verdict.passed, verdict.why
    assert verdict.why.startswith("self-test passed in ")


def test_a_wrong_byte_is_named():
    verdict = selftest.run("zvc", "cpu", _FlipSlotByte)
    assert not verdict.passed
    assert verdict.why.startswith("self-test failed: case float32-E512-relu, compress: slots")
    assert "byte 37: expected 0x" in verdict.why and ", got 0x" in verdict.why


# ---- the kernels under the emulator -----------------------------------------------------------------
@pytest.fixture(scope="module")
def emulated():
    """The real kernel sources under the emulator (asan build), as a CudaEngine factory for CPU tensors."""
    from emulator import Emulator

    with Emulator("asan", seed=7) as emu:
        yield emu, functools.partial(bcuda.CudaEngine, launch=emu, device_type="cpu")


@needs_gxx
@pytest.mark.emulator
def test_the_kernels_pass_the_self_test_and_run_by_default(emulated, kernels_on_the_cpu, store, gen):
    emu, factory = emulated
    kernels_on_the_cpu(factory)
    t = make_data("relu", 20_000, torch.float32, gen)
    for codec in KERNELS:
        emu.launches.clear()
        bt = buddy.compress(t, 2.0, codec, entry_bytes=512, store=store)  # backend="auto"
        assert bt.backend == "cuda", buddy.dispatch.chosen(codec)
        ops = [kernel.rsplit("_", 1)[1] for kernel, *_ in emu.launches]
        assert ops.count("unpack") == len(selftest.INPUTS)  # the self-test decoded its vectors first
        (row,) = buddy.dispatch.chosen(codec, device="cpu")
        assert (row.backend, row.device) == ("cuda", "cpu") and row.why.startswith("self-test passed in "), row
        ref = buddy.compress(t, 2.0, codec, entry_bytes=512, store=store, backend="reference")
        assert _buffers_equal(bt, ref)
        assert torch.equal(bt.decompress(check=True), t)
        emu.launches.clear()
        buddy.compress(t, 2.0, codec, entry_bytes=512, store=store).free()  # no second self-test
        assert "unpack" not in [kernel.rsplit("_", 1)[1] for kernel, *_ in emu.launches]
        bt.free()
        ref.free()


_MUTATION = (  # the 32-lane form (the one-lane build has its own line)
    "codec_zvc.h",
    "        } else if ((m >> i) & 1u) {\n          buddy_store<word_t>(payload + pos, chunk_word(c, i));\n",
    "        } else if ((m >> i) & 1u) {\n          buddy_store<word_t>(payload + pos, (word_t)(chunk_word(c, i) ^ 1u));\n",
)


@needs_gxx
@pytest.mark.emulator
def test_broken_kernels_warn_once_and_fall_back(kernels_on_the_cpu, store, gen, tmp_path):
    """zvc's kernels built from a copy of the sources that flips the low bit of every word it packs."""
    from emulator import CSRC, Emulator

    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    file, old, new = _MUTATION
    text = (csrc / file).read_text()
    assert text.count(old) == 1
    (csrc / file).write_text(text.replace(old, new))
    with Emulator("asan", seed=3, csrc=csrc, codecs="zvc") as emu:
        kernels_on_the_cpu(functools.partial(bcuda.CudaEngine, launch=emu, device_type="cpu"), ("zvc",))
        _assert_falls_back("zvc", "case float32-E512-relu, compress: slots (slot of 8 sectors), byte ", store, gen)
        assert emu.launches  # the broken kernels ran (in the self-test), and only there


def test_a_flipped_byte_warns_once_and_falls_back(kernels_on_the_cpu, store, gen):
    """The same without g++: the "kernels" are the reference with one byte of every pack flipped."""
    kernels_on_the_cpu(_FlipSlotByte, ("zvc", "auto2"))
    _FlipSlotByte.packs = 0
    for codec in ("zvc", "auto2"):
        _assert_falls_back(codec, "case float32-E512-relu, compress: slots (slot of 8 sectors), byte 37: ", store, gen)
    assert _FlipSlotByte.packs == 2  # one self-test each; every compress after ran the reference


def _assert_falls_back(codec: str, says: str, store, gen) -> None:
    t = make_data("relu", 20_000, torch.float32, gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bt = buddy.compress(t, 2.0, codec, entry_bytes=512, store=store)
    (warning,) = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    message = str(warning.message)
    assert f"CUDA kernels of codec {codec!r} failed their self-test on cpu" in message, message
    assert says in message and ": expected 0x" in message and ", got 0x" in message, message
    assert bt.backend == "reference"
    (row,) = buddy.dispatch.chosen(codec, device="cpu")
    assert row.backend == "reference" and row.why.startswith(f"self-test failed: {says}"), row
    ref = buddy.compress(t, 2.0, codec, entry_bytes=512, store=store, backend="reference")
    assert _buffers_equal(bt, ref)  # the fallback is the reference, byte for byte
    assert torch.equal(bt.decompress(), t)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        second = buddy.compress(t, 2.0, codec, entry_bytes=512, store=store)
    assert not [w for w in again if issubclass(w.category, RuntimeWarning)], "warned twice"
    assert second.backend == "reference"
    for x in (bt, ref, second):
        x.free()


# ---- the choice ----------------------------------------------------------------------------------
def test_kernels_that_raise_fall_back_with_the_reason(kernels_on_the_cpu, store, gen):
    class Raising(BlockEngine):
        def measure(self, *args):
            raise RuntimeError("NVRTC: compilation failed\nmore lines")

    kernels_on_the_cpu(Raising, ("zvc",))
    with pytest.warns(RuntimeWarning, match="RuntimeError: NVRTC: compilation failed"):
        bt = buddy.compress(make_data("relu", 5000, torch.float32, gen), store=store, codec="zvc")
    assert bt.backend == "reference"
    (row,) = buddy.dispatch.chosen("zvc")
    assert row.why == "self-test failed: RuntimeError: NVRTC: compilation failed"


def test_the_self_test_runs_once_across_threads(kernels_on_the_cpu, store, gen):
    kernels_on_the_cpu(_Counting, ("zvc",))
    _Counting.made = 0
    t = make_data("relu", 5000, torch.float32, gen)
    barrier = threading.Barrier(6)
    results: list[str] = []

    def work():
        barrier.wait()
        bt = buddy.compress(t, codec="zvc", store=store)
        results.append(bt.backend)
        bt.free()

    threads = [threading.Thread(target=work) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == ["cuda"] * 6
    per_case = 2  # the self-test makes an engine to compress and one to decompress each input
    tested = per_case * len(selftest.INPUTS)
    # the compresses' engine is kept once made: made again only by the threads that asked before it was
    assert tested + 1 <= _Counting.made <= tested + 6


def test_buddy_backend_reference_forces_the_reference(kernels_on_the_cpu, store, gen, monkeypatch):
    kernels_on_the_cpu(_Counting, ("zvc",))
    _Counting.made = 0
    monkeypatch.setenv("BUDDY_BACKEND", "reference")
    bt = buddy.compress(make_data("relu", 5000, torch.float32, gen), codec="zvc", store=store)
    assert bt.backend == "reference" and _Counting.made == 0  # no self-test, no kernels
    assert buddy.dispatch.chosen("zvc")[0].why == "BUDDY_BACKEND=reference"
    monkeypatch.setenv("BUDDY_BACKEND", "auto")  # read at every use
    assert buddy.compress(make_data("relu", 5000, torch.float32, gen), codec="zvc", store=store).backend == "cuda"
    monkeypatch.setenv("BUDDY_BACKEND", "gpu")
    with pytest.raises(ValueError, match=r"BUDDY_BACKEND='gpu' is not a backend: use one of auto, reference, cuda"):
        buddy.compress(make_data("relu", 5000, torch.float32, gen), codec="zvc", store=store)


def test_explicit_backends_run_what_they_name(kernels_on_the_cpu, store, gen):
    """``backend="reference"`` never runs the kernels; ``backend="cuda"`` runs them without a self-test, even
    where it failed; ``set_defaults(backend="reference")`` forces the reference for "auto"."""
    kernels_on_the_cpu(_FlipSlotByte, ("zvc",))
    _FlipSlotByte.packs = 0
    t = make_data("relu", 5000, torch.float32, gen)
    assert buddy.compress(t, codec="zvc", store=store, backend="reference").backend == "reference"
    assert _FlipSlotByte.packs == 0 and not buddy.dispatch.chosen()
    assert buddy.compress(t, codec="zvc", store=store, backend="cuda").backend == "cuda"
    assert _FlipSlotByte.packs == 1  # the one compress: no self-test
    previous = buddy.set_defaults(backend="reference")
    try:
        assert buddy.compress(t, codec="zvc", store=store).backend == "reference"
        assert buddy.dispatch.chosen("zvc")[0].why == "set_defaults(backend='reference')"
    finally:
        buddy.set_defaults(backend=previous.backend)
    assert _FlipSlotByte.packs == 1


def test_the_record_of_what_ran_and_why(store, gen):
    """On this machine: raw's CPU tensors run the reference (its CPU default: it has no kernels); a CUDA device would
    run it too, saying why; and zvc's CUDA tensors would fall back to the reference, saying why."""
    buddy.compress(make_data("relu", 5000, torch.float32, gen), codec="raw", store=store)
    (row,) = buddy.dispatch.chosen()
    assert (row.device, row.codec, row.backend, row.why) == ("cpu", "raw", "reference", "the default on cpu tensors")
    assert "the default on cpu tensors" in str(row)
    engine = dispatch.engine(buddy.get_codec("raw"), "cuda")  # no kernels: the reference (nothing runs yet)
    assert engine.backend == "reference"
    assert buddy.dispatch.chosen("raw", device="cuda")[0].why == "codec 'raw' has no CUDA kernels"
    why = bcuda.why_unusable()
    if why is not None:  # no CuPy or no GPU here: the kernels' default falls back to the reference, saying why
        assert dispatch.engine(buddy.get_codec("zvc"), "cuda").backend == "reference"
        (row,) = buddy.dispatch.chosen("zvc", device="cuda")
        assert row.backend == "reference" and row.why == why
    assert buddy.dispatch.chosen(device="cpu") == [buddy.dispatch.chosen("raw")[0]]


def test_a_codec_object_the_kernels_do_not_reproduce_runs_the_reference(kernels_on_the_cpu, store, gen):
    from buddy.codecs.zvc import ZVCCodec

    class Tweaked(ZVCCodec):
        name = "zvc"

    kernels_on_the_cpu(functools.partial(bcuda.CudaEngine, device_type="cpu"), ("zvc",))
    bt = buddy.compress(make_data("relu", 5000, torch.float32, gen), codec=Tweaked(), store=store)
    assert bt.backend == "reference"
    assert "has no CUDA kernels" in buddy.dispatch.chosen("zvc")[0].why


# ---- on a GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(bcuda.why_unusable() is not None, reason=f"the kernels cannot run here: {bcuda.why_unusable()}")
@pytest.mark.parametrize("codec", KERNELS)
def test_gpu_kernels_pass_the_self_test(codec):
    """The real kernels on the GPU: the self-test passes, and ``backend="auto"`` runs them."""
    device = torch.device("cuda", torch.cuda.current_device())
    verdict = selftest.run(codec, device, bcuda.CudaEngine)
    assert verdict.passed, verdict.why
    t = torch.relu(torch.randn(MiB, device=device))
    bt = buddy.compress(t, codec=codec, entry_bytes=4096)
    assert bt.backend == "cuda", buddy.dispatch.chosen(codec)
    (row,) = buddy.dispatch.chosen(codec, device=str(device))
    assert row.why.startswith("self-test passed in "), row
    assert torch.equal(bt.decompress(check=True), t)
    bt.free()
