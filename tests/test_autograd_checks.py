"""Training's decompress checks every entry, and a session keeps tensors as they are during CUDA graph capture.

* The torch reference checks on the host and raises at once; the CUDA
  kernels flag failed entries on the device (they decode to zeros there) and
  the session reads every flag of a backward once, at its end: either way
  backward raises :class:`buddy.CorruptDataError` naming the key, never
  returns gradients computed from zeros silently. The kernel path runs
  under the block emulator (the real kernel sources, as the default
  implementation of CPU tensors, behind their self-test).
* While a CUDA graph is being captured the session compresses nothing (the
  capture check patched on the CPU); the step is bit-identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import buddy
from conftest import emulated_cpu_kernels

KEY = "net/"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _step(model, session=None):
    """One forward and backward; the gradients."""
    torch.manual_seed(1)
    x = torch.randn(16, 256)
    model.zero_grad()
    if session is None:
        loss = model(x).square().mean()
    else:
        with session:
            loss = model(x).square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def packed(monkeypatch):
    """The BuddyTensors the session packs, in order: sized first (``pack``, :mod:`buddy.keyed`) or packed ahead
    (``pack_ahead``, the default once a key has a plan; its refusals, None, left out)."""
    made: list = []
    for module, name in ((buddy.keyed, "pack"), (buddy.autograd, "pack_ahead")):
        original = getattr(module, name)

        def spy(*args, _original=original, **kwargs):
            result = _original(*args, **kwargs)
            if result is not None:
                made.append(result)
            return result

        monkeypatch.setattr(module, name, spy)
    return made


def _session(tracker, store):
    policy = buddy.FixedRatio(2.0)
    return buddy.compressed_activations(policy, tracker=tracker, store=store, min_bytes=4096, key_prefix=KEY)


def _corrupt(bt: buddy.BuddyTensor) -> None:
    """An entry's metadata given a mode zvc never writes (E = 128: the high 4 bits of its byte)."""
    meta, _, _ = bt.buffers()
    meta[0] |= 0x10


def test_the_reference_raises_naming_the_key(tracker, store, packed, monkeypatch):
    monkeypatch.setenv(buddy.dispatch.ENV_BACKEND, "reference")  # (zvc's CPU default is the native engine)
    model = _model()
    session = _session(tracker, store)
    with session:
        loss = model(torch.randn(16, 256)).square().mean()
    assert packed and all(bt.backend == "reference" for bt in packed)
    _corrupt(packed[0])
    with pytest.raises(buddy.CorruptDataError, match=rf"saved activation '{KEY}0:float32\[16, 256\]' failed"):
        loss.backward()


@pytest.fixture
def emulated_kernels():
    """The real kernel sources under the emulator, the default implementation of zvc on CPU tensors."""
    with emulated_cpu_kernels("zvc", seed=11) as emu:
        yield emu


@pytest.mark.emulator
def test_the_kernels_flag_and_backward_raises_at_its_end(emulated_kernels, tracker, store, packed):
    model = _model()
    expected = _step(_model())
    assert all(torch.equal(a, b) for a, b in zip(_step(model, _session(tracker, store)), expected))
    assert packed and all(bt.backend == "cuda" for bt in packed)  # the kernels ran, after their self-test
    packed.clear()
    session = _session(tracker, store)
    with session:
        loss = model(torch.randn(16, 256)).square().mean()
    _corrupt(packed[0])
    _corrupt(packed[1])
    with pytest.raises(buddy.CorruptDataError) as info:
        loss.backward()
    message = str(info.value)
    # the session's check at the end of backward, not the unpack's: the kernels decoded zeros and flagged them
    assert "2 saved activation(s) failed the format's checks when decompressed for this backward pass" in message
    assert f"'{KEY}0:float32[16, 256]' (error bits 0x4)" in message and f"'{KEY}1:float32[16, 256]'" in message


@pytest.mark.emulator
def test_a_flag_outside_backward_is_checked_at_once(emulated_kernels, tracker, store, packed):
    model = _model()
    session = _session(tracker, store)
    with session:
        h = model[1](model[0](torch.randn(16, 256)))
        out = model[2](h)
    assert packed[-1].backend == "cuda"
    _corrupt(packed[-1])
    with pytest.raises(buddy.CorruptDataError, match="failed the format's checks"):
        out.grad_fn._saved_mat1  # a saved tensor read directly: unpacked outside any backward pass


# ---- CUDA graph capture ------------------------------------------------------------------------------
def test_nothing_is_compressed_while_a_graph_is_captured(tracker, store, packed, monkeypatch):
    model = _model()
    expected = _step(_model())
    monkeypatch.setattr(buddy.hooks, "_capturing", lambda: True)
    session = _session(tracker, store)
    grads = _step(model, session)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    st = session.stats()
    assert not packed and not st.rows and st.original_bytes == 0
    # every save but the weights': the input, each ReLU's output twice (the ReLU's and the next Linear's save)
    assert (st.saves, st.skipped, st.captured) == (8, 8, 5)
    assert st.kept_bytes >= st.captured * 16 * 256 * 4  # the activations, (16, 256) float32 each
    assert "kept as they are: a CUDA graph was being captured" in str(st)
    assert st.to_dict()["captured"] == st.captured
    monkeypatch.setattr(buddy.hooks, "_capturing", lambda: False)
    _step(model, session)
    assert packed and session.stats().captured == 0


def test_the_capture_check_asks_torch(monkeypatch):
    assert buddy.hooks._capturing() is False  # no CUDA initialised here
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert buddy.hooks._capturing() is True
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert buddy.hooks._capturing() is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_captured_step_keeps_tensors_as_they_are(tracker, store):
    """A forward and backward captured into a CUDA graph inside a session: nothing compressed, the capture
    completes, and replaying it gives the eager step's gradients."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
    x = torch.randn(256, 1024, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(2):
            model.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    expected = [p.grad.clone() for p in model.parameters()]
    graph = torch.cuda.CUDAGraph()
    session = buddy.compressed_activations(tracker=tracker, store=store, min_bytes=0)
    model.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        with session:
            loss = model(x).square().mean()
        loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    assert session.stats().captured > 0 and not session.stats().rows
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
