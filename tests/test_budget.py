"""Compress where it pays: the cost model, the step's peak, and the budget policies that use them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import buddy
from buddy import cost
from buddy import MemoryTarget, TimeBudget
from buddy.peak import Saved, StepProfile, plan

MIB = 1 << 20


def _flat(device, codec, dtype) -> cost.Rates:
    """A cost model that makes every byte cost the same: 1 GB/s each way, 0.1 ms a tensor."""
    return cost.Rates(1e9, 1e9, 1e-4)


# ---- the cost model ---------------------------------------------------------------------------------------------
def test_rates_model_seconds_and_refuse_what_means_nothing():
    r = cost.Rates(compress=2e9, decompress=4e9, host=1e-3)
    assert r.seconds(0) == pytest.approx(1e-3)
    assert r.seconds(4_000_000) == pytest.approx(1e-3 + 2e-3 + 1e-3)
    for bad in (
        {"compress": 0, "decompress": 1},
        {"compress": 1, "decompress": -1},
        {"compress": 1, "decompress": 1, "host": -1e-3},
    ):
        with pytest.raises(ValueError):
            cost.Rates(**bad)


def test_rates_are_measured_once_per_device_codec_and_dtype(monkeypatch):
    cost.forget_rates()
    try:
        calls = []
        real = cost._calibrate
        monkeypatch.setattr(cost, "_calibrate", lambda *a: calls.append(a) or real(*a))
        first = cost.rates("cpu", "zvc", torch.float32)
        assert first.compress > 0 and first.decompress > 0 and first.host >= 0
        assert cost.rates(torch.device("cpu"), "zvc", torch.float32) is first  # kept
        assert len(calls) == 1
        cost.rates("cpu", "zvc", torch.bfloat16)  # another dtype: measured
        assert len(calls) == 2
        mine = cost.Rates(1.0, 2.0)
        cost.set_rates("cpu", "zvc", torch.float32, mine)
        assert cost.rates("cpu", "zvc", torch.float32) is mine
        cost.set_rates("cpu", "zvc", torch.float32, None)
        cost.rates("cpu", "zvc", torch.float32)
        assert len(calls) == 3
        with pytest.raises(TypeError):
            cost.set_rates("cpu", "zvc", torch.float32, 5.0)  # type: ignore[arg-type]
    finally:
        cost.forget_rates()


# ---- the peak ---------------------------------------------------------------------------------------------------
def _profile(sizes, compressed=None, order=None, samples=None) -> StepProfile:
    """A step saving tensors of ``sizes`` (original, device bytes) in order, then using them in ``order`` (default:
    last saved, first used); ``samples``: the allocator's bytes per event."""
    p = StepProfile()
    if samples is not None:
        counter = iter(samples)
        p._sample = lambda: next(counter)
    for i, (original, device) in enumerate(sizes):
        p.save(Saved(f"m/{i}", original, device, bool(compressed and i in compressed), torch.float32,
                     torch.device("cpu"), "zvc", 0))  # fmt: skip
    p.end_forward()
    for i in order if order is not None else reversed(range(len(sizes))):
        p.use(i)
    return p


def test_a_tensor_saved_at_the_peak_and_used_first_is_never_compressed():
    # three activations, then the loss's tensor (as large as the three together), used first in backward
    p = _profile([(4 * MIB, MIB)] * 3 + [(12 * MIB, 2 * MIB)])
    chosen = plan(p, [1e-3] * 4)
    assert chosen.compress == {0, 1, 2}
    assert chosen.left == {3: "it is not held at the peak"}
    assert chosen.peak_plain == 24 * MIB
    assert chosen.peak == 3 * MIB + 12 * MIB  # where the loss's tensor is used: itself, whole, and the others


def test_a_target_stops_at_the_cheapest_choice_that_meets_it():
    # used in the order saved: where each is used, the ones saved after it are held (compressed or not)
    p = _profile([(4 * MIB, MIB), (4 * MIB, 3 * MIB), (4 * MIB, MIB)], order=[0, 1, 2])
    # the second tensor frees least per second: a target the other two meet leaves it
    chosen = plan(p, [1e-3] * 3, target=9 * MIB)
    assert chosen.compress == {0, 2}
    assert chosen.left == {1: "the target is met"}
    assert chosen.peak == 9 * MIB
    # a target nothing can meet: every tensor that lowers the peak
    assert plan(p, [1e-3] * 3, target=MIB).compress == {0, 1, 2}


