"""Run a GPU entry point on a machine without one, as far as it goes: up to its first CUDA call.

:func:`pretend_gpu` makes ``torch.cuda`` look like a process with one GPU
(an H100-like device: available, one device, its name, capability and
memory) until something needs the device itself -- a tensor or module moved
there, a stream, an event, a synchronisation, a memory cap -- which raises
:class:`NoCuda`. :func:`run_entry` calls an entry point's ``main(argv)``
with its real arguments under that pretence and sorts what ended it:

* the expected stops: :class:`NoCuda`; PyTorch's own "compiled without CUDA"
  errors (pinned memory, dummy stream classes); a missing GPU-only package
  (CuPy, nvcomp) -- also when an entry point turns it into its exit message;
* anything else -- a ``TypeError`` from a call with a missing argument, an
  ``AttributeError``, a bad option -- is a failure, reported with where it
  was raised.

An entry point that returns without touching CUDA passes too. The GPU
session's ``--dry-run`` runs every phase's entry points this way
(:mod:`experiments.lab.gpu_session`).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import torch

from buddy.errors import MissingDependencyError

__all__ = ["NoCuda", "pretend_gpu", "Outcome", "classify", "run_entry", "GPU_ONLY_MODULES"]

ROOT = Path(__file__).resolve().parents[2]
#: packages that exist only where there is a GPU (their absence here is expected, not a bug)
GPU_ONLY_MODULES = ("cupy", "nvidia.nvcomp")
#: how PyTorch's CPU builds refuse CUDA on their own (messages, as a regular expression)
_TORCH_NO_CUDA = re.compile(
    "Torch not compiled with CUDA enabled|compiled without CUDA support|requires CUDA support|"
    "Tried to instantiate dummy base class|pin_memory=True requires|without ATen_cuda library|"
    "CUDA profiling requires"
)
_GPU_ONLY = re.compile(r"needs '(?:" + "|".join(re.escape(m) for m in GPU_ONLY_MODULES) + r")'|nvcomp is not installed")


class NoCuda(RuntimeError):
    """The first call that needs the GPU itself, in a dry run."""


def _refuse(what: str) -> Callable[..., NoReturn]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise NoCuda(f"{what}: the first CUDA call (a dry run has no GPU)")

    return refuse


@contextlib.contextmanager
def pretend_gpu(
    name: str = "dry run: no GPU", total_memory: int = 80 << 30, capability: tuple[int, int] = (9, 0)
) -> Iterator[None]:
    """``torch.cuda`` answering like a process with one GPU, until something needs the device itself."""
    props = SimpleNamespace(
        name=name, total_memory=total_memory, major=capability[0], minor=capability[1], multi_processor_count=132
    )
    patches: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_name": lambda device=None: name,
        "get_device_capability": lambda device=None: capability,
        "get_device_properties": lambda device=None: props,
        "_lazy_init": _refuse("torch.cuda initialisation"),
        "Stream": _refuse("torch.cuda.Stream"),
        "Event": _refuse("torch.cuda.Event"),
        "set_per_process_memory_fraction": _refuse("torch.cuda.set_per_process_memory_fraction"),
        "device": _refuse("torch.cuda.device"),
    }
    saved = {k: getattr(torch.cuda, k) for k in patches}
    try:
        for k, v in patches.items():
            setattr(torch.cuda, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)


@dataclass
class Outcome:
    """How one entry point's dry run ended."""

    entry: str
    argv: list[str]
    ok: bool
    stop: str  # "returned", or what stopped it
    where: str  # file:line (function) in this repository where it stopped, or ""
    seconds: float
    output: str = ""

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        at = f" at {self.where}" if self.where else ""
        return f"{status} {self.entry} {' '.join(self.argv)}\n       {self.stop}{at} [{self.seconds:.1f} s]"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        yield node
        node = node.__cause__ or node.__context__


def classify(exc: BaseException) -> str | None:
    """Why ``exc`` is an expected stop of a dry run, or ``None`` when it is a failure."""
    for e in _chain(exc):
        if isinstance(e, NoCuda):
            return f"no CUDA: {e}"
        if isinstance(e, MissingDependencyError) and _GPU_ONLY.search(str(e)):
            return f"GPU-only package missing: {str(e).split('. Install it')[0]}"
        if isinstance(e, (RuntimeError, AssertionError)) and _TORCH_NO_CUDA.search(str(e)):
            return f"no CUDA in this PyTorch: {e}"
    return None


def _where(exc: BaseException) -> str:
    """The innermost frame in this repository where ``exc`` was raised (``path:line (function)``)."""
    here = str(Path(__file__).resolve())
    ours = tuple(str(ROOT / d) + "/" for d in ("buddy", "experiments", "tests"))
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if f.filename.startswith(ours) and f.filename != here  # not the pretence's own refusal
    ]
    if not frames:
        return ""
    f = frames[-1]
    return f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} ({f.name})"


def run_entry(module: str, argv: Sequence[str], *, quiet: bool = True) -> Outcome:
    """``module.main(argv)`` under :func:`pretend_gpu`; how it ended (see the module doc)."""
    start = time.perf_counter()
    buffer = io.StringIO()
    out = contextlib.redirect_stdout(buffer) if quiet else contextlib.nullcontext()
    err = contextlib.redirect_stderr(buffer) if quiet else contextlib.nullcontext()
    try:
        main = importlib.import_module(module).main
        with out, err, pretend_gpu(), _restore_buddy_defaults():
            main(list(argv))
    except SystemExit as exc:
        why = classify(exc)
        code = exc.code
        if why is None and code in (0, None):
            why = "exited 0"
        message = why if why is not None else f"SystemExit({code!r})"
        return Outcome(module, list(argv), why is not None, message, _where(exc), _since(start), buffer.getvalue())
    except BaseException as exc:  # anything else the entry point raised: sorted, never swallowed
        if isinstance(exc, KeyboardInterrupt):
            raise
        why = classify(exc)
        stop = why if why is not None else f"{type(exc).__name__}: {exc}"
        return Outcome(module, list(argv), why is not None, stop, _where(exc), _since(start), buffer.getvalue())
    return Outcome(module, list(argv), True, "returned", "", _since(start), buffer.getvalue())


def _since(start: float) -> float:
    return time.perf_counter() - start


@contextlib.contextmanager
def _restore_buddy_defaults() -> Iterator[None]:
    """Entry points set process-wide defaults (the backend); a dry run of the next one starts clean."""
    import buddy

    previous = buddy.defaults()
    try:
        yield
    finally:
        buddy.set_defaults(
            codec=previous.codec,
            entry_bytes=previous.entry_bytes,
            backend=previous.backend,
            checksum=previous.checksum,
        )
