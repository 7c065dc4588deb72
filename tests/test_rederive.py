"""A parameter's saved copy in another dtype is made again in backward, not held: ``rederive_casts``.

Under bf16 autocast every Linear saves the bf16 cast of its fp32 weight (a view of it, ``weight.t()``), which
autocast's cache holds until its block ends anyway. The session keeps the parameter and its version instead, and
makes the copy again in backward: the same bytes, so training is bit-identical to training without buddy. These
tests check that, the cases that must not be re-derived (a copy made before the step, of a tensor that is not a
parameter, in other strides), and that a parameter changed in place between forward and backward raises rather
than giving a gradient of its new values.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import buddy
from buddy.keys import cast_source, node_sequence_now

pytestmark = [
    pytest.mark.library_defaults,
    pytest.mark.filterwarnings("ignore:buddy. this step's overflow passed its policy's bound"),
]

MIN = 64 << 10  # the MLP's activations and weights (128 KiB each) are all large enough


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 10))


def train(steps: int, rederive: bool | None) -> tuple[list, list]:
    """``steps`` SGD steps of a fresh MLP under bf16 autocast, in a session (``rederive`` its ``rederive_casts``;
    ``None``: no session): per step the session's stats and the parameters' bytes."""
    model = mlp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 256, generator=g), torch.randint(0, 10, (256,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker, store = buddy.Tracker(), buddy.BuddyStore(capacity_bytes=64 << 20, pin=False)
    stats, weights = [], []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if rederive is None:
                loss = F.cross_entropy(model(x), y)
            else:
                with buddy.compressed_activations(
                    tracker=tracker, store=store, min_bytes=MIN, rederive_casts=rederive
                ) as s:
                    loss = F.cross_entropy(model(x), y)
        loss.float().backward()
        opt.step()
        stats.append(None if rederive is None else s.stats())
        weights.append([p.detach().clone().view(torch.uint8) for p in model.parameters()])
    return stats, weights


def test_autocast_weight_casts_are_made_again_and_training_is_bit_identical():
    _, plain = train(3, None)
    on, weights_on = train(3, True)
    off, weights_off = train(3, False)
    for weights in (weights_on, weights_off):
        assert all(torch.equal(a, b) for w, v in zip(weights, plain) for a, b in zip(w, v))
    for a, b in zip(on, off):
        # the weight casts of 7 large layers (128 KiB each) are re-derived, not rows: the first layer saves no weight
        # (its input needs no gradient), and the head's (5 KiB) is small
        assert a.rederived == 7 and a.rederived_bytes == 7 * 256 * 256 * 2
        assert b.rederived == 0 and b.rederived_bytes == 0
        assert len(b.rows) - len(a.rows) == 7
        assert a.original_bytes == b.original_bytes - 7 * 256 * 256 * 2  # not counted as compressed bytes
        assert "made again in backward" in str(a) and "made again" not in str(b)


def test_a_parameter_changed_in_place_between_forward_and_backward_raises():
    lin = nn.Linear(256, 256)
    x = torch.randn(256, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with buddy.compressed_activations(min_bytes=MIN) as s:
            loss = lin(x).float().sum()
    assert s.stats().rederived == 2  # the weight's copy, and the input's: a leaf that requires grad too
    with torch.no_grad():
        lin.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*rederive_casts=False"):
        loss.backward()


def test_without_rederiving_a_changed_parameter_keeps_the_saved_copy():
    """What PyTorch does under autocast: the gradient of the input uses the weight as it was cast, not as it is."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(256, 256))
    x = torch.randn(256, 256, requires_grad=True)
    grads = []
    for session in (None, False):
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if session is None:
                loss = (x @ w).float().sum()
            else:
                with buddy.compressed_activations(min_bytes=MIN, rederive_casts=session) as s:
                    loss = (x @ w).float().sum()
                assert s.stats().rederived == 0
        with torch.no_grad():
            w.add_(1.0)
        loss.backward()
        with torch.no_grad():
            w.sub_(1.0)
        grads.append(x.grad.clone())
    assert torch.equal(grads[0].view(torch.uint8), grads[1].view(torch.uint8))


