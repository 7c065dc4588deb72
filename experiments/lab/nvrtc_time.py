"""Seconds NVRTC takes to compile each kernel module: what a GPU run pays before its first launch.

``buddy.engines.cuda`` compiles one module per (codec, entry size, device
architecture) through CuPy's NVRTC the first time it launches a kernel of it.
NVRTC itself needs no GPU, so this script compiles exactly those modules --
the same translation unit and options (:func:`buddy.engines.sources.translation_unit`,
:func:`buddy.engines.sources.compile_options`), for ``--arch`` -- on any machine with
NVRTC's library, and prints the seconds and the size of the cubin. The
numbers size the GPU session's phases (``experiments/lab/README.md``).

NVRTC's library comes from the ``nvidia-cuda-nvrtc`` wheel (CUDA 13:
``pip install nvidia-cuda-nvrtc==13.0.*``) or a CUDA toolkit; ``--nvrtc``
names the file when it is elsewhere.

    python -m experiments.lab.nvrtc_time                                 # every codec at 512 and 4096 B
    python -m experiments.lab.nvrtc_time --codecs auto2 --entry-bytes 4096 --jobs 2
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from buddy.engines import sources as bsources
from buddy import env
from experiments.common import command_line

__all__ = ["find_nvrtc", "compile_seconds", "main"]


def find_nvrtc(explicit: str | None = None) -> str | None:
    """Path of ``libnvrtc.so``: ``explicit``, else the ``nvidia-cuda-nvrtc`` wheel, else a CUDA toolkit."""
    if explicit:
        return explicit
    candidates: list[str] = []
    for entry in sys.path:
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "cu*", "lib", "libnvrtc.so*")))
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            candidates += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    plain = [c for c in candidates if ".alt." not in c]
    return plain[0] if plain else None


class _Nvrtc:
    """The few NVRTC calls a compile needs (ctypes)."""

    def __init__(self, path: str):
        # NVRTC opens its builtins library by name at the first compile: load the one beside it first
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
            if ".alt." not in builtins:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                break
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _check(self, status: int, what: str, log: str = "") -> None:
        if status != 0:
            message = self.lib.nvrtcGetErrorString(status).decode()
            raise RuntimeError(f"{what}: {message}\n{log}")

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return f"{major.value}.{minor.value}"

    def compile(self, source: str, options: list[str]) -> int:
        """Compile ``source``; the cubin's size in bytes."""
        prog = ctypes.c_void_p()
        self._check(
            self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"buddy_kernels.cu", 0, None, None),
            "nvrtcCreateProgram",
        )
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, log)
            self._check(status, "nvrtcCompileProgram", log.value.decode(errors="replace"))
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            return size.value
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_seconds(nvrtc: _Nvrtc, codec: str, entry_bytes: int, arch: str) -> dict[str, Any]:
    """One module as :mod:`buddy.engines.cuda` builds it: ``{"codec", "entry_bytes", "seconds", "cubin_bytes"}``."""
    options = [*bsources.compile_options(entry_bytes, codec), f"-arch={arch}"]
    start = time.perf_counter()
    cubin = nvrtc.compile(bsources.translation_unit(), options)
    return {"codec": codec, "entry_bytes": entry_bytes, "seconds": time.perf_counter() - start, "cubin_bytes": cubin}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nvrtc_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--codecs", nargs="+", default=list(bsources.KERNEL_CODECS), choices=list(bsources.KERNEL_CODECS))
    p.add_argument("--entry-bytes", nargs="+", type=int, default=[512, 4096])
    p.add_argument("--arch", default="sm_90", help="target architecture (H100 and H200: sm_90)")
    p.add_argument("--jobs", type=int, default=1, help="modules compiled at once (threads; NVRTC releases the GIL)")
    p.add_argument("--nvrtc", default=None, help="path of libnvrtc.so (default: the nvidia-cuda-nvrtc wheel)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    path = find_nvrtc(args.nvrtc)
    if path is None:
        raise SystemExit("nvrtc_time: no libnvrtc.so found: pip install 'nvidia-cuda-nvrtc==13.0.*' or pass --nvrtc")
    nvrtc = _Nvrtc(path)
    print(f"NVRTC {nvrtc.version()} ({path}), target {args.arch}, {args.jobs} at once, {os.cpu_count()} CPUs")
    jobs = [(c, e) for c in args.codecs for e in args.entry_bytes]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(lambda job: compile_seconds(nvrtc, job[0], job[1], args.arch), jobs))
    wall = time.perf_counter() - start
    for r in rows:
        print(
            f"  {r['codec']:>6} E={r['entry_bytes']:<6} {r['seconds']:6.2f} s  cubin {r['cubin_bytes'] / 1024:7.1f} KiB"
        )
    seconds = [float(r["seconds"]) for r in rows]
    print(
        f"{len(rows)} modules: {sum(seconds):.1f} s of compiling (median {statistics.median(seconds):.2f} s, "
        f"max {max(seconds):.2f} s), {wall:.1f} s wall"
    )
    if args.json is not None:
        payload = {
            "command": command_line("lab.nvrtc_time", argv if argv is not None else sys.argv[1:]),
            "environment": env.environment(),
            "nvrtc": nvrtc.version(),
            "arch": args.arch,
            "wall_seconds": wall,
            "rows": rows,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
