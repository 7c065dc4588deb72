"""The kernels of ``csrc/buddy_kernels.cu`` on the host under the block emulator (``tests/host/emulator``).

The sources are compiled unchanged by g++ through a CUDA shim
(``cuda_shim.h``) with the defines the loader gives NVRTC
(:func:`buddy.engines.sources.compile_options`: one module per codec, entry size
and word size, the word size a launch's last argument), and run by the emulator's driver
(``runtime.cpp``): every thread of a block a fiber, a seeded random order
between synchronisation points, blocks one after another. Two builds:

* ``tsan`` -- ThreadSanitizer: every fiber a TSan fiber, happens-before only
  where CUDA gives it (``__syncthreads`` among the block, ``__syncwarp`` among
  the warp), so a shared- or global-memory race is reported with both stacks;
* ``asan`` -- AddressSanitizer and UndefinedBehaviorSanitizer, no recovery:
  a misaligned load (the kernels' aligned ``reinterpret_cast`` loads), a read
  or write past any buffer (each exactly its size: the launch arguments, the
  dynamic shared buffer, the static ``__shared__`` arrays) or undefined
  behaviour aborts.

:class:`Emulator` is a ``launch=`` for :class:`buddy.engines.kernels.Kernels` and
:class:`buddy.engines.kernel_engine.KernelEngine`: it launches a kernel with the grid,
block and shared memory of :func:`buddy.engines.launch.launch_config` on an H100 (optionally fewer blocks,
so the warps' grid-stride loops loop), on exactly-sized copies of the
arguments, several schedules each, and copies the results back. Any report
raises :class:`EmulatorError` with the emulator's text.

Builds are cached by the hash of their sources and flags in a folder of the
temporary directory (``BUDDY_EMULATOR_CACHE`` overrides it), so a session
compiles each (build, entry size) once and a later session not at all.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import select
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from buddy import spec as buddy_spec
from buddy.engines import launch as blaunch
from buddy.engines import sources as bsources
from buddy.engines.tuning import Tuning, current

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
SOURCES = ROOT / "tests" / "host" / "emulator"
#: what the emulator shares with the native CPU engine: the CUDA shim, the fibers, the kernel table
HOST = CSRC / "host"
BUILDS = ("tsan", "asan")

_WARNINGS = ["-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas"]  # the sources' unroll hints are for nvcc
_SANITIZE = {
    "tsan": ["-fsanitize=thread"],
    # the static __shared__ arrays live in the shim's section: GCC instruments such globals only when told
    "asan": [
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
        "-fsanitize-sections=buddy_emu_shared",
        "-fno-omit-frame-pointer",
    ],
}
# what runtime.cpp itself is compiled with: TSan does not instrument the scheduler (it would see its bookkeeping
# as races between fibers); its annotations call the sanitizer's interface directly
_RUNTIME = {
    "tsan": ["-DBUDDY_EMU_TSAN"],
    "asan": ["-DBUDDY_EMU_ASAN", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
}
_ENV = {
    "TSAN_OPTIONS": "halt_on_error=1 exitcode=66 history_size=4 report_signal_unsafe=0 atexit_sleep_ms=0",
    "ASAN_OPTIONS": "detect_leaks=0 halt_on_error=1 detect_stack_use_after_return=0",
    "UBSAN_OPTIONS": "halt_on_error=1 print_stacktrace=1",
}


class EmulatorError(AssertionError):
    """A launch the emulator reported: a race, a memory or UB error, a deadlock, schedules that disagree."""

    def __init__(self, kernel: str, build: str, status: int, report: str):
        self.kernel, self.build, self.status, self.report = kernel, build, status, report
        super().__init__(f"{kernel} ({build} build) failed with status {status}: {self.what}\n{report}")

    @property
    def what(self) -> str:
        """What was reported: ``race``, ``memory`` (ASan), ``undefined`` (UBSan), ``stuck`` (a deadlock or
        divergence), ``schedules`` (schedules wrote different bytes, or an input changed) or ``other``."""
        if "ThreadSanitizer: data race" in self.report:
            return "race"
        if "ERROR: AddressSanitizer" in self.report:
            return "memory"
        if "runtime error:" in self.report:
            return "undefined"
        return {4: "stuck", 3: "schedules"}.get(self.status, "other")

    def race_stacks(self) -> list[list[Frame]]:
        """Per access of a race report (the access, then the earlier one): its frames in the kernel sources,
        innermost first (the shim's and the emulator's own frames left out)."""
        stacks = []
        for section in re.split(r"\n(?=  \S)", self.report):
            if re.match(r"  (Previous )?(atomic |Atomic )?(read|write|Read|Write) of size", section):
                frames = re.findall(r"#\d+ (.*) (/\S+?):(\d+)(?::\d+)? \(", section)
                own = (SOURCES, HOST)  # the shim's and the emulator's frames
                stacks.append(
                    [Frame(Path(path).name, int(line), fn) for fn, path, line in frames if Path(path).parent not in own]
                )
        return stacks


@dataclass(frozen=True)
class Frame:
    """A frame of a sanitizer's stack: source file (its name), line, function (as the report spells it)."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def cache_dir() -> Path:
    folder = Path(os.environ.get("BUDDY_EMULATOR_CACHE") or Path(tempfile.gettempdir()) / "buddy-emulator")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _tree(folder: Path) -> list[tuple[str, bytes]]:
    return [(p.name, p.read_bytes()) for p in sorted(folder.iterdir()) if p.suffix in (".h", ".cu", ".cpp")]


