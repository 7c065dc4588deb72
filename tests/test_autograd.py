"""compressed_activations: training is bit-identical with and without it."""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import buddy
from buddy.codecs import Codec

#: the session under the suite's pinned zvc at E = 128 and under the library's own defaults
pytestmark = pytest.mark.both_defaults

MIN = 4096  # small models: compress everything above 4 KiB


@pytest.fixture
def store():
    return buddy.BuddyStore(capacity_bytes=1 << 30, block_bytes=1 << 20)


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


class TinyTransformer(nn.Module):
    def __init__(self, vocab=64, dim=32, seq=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, activation="gelu", batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.head(self.block(self.emb(x) + self.pos))


def cnn_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def lm_batch():
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 64, (8, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train(model_fn, batch_fn, steps, session_fn=None, autocast=False):
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = batch_fn()
    losses, sessions = [], []
    for _ in range(steps):
        opt.zero_grad()
        ctx = session_fn() if session_fn else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if ctx is not None:
                with ctx:
                    out = model(x)
                sessions.append(ctx)
            else:
                out = model(x)
            loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return model, losses, sessions


def assert_same_training(a, b):
    model_a, losses_a, _ = a
    model_b, losses_b, _ = b
    for la, lb in zip(losses_a, losses_b):
        assert torch.equal(la.view(torch.int32), lb.view(torch.int32))
    for (name, pa), pb in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(pa.view(-1).view(torch.uint8), pb.view(-1).view(torch.uint8)), name


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "policy",
    [buddy.BuddyThreshold(0.1), buddy.FixedRatio(4.0), buddy.DeviceBudget(1 << 16), buddy.OverflowBudget(0.1)],
    ids=["threshold", "fixed4x", "budget", "overflow-budget"],
)
@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_training_is_bit_identical(model, policy, autocast, tracker, store):
    model_fn, batch_fn = (small_cnn, cnn_batch) if model == "cnn" else (TinyTransformer, lm_batch)
    plain = train(model_fn, batch_fn, 3, autocast=autocast)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", buddy.BudgetExceededWarning)
        compressed = train(
            model_fn,
            batch_fn,
            3,
            lambda: buddy.compressed_activations(policy, tracker=tracker, store=store, min_bytes=MIN),
            autocast=autocast,
        )
    assert_same_training(plain, compressed)
    stats = compressed[2][-1].stats()
    assert stats.rows and stats.failed == 0
    packed = [r for r in stats.rows if r.codec != "kept"]
    assert stats.original_bytes > 0 and stats.decompressions >= len(packed)
    # everything released after backward
    assert store.bytes_held == 0 and buddy.ledger.default_ledger().tensors_held == 0
    assert tracker.held_device_bytes == 0


def test_stats_fields_and_table(tracker, store):
    _, _, sessions = train(
        small_cnn, cnn_batch, 2, lambda: buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN)
    )
    st = sessions[-1].stats()
    assert st.device_bytes == sum(r.device_bytes for r in st.rows)
    assert st.buddy_bytes == sum(r.buddy_bytes for r in st.rows)
    assert st.effective_capacity == pytest.approx(st.original_bytes / (st.device_bytes + st.reserve_bytes))
    assert st.overflow_fraction == pytest.approx(st.buddy_bytes / st.original_bytes)
    assert st.compress_seconds > 0 and st.decompress_seconds > 0
    table = str(st)
    assert "total (unique storages)" in table and st.rows[0].key in table
    # second step: every key was seen before, so every row has a prediction
    assert all(r.predicted_overflow_bytes is not None for r in st.rows)
    assert [r.key for r in st.rows] == [r.key for r in sessions[0].stats().rows]  # keys are stable


