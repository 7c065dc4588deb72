"""The kernel sources: which codecs they have kernels of, their text, and the options they are compiled with.

``csrc/buddy_kernels.cu`` and its headers ship as package data (``buddy.csrc``,
the repository's ``csrc/``). Every build of them reads them from here: NVRTC
through CuPy on a GPU (:mod:`buddy.engines.cuda`), the host's C++ compiler for
the native CPU engine (:mod:`buddy.engines.native`), the block emulator and
NVRTC itself in the tests. The format constants arrive as ``-D`` defines from
:func:`buddy.spec.c_defines`, never restated in C.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

from .. import spec
from ..codecs.auto import AUTO_MEMBERS, AutoCodec
from ..codecs.base import Codec
from ..codecs.bpc import BPCCodec
from ..codecs.fpe import FPECodec
from ..codecs.fpx import FPXCodec
from ..codecs.zvc import ZVCCodec
from ..layout import WORD_SIZES

__all__ = [
    "KERNEL_CODECS", "TABLED_KERNELS", "SOURCE", "REPO_CSRC", "read_source", "translation_unit", "compile_options",
]  # fmt: skip

#: codecs with kernels: the exact class the kernels reproduce, by registry name (the one list: the
#: implementation table, the self-test and the tests read it; csrc/ has its own, checked against it)
KERNEL_CODECS: dict[str, type[Codec]] = {
    "zvc": ZVCCodec, "fpx": FPXCodec, "bpc": BPCCodec, "auto": AutoCodec, "fpe": FPECodec, "auto2": AutoCodec,
}  # fmt: skip
#: codecs whose kernels code with a table (their ``table`` argument is a device table, not null): ``fpe`` and the
#: auto codecs with it among their members
TABLED_KERNELS = frozenset(
    name for name, cls in KERNEL_CODECS.items() if FPECodec in (cls, *AUTO_MEMBERS.get(name, ()))
)
#: the translation unit of every kernel
SOURCE = "buddy_kernels.cu"
#: the repository's kernel sources, read where the package is not installed with them
REPO_CSRC = Path(__file__).resolve().parents[2] / "csrc"

_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)


def read_source(name: str) -> str:
    """Text of ``csrc/<name>``: from the installed ``buddy.csrc`` package, else the repository."""
    try:
        return importlib.resources.files("buddy.csrc").joinpath(name).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    path = REPO_CSRC / name
    if not path.is_file():
        raise FileNotFoundError(
            f"CUDA source {name!r} is neither in the installed package (buddy.csrc) nor in {REPO_CSRC}"
        )
    return path.read_text(encoding="utf-8")


def translation_unit(name: str = SOURCE) -> str:
    """``csrc/<name>`` with its local ``#include "..."`` files inlined (each once).

    NVRTC compiles one string; inlining makes it independent of where the
    package lives, and the text hashed for the compile cache is exactly
    what is compiled.
    """
    seen: set[str] = set()

    def expand(file: str) -> str:
        seen.add(file)
        text = _PRAGMA_ONCE.sub("", read_source(file))

        def include(match: re.Match) -> str:
            header = match.group(1)
            if header in seen:
                return f"// {header}: already included"
            return f"// ---- begin {header}\n{expand(header)}\n// ---- end {header}"

        return _LOCAL_INCLUDE.sub(include, text)

    return f"// buddy: {name}, local includes inlined\n{expand(name)}"


def compile_options(
    entry_bytes: int, codec: str = "all", word_bytes: int | None = None, shared_tables: bool = False,
    pack_fields: bool = False,
) -> tuple[str, ...]:  # fmt: skip
    """NVRTC options: C++17, the format constants of this entry size, which codec's kernels to build, when given
    the one word size they are built for (csrc/buddy_kernels.cu: a kernel of one word size needs fewer registers
    than one of all four), and whether a table codec's tables are in each block's shared memory (``shared_tables``:
    unpack's copy of the device table's decode rows, and with ``pack_fields`` pack's table of whole fields;
    launched with :func:`buddy.engines.launch.launch_config`'s ``shared`` and ``pack_fields`` then)."""
    if pack_fields and not shared_tables:
        raise ValueError("pack's table of whole fields is in shared memory: pack_fields needs shared_tables")
    defines = spec.c_defines(spec.check_entry_bytes(entry_bytes))
    if word_bytes is not None and word_bytes not in WORD_SIZES:  # a launch's last argument, read as the word size
        raise ValueError(f"word sizes are 1, 2, 4 or 8 bytes, got {word_bytes!r}")
    words = () if word_bytes is None else (f"-DBUDDY_WORD_BYTES={int(word_bytes)}",)
    table: tuple[str, ...] = ("-DBUDDY_SHARED_TABLES=1",) if shared_tables else ()
    table += ("-DBUDDY_PACK_FIELDS=1",) if pack_fields else ()
    constants = tuple(f"-D{k}={v}" for k, v in defines.items())
    return ("-std=c++17", *constants, f"-DBUDDY_CODEC_{codec.upper()}=1", *words, *table)