def test_what_the_step_compressed_holds_against_a_slightly_better_choice():
    # two tensors held at the peak (where a third, saved last, is used first), a budget for one: the second frees
    # 10 % more a second, the first was compressed
    p = _profile([(4 * MIB, MIB), (4 * MIB, MIB), (8 * MIB, 8 * MIB)], compressed={0}, order=[2, 0, 1])
    seconds = [1.1e-3, 1e-3, 1e-3]
    assert plan(p, seconds, budget=1.2e-3, sticky=1.0).compress == {1}
    assert plan(p, seconds, budget=1.2e-3).compress == {0}  # (the default: 25 % in its favour)


def test_a_budget_buys_the_most_peak_bytes_it_can():
    p = _profile([(4 * MIB, MIB), (8 * MIB, MIB), (4 * MIB, 2 * MIB)])
    seconds = [1e-3, 2e-3, 1e-3]
    chosen = plan(p, seconds, budget=2.5e-3)
    assert chosen.compress == {1}  # 7 MiB freed for 2 ms before 3 MiB for 1 ms: the most freed a second
    assert chosen.seconds == pytest.approx(2e-3)
    # the peak is now where tensor 1 is saved (whole): tensor 0, held there, had no time left; tensor 2 (saved
    # last, used first) is not held there
    assert chosen.left == {0: "the time budget is spent", 2: "it is not held at the peak"}
    assert plan(p, seconds, budget=0.0).compress == set()
    with pytest.raises(ValueError):
        plan(p, [1e-3])


def test_the_allocators_samples_give_each_event_its_base():
    # 100 MiB held beside the saved tensors throughout, and 50 MiB more where the first tensor is used (a gradient)
    sizes = [(4 * MIB, MIB), (4 * MIB, MIB)]
    held = [4, 8, 8, 8, 4]  # MiB of saved tensors at: save 0, save 1, forward's end, use 1, use 0
    extra = [0, 0, 0, 0, 50]
    samples = [(100 + h + e) * MIB for h, e in zip(held, extra, strict=True)]
    p = _profile(sizes, samples=samples)
    assert list(p.base()) == [(100 + e) * MIB for e in extra]
    chosen = plan(p, [1e-3, 1e-3])
    # the step peaks where tensor 0 is used: its own compression buys nothing there, tensor 1 was used before it
    assert chosen.compress == set()
    assert chosen.peak == chosen.peak_plain == 154 * MIB


# ---- the policies in a training step ------------------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6)], nn.Linear(256, 2048))