def test_dedup_compresses_once_and_counts_once(tracker, store):
    x = torch.randn(64, 1024, requires_grad=True)
    w1 = torch.randn(1024, 8, requires_grad=True)
    w2 = torch.randn(1024, 8, requires_grad=True)
    with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN) as s:
        h = torch.relu(x * 2)  # relu saves its output ...
        out = (h @ w1).sum() + (h @ w2).sum()  # ... and both matmuls save it again
    st = s.stats()
    h_rows = [r for r in st.rows if r.shape == (64, 1024)]
    assert len(h_rows) == 1 and h_rows[0].saves == 3
    assert st.deduplicated == 2
    assert st.original_bytes == 64 * 1024 * 4  # h once (x*2 is not saved: mul by a scalar saves nothing)
    out.backward()
    expect = torch.relu(x.detach() * 2)
    g1 = expect.t() @ torch.ones(64, 8)
    assert torch.equal(w1.grad, g1)


def test_a_tensor_changed_in_place_between_two_saves_is_saved_twice(tracker, store):
    """``x`` is saved by a matmul, scaled in place, then saved by another matmul: the same storage, offset, shape
    and strides, a new version. Each op must get the values it saved (the second save is no dedup hit of the
    first), so the gradients are those of the same step written with a new tensor instead of the in-place op."""
    w1 = torch.randn(256, 64, requires_grad=True, generator=torch.Generator().manual_seed(1))
    w2 = torch.randn(256, 64, requires_grad=True, generator=torch.Generator().manual_seed(2))

    def grads(in_place: bool):
        w1.grad = w2.grad = None
        x = torch.relu(torch.randn(512, 256, generator=torch.Generator().manual_seed(3)))  # compresses: not kept
        with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN) as s:
            a = x @ w1  # saves x
            x = x.mul_(3.0) if in_place else x * 3.0
            b = x @ w2  # saves x again: new values
            loss = (a * b).sum()
        loss.backward()
        return w1.grad.clone(), w2.grad.clone(), s.stats()

    expected, got = grads(in_place=False), grads(in_place=True)
    assert torch.equal(got[0].view(torch.int32), expected[0].view(torch.int32))
    assert torch.equal(got[1].view(torch.int32), expected[1].view(torch.int32))
    rows = [r for r in got[2].rows if r.shape == (512, 256)]
    assert got[2].deduplicated == 0 and len(rows) == 2 and all(r.codec != "kept" for r in rows)


@pytest.mark.parametrize("why", ["small", "kept"])
def test_a_tensor_kept_as_it_is_and_changed_in_place_raises_as_without_buddy(why, tracker, store):
    """A saved tensor buddy leaves as it is (too small; or incompressible: the raw slot) is the user's memory. Changed
    in place before backward, it raises PyTorch's own error, as it does without buddy: never a wrong gradient."""
    w = torch.randn(256, 64, requires_grad=True)
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(3))  # random: incompressible
    with buddy.compressed_activations(
        policy=buddy.FixedRatio(1.0), tracker=tracker, store=store, min_bytes=1 << 30 if why == "small" else MIN
    ) as s:
        loss = (x @ w).sum()
        x.mul_(3.0)
    assert (s.stats().rows[0].codec == "kept") if why == "kept" else not s.stats().rows
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_parameters_and_small_tensors_are_not_compressed(tracker, store):
    lin0, lin = nn.Linear(1024, 1024), nn.Linear(1024, 1024)
    x = torch.randn(512, 1024)
    with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN) as s:
        h = torch.tanh(lin0(x))
        y = lin(h).sum()
    st = s.stats()
    # the weights (4 MiB parameters, saved as transposed views for h's grad)
    # and the biases (small) are kept; the activations are compressed
    assert all(r.shape != (1024, 1024) for r in st.rows)
    assert sorted(r.shape for r in st.rows) == [(512, 1024), (512, 1024)]
    assert st.skipped >= 1
    y.backward()


