"""The self-test of a codec's compiled kernels: golden vectors through them, both ways, before their first use.

``backend="auto"`` runs a codec's kernels -- the CUDA kernels on a CUDA
tensor, the native engine (the same sources built for the host) on a CPU
tensor -- only once they have passed this test on the tensor's device (see
:mod:`buddy.dispatch`):
the first time in a process that the kernels of a codec are chosen for a
device, :func:`verdict` runs the codec's golden vectors through them --

* compress: measure (and, for a codec with a table, count and fit) and
  pack the golden input; the metadata, the table, the slots and the overflow
  must be the golden bytes exactly;
* decompress: the golden buffers must decode to the golden input exactly

-- and remembers the verdict for the process, device and codec (thread-safe:
run once; other threads wait for it). A failure warns once (a
``RuntimeWarning`` naming the codec, the case, the buffer and the first
differing byte, expected and got), and that codec runs the torch reference on
that device from then on; so does an exception in the kernels (a compile
error, a check that fails). ``buddy.dispatch.chosen()`` records which ran and
why.

The vectors are a subset of the repository's golden vectors
(``tests/golden``), shipped as package data (:data:`VECTORS`, about 23 KB):
the inputs :data:`INPUTS` (float32 and bfloat16 words, E = 512), each with
every kernel codec's metadata, table and the buffers of a slot of
:data:`SLOT` sectors, from ``format_v1`` for the version 1 codecs and
``format_v3`` for ``fpe`` and ``auto2``. ``tests/test_selftest.py`` checks
they are the committed goldens byte for byte (``tests/golden/make_selftest.py``
writes them). The test takes a fraction of a second once the kernels are
compiled; it compiles the modules of E = 512 for 4- and 2-byte words.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import io
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .codecs import get_codec
from .engines import Engine
from .engines.sources import KERNEL_CODECS, TABLED_KERNELS
from .layout import Layout

__all__ = ["Verdict", "verdict", "run", "reset", "VECTORS", "INPUTS", "SLOT", "SOURCES", "load_vectors"]

#: the package data file of the vectors
VECTORS = "selftest_vectors.npz"
#: the golden inputs the test runs: ``<dtype>-E<entry bytes>-<kind>``
INPUTS = ("float32-E512-relu", "bfloat16-E512-structured")
#: the slot (sectors) whose buffers are compared: half an entry at E = 512
SLOT = 8
#: per kernel codec, the golden set its vectors come from: ``format_v3`` for the codecs with a table
SOURCES = {name: "format_v3" if name in TABLED_KERNELS else "format_v1" for name in KERNEL_CODECS}

Factory = Callable[..., Engine]


@dataclass(frozen=True)
class Verdict:
    """What the self-test of one codec's kernels on one device found."""

    passed: bool
    #: ``"self-test passed in 0.12 s (2 golden cases)"`` or ``"self-test failed: case ..., byte 123: ..."``
    why: str
    seconds: float


_verdicts: dict[tuple, Verdict] = {}
_running: dict[tuple, threading.Lock] = {}
_lock = threading.Lock()


def verdict(codec: str, device: torch.device, factory: Factory, what: str = "compiled kernels") -> Verdict:
    """The self-test's verdict on the kernels ``factory`` makes for ``codec`` on ``device``: run on the first
    call for this process, device, codec and factory, remembered after; a failure warns then, once (naming the
    kernels as ``what``: "CUDA kernels", "native CPU engine")."""
    key = (str(device), codec, factory)
    found = _verdicts.get(key)
    if found is not None:
        return found
    with _lock:
        running = _running.setdefault(key, threading.Lock())
    with running:  # one thread runs it; the others wait for its verdict
        found = _verdicts.get(key)
        if found is None:
            found = run(codec, device, factory)
            with _lock:
                _verdicts[key] = found
            if not found.passed:
                warnings.warn(
                    f"buddy: the {what} of codec {codec!r} failed their self-test on {device} "
                    f"({found.why.removeprefix('self-test failed: ')}): codec {codec!r} runs the torch reference "
                    f"on {device} in this process (buddy.dispatch.chosen() says why). Please report this, with "
                    f"buddy.env.format_environment(buddy.env.environment()).",
                    RuntimeWarning,
                    stacklevel=5,
                )
    return found


def reset() -> None:
    """Forget every verdict: the next use of each codec's kernels tests them again (for tests)."""
    with _lock:
        _verdicts.clear()
        _running.clear()