def test_a_copy_made_before_the_step_is_not_rederived():
    """A cast that outlives a step (autocast's cache kept over an optimizer's step) may hold a parameter's old
    values: only copies made in the block are re-derived."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(256, 256))
    x = torch.randn(256, 256, requires_grad=True)
    stale = w.to(torch.bfloat16)
    with torch.no_grad():
        w.mul_(2.0)  # the copy is now of old values
    expected = torch.autograd.grad((x.to(torch.bfloat16) @ stale).float().sum(), x)[0]
    with buddy.compressed_activations(min_bytes=MIN) as s:
        loss = (x.to(torch.bfloat16) @ stale).float().sum()
    # the input's copy, made in the block, is re-derived (x is a leaf that requires grad); the stale one compressed
    assert s.stats().rederived == 1 and len(s.stats().rows) == 1
    assert torch.equal(torch.autograd.grad(loss, x)[0].view(torch.uint8), expected.view(torch.uint8))


def test_an_explicit_cast_in_the_block_is_rederived_bit_exact():
    """``w.to(dtype)`` in the block, saved whole (not a view): the same bytes come back, on awkward values too."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(300, 257) * 1e30)  # values past bf16's precision and fp16's range
    with torch.no_grad():
        w[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    x = torch.randn(64, 300, requires_grad=True)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        expected = torch.autograd.grad((x.to(dtype) @ w.to(dtype)).sum(), (x, w))
        with buddy.compressed_activations(min_bytes=1024) as s:
            loss = (x.to(dtype) @ w.to(dtype)).sum()
        assert s.stats().rederived == 2, dtype  # the weight's copy and the input's (a leaf)
        got = torch.autograd.grad(loss, (x, w))
        for a, b in zip(got, expected):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), dtype


def test_what_is_not_a_parameters_copy_is_not_rederived():
    torch.manual_seed(0)
    since = node_sequence_now()
    p = nn.Parameter(torch.randn(8, 4, 6, 6))
    h = torch.randn(32, 32, requires_grad=True)
    assert cast_source(p.to(torch.bfloat16), since) is p
    assert cast_source(p.to(torch.bfloat16).transpose(0, 1), since) is p  # a view of a copy
    assert cast_source((h * 2).to(torch.bfloat16), since) is None  # a copy of an activation
    assert cast_source(p.to(memory_format=torch.channels_last), since) is None  # other strides
    assert cast_source(p.detach().to(torch.bfloat16), since) is None  # no grad_fn
    assert cast_source(p.to(torch.int32), since) is None  # not a float copy
    assert cast_source(p.to(torch.bfloat16), node_sequence_now()) is None  # made before the given node


def test_node_sequence_now_is_after_every_node_made_so_far():
    a = torch.randn(3, requires_grad=True) * 2
    now = node_sequence_now()
    assert a.grad_fn._sequence_nr() < now
    b = torch.randn(3, requires_grad=True) * 2
    assert b.grad_fn._sequence_nr() >= now
    with torch.no_grad():
        assert node_sequence_now() > b.grad_fn._sequence_nr()
    with torch.inference_mode():
        assert node_sequence_now() == sys.maxsize


def test_rederive_casts_must_be_a_bool():
    with pytest.raises(TypeError, match="rederive_casts must be True or False"):
        buddy.compressed_activations(rederive_casts="yes")


@pytest.mark.gpu
def test_weight_casts_are_made_again_on_the_gpu_bit_exact_and_without_a_host_wait(cuda):
    """Under bf16 autocast on a GPU: the casts made again on the device (``to`` on the current stream, no host
    wait under sync debug mode "error" once the keys are learned), the gradients bit-identical to a plain step's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())]).to(cuda)
    x = torch.randn(512, 1024, device=cuda, requires_grad=True)
    tracker, store = buddy.Tracker(), buddy.BuddyStore(capacity_bytes=256 << 20, pin=True)

    def step(session=None):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with session if session is not None else contextlib.nullcontext():
                loss = model(x).float().square().mean()
        return torch.autograd.grad(loss, [x, *model.parameters()])

    expected = step()
    for _ in range(2):  # the keys learned: sized first, then packed ahead
        step(buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN))
    s = buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step(s)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert s.stats().rederived == 4 + 1  # the weights' copies, and the input's (a leaf that requires grad)
    for a, b in zip(got, expected):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
