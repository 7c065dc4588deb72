"""compressed_activations under DistributedDataParallel and FSDP: two CPU ranks, gloo.

Two ranks of this very file run as subprocesses (``python
tests/test_distributed.py <scenarios> <rank> <init> <out>``), meeting through a
``file://`` rendezvous in a temporary folder; one launch runs every scenario
(DDP, FSDP2 ``fully_shard``, FSDP1 ``FullyShardedDataParallel``), since
starting a rank costs more than its training. In each scenario every rank owns
its buddy store and tracker, trains the same model on its own shard of data a
few steps without buddy and then under ``compressed_activations`` with two
policies, and saves what it got. The tests compare, as raw bytes:

* on every rank, the parameters and losses with buddy against those without:
  bit-identical;
* across ranks, the parameters (whole, for FSDP): identical -- the data shards
  differ, so the updates agree only through the all-reduce / reduce-scatter;

and check that tensors were really compressed (``session.stats()``) into the
rank's own stores, which are empty again after each step.

No hangs: collectives time out after ``COLLECTIVE_TIMEOUT_S``, the launcher
kills both ranks after ``DEADLINE_S``, and as soon as one rank fails the other
is killed and the test fails with the failed rank's output. If FSDP itself
(without buddy) cannot run on this build, its tests skip with the error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from conftest import SUITE_CODEC, SUITE_ENTRY_BYTES

import buddy

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
STEPS = 3
MIN_BYTES = 16 << 10  # the model's activations are 32-512 KiB; biases and norms stay below
COLLECTIVE_TIMEOUT_S = 60
DEADLINE_S = 240  # both ranks, every scenario, start to finish; about 30 s on a busy 2-core machine
DEFAULTS_ENV = "BUDDY_TEST_DEFAULTS"  # "<codec>@<entry bytes>" the ranks run under
UNSUPPORTED_EXIT = 75  # a rank exits with this when plain FSDP (without buddy) cannot run here
POLICIES = {"fixed2": lambda: buddy.FixedRatio(2.0), "threshold": lambda: buddy.BuddyThreshold(0.1)}
ALL = ("ddp", "fsdp2", "fsdp2_bf16", "fsdp1")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


# ---------------------------------------------------------------------------
# the model and one rank's training (run inside the ranks)
# ---------------------------------------------------------------------------
class ConvTransformer(nn.Module):
    """Conv-BN-ReLU, Conv-ReLU, then the feature map as 64 tokens through a transformer block."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and every run
        self.conv = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2),
            nn.ReLU(),
        )
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        tokens = self.conv(x).flatten(2).transpose(1, 2)  # [B, 64, 32]
        return self.head(self.block(tokens).mean(1))


def rank_batch(rank: int):
    """This rank's shard: different data on every rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 holds DTensors: this rank's shard


def train(model: nn.Module, rank: int, session_fn=None) -> dict:
    """``STEPS`` SGD steps on this rank's shard; losses, local parameters and per-step stats."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = rank_batch(rank)
    losses, stats = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        if session_fn is None:
            loss = F.cross_entropy(model(x), y)
        else:
            with session_fn() as session:
                loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(raw(loss))
        if session_fn is not None:
            st = session.stats()
            stats.append(
                {
                    "compressed": sum(r.codec != "kept" for r in st.rows),
                    "compressed_original": sum(r.original_bytes for r in st.rows if r.codec != "kept"),
                    "compressed_device": sum(r.device_bytes for r in st.rows if r.codec != "kept"),
                    "compressed_shapes": [list(r.shape) for r in st.rows if r.codec != "kept"],
                    "failed": st.failed,
                    "original_bytes": st.original_bytes,
                    "device_bytes": st.device_bytes,
                    "buddy_bytes": st.buddy_bytes,
                }
            )
    params = {str(i): raw(local(p)) for i, p in enumerate(model.parameters())}
    return {"losses": losses, "params": params, "stats": stats}


def new_store() -> buddy.BuddyStore:
    return buddy.BuddyStore(capacity_bytes=256 << 20, block_bytes=1 << 20, pin=False)


def store_summary(store: buddy.BuddyStore) -> dict:
    st = store.stats()
    return {"buddy_peak": st.buddy_peak_bytes, "held": st.buddy_bytes_held}