@functools.cache
def _compiler() -> str:
    if shutil.which("g++") is None:
        raise FileNotFoundError("the emulator needs g++ (C++17, with -fsanitize=thread and address)")
    return subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout


_FLAGS = ["-O1", "-g1", *_WARNINGS]  # -g1: the line tables the sanitizers' reports need, quicker to build than -g


def _compile(cmd: list[str], out: Path) -> Path:
    """Runs ``cmd`` (a compile or link writing ``out``) into a temporary name, then moves it to ``out`` (atomic:
    concurrent builds of the same key write the same file)."""
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    result = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
    if result.returncode:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"emulator build failed: {' '.join(cmd)}\n{result.stderr}")
    os.replace(tmp, out)
    return out


def cached_build(name: str, cmd: list[str], *key, folders: tuple[Path, ...] = (), suffix: str = "") -> Path:
    """``cmd`` (a compile or link, without its ``-o``) built into the cache as ``name-<hash><suffix>``, or the build
    already there: the hash of the sources of ``folders`` (their text, not their place), ``key`` (what else the
    output depends on: a source's bytes, flags) and the compiler."""
    out = cache_dir() / f"{name}-{_digest(*(_tree(f) for f in folders), *key, _compiler())}{suffix}"
    return out if out.exists() else _compile(cmd, out)


def _runtime(kind: str) -> Path:
    """runtime.cpp compiled for ``kind`` (it does not depend on the kernels: one object for every build)."""
    cmd = ["g++", "-std=c++17", *_FLAGS, *_RUNTIME[kind], f"-I{SOURCES}", f"-I{HOST}", "-c"]
    cmd.append(str(SOURCES / "runtime.cpp"))
    return cached_build(f"runtime-{kind}", cmd, _FLAGS, _RUNTIME[kind], folders=(SOURCES, HOST), suffix=".o")