def test_is_parameter_says_what_isinstance_of_parameter_says():
    """is_parameter reads a plain tensor's _is_param flag where isinstance(t, Parameter) would run torch's metaclass
    in Python: the same answer for parameters, their views, leaves with and without grad, activations, flagged
    tensors and a parameter subclass."""
    from buddy.autograd import is_parameter

    def reference(t):  # the definition before
        base = t._base if t._base is not None else t
        return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)

    p, frozen = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4), requires_grad=False)
    flagged = torch.randn(3)
    flagged._is_param = True  # what torch marks a parameter of a tensor subclass with
    leaf = torch.randn(4, requires_grad=True)

    class Sub(nn.Parameter):
        pass

    sub = Sub(torch.randn(2), requires_grad=False)
    cases = [p, p.t(), p[1:], frozen, frozen.view(2, 2), flagged, flagged[:2], leaf, leaf[:2], torch.randn(4),
             torch.tanh(leaf), torch.tanh(leaf).t(), (p @ p)[0], sub, sub[:1]]  # fmt: skip
    got = [is_parameter(t) for t in cases]
    assert got == [reference(t) for t in cases]
    assert got.count(True) == 11  # (the activations and a plain tensor are not)


def test_a_saved_weight_is_skipped_as_the_full_checks_skip_it(tracker, store, monkeypatch):
    """A weight, or a view of one, an op saves is named a parameter without check_tensor (_PLAIN), as a small save is
    named small: the same reasons, and the same counts, as the full checks give -- for a large and a small weight,
    an LSTM's and a linear's."""
    from buddy import hooks as ag

    torch.manual_seed(0)
    lin, lstm = nn.Linear(1024, 1024), nn.LSTM(16, 16)
    x, seq = torch.randn(64, 1024), torch.randn(5, 2, 16)
    seen: list[str | None] = []
    checked = []
    skip, check = ag._SavedTensorHooks._skip_reason, ag.check_tensor
    monkeypatch.setattr(ag._SavedTensorHooks, "_skip_reason", lambda self, t: seen.append(skip(self, t)) or seen[-1])
    monkeypatch.setattr(ag, "check_tensor", lambda t: checked.append(t) or check(t))

    def run():
        seen.clear()
        checked.clear()
        with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN) as s:
            y = torch.tanh(lin(x)).sum() + lstm(seq)[0].sum()
        y.backward()
        st = s.stats()
        return list(seen), (st.saves, st.skipped, st.skipped_bytes, st.kept_bytes, len(st.rows)), len(checked)

    *fast, fast_checks = run()
    monkeypatch.setattr(ag, "_PLAIN", ())  # every save through check_tensor, as before the fast path
    *full, full_checks = run()
    assert fast == full
    assert fast[0].count("parameter") >= 3  # lin.weight (a transposed view), lstm's weights
    # none of the saves the fast path names (the weights, the small ones) went through check_tensor
    assert full_checks - fast_checks == fast[0].count("parameter") + fast[0].count("small")
    buf = torch.randn(256, 1024)
    holder = nn.Module()
    holder.register_buffer("table", buf)
    x = torch.randn(256, 1024, requires_grad=True)
    with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN, exclude=holder) as s:
        (x * holder.table).sum().backward()
    assert s.stats().rows == []  # x is a leaf requiring grad; the buffer is excluded
    assert torch.equal(x.grad, buf)


def test_fixed_ratio_is_fixed(tracker, store):
    _, _, sessions = train(
        small_cnn,
        cnn_batch,
        2,
        lambda: buddy.compressed_activations(buddy.FixedRatio(2.0), tracker=tracker, store=store, min_bytes=MIN),
    )
    assert {r.target_ratio for s in sessions for r in s.stats().rows} == {2.0}


def test_threshold_is_respected_on_stable_data(tracker, store):
    _, _, sessions = train(
        small_cnn,
        cnn_batch,
        1,
        lambda: buddy.compressed_activations(buddy.BuddyThreshold(0.05), tracker=tracker, store=store, min_bytes=MIN),
    )
    for row in sessions[0].stats().rows:  # new keys: decided from their own size pass, so exact
        assert row.buddy_bytes <= 0.05 * row.original_bytes


