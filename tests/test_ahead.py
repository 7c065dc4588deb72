"""A step that reads nothing back per tensor: ``compressed_activations(strict=False)``.

Slots come from the tracker's plan; each tensor is measured and packed with no read, its sizes added to a slice of
the step's buffer and its overflow written into buddy memory reserved at the worst case; where forward ends the
step reads that buffer once, trims each tensor's buddy memory and teaches the tracker; where backward ends it reads
the error flags once. These tests count the reads (``SessionStats.host_reads``, through the one choke point
``buddy.engines.to_host``) and the torch operators a compressed tensor costs, on the native engine -- the host code
a GPU runs, with the native build as its launcher -- and check every result byte for byte against training without
buddy and against the strict step.
"""

from __future__ import annotations

import collections
import functools
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import DATA_KINDS, assert_bitexact, emulated_cpu_kernels, fuzz_settings, make_data, record_results
from hypothesis import given
from hypothesis import strategies as st

import buddy
from buddy import engines, pipeline
from buddy.engines import cuda as bcuda
from buddy.engines import sources as bsources
from experiments.operators import OperatorCount

pytestmark = [
    pytest.mark.library_defaults,  # the library's defaults: auto2 at 4096 B, on the native engine
    # a plan from history may pass the bound by what a step's tensors spill beyond their prediction: said once
    pytest.mark.filterwarnings("ignore:buddy. this step's overflow passed its policy's bound"),
]


