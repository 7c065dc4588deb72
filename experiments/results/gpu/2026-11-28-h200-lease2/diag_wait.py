"""Call 4 of this session: does a compress make the compute stream wait for the copy stream?

The copy stream sleeps about 0.5 s; a compress of 8 MiB of random bytes at a 4x slot follows on the compute
stream, its host calls of stream and event waits, pinned copies and reads recorded with their stacks, under
cProfile. Run from the repository's root on a GPU machine: ``PYTHONPATH=$PWD python3 <this file>``.
"""

import cProfile
import io
import pstats
import sys
import time
import traceback

import torch

import buddy

sys.path.insert(0, "tests")
from conftest import make_data  # noqa: E402

MiB = 2**20
dev = torch.device("cuda")
store = buddy.BuddyStore(capacity_bytes=256 * MiB, block_bytes=64 * MiB, pin=True)
w = buddy.compress(torch.rand(MiB, device=dev), target_ratio=4.0, store=store)
torch.cuda.synchronize()
w.free()
log = []


def wrap(owner, name):
    orig = getattr(owner, name)

    def f(*a, **k):
        t0 = time.perf_counter()
        r = orig(*a, **k)
        dt = time.perf_counter() - t0
        log.append((name, dt, "".join(traceback.format_stack(limit=7)[:-1])))
        return r

    setattr(owner, name, f)


for owner, name in [
    (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Stream, "wait_event"),
    (torch.cuda.Stream, "wait_stream"), (torch.Tensor, "pin_memory"), (torch.Tensor, "cpu"), (torch.Tensor, "item"),
    (torch.Tensor, "tolist"),
]:  # fmt: skip
    wrap(owner, name)
for codec in ("auto2", "zvc"):
    t = make_data("random_bytes", 8 * MiB // 4, torch.float32, torch.Generator().manual_seed(3)).to(dev)
    torch.cuda.synchronize()
    log.clear()
    copy = buddy.streams.for_device(dev).copy_stream(dev)
    with torch.cuda.stream(copy):
        torch.cuda._sleep(1_000_000_000)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    bt = buddy.compress(t, target_ratio=4.0, store=store, codec=codec)
    pr.disable()
    t1 = time.perf_counter()
    busy_after = not torch.cuda.current_stream().query()
    torch.cuda.current_stream().synchronize()
    t2 = time.perf_counter()
    print(f"== {codec}: compress {1e3 * (t1 - t0):.1f} ms, compute busy after {busy_after}, compute sync "
          f"{1e3 * (t2 - t1):.1f} ms, copy done {copy.query()}, buddy {bt.buddy_bytes}")  # fmt: skip
    for name, dt, st in log:
        if dt > 0.01 or name in ("wait_event", "wait_stream"):
            print(f"-- {name} {1e3 * dt:.1f} ms\n{st}")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(18)
    print(s.getvalue()[-3500:])
    torch.cuda.synchronize()
    bt.free()