def build(kind: str, entry_bytes: int, *, csrc: Path = CSRC, codec: str = "all", word_bytes: int | None = None,
          pack_fields: bool = False) -> Path:  # fmt: skip
    """The emulator binary of ``kind`` (``"tsan"``/``"asan"``) for the kernels of ``csrc`` at this entry size.

    Compiled with ``buddy.engines.sources.compile_options(entry_bytes, codec, word_bytes, shared_tables,
    pack_fields)``: with a word size, the module of that word size alone, as the loader compiles it; a table
    codec's unpack with its table in shared memory where an H100's would hold it
    (:data:`buddy.engines.launch.HOPPER`: every entry size), and its pack with its table of whole fields there where
    ``pack_fields`` (:attr:`buddy.engines.tuning.Tuning.pack_fields`), as :class:`Emulator` launches it; cached by the hash of every source, the options and
    the compiler.
    """
    if kind not in BUILDS:
        raise ValueError(f"kind must be one of {BUILDS}, got {kind!r}")
    shared_tables = blaunch.shared_table_layout(entry_bytes, blaunch.HOPPER) is not None
    fields = shared_tables and pack_fields  # pack's table of whole fields, as the loader compiles it
    options = list(bsources.compile_options(entry_bytes, codec, word_bytes, shared_tables, fields))
    kernels = ["g++", *options, *_FLAGS, *_SANITIZE[kind], f"-I{csrc}", f"-I{SOURCES}", f"-I{HOST}", "-c"]
    # the sources' text, not their folder: a copy elsewhere (a mutation test's, another session's) is the same build
    trees = (_tree(Path(csrc)), _tree(SOURCES), _tree(HOST))
    key = _digest(*trees, options, _FLAGS, _SANITIZE[kind], _RUNTIME[kind], _compiler())
    words = "" if word_bytes is None else f"-w{word_bytes}"
    exe = cache_dir() / f"emulator-{kind}-E{entry_bytes}-{codec}{words}-{key}"
    if exe.exists():
        return exe
    runtime = _runtime(kind)
    objects = _compile([*kernels, str(SOURCES / "kernels.cpp")], exe.with_name(f"{exe.name}.{os.getpid()}.o"))
    _compile(["g++", *_SANITIZE[kind], str(objects), str(runtime)], exe)
    objects.unlink(missing_ok=True)
    return exe


# ---------------------------------------------------------------------------
# the kernels' parameters, from the sources
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """A kernel parameter: its C type (``const`` left out), name, and whether it points to const."""

    ctype: str  # "uint8_t*", "long long", ...
    name: str
    const: bool


#: pointers a kernel adds to, ORs into or writes in part (the caller zeroes them, or keeps the rest): their bytes go
#: in and come back
_ACCUMULATED = {"histogram", "counts", "error", "place", "step", "reserve"}
#: pointers a kernel uses as scratch: garbage in, nothing comes back
_SCRATCH = {"work"}


def kernel_parameters(csrc: Path = CSRC) -> dict[str, list[Param]]:
    """Every ``extern "C"`` kernel's parameters, from the translation unit with its macros expanded."""
    return _parameters(_digest(_tree(Path(csrc))), str(csrc))