def ledger_summary(ledger: buddy.ledger.DeviceLedger) -> dict:
    st = ledger.stats()
    return {"device_peak": st.device_peak_bytes, "held": st.device_bytes_held, "tensors": st.tensors_held}


class Unsupported(Exception):
    """Training without buddy failed: this parallelism cannot run here."""


def run_policies(rank: int, wrap, *, gather=None) -> dict:
    """Plain, then each policy, each on a fresh model that ``wrap`` hands to DDP or FSDP.

    ``gather(model)``: whole parameters after training (FSDP shards them).
    """
    # This rank's own store, the default for every session here that names none ...
    rank_store = new_store()
    buddy.set_default_store(rank_store)
    # ... and a second one, passed explicitly with store=.
    explicit_store = new_store()
    session_fns = {"plain": None}
    ledgers = {}
    for name, policy in POLICIES.items():
        ledgers[name] = buddy.ledger.DeviceLedger()  # the device bytes of this policy's sessions
        tracker = buddy.Tracker(ledger=ledgers[name])  # this rank's tracker: its shard's history, fresh per policy
        store = explicit_store if name == "threshold" else None
        session_fns[name] = lambda policy=policy, tracker=tracker, store=store: buddy.compressed_activations(
            policy(), tracker=tracker, store=store, min_bytes=MIN_BYTES
        )
    runs = {}
    for name, session_fn in session_fns.items():
        try:
            model = wrap(ConvTransformer())
            runs[name] = train(model, rank, session_fn)
        except Exception as exc:
            if name == "plain":
                raise Unsupported from exc
            raise
        if gather is not None:
            runs[name]["full"] = gather(model)
        if name in ledgers:
            runs[name]["ledger"] = ledger_summary(ledgers[name])
    return {
        "runs": runs,
        "stores": {"default": store_summary(rank_store), "explicit": store_summary(explicit_store)},
        "default_is_rank_store": buddy.default_store() is rank_store,
        "param_shapes": [list(p.shape) for p in ConvTransformer().parameters()],
        "defaults": (buddy.defaults().codec, buddy.defaults().entry_bytes),
        "pid": os.getpid(),
    }


