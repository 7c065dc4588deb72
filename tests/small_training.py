"""A small model trained a few steps with and without compressed activations, compared bit for bit.

Shared by the fault, hygiene and concurrency tests. Everything is built from
explicit generators (never the global RNG), so threads can build and train
their own copies and every run of the same steps gives the same bits.
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import buddy

#: compress every saved tensor above 4 KiB (the default 1 MiB would skip this model)
MIN_BYTES = 4096
IN, WIDTH, OUT, BATCH = 128, 256, 10, 64  # activations of 64 KiB


def make_mlp(seed: int = 0) -> nn.Sequential:
    """Linear-ReLU-Linear-ReLU-Linear; ReLU outputs compress, the dense input and logits mostly do not."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def make_batch(seed: int = 1, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, IN, generator=g), torch.randint(0, OUT, (rows,), generator=g)


@dataclass
class Run:
    """What a training run produced: every loss, the last step's gradients, the final parameters."""

    losses: list[torch.Tensor]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    sessions: list[buddy.Session]


def train(model: nn.Module, steps: int, session_fn=None, *, batch=None, after_step=None) -> Run:
    """``steps`` SGD steps on one batch; ``session_fn(step)`` gives the step's context (``None``: none)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = batch if batch is not None else make_batch()
    losses, sessions = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        session = session_fn(step) if session_fn is not None else None
        if session is None:
            loss = F.cross_entropy(model(x), y)
        else:
            with session:
                loss = F.cross_entropy(model(x), y)
            sessions.append(session)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
        del loss
        if after_step is not None:
            after_step(step)
    grads = [p.grad.detach().clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    return Run(losses, grads, params, sessions)


@functools.cache
def plain_run(steps: int) -> Run:
    """``steps`` steps of :func:`make_mlp` on :func:`make_batch` without buddy (computed once per process)."""
    return train(make_mlp(), steps)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_training(a: Run, b: Run) -> None:
    """Losses, last gradients and parameters are the very same bits."""
    assert len(a.losses) == len(b.losses)
    for step, (la, lb) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(bits(la), bits(lb)), f"loss of step {step} differs: {la.item()} != {lb.item()}"
    for i, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        assert torch.equal(bits(ga), bits(gb)), f"gradient {i} differs"
    for i, (pa, pb) in enumerate(zip(a.params, b.params)):
        assert torch.equal(bits(pa), bits(pb)), f"parameter {i} differs"


@pytest.fixture(scope="module", autouse=True)
def module_setup():
    """The setting of a test module that imports it (everything is undone after the module).

    * one intra-op thread: on a small, shared CPU, two threads each waiting
      for a core make these tiny ops ten times slower; both runs of every
      comparison use the same setting, so the bits are comparable;
    * objects that exist before the module (torch's, pytest's) are frozen out
      of garbage collection: ``gc.collect()`` then scans only what the tests
      made, microseconds instead of a quarter of a second, so the leak checks
      can collect after every step.

    Every test also runs with ``zvc`` at 128-byte entries (conftest's
    ``suite_defaults``), which leaves the dense input of :func:`make_mlp` as
    it is (``kept``).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(threads)


def live_buddy_tensors(store: buddy.BuddyStore) -> list[buddy.BuddyTensor]:
    """BuddyTensors of ``store`` that are still alive and not freed (a leak if the test holds none)."""
    return [o for o in gc.get_objects() if type(o) is buddy.BuddyTensor and o.store is store and not o.freed]


def assert_clean(store: buddy.BuddyStore, tracker: buddy.Tracker | None = None) -> None:
    """After a garbage collection nothing is held: no bytes, no tensors (so no live BuddyTensor), no taken range."""
    gc.collect()
    st, dev = store.stats(), buddy.ledger.default_ledger().stats()
    assert st.buddy_bytes_held == 0, f"{st.buddy_bytes_held} buddy bytes still held"
    assert dev.device_bytes_held == 0 and dev.tensors_held == 0, f"{dev.tensors_held} tensor(s) still counted"
    assert not store._pending, "releases left unapplied"
    assert all(b.unused for b in store._blocks), "a range is still taken in a block"
    if tracker is not None:
        assert tracker.held_device_bytes == 0, f"the tracker still counts {tracker.held_device_bytes} bytes held"