def test_device_budget_is_respected(tracker, store):
    """Slots, metadata and the codec tables together stay within the budget once keys have a history.

    The first step has none: each tensor takes its per-tensor slot while the
    budget lasts, so the last tensors may find no room even for their metadata
    and table; they go wholly to buddy memory with a warning.
    """
    budget = 200_000
    policy = buddy.DeviceBudget(budget)
    exceeded = []

    def session():
        exceeded.append(policy.exceeded)
        return buddy.compressed_activations(policy, tracker=tracker, store=store, min_bytes=MIN)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, losses, sessions = train(small_cnn, cnn_batch, 3, session)
    exceeded = [b - a for a, b in zip(exceeded, exceeded[1:] + [policy.exceeded])]
    warned = sum(issubclass(w.category, buddy.BudgetExceededWarning) for w in caught)
    assert warned == sum(exceeded) and exceeded[1:] == [0, 0], "planned steps fit"
    for s, over in zip(sessions, exceeded):
        assert s.stats().device_bytes <= budget or over
    assert all(s.stats().device_bytes <= budget for s in sessions[1:])
    assert sessions[-1].stats().buddy_bytes > 0  # it had to spill to fit


def test_device_budget_that_cannot_fit_warns_and_keeps_data(tracker, store):
    x = torch.randn(256, 1024, requires_grad=True)
    with pytest.warns(buddy.BudgetExceededWarning):
        with buddy.compressed_activations(buddy.DeviceBudget(10), tracker=tracker, store=store, min_bytes=MIN) as s:
            y = torch.sigmoid(x)
    row = s.stats().rows[0]
    assert row.target_ratio == float("inf") and row.buddy_bytes > 0
    y.sum().backward()
    assert torch.equal(x.grad, (torch.sigmoid(x) * (1 - torch.sigmoid(x))).detach())


def test_tracker_follows_drift(tracker, store):
    """Sparsity drops mid-run: the slot grows at once, the bound holding at every step, while the history lags (zvc at 128 B: sparsity is all it sees). Sized first (strict=True): each slot from the tensor's own sizes."""
    g = torch.Generator().manual_seed(3)
    slots = []
    for step in range(10):
        zero_fraction = 0.95 if step < 5 else 0.0
        x = torch.randn(128, 1024, generator=g)
        x[torch.rand(128, 1024, generator=g) < zero_fraction] = 0
        x.requires_grad_(True)
        session = buddy.compressed_activations(
            buddy.BuddyThreshold(0.1), tracker=tracker, store=store, min_bytes=MIN, codec="zvc", entry_bytes=128,
            strict=True,
        )
        with session as s:
            y = torch.relu(x)  # saves its (sparse, then dense) output
        y.sum().backward()
        slots.append(s.stats().rows[0].target_ratio)
    assert slots[4] == 4.0  # 95 % zeros: 4x
    assert slots[5:] == [pytest.approx(4 / 3)] * 5  # a plain ReLU, half zeros: 1.33x from the first dense step
    history = tracker.history(s.stats().rows[0].key)
    assert history.steps == 10
    assert all(o.overflow_bytes <= 0.1 * o.original_bytes for o in history.observations)
    # the history, which had seen only sparse steps, predicted that the 1.33x slot would spill nothing at the drift step
    drift = history.observations[5]
    assert drift.predicted_overflow_bytes == 0 < drift.overflow_bytes


class _Boom(Codec):
    name = "boom-test"

    def analyse(self, entries, word_bytes):
        raise RuntimeError("codec exploded")

    def decode(self, payload, sectors, modes, word_bytes):
        raise AssertionError("never called")