def _train(policy, steps: int, *, checkpointed: bool = False, tracker=None):
    """``steps`` SGD steps of the MLP on a fixed batch, the loss of a wide head inside the block (its ReLU's
    output, half zeros, saved last and used first); the parameters after them and the sessions (``policy``
    ``None``: without buddy)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=gen)
    tracker = tracker if tracker is not None else buddy.Tracker()
    sessions = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        session = buddy.compressed_activations(
            policy, tracker=tracker, store=buddy.BuddyStore(), min_bytes=8192, enabled=policy is not None
        )
        with session:
            h = x
            for block in model[:-1]:
                h = checkpoint(block, h, use_reentrant=False) if checkpointed else block(h)
            loss = model[-1](h).relu().square().mean()
        loss.backward()
        opt.step()
        sessions.append(session)
    return [p.detach().clone() for p in model.parameters()], sessions


@pytest.mark.parametrize("policy", [
    MemoryTarget(fraction=0.5, rates=_flat), TimeBudget(seconds=1.0, rates=_flat), TimeBudget(0.0, rates=_flat),
], ids=["target", "budget", "no-time"])  # fmt: skip
def test_budget_policies_train_bit_identically_and_leave_the_loss(policy):
    plain, _ = _train(None, 4)
    params, sessions = _train(policy, 4)
    assert all(torch.equal(a, b) for a, b in zip(plain, params, strict=True))
    first, last = sessions[0].stats(), sessions[-1].stats()
    assert first.left_bytes == 0 and first.plan is None  # no step before it: everything compressed, learned
    head = next(r for r in last.rows if r.shape == (512, 2048))  # the head's ReLU: saved last, used first
    assert head.codec == "left"
    if isinstance(policy, TimeBudget) and policy.fraction == 0.0:
        assert all(r.codec == "left" for r in last.rows)
    else:
        assert head.left == "it is not held at the peak"
        assert any(r.codec not in ("left", "kept") for r in last.rows)
    assert last.plan is not None and type(policy).__name__ in last.plan
    assert "left as they are" in str(last)
    assert last.within_bound


def test_a_target_met_compresses_no_more_than_it_needs():
    _, loose = _train(MemoryTarget(fraction=0.9, rates=_flat), 3)
    _, tight = _train(MemoryTarget(fraction=0.4, rates=_flat), 3)
    left = [sum(r.left is not None for r in s[-1].stats().rows) for s in (loose, tight)]
    assert left[0] > left[1]
    assert any(r.left == "the target is met" for r in loose[-1].stats().rows)


def test_the_profile_follows_the_step():
    tracker = buddy.Tracker()
    _, sessions = _train(MemoryTarget(fraction=0.5, rates=_flat), 2, tracker=tracker)
    p = tracker.last_profile
    assert p is not None and p.forward_end is not None and p.period is None  # the last step: no next one yet
    assert all(s.saved_at < p.forward_end < s.used_at for s in p.saved)  # every tensor used in backward
    last_saved = max(p.saved, key=lambda s: s.saved_at)
    assert min(p.saved, key=lambda s: s.used_at) is last_saved  # the head's ReLU: saved last, used first
    assert p.measured_seconds > 0


def test_budget_policies_with_checkpointing_are_bit_identical_to_checkpointing_alone():
    plain, _ = _train(None, 3, checkpointed=True)
    for policy in (None, MemoryTarget(fraction=0.5, rates=_flat)):
        tracker = buddy.Tracker()
        params, sessions = _train(policy or buddy.OverflowBudget(), 3, checkpointed=True, tracker=tracker)
        assert all(torch.equal(a, b) for a, b in zip(plain, params, strict=True))
        st = sessions[-1].stats()
        # what checkpointing keeps (each region's input) is what the session takes, and the head's input and
        # output; the regions' recomputation is not taken
        assert len(st.rows) == 8
        assert st.in_backward == 0  # a non-reentrant checkpoint recomputes through its own hooks


def test_a_time_budget_counts_the_host_work_the_step_before_measured():
    # three 4 MiB tensors, compressed in the step before; 1 GB/s each way: 8.4 ms of kernels a tensor on the CPU
    tracker = buddy.Tracker()
    for measured, expected in ((0.0, 1), (0.06, 0)):  # its hooks took no more than the kernels; 60 ms in all
        tracker.last_profile = _profile([(4 * MIB, MIB)] * 3, compressed={0, 1, 2}, order=[0, 1, 2])
        tracker.last_profile.measured_seconds = measured
        policy = TimeBudget(seconds=0.012, rates=_flat)
        policy.begin_step(tracker)
        assert policy.last_plan is not None and len(policy.last_plan.compress) == expected
        assert sum(policy.leaves(f"m/{i}") is not None for i in range(3)) == 3 - expected


@pytest.mark.parametrize("bad", [
    lambda: MemoryTarget(), lambda: MemoryTarget(1 << 20, fraction=0.5), lambda: MemoryTarget(fraction=0.0),
    lambda: MemoryTarget(fraction=1.5), lambda: MemoryTarget(-1), lambda: TimeBudget(),
    lambda: TimeBudget(0.1, seconds=1.0), lambda: TimeBudget(-0.1), lambda: TimeBudget(seconds=True),
])  # fmt: skip
def test_budget_policies_refuse_what_means_nothing(bad):
    with pytest.raises(ValueError):
        bad()


def test_a_cost_model_that_is_not_one_is_refused():
    with pytest.raises(TypeError):
        MemoryTarget(fraction=0.5, rates=3.0)  # type: ignore[arg-type]