def run(codec: str, device: torch.device | str, factory: Factory) -> Verdict:
    """Run the self-test of ``codec``'s kernels (engines from ``factory(codec object)``) on ``device`` now."""
    device = torch.device(device)
    start = time.perf_counter()
    try:
        with _sync_allowed(device):
            failure = _check(codec, device, factory)
    except Exception as exc:  # a compile error, a failed check: the kernels cannot be trusted here
        failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    seconds = time.perf_counter() - start
    if failure is not None:
        return Verdict(False, f"self-test failed: {failure}", seconds)
    return Verdict(True, f"self-test passed in {seconds:.2f} s ({len(INPUTS)} golden cases)", seconds)


@contextlib.contextmanager
def _sync_allowed(device: torch.device) -> Iterator[None]:
    """The test reads its results back: allowed under ``torch.cuda.set_sync_debug_mode``."""
    mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


@functools.lru_cache(maxsize=1)
def load_vectors() -> dict[str, torch.Tensor]:
    """The shipped vectors (uint8 host tensors) by ``<input>/input`` and ``<input>/<codec>/<buffer>``."""
    raw = importlib.resources.files("buddy").joinpath(VECTORS).read_bytes()
    with np.load(io.BytesIO(raw), allow_pickle=False) as data:
        return {name: torch.from_numpy(data[name].copy()) for name in data.files}


def _check(codec: str, device: torch.device, factory: Factory) -> str | None:
    """The first difference the kernels make from the golden vectors of ``codec``, or ``None``."""
    if codec not in SOURCES:
        return f"no self-test vectors for codec {codec!r} (vectors for: {', '.join(SOURCES)})"
    vectors = load_vectors()
    for name in INPUTS:
        failure = _compress(codec, name, vectors, device, factory) or _decompress(codec, name, vectors, device, factory)
        if failure is not None:
            return failure
    return None


def _layout(name: str) -> tuple[int, int]:
    """``(word bytes, entry bytes)`` of an input named ``<dtype>-E<entry bytes>-<kind>``."""
    dtype, entry, _ = name.split("-")
    return getattr(torch, dtype).itemsize, int(entry[1:])


def _compress(codec: str, name: str, vectors: dict, device: torch.device, factory: Factory) -> str | None:
    word, entry_bytes = _layout(name)
    golden = f"{name}/{codec}"
    flat = vectors[f"{name}/input"].to(device, copy=True)
    engine = factory(get_codec(codec))
    layout = Layout(entry_bytes, flat.numel(), word)
    fitted, measured = engine.fit_measure(flat, layout)
    slots, overflow = engine.pack(flat, measured, SLOT, layout)
    got: dict[str, torch.Tensor | None] = {"metadata": measured.meta, "slots": slots, "overflow": overflow}
    want = {"metadata": vectors[f"{golden}/meta"], "slots": vectors[f"{golden}/s{SLOT}/slots"]}
    want["overflow"] = vectors[f"{golden}/s{SLOT}/overflow"]
    if f"{golden}/table" in vectors:
        got["table"], want["table"] = fitted.table, vectors[f"{golden}/table"]
    for buffer, expected in want.items():
        differs = _first_difference(expected, got[buffer])
        if differs is not None:
            return f"case {name}, compress: {buffer}{_slot_of(buffer)}, {differs}"
    return None


def _decompress(codec: str, name: str, vectors: dict, device: torch.device, factory: Factory) -> str | None:
    word, entry_bytes = _layout(name)
    golden = f"{name}/{codec}"
    expected = vectors[f"{name}/input"]
    bound = get_codec(codec).bind(vectors.get(f"{golden}/table"), word)
    meta, slots = (vectors[f"{golden}/{b}"].to(device, copy=True) for b in ("meta", f"s{SLOT}/slots"))
    overflow = vectors[f"{golden}/s{SLOT}/overflow"].clone()  # buddy memory: host
    out = factory(bound).unpack(meta, slots, overflow, SLOT, Layout(entry_bytes, expected.numel(), word), check=True)
    differs = _first_difference(expected, out)
    return None if differs is None else f"case {name}, decompress: decoded bytes, {differs}"


def _slot_of(buffer: str) -> str:
    return f" (slot of {SLOT} sectors)" if buffer in ("slots", "overflow") else ""


def _first_difference(expected: torch.Tensor, got: torch.Tensor | None) -> str | None:
    """``"byte 123: expected 0x1f, got 0x00"`` for the first byte that differs (or the sizes), or ``None``."""
    if got is None:
        return "missing"
    got = got.detach().reshape(-1).view(torch.uint8).cpu()
    expected = expected.reshape(-1).view(torch.uint8)
    if got.numel() != expected.numel():
        return f"{got.numel()} bytes where {expected.numel()} were expected"
    where = torch.nonzero(got != expected)
    if not where.numel():
        return None
    i = int(where[0, 0])
    return f"byte {i}: expected {int(expected[i]):#04x}, got {int(got[i]):#04x}"