def test_failing_codec_keeps_original_and_warns_once(tracker, store, temporary_codec):
    temporary_codec(_Boom())
    plain = train(small_cnn, cnn_batch, 2)
    with pytest.warns(RuntimeWarning, match="codec exploded") as record:
        failing = train(
            small_cnn,
            cnn_batch,
            2,
            lambda: buddy.compressed_activations(codec="boom-test", tracker=tracker, store=store, min_bytes=MIN),
        )
    assert sum("codec exploded" in str(w.message) for w in record) == 1
    assert_same_training(plain, failing)
    st = failing[2][-1].stats()
    assert st.failed > 0 and not st.rows
    assert store.bytes_held == 0


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpoints_recomputation_in_backward_is_not_compressed(reentrant, tracker, store):
    """Backward run inside the block: a reentrant checkpoint's forward, recomputed there, saves its tensors through
    the session's hooks; autograd uses them at once, so they are kept as they are (counted), not compressed again.
    A non-reentrant checkpoint's recomputation saves through its own hooks, which the session never sees. Either
    way the gradients are checkpointing's alone, bit for bit."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))

    def step(session=None):
        net.zero_grad()
        with session if session is not None else contextlib.nullcontext():
            h = net[1](net[0](x))
            h = checkpoint(lambda t: net[3](net[2](t)), h, use_reentrant=reentrant)
            net[4](h).square().mean().backward()
        return [p.grad.clone() for p in net.parameters()]

    alone = step()
    session = buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN)
    both = step(session)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(alone, both))
    st = session.stats()
    # the recomputed ReLU's output (the region's input is a leaf that requires grad there: skipped as a weight)
    assert st.rows and st.in_backward == (1 if reentrant else 0)
    assert ("made in backward" in str(st)) is reentrant
    forward = buddy.compressed_activations(tracker=buddy.Tracker(), store=store, min_bytes=MIN)
    with forward:  # the same forward, backward outside the block: the same tensors compressed
        h = net[1](net[0](x))
        h = checkpoint(lambda t: net[3](net[2](t)), h, use_reentrant=reentrant)
        loss = net[4](h).square().mean()
    loss.backward()
    assert [(r.shape, r.dtype) for r in forward.stats().rows] == [(r.shape, r.dtype) for r in st.rows]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_regions_inside_the_block(reentrant, tracker, store):
    def model_fn():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model_fn()

        def forward(self, x):
            h = self.net[1](self.net[0](x))
            h = checkpoint(lambda t: self.net[3](self.net[2](t)), h, use_reentrant=reentrant)
            return self.net[4](h)

    def batch():
        g = torch.Generator().manual_seed(4)
        return torch.randn(64, 256, generator=g, requires_grad=True), torch.randint(0, 10, (64,), generator=g)

    plain = train(Checkpointed, batch, 2)
    compressed = train(
        Checkpointed, batch, 2, lambda: buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN)
    )
    assert_same_training(plain, compressed)
    assert compressed[2][-1].stats().rows


def test_nested_sessions_innermost_packs(tracker, store):
    x0 = torch.rand(128, 1024)
    x = x0.clone().requires_grad_(True)
    with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN) as outer:
        a = x.exp()
        with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN, key_prefix="inner/") as inner:
            b = a.exp()
        c = b.exp()
    assert len(inner.stats().rows) == 1 and inner.stats().rows[0].key.startswith("inner/")
    assert len(outer.stats().rows) == 2
    (a.sum() + c.sum()).backward()
    ref = x0.clone().requires_grad_(True)
    a = ref.exp()
    (a.sum() + a.exp().exp().sum()).backward()
    assert torch.equal(x.grad, ref.grad)


def test_reentering_an_open_session_is_refused(tracker, store):
    session = buddy.compressed_activations(tracker=tracker, store=store)
    with session:
        with pytest.raises(RuntimeError, match="already open"):
            session.__enter__()
    with session:  # sequential reuse is one more step
        pass


def test_threads_have_their_own_sessions(tracker, store):
    plain = train(small_cnn, cnn_batch, 2)
    models = [small_cnn() for _ in range(2)]  # built here: the global RNG is not thread-safe to seed
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = train(
                lambda: models[i],
                cnn_batch,
                2,
                lambda: buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN, key_prefix=f"t{i}/"),
            )
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(2):
        assert_same_training(plain, results[i])
        assert all(r.key.startswith(f"t{i}/") for r in results[i][2][-1].stats().rows)


def test_session_in_one_thread_does_not_touch_another(tracker, store):
    seen = {}

    def other():
        x = torch.randn(256, 1024, requires_grad=True)
        y = x.exp()
        seen["grad_fn_saved"] = y.grad_fn._saved_result is not None

    with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN) as s:
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["grad_fn_saved"] and s.stats().saves == 0


def test_wrap_uses_tracker_history(tracker, store):
    g = torch.Generator().manual_seed(5)
    for _step in range(3):
        t = torch.relu(torch.randn(256, 1024, generator=g))
        bt = buddy.wrap(t, "kept/features", tracker=tracker, store=store)
        assert torch.equal(bt.decompress().view(torch.uint8), t.view(torch.uint8))
        assert tracker.held_device_bytes == bt.device_bytes
        bt.free()
        assert tracker.held_device_bytes == 0
    assert tracker.history("kept/features").steps == 3
    with pytest.raises(ValueError):
        buddy.wrap(t, "", tracker=tracker, store=store)


def test_set_defaults_switches_codec_and_entry_size(tracker, store):
    previous = buddy.set_defaults(codec="raw", entry_bytes=256)
    try:
        x = torch.randn(256, 1024, requires_grad=True)
        with buddy.compressed_activations(buddy.FixedRatio(2.0), tracker=tracker, store=store, min_bytes=MIN) as s:
            y = torch.relu(x)
        row = s.stats().rows[0]
        assert row.codec == "raw" and row.buddy_bytes == row.original_bytes // 2  # raw: half of every entry spills
        assert tracker.history(row.key).entry_bytes == 256
        bt = buddy.compress(torch.zeros(1000))
        assert bt.codec == "raw" and bt.entry_bytes == 256
        y.sum().backward()
    finally:
        buddy.set_defaults(codec=previous.codec, entry_bytes=previous.entry_bytes)
    assert buddy.defaults() == previous
    with pytest.raises(ValueError):
        buddy.set_defaults(codec="nope")


def test_incompressible_tensors_are_kept_as_they_are(tracker, store):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(256, 1024, generator=g, requires_grad=True)  # dense: zvc cannot beat the raw slot
    with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN, codec="zvc", entry_bytes=128) as s:
        y = x.exp()
        z = torch.relu(x - 3)  # mostly zeros: compressed
    st = s.stats()
    kept = [r for r in st.rows if r.codec == "kept"]
    assert len(kept) == 1 and kept[0].target_ratio == 1.0 and kept[0].device_bytes == kept[0].original_bytes
    assert st.device_bytes == sum(r.device_bytes for r in st.rows)
    assert tracker.history(kept[0].key).steps == 1  # the tracker still learns it
    (y.sum() + z.sum()).backward()
    assert torch.equal(x.grad, (x.exp() + (x > 3)).detach())


def test_disabled_session_is_a_no_op(tracker, store):
    x = torch.randn(256, 1024, requires_grad=True)
    with buddy.compressed_activations(tracker=tracker, store=store, min_bytes=MIN, enabled=False) as s:
        x.exp().sum().backward()
    assert s.stats().rows == [] and s.stats().skipped == 1


def test_bad_arguments():
    with pytest.raises(TypeError):
        buddy.compressed_activations(policy="fast")
    with pytest.raises(ValueError):
        buddy.compressed_activations(min_bytes=-1)
    with pytest.raises(ValueError):
        buddy.BuddyThreshold(1.5)
    with pytest.raises(ValueError):
        buddy.DeviceBudget(-1)
    with pytest.raises(ValueError):
        buddy.FixedRatio(0.5)
    with pytest.raises(TypeError):
        buddy.compressed_activations(exclude=3)