@functools.cache
def _parameters(key: str, csrc: str) -> dict[str, list[Param]]:
    """:func:`kernel_parameters` of the sources in ``csrc`` whose text hashes to ``key``."""
    expanded = subprocess.run(
        ["g++", "-E", "-P", "-x", "c++", *bsources.compile_options(128, "all"), f"-I{csrc}", "-"],
        input='#include "buddy_kernels.cu"\n',
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sigs = {}
    kernels = r'extern "C" __global__ (?:__launch_bounds__\([^)]*\) )?void (\w+)\((.*?)\)\s*\{'
    for name, params in re.findall(kernels, expanded, re.S):
        out = []
        for param in re.sub(r"/\*.*?\*/", "", params).split(","):
            words = param.replace("__restrict__", "").replace("*", " * ").split()
            ctype = " ".join(w for w in words[:-1] if w != "const").replace(" *", "*")
            out.append(Param(ctype, words[-1], "const" in words))
        sigs[name] = out
    return sigs


def role(param: Param) -> str:
    """How a launch passes a parameter: ``in``, ``out``, ``inout``, ``scratch``, ``i32`` or ``i64``."""
    if not param.ctype.endswith("*"):
        return {"int": "i32", "long long": "i64"}[param.ctype]
    if param.const:
        return "in"
    return "inout" if param.name in _ACCUMULATED else "scratch" if param.name in _SCRATCH else "out"


# ---------------------------------------------------------------------------
# launches
# ---------------------------------------------------------------------------
class Emulator:
    """A ``launch=`` for :class:`buddy.engines.kernels.Kernels` / :class:`buddy.engines.kernel_engine.KernelEngine`
    that runs the emulator.

    ``kind``: the build; ``seed``, ``schedules``: schedule ``s`` of a launch uses
    the random stream of ``seed + s`` (each launch advances ``seed``);
    ``max_blocks``: launch at most this many blocks (the warps' grid-stride
    loops then cover the rest); ``csrc``: the sources (a mutated copy in the
    tests that a removed barrier is caught); ``codecs``: whose kernels the
    build holds (``"all"``, or one codec's: a smaller build, as the loader
    compiles them). :attr:`launches` records ``(kernel, grid, block, shared)``
    of each launch.

    The launches of one entry size go to one emulator process (``--serve``:
    the sanitizer's start-up is paid once); a report ends it, and the next
    launch starts another. :meth:`close` (or leaving a ``with`` block) ends them.
    """

    def __init__(self, kind: str, *, seed: int = 0, schedules: int = 2, max_blocks: int | None = None,
                 csrc: Path = CSRC, codecs: str = "all", timeout: float = 600.0):  # fmt: skip
        if kind not in BUILDS:
            raise ValueError(f"kind must be one of {BUILDS}, got {kind!r}")
        self.kind, self.seed, self.schedules, self.max_blocks = kind, seed, schedules, max_blocks
        self.csrc, self.codecs, self.timeout = Path(csrc), codecs, timeout
        self.launches: list[tuple[str, int, int, int]] = []
        self._folder = Path(tempfile.mkdtemp(prefix="buddy-emu-"))
        self._servers: dict[Path, tuple[subprocess.Popen, object]] = {}

    def __enter__(self) -> Emulator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the emulator processes and remove the launches' files."""
        for proc, err in self._servers.values():
            proc.kill()
            proc.wait()
            err.close()
        self._servers.clear()
        shutil.rmtree(self._folder, ignore_errors=True)

    def __call__(self, codec: str, op: str, entry_bytes: int, device, n_entries: int, args: tuple,
                 tuning: Tuning | None = None) -> None:  # fmt: skip
        tuning = current() if tuning is None else tuning
        fields = blaunch.shares_tables(codec, entry_bytes, blaunch.HOPPER) and tuning.pack_fields
        warps = tuning.unpack_warps
        blocks, threads, shared = blaunch.launch_config(op, entry_bytes, n_entries, codec, blaunch.HOPPER, fields, warps)
        if self.max_blocks is not None:
            blocks = min(blocks, self.max_blocks)
        if op == "pack" and args[5].numel():
            # A pack ahead writes its overflow into buddy memory reserved at the worst case: the launch gets the
            # bytes the overflow's prefix sums say it writes there (less those its placement puts in the step's
            # reserve), exactly sized, so that a write past them is caught and every byte of them must be written.
            ends, overflow, place = args[5], args[8], args[9]
            held = int(ends[-1]) - (int(place[1]) if place.numel() else 0)
            args = (*args[:8], overflow[: held * buddy_spec.SECTOR_BYTES], *args[9:])
        if op == "drain" and args[2].numel():
            # An overflow ring's drain: the launch gets exactly the bytes it copies (the same count), in the
            # ring's region and in buddy memory, so that a read or write past them is caught, every byte written.
            staged, ends, place, into = args[0], args[2], args[4], args[5]
            nbytes = (int(ends[-1]) - int(place[1])) * buddy_spec.SECTOR_BYTES
            args = (staged[:nbytes], args[1], ends, args[3], place, into[:nbytes], args[6])
        self.run(f"buddy_{codec}_{op}", entry_bytes, (blocks, threads, shared), args, pack_fields=fields)

    def run(self, kernel: str, entry_bytes: int, config: tuple[int, int, int], args: tuple, *,
            pack_fields: bool = False) -> None:  # fmt: skip
        """Launch ``kernel`` with ``config`` = (grid, block, dynamic shared bytes) on CPU tensors and integers, from
        the module with pack's table of whole fields where ``pack_fields`` (:func:`build`)."""
        params = kernel_parameters(self.csrc)[kernel]
        if len(params) != len(args):
            raise ValueError(f"{kernel} takes {len(params)} arguments, got {len(args)}")
        specs, inputs, outputs = [], [], []
        for param, arg in zip(params, args):
            how = role(param)
            if how in ("i32", "i64"):
                want = np.int32 if how == "i32" else np.int64
                if type(arg) is not want:
                    raise TypeError(f"{kernel}: {param.name} is a {param.ctype}, got {type(arg).__name__}")
                specs.append(f"{how}:{int(arg)}")
                continue
            if not isinstance(arg, torch.Tensor) or arg.device.type != "cpu" or not arg.is_contiguous():
                raise TypeError(f"{kernel}: {param.name} must be a contiguous CPU tensor")
            nbytes = arg.numel() * arg.element_size()
            specs.append(f"{how}:{nbytes}")
            if how in ("in", "inout"):
                inputs.append(arg.reshape(-1).view(torch.uint8).numpy())
            if how in ("out", "inout"):
                outputs.append(arg)
        src, dst = self._folder / "in.bin", self._folder / "out.bin"
        (np.concatenate(inputs) if inputs else np.zeros(0, np.uint8)).tofile(src)
        grid, block, shared = config
        words = [kernel, grid, block, shared, self.seed, self.schedules, src, dst, *specs]
        # the module of the launch's word size, as the loader compiles it (every kernel's last parameter)
        word_bytes = int(args[-1]) if params[-1].name == "word_bytes" else None
        exe = build(self.kind, entry_bytes, csrc=self.csrc, codec=self.codecs, word_bytes=word_bytes,
                    pack_fields=pack_fields)
        self._request(exe, kernel, " ".join(map(str, words)))
        self.launches.append((kernel, grid, block, shared))
        self.seed += self.schedules
        data = torch.from_numpy(np.fromfile(dst, dtype=np.uint8))
        at = 0
        for t in outputs:
            nbytes = t.numel() * t.element_size()
            t.reshape(-1).view(torch.uint8).copy_(data[at : at + nbytes])
            at += nbytes
        assert at == data.numel(), f"{kernel}: the emulator wrote {data.numel()} bytes, expected {at}"

    def _request(self, exe: Path, kernel: str, line: str) -> None:
        """One launch in the emulator process of ``exe``; :class:`EmulatorError` with its report if it fails."""
        if exe not in self._servers or self._servers[exe][0].poll() is not None:
            err = tempfile.TemporaryFile(dir=self._folder)
            proc = subprocess.Popen([str(exe), "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, env={**os.environ, **_ENV}, text=True)  # fmt: skip
            self._servers[exe] = (proc, err)
        proc, err = self._servers[exe]
        answer = ""
        try:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            if select.select([proc.stdout], [], [], self.timeout)[0]:
                answer = proc.stdout.readline()
        except BrokenPipeError:
            pass
        if answer == "ok\n":
            return
        del self._servers[exe]
        if proc.poll() is None:  # no answer in time: a hang the emulator did not catch
            proc.kill()
        proc.wait()
        err.seek(0)
        report = err.read().decode(errors="replace")
        err.close()
        raise EmulatorError(kernel, self.kind, proc.returncode, report[-20000:] or "(no report: timed out)")