def mlp() -> nn.Module:
    """16 Linear layers with ReLUs: the MLP of the host-path target (run under bf16 autocast)."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 10))


def cnn() -> nn.Module:
    """7 convolutions with batch norm and ReLUs: the CNN of the host-path target."""
    torch.manual_seed(0)
    layers, width = [], 3
    for out in (16, 16, 32, 32, 32, 32, 32):
        layers += [nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
        width = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def batch(kind: str):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 256, generator=g) if kind == "mlp" else torch.randn(8, 3, 32, 32, generator=g)
    return x, torch.randint(0, 10, (x.shape[0],), generator=g)


MODELS = {"mlp": (mlp, True), "cnn": (cnn, False)}  # (model, under bf16 autocast)
MIN = 64 << 10  # every activation of these models (64-256 KiB) is compressed


def train(kind: str, steps: int, session=None) -> tuple[list, list]:
    """``steps`` SGD steps of a fresh model, each in ``session()`` when given: (per step its stats or None, the
    weights' bytes after each step)."""
    make, autocast = MODELS[kind]
    model, (x, y) = make(), batch(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stats, weights = [], []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if session is None:
                loss = F.cross_entropy(model(x), y)
            else:
                with session() as s:
                    loss = F.cross_entropy(model(x), y)
        loss.float().backward()
        opt.step()
        stats.append(None if session is None else s.stats())
        weights.append([p.detach().clone().view(torch.uint8) for p in model.parameters()])
    return stats, weights


def sessions(strict: bool, **kwargs):
    """Sessions of one run: one tracker and store for all its steps."""
    tracker, store = buddy.Tracker(**kwargs), buddy.BuddyStore(capacity_bytes=256 << 20, pin=False)
    return functools.partial(buddy.compressed_activations, tracker=tracker, store=store, min_bytes=MIN, strict=strict)


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_steady_step_reads_twice_and_trains_bit_identically(kind):
    _, plain = train(kind, 4)
    stats, weights = train(kind, 4, sessions(strict=False))
    assert all(all(torch.equal(a, b) for a, b in zip(w, v)) for w, v in zip(weights, plain))
    n = len(stats[0].rows)
    assert n >= 7 and all(len(st.rows) == n for st in stats)
    # the first step sizes every tensor (a new key: one read each, its table's fit with it; and the kernels'
    # self-test, the first time in the process); then the plan
    assert stats[0].host_reads >= n + 1
    assert all(step.host_reads == 2 for step in stats[1:]), [step.host_reads for step in stats]
    for step in stats[1:]:
        assert all(r.predicted_overflow_bytes is not None for r in step.rows)
        assert step.buddy_bytes == sum(r.buddy_bytes for r in step.rows) and step.ideal_bytes > 0
    strict, _ = train(kind, 4, sessions(strict=True))
    assert [step.host_reads for step in strict[1:]] == [n + 1] * 3  # a read per tensor, and backward's


def test_forward_reads_nothing_until_it_ends():
    run = sessions(strict=False)
    model, (x, y) = mlp(), batch("mlp")
    for step in range(3):
        with run() as s:
            loss = F.cross_entropy(model(x), y)
            during = s.stats().host_reads
            assert all(not r.buddy_bytes and not r.ideal_bytes for r in s.stats().rows[-1:]) or step == 0
        after = s.stats()
        loss.backward()
    assert during == 0 and after.host_reads == 1 and s.stats().host_reads == 2
    assert after.rows[-1].ideal_bytes > 0  # filled in where forward ended


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_compressed_tensor_costs_at_most_four_operators(kind):
    """A steady step's torch operators that allocate or compute, beyond the plain step's: at most four a compressed
    tensor (its metadata, slots and overflow sums; its decompressed tensor), and four a step (the histograms'
    and flags' buffers, the flags gathered for their read, the device reserve). Symbols are not counted that step
    (count_every). A weight's bf16 copy made again in backward instead (``rederive_casts``) is one: the cast."""
    make, autocast = MODELS[kind]
    model, (x, y) = make(), batch(kind)
    run = sessions(strict=False, count_warmup=0, count_every=1000)

    def step(session):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with session() as s:
                loss = F.cross_entropy(model(x), y)
        loss.float().backward()
        return s

    for _ in range(2):
        step(run)
    counted = []
    for session in (functools.partial(buddy.compressed_activations, enabled=False), run):
        with OperatorCount() as c:  # (views and detaches apart)
            s = step(session)
        counted.append(c.ops)
    plain, ours = counted
    extra = sum(ours.values()) - sum(plain.values())
    n, recast = len(s.stats().rows), s.stats().rederived
    assert n >= 7 and s.stats().host_reads == 2 and recast == (15 if autocast else 0)
    assert extra <= 4 * n + recast + 4, f"{extra} operators for {n} tensors and {recast} casts: {ours - plain}"


def test_a_steady_step_launches_two_kernels_a_compress_and_one_a_decompress(monkeypatch):
    """Packed ahead, a compress is two launches -- sizes (measure, and the overflow's prefix sums in its last block)
    and pack -- and a decompress one, unpack; a tensor kept as it is, its sizes still learned, one: measure. Symbols
    are not counted that step (count_every)."""
    from buddy.engines import native

    model, (x, y) = mlp(), batch("mlp")
    run = sessions(strict=False, count_warmup=0, count_every=1000)

    def step():
        with run() as s:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        return s

    for _ in range(2):
        step()
    launched: list[str] = []
    real = native.launch
    monkeypatch.setattr(native, "launch", lambda codec, op, *rest: (launched.append(op), real(codec, op, *rest))[1])
    stats = step().stats()
    rows = stats.rows
    packed = sum(r.codec != "kept" for r in rows)
    assert packed >= 3 and stats.host_reads == 2
    want = {"sizes": packed, "pack": packed, "unpack": packed, "measure": len(rows) - packed}
    assert collections.Counter(launched) == {op: n for op, n in want.items() if n}, launched


def test_the_device_reserve_keeps_the_running_bound_where_the_plan_falls_short():
    """Packed ahead, a tensor that spills more than its plan says sends the sectors past the step's running bound
    to a reserve on the device, which the tracker sizes: for the first four steps packed ahead, a quarter of what
    the bound allows the last step's bytes; then from the most the recent steps sent past it. The CNN's drifting
    weights spill past the plan by a few sectors a step: the reserve holds them, and the bound holds at every
    tensor of every step. Training stays bit-identical."""
    _, plain = train("cnn", 8)
    stats, weights = train("cnn", 8, sessions(strict=False))
    assert all(all(torch.equal(a, b) for a, b in zip(w, v)) for w, v in zip(weights, plain))
    first, later = stats[1], stats[5:]  # (the first step sizes every tensor: no reserve)
    assert stats[0].reserve_bytes == 0 and first.reserve_bytes >= first.original_bytes * 0.1 / 4 - 4096
    assert all(0 < st.reserve_bytes < first.reserve_bytes for st in later)  # learned: far less than the guess
    assert sum(st.reserved_bytes for st in stats) > 0 and not any(st.reserve_short_bytes for st in stats)
    for st in stats:
        spent = seen = 0
        for row in st.rows:  # the running bound, tensor by tensor
            spent, seen = spent + row.buddy_bytes, seen + row.original_bytes
            assert spent <= st.overflow_bound * seen, row.key
        assert st.reserved_bytes == sum(r.reserve_bytes for r in st.rows) <= st.reserve_bytes
        assert st.effective_capacity == st.original_bytes / (st.device_bytes + st.reserve_bytes)
    assert "device reserve" in str(later[-1])


def test_a_step_that_compresses_worse_than_its_history_says_so_and_the_next_plan_widens():
    """The plan comes from history: a step whose activations suddenly compress worse than that spills more than its
    bound. Nothing is lost (every byte back, the gradients as without buddy), the step's stats say it passed the
    bound, and the next step, planned from it, keeps the bound again."""
    model, (x, y) = mlp(), batch("mlp")
    run = sessions(strict=False)
    out = []
    for step in range(5):
        if step == 3:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(7.0)  # the same keys, their activations far larger: other exponents, other tables
        with run() as s:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        plain = F.cross_entropy(model(x), y)
        plain.backward()
        assert all(torch.equal(a.view(torch.int32), p.grad.view(torch.int32)) for a, p in zip(grads, model.parameters()))
        model.zero_grad()
        out.append(s.stats())
    assert [st.within_bound for st in out] == [True, True, True, False, True], [st.overflow_fraction for st in out]
    assert "PAST IT" in str(out[3]) and out[3].host_reads == 2


def test_store_holds_what_the_tensors_spill_once_forward_ends():
    run = sessions(strict=False)
    store = run.keywords["store"]
    model, (x, y) = mlp(), batch("mlp")
    for step in range(3):
        with run() as s:
            loss = F.cross_entropy(model(x), y)
            reserved = store.bytes_held  # packed ahead (after the first step): every tensor's worst case
        held = store.bytes_held
        spilled = sum(-(-r.buddy_bytes // 32) * 32 for r in s.stats().rows)
        assert held == spilled and (held < reserved or step == 0)
        loss.backward()
        del loss
    assert store.bytes_held == 0


def test_pack_ahead_settles_alone_with_one_read():
    t = torch.relu(torch.randn(300, 1000, generator=torch.Generator().manual_seed(2)))
    engine, layout = pipeline.resolve(t, "zvc", 4096)
    sizes = torch.zeros(engines.PLACE_WORDS + layout.bins, dtype=torch.int64)
    store = buddy.BuddyStore(capacity_bytes=64 << 20, pin=False)
    before = engines.host_reads()
    bt = pipeline.pack_ahead(t, engine, layout, 20, sizes, store=store, ledger=buddy.ledger.DeviceLedger())
    assert engines.host_reads() == before and not bt.settled
    assert int(sizes[3]) >= 1  # the sizes kernel's blocks, counted as each was done: the last made the sums
    # no bound, no reserve: every overflow sector in buddy memory (cap: all of them; none in a reserve)
    assert int(sizes[0]) == layout.overflow_bytes(sizes[4:].tolist(), 20) // 32 and int(sizes[1]) == 0
    assert bt.buddy_bytes == layout.n_entries * (128 - 20) * 32  # reserved: every entry raw
    u = bt.decompress()  # settles first: one read
    assert engines.host_reads() == before + 1 and bt.settled
    assert torch.equal(u.view(torch.int32), t.view(torch.int32))
    exact = buddy.compress(t, codec="zvc", entry_bytes=4096, target_ratio=4096 / (20 * 32), store=store)
    assert bt.histogram == exact.histogram and bt.buddy_bytes == exact.buddy_bytes
    # the overflow's sums are kept with the tensor: its device bytes count them
    assert bt.device_bytes == exact.device_bytes + layout.n_entries * 8
    # a codec with a table and nothing learned: its table is fitted to the tensor, read back -- not ahead
    engine, layout = pipeline.resolve(t, "auto2", 4096)
    assert pipeline.pack_ahead(t, engine, layout, 20, sizes, store=store, ledger=buddy.ledger.DeviceLedger()) is None
    with pytest.raises(ValueError, match="sizes must be 133 zero int64"):
        pipeline.pack_ahead(t, engine, layout, 20, sizes[:-1], store=store, ledger=buddy.ledger.DeviceLedger())
    # no room for the worst case: not ahead (the session then sizes it, and a full store keeps it on the device)
    small = buddy.BuddyStore(capacity_bytes=512 << 10, block_bytes=64 << 10, pin=False)
    engine, layout = pipeline.resolve(t, "zvc", 4096)
    assert pipeline.pack_ahead(t, engine, layout, 20, sizes, store=small, ledger=buddy.ledger.DeviceLedger()) is None


def test_a_full_store_falls_back_to_the_sized_step():
    run = functools.partial(
        buddy.compressed_activations, tracker=buddy.Tracker(), min_bytes=MIN, strict=False,
        store=buddy.BuddyStore(capacity_bytes=128 << 10, block_bytes=64 << 10, pin=False),
    )  # fmt: skip
    _, plain = train("mlp", 3)
    stats, weights = train("mlp", 3, run)
    assert all(all(torch.equal(a, b) for a, b in zip(w, v)) for w, v in zip(weights, plain))
    assert stats[-1].host_reads > 2  # the worst case did not fit: sized, one read a tensor


def test_a_tensor_that_falls_back_mid_step_leaves_the_others_their_own_sizes(monkeypatch):
    """A tensor that cannot be packed ahead after its words were set aside in the step's buffer (here: the second
    of each step, as a store without room for its worst case refuses it) is sized instead; every other tensor
    still gets its own sizes where forward ends -- each key's ideal bytes as a strict step measures them."""
    from buddy import autograd

    real, calls = autograd.pack_ahead, []

    def refuse_the_second(*args, **kwargs):
        calls.append(1)
        return None if len(calls) % 1000 == 2 else real(*args, **kwargs)

    model, (x, y) = mlp(), batch("mlp")
    ahead, strict = sessions(strict=False), sessions(strict=True)
    for _ in range(2):  # history for every key
        with ahead() as s:
            F.cross_entropy(model(x), y).backward()
    monkeypatch.setattr(autograd, "pack_ahead", refuse_the_second)
    calls.clear()
    with ahead() as s:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    with strict() as sized:
        F.cross_entropy(model(x), y).backward()
    got = {r.key: r.ideal_bytes for r in s.stats().rows}
    assert len(calls) >= 3 and s.stats().host_reads >= 3  # the refused one sized: a read of its own
    assert got == {r.key: r.ideal_bytes for r in sized.stats().rows}


@pytest.fixture
def emulated_zvc():
    """zvc's kernels, the real sources under the emulator (ASan build), as zvc's CPU default."""
    with emulated_cpu_kernels("zvc", seed=5) as emu:
        yield emu


@pytest.mark.emulator
def test_the_kernels_pack_ahead_under_the_emulator(emulated_zvc):
    """The kernel sources, unchanged, under the emulator: each pack ahead is launched with exactly the overflow its
    sums say it writes (a write past it is caught, every byte of it must be written), and the step is bit-exact.
    (A damaged entry: test_a_damaged_tensor_packed_ahead_raises_where_backward_ends.)"""
    policy = buddy.FixedRatio(2.0)  # a fixed slot: planned ahead from the first step
    run = sessions(strict=False)
    model, (x, _) = mlp(), batch("mlp")
    model = model[:5]  # two layers: a few launches
    x = x[:64]
    for step in range(2):
        with run(policy=policy, codec="zvc") as s:
            loss = model(x).square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).square().mean().backward()
        assert all(torch.equal(a.view(torch.int32), p.grad.view(torch.int32)) for a, p in zip(grads, model.parameters()))
        model.zero_grad()
        assert all(r.codec == "zvc" for r in s.stats().rows)
        assert s.stats().host_reads == 2 or step == 0  # (the kernels' self-test reads, at their first use)
    assert any("pack" in launch[0] for launch in emulated_zvc.launches)


def test_policies_that_need_no_sizes_plan_every_key_from_the_first_step():
    """FixedRatio and CompressedOffload choose a slot without sizes: with a codec without a table, even a new key is
    packed ahead (two reads from the first step on); the others size a new key first."""
    buddy.compress(torch.ones(1024), codec="zvc").free()  # the kernels' self-test, at their first use: done
    for policy, sized in ((buddy.FixedRatio(2.0), False), (buddy.CompressedOffload(), False),
                          (buddy.BuddyThreshold(0.1), True)):  # fmt: skip
        run = sessions(strict=False)
        model, (x, _) = mlp(), batch("mlp")
        model = model[:7]  # three layers: 256 x 256 float32 activations, 256 KiB each
        reads = []
        for _ in range(2):
            with run(policy=policy, codec="zvc") as s:
                loss = model(x).square().mean()
            loss.backward()
            reads.append(s.stats().host_reads)
        n = len(s.stats().rows)
        assert reads[1] == 2 and reads[0] == (n + 1 if sized else 2), (policy, reads, n)


def test_a_device_budget_counts_what_a_tensor_packed_ahead_carries():
    """DeviceBudget plans ahead too: the device bytes it counts for a tensor include the overflow's sums it keeps."""
    tracker = buddy.Tracker()
    run = functools.partial(
        buddy.compressed_activations, tracker=tracker, min_bytes=MIN, strict=False,
        store=buddy.BuddyStore(capacity_bytes=256 << 20, pin=False),
    )  # fmt: skip
    model, (x, y) = mlp(), batch("mlp")
    budget = 3 << 20  # of 4.25 MiB of activations: every slot planned below raw, none to the zero slot
    with warnings.catch_warnings():
        warnings.simplefilter("error", buddy.BudgetExceededWarning)
        for _ in range(3):
            with run(policy=buddy.DeviceBudget(budget), codec="zvc") as s:
                loss = F.cross_entropy(model(x), y)
                held = tracker.ledger.bytes_held
            loss.backward()
    st = s.stats()
    assert st.host_reads == 2 and held <= budget and held == st.device_bytes
    assert all(r.predicted_overflow_bytes is not None for r in st.rows)


def test_checksums_size_every_tensor_first():
    """A tensor with checksums has its buffers read by the host when it is compressed: not packed ahead."""
    previous = buddy.defaults()
    buddy.set_defaults(checksum=True)
    try:
        stats, _ = train("mlp", 2, sessions(strict=False))
    finally:
        buddy.set_defaults(checksum=previous.checksum)
    assert stats[-1].host_reads > 2


def test_one_engine_class_runs_every_device_its_launcher_passed_in():
    """The native engine of the CPU and the CUDA engine are one class with another launcher each: the host's work per
    tensor (checks, allocations, launches, reads) is one code on every device; only the launcher differs."""
    from buddy.engines import native
    from buddy.engines.kernel_engine import KernelEngine

    cpu = buddy.dispatch.engine(buddy.get_codec("auto2"), "cpu")
    assert type(cpu) is KernelEngine and cpu.backend == "native"
    assert cpu.kernels.launcher is native.launch and cpu.kernels.device_type == "cpu"
    on_gpu = bcuda.CudaEngine(buddy.get_codec("auto2"))  # (made without a GPU: nothing launched)
    assert type(on_gpu) is type(cpu) and on_gpu.kernels.launcher is bcuda._launch
    assert on_gpu.kernels.device_type == "cuda"
    # neither engine is a class of its own (no method of the CPU's that a GPU does not run): factories
    for factory in (native.NativeEngine, bcuda.CudaEngine):
        assert not isinstance(factory, type) and type(factory(cpu.codec)) is KernelEngine


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.complex64]


@fuzz_settings(0.5)
@given(
    codec=st.sampled_from(sorted(bsources.KERNEL_CODECS)),
    dtype=st.sampled_from(_DTYPES),
    kind=st.sampled_from(DATA_KINDS),
    numel=st.integers(1, 3000),
    entry_bytes=st.sampled_from([32, 128, 512, 4096]),
    share=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_a_pack_ahead_is_the_sized_packs_bytes(codec, dtype, kind, numel, entry_bytes, share, seed):
    """Any codec with kernels, dtype, data, size (a last entry cut short included) and slot: the buffers a pack
    ahead leaves once settled are a sized compress's with the same slot and table, byte for byte, its buddy memory
    trimmed to exactly them; the tensor comes back bit-exact."""
    t = make_data(kind, numel, dtype, torch.Generator().manual_seed(seed))
    store = buddy.BuddyStore(capacity_bytes=64 << 20, block_bytes=1 << 20, pin=False)
    engine, layout = pipeline.resolve(t, codec, entry_bytes)
    slot = round(share * layout.sectors_per_entry)
    measured = buddy.measure(t, codec, entry_bytes=entry_bytes)  # the table a sized compress fits: the prior here
    prior = None if measured.statistics is None else measured.statistics.double()
    sizes = torch.zeros(engines.PLACE_WORDS + layout.bins, dtype=torch.int64)
    ledger = buddy.ledger.DeviceLedger()
    bt = pipeline.pack_ahead(
        t, engine, layout, slot, sizes, store=store, ledger=ledger, prior=prior, keep=measured.codec
    )  # fmt: skip
    assert bt is not None
    sized = buddy.pack(measured, slot, store=store)
    bt.settle()
    assert bt.histogram == sized.histogram and bt.buddy_bytes == sized.buddy_bytes
    for got, want in zip(bt.buffers(), sized.buffers()):
        assert torch.equal(got, want)
    assert store.bytes_held == 2 * -(-sized.buddy_bytes // 32) * 32
    assert_bitexact(bt.decompress(), t)
    bt.free()
    sized.free()
    assert store.bytes_held == 0


def test_a_damaged_tensor_packed_ahead_raises_where_backward_ends(monkeypatch):
    """A decode error in a tensor packed ahead is flagged on the device, read where backward ends with the step's
    other flags, and raised naming its key: never zeros handed on as gradients' inputs."""
    made = record_results(monkeypatch, buddy.autograd, "pack_ahead")
    run = sessions(strict=False)
    model, (x, y) = mlp(), batch("mlp")
    for _ in range(2):
        made.clear()
        with run(codec="zvc") as s:
            loss = F.cross_entropy(model(x), y)
    assert made and all(bt is not None and bt.settled for bt in made)
    meta, _, _ = made[0].buffers()
    meta[1] |= 0xF0  # a mode zvc never writes (E = 4096: the high 4 bits of the entry's 2-byte word)
    with pytest.raises(buddy.CorruptDataError, match=re.escape(f"{s.stats().rows[0].key!r} (error bits")):
        loss.backward()