def scenario_ddp(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return run_policies(rank, DDP)


def scenario_fsdp2(rank: int) -> dict:
    def wrap(model):
        from torch.distributed.fsdp import fully_shard  # FSDP2

        fully_shard(model.conv)
        fully_shard(model.block)
        return fully_shard(model)

    return run_policies(
        rank, wrap, gather=lambda m: {str(i): raw(p.full_tensor()) for i, p in enumerate(m.parameters())}
    )


def scenario_fsdp2_bf16(rank: int) -> dict:
    """FSDP2 under bf16 autocast: each Linear saves its all-gathered weight's bf16 copy, which the session makes
    again in backward (``rederive_casts``) -- after FSDP has freed the weight at forward's end and gathered it
    again for backward. Plain, then the default session; losses, whole parameters and the casts made again."""
    from torch.distributed.fsdp import fully_shard  # FSDP2

    runs = {}
    for name in ("plain", "buddy"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
        losses, rederived = [], []
        for _ in range(STEPS):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with buddy.compressed_activations(min_bytes=MIN_BYTES, enabled=name == "buddy") as session:
                    loss = F.cross_entropy(model(x), y)
            loss.float().backward()
            opt.step()
            losses.append(raw(loss))
            rederived.append(session.stats().rederived)
        full = {str(i): raw(p.full_tensor()) for i, p in enumerate(model.parameters())}
        runs[name] = {"losses": losses, "full": full, "rederived": rederived}
    return {"runs": runs, "pid": os.getpid(), "defaults": (buddy.defaults().codec, buddy.defaults().entry_bytes)}


def scenario_fsdp1(rank: int) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def gather(model):
        with FSDP.summon_full_params(model):
            return {str(i): raw(p) for i, p in enumerate(model.parameters())}

    return run_policies(rank, lambda m: FSDP(m, device_id=torch.device("cpu")), gather=gather)


def scenario_fail(rank: int) -> dict:
    """For the launcher's own test: rank 1 dies, rank 0 waits for it in a collective."""
    if rank == 1:
        print("rank 1 fails on purpose", flush=True)
        os._exit(3)
    dist.barrier()
    return {}


SCENARIOS = {
    "ddp": scenario_ddp, "fsdp2": scenario_fsdp2, "fsdp2_bf16": scenario_fsdp2_bf16, "fsdp1": scenario_fsdp1,
    "fail": scenario_fail,
}


def rank_main(scenarios: str, rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    codec, _, entry_bytes = os.environ.get(DEFAULTS_ENV, "").partition("@")
    if codec:  # the suite's pinned defaults; none: the library's own
        buddy.set_defaults(codec=codec, entry_bytes=int(entry_bytes))
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    try:
        for scenario in scenarios.split(","):
            start = time.monotonic()
            try:
                result = SCENARIOS[scenario](rank)
            except Unsupported:
                # the peer may be blocked in a collective: stop here and let the launcher say why
                traceback.print_exc()
                (Path(out_dir) / f"{scenario}-unsupported-rank{rank}.txt").write_text(
                    traceback.format_exc().strip().splitlines()[-1]
                )
                sys.stdout.flush()
                os._exit(UNSUPPORTED_EXIT)
            dist.barrier()  # both ranks are done with this scenario's collectives
            result["seconds"] = time.monotonic() - start
            torch.save(result, Path(out_dir) / f"{scenario}-rank{rank}.pt")
            print(f"rank {rank}: {scenario} done in {result['seconds']:.1f} s", flush=True)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# the launcher (in pytest)
# ---------------------------------------------------------------------------
def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def launch(scenarios: tuple[str, ...], out: Path, defaults: str = "") -> dict:
    """Run both ranks through ``scenarios``; per scenario, its ranks' results or why it did not run.

    ``defaults``: ``"<codec>@<entry bytes>"`` the ranks set as buddy's
    defaults, or ``""`` for the library's own. Never leaves a process behind:
    on return, failure or deadline, every rank still running is killed.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", **{DEFAULTS_ENV: defaults})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    init = (out / "rendezvous").as_uri()
    logs = [out / f"rank{rank}.log" for rank in range(WORLD)]
    procs = []
    start = time.monotonic()
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as sink:
                cmd = [sys.executable, __file__, ",".join(scenarios), str(rank), init, str(out)]
                procs.append(subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed and not any(code == UNSUPPORTED_EXIT for _, code in failed):
                # the peers may be blocked in a collective: killed below, not waited for
                report = "\n".join(f"rank {r} exited with {c}; its output:\n{_tail(logs[r])}" for r, c in failed)
                pytest.fail(f"{','.join(scenarios)}: {report}")
            if failed or all(code == 0 for code in codes):
                break
            if time.monotonic() - start > DEADLINE_S:
                outputs = "\n".join(f"--- rank {r}:\n{_tail(log, 20)}" for r, log in enumerate(logs))
                pytest.fail(f"the ranks did not finish within {DEADLINE_S} s\n{outputs}")
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results, stopped = {}, None
    for scenario in scenarios:
        why = sorted(out.glob(f"{scenario}-unsupported-rank*.txt"))
        if why:
            stopped = scenario
            version = f"torch {torch.__version__}"
            results[scenario] = f"{scenario} cannot run on CPU with gloo in {version}: {why[0].read_text()}"
        elif stopped is not None:
            results[scenario] = f"not run: {stopped} before it could not run"
        else:
            results[scenario] = [torch.load(out / f"{scenario}-rank{rank}.pt") for rank in range(WORLD)]
    return results


@pytest.fixture(
    scope="module", params=[f"{SUITE_CODEC}@{SUITE_ENTRY_BYTES}", ""], ids=["defaults=zvc@128", "defaults=library"]
)
def launched(request, tmp_path_factory) -> dict:
    """Every scenario, in one launch of the two ranks, under the suite's pinned defaults and the library's own."""
    results = launch(ALL, tmp_path_factory.mktemp("ranks"), request.param)
    expected = (
        (SUITE_CODEC, SUITE_ENTRY_BYTES)
        if request.param
        else (buddy.codecs.DEFAULT_CODEC, buddy.spec.DEFAULT_ENTRY_BYTES)
    )
    for ranks in results.values():
        assert isinstance(ranks, str) or all(tuple(r["defaults"]) == expected for r in ranks)
    return results


def ranks_of(launched: dict, scenario: str) -> list[dict]:
    results = launched[scenario]
    if isinstance(results, str):
        pytest.skip(results)
    return results


def assert_same_bytes(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: parameter {name} differs"


def check_ranks(results: list[dict]) -> None:
    """Per rank bit-identical with and without buddy, compressed for real, into the rank's own stores."""
    for rank, result in enumerate(results):
        runs = result["runs"]
        plain = runs["plain"]
        for name in POLICIES:
            run = runs[name]
            assert_same_bytes(plain["params"], run["params"], f"rank {rank}, {name} vs plain")
            for step, (a, b) in enumerate(zip(plain["losses"], run["losses"])):
                assert torch.equal(a, b), f"rank {rank}, {name}: loss of step {step} differs"
            for step in run["stats"]:
                assert step["failed"] == 0
                assert step["compressed"] > 0, f"rank {rank}, {name}: nothing was compressed: {step}"
                assert step["compressed_device"] < step["compressed_original"]
                # parameters -- FSDP's all-gathered ones too -- are never compressed: activations only
                assert not any(shape in result["param_shapes"] for shape in step["compressed_shapes"])
            ledger = run["ledger"]
            assert ledger["device_peak"] > 0, f"rank {rank}, {name}: nothing was held on the device"
            assert ledger["held"] == 0 and ledger["tensors"] == 0, f"rank {rank}, {name}: device bytes still held"
        assert result["default_is_rank_store"]
        for which, store in result["stores"].items():
            assert store["buddy_peak"] > 0, f"rank {rank}: its {which} store was never used"
            assert store["held"] == 0, f"rank {rank}: its {which} store was not emptied"
    assert len({r["pid"] for r in results}) == WORLD  # a process, and so a store and a tracker, per rank
    # the shards differ, so the losses do: the parameters below agree only through the collectives
    assert not torch.equal(results[0]["runs"]["plain"]["losses"][0], results[1]["runs"]["plain"]["losses"][0])


def test_ddp_is_bit_identical_on_every_rank(launched):
    results = ranks_of(launched, "ddp")
    check_ranks(results)
    for name in ("plain", *POLICIES):  # DDP replicates: the same parameters on both ranks
        assert_same_bytes(results[0]["runs"][name]["params"], results[1]["runs"][name]["params"], f"{name}: 0 vs 1")
    print(f"ddp: {WORLD} ranks, {STEPS} steps x {1 + len(POLICIES)} runs in {results[0]['seconds']:.1f} s")


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_fsdp_is_bit_identical_on_every_rank(kind, launched):
    results = ranks_of(launched, kind)
    check_ranks(results)
    for name in ("plain", *POLICIES):  # each rank holds a shard: whole parameters, gathered, agree across ranks
        a, b = results[0]["runs"][name]["full"], results[1]["runs"][name]["full"]
        assert_same_bytes(a, b, f"{kind}, {name}: rank 0 vs 1")
        assert_same_bytes(results[0]["runs"]["plain"]["full"], a, f"{kind}, {name} vs plain, whole")
    print(f"{kind}: {WORLD} ranks, {STEPS} steps x {1 + len(POLICIES)} runs in {results[0]['seconds']:.1f} s")


def test_fsdp2_under_autocast_makes_the_gathered_weights_casts_again_bit_identically(launched):
    results = ranks_of(launched, "fsdp2_bf16")
    for rank, result in enumerate(results):
        plain, ours = result["runs"]["plain"], result["runs"]["buddy"]
        for step, (a, b) in enumerate(zip(plain["losses"], ours["losses"])):
            assert torch.equal(a, b), f"rank {rank}: loss of step {step} differs"
        assert_same_bytes(plain["full"], ours["full"], f"rank {rank}, buddy vs plain, whole")
        # the two large layers' weights (the first saves none: its input needs no gradient), every step
        assert ours["rederived"] == [1] * STEPS and plain["rederived"] == [0] * STEPS, ours["rederived"]
    assert_same_bytes(results[0]["runs"]["buddy"]["full"], results[1]["runs"]["buddy"]["full"], "rank 0 vs 1")


def test_a_failing_rank_fails_the_launch_fast(tmp_path):
    """A rank that dies leaves its peer blocked in a collective: the launcher kills it instead of waiting."""
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"rank 1 exited with 3[\s\S]*rank 1 fails on purpose"):
        launch(("fail",), tmp_path)
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT_S  # well before the peer's collective would time out


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
