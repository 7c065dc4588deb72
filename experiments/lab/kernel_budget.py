"""The kernel budget of the default codec at 4 KiB entries: what each kernel costs an H100, estimated from its SASS.

No GPU is needed. For each kernel of the codec (measure, pack, unpack,
count, fit), built as the loader builds it (``buddy.engines.sources.translation_unit``
and ``compile_options`` for one word size) for sm_90 with nvcc:

* **resources** from ptxas (``-Xptxas -v``): registers, shared memory,
  spills; with the launch configuration (``buddy.engines.launch.launch_config``) they
  give the **occupancy** (resident warps per SM);
* **instructions per entry**: the SASS (``nvdisasm``, with ``-lineinfo``)
  is cut into its loops (a backward branch closes one); each instruction
  counts once per entry, times the iterations per entry of the innermost
  loop around it. The iterations come from the source line that closes the
  loop (:data:`TRIPS`: e.g. the middle of fpe's find walk, ``while (pos <=
  limit - BUDDY_FPE_CODE_BITS)``, steps as often as the split layout's
  decoder steps there on real data -- the lane
  simulation of :mod:`experiments.lab.fpe_lanes` on the capture workloads --
  and a copy loop E / 16 / 32 times). Every instruction of a loop body
  counts, both sides of its branches: an upper bound, but for the blocks
  run on a known share of the steps (:data:`RARE_BLOCKS`) or not at all
  on what is written now (:data:`SERIAL_BLOCKS`). A loop the compiler
  made several copies of (unswitched, or unrolled: :data:`ANCHORS` says
  how many source iterations a copy's pass does) counts once, as its
  largest copy per source iteration; a call of a routine (64-bit
  division) counts the routine's instructions. Loops the table does
  not name count once and are listed;
* **bytes moved** per entry (reads and writes of device memory);
* the **estimated GB/s** of input on an H100 (132 SMs, 4 schedulers each
  issuing one warp instruction a cycle, 1.755 GHz, HBM 3.35 TB/s) as the
  least of three bounds: issue (instructions / 4 per cycle per SM), memory
  (bytes / 3.35 TB/s) and, given a GPU run (``--ncu``), latency: each
  resident warp issuing one instruction per the cycles an instruction took
  a warp in that run (:func:`cycles_per_instruction`: the kernel's time x
  clock x SMs x resident warps over the instructions it ran), at the warps
  allowed here -- the run measures how long the kernel's dependent chains
  keep a warp waiting, which no count of instructions says; and which one
  binds.

A whole compress with nothing learned runs count, fit, measure and pack
(and reads back the histogram); with a learned table, count (the
statistics it learns from), measure and pack -- and fit again on the steps
where the learned statistics have drifted from the table kept. The tracker
counts a learned key only every ``count_every`` steps after its first
``count_warmup`` (:class:`buddy.Tracker`): the other steps run measure and
pack alone, and the steady state is the mean over ``count_every`` steps.
Decompress is unpack. The totals are for a 256 MiB tensor.

    python -m experiments.lab.kernel_budget                      # writes docs/kernel_budget.md
    python -m experiments.lab.kernel_budget --codec fpe --out -   # print only

Needs nvcc (CUDA 12 or 13) and nvdisasm (``pip install
nvidia-cuda-nvdisasm``, or the CUDA toolkit's).
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

import buddy
from buddy.tracker import COUNT_EVERY, COUNT_WARMUP
from buddy.engines import launch as blaunch
from buddy.engines import sources as bsources
from buddy import spec
from experiments import cli

__all__ = ["H100", "TRIPS", "main"]

#: the machine the estimate is for
H100 = {"sms": 132, "schedulers": 4, "clock_ghz": 1.755, "hbm_gbps": 3350.0, "regs": 65536, "smem": 228 << 10,
        "max_warps": 64, "max_blocks": 32}  # fmt: skip
#: bytes of a tensor the compress and decompress totals are for
TENSOR_BYTES = 256 << 20
#: fixed costs: a kernel launch, the one device-to-host read of a compress (histogram and fitted table)
LAUNCH_US, READBACK_US = 4.0, 15.0

#: the split layout's find loops (experiments.lab.fpe_lanes: a warp's steps in each, per entry)
FIND_LOOPS = ("warm_mid", "warm_tail", "find_head", "find_mid", "find_tail", "resync_head", "resync_mid",
              "resync_tail")

#: (pattern on the source line that closes a loop, key of its iterations per entry per warp); see `_trips`
TRIPS = [
    (r"while \(pos < limit && pos < early\)", "find_head"),  # fpe: the find walk (and resync): the span's first bits
    (r"while \(pos <= limit - BUDDY_FPE_CODE_BITS\)", "find_mid"),  # its middle
    (r"while \(pos < limit\)", "find_tail"),          # its last steps
    (r"while \(done < count\)", "emit_steps"),        # fpe: the emit walk
    (r"for \(; m; m &= m - 1u\)", "emit_rest"),         # fpe: a step's words with tails after its first code
    (r"for \(uint32_t round = 0; round < BUDDY_WARP_SIZE", "rounds"),
    (r"while \(done < words\)", "passes"),
    (r"u < n / 16; u \+= BUDDY_WARP_SIZE", "fill16"),  # 16-byte copies and fills
    (r"buddy_bits_between|u <= \(hi - 1u\) / 64u", "one"),
    (r"i \+= buddy_warp_stride\(\)", "grid"),          # the format kernels' loop over entries
    (r"u0 \+= stride|for \(long long u0 = ", "grid"),  # the count kernel's (either line of its for)
    (r"for \(uint32_t r = 0; r < rounds; \+\+r\)", "rounds16"),
    (r"i < unit_words; \+\+i\) pos = put\(", "serial_words"),  # the serial layout's encode (not run)
    (r"for \(uint32_t i = 0; i < unit_words; \+\+i\)", "unit_words"),  # the words of a 16-byte round
    (r"while \(pos \+ BUDDY_FPE_CODE_BITS <= guess\)", "warm_mid"),  # fpe: a lane's warm-up before its span
    (r"while \(pos < guess\)", "warm_tail"),           # its last steps
    (r"while \(p < stop\)", "rounds"),                 # fpe: tails of the codes a resynchronized lane drops
    (r"for \(uint32_t i = 0; i < words; \+\+i\)", "serial_words"),  # the serial layout's walk (not run)
    (r"r0 < unit_rounds; r0 \+= block", "fpx_blocks"),  # auto2's fpx member sizing an entry: its histograms
    (r"for \(uint32_t r = r0; r < r1; \+\+r\)", "fpx_words"),  # auto2's fpx member: 16 bytes a lane an iteration
    (r"for \(uint32_t r = 0; r < unit_rounds; \+\+r\)", "rounds16"),  # fpx's first pass: 16 bytes a lane
    (r"for \(uint32_t c = 0; c < C; \+\+c\)", "bpc_chunks"),  # auto2's bpc member: 32-delta chunks
    (r"u = total / 64u \+ warp.lane\(\); u < n64", "bits_after"),  # the serial layout's and other codecs' check
]


@dataclass
class Kernel:
    name: str
    regs: int = 0
    smem: int = 0
    spills: int = 0
    instrs: list = field(default_factory=list)  # (address, text, source line)
    labels: dict = field(default_factory=dict)
    chains: dict = field(default_factory=dict)  # address -> the source line and the lines it was inlined at
    routines: dict = field(default_factory=dict)  # a called routine ($__internal_...) -> its instructions to RET


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for root in (Path(sysconfig.get_paths()["purelib"]) / "nvidia", Path("/usr/local/cuda/bin")):
        for path in sorted(root.rglob(name)) if root.exists() else []:
            if path.is_file():
                return str(path)
    raise SystemExit(f"{name} not found: pip install nvidia-cuda-{name} (or put the CUDA toolkit on PATH)")


_BUILT: dict[tuple, tuple] = {}


def build(codec: str, word: int, entry_bytes: int, folder: Path) -> tuple[dict[str, Kernel], list[str]]:
    """The codec's kernels for one word size, sm_90: ptxas resources and the SASS with source lines (once)."""
    key = (codec, word, entry_bytes)
    if key not in _BUILT:
        _BUILT[key] = _build(codec, word, entry_bytes, folder)
    return _BUILT[key]


def _build(codec: str, word: int, entry_bytes: int, folder: Path) -> tuple[dict[str, Kernel], list[str]]:
    unit = folder / "kernels.cu"
    text = bsources.translation_unit()
    unit.write_text(text)
    cubin = folder / f"{codec}_{word}.cubin"
    cmd = [_tool("nvcc"), "-arch=sm_90", "-lineinfo", "-Xptxas", "-v", *bsources.compile_options(entry_bytes, codec, word, blaunch.shares_tables(codec, entry_bytes, blaunch.HOPPER)),
           "-cubin", str(unit), "-o", str(cubin)]  # fmt: skip
    log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    kernels: dict[str, Kernel] = {}
    for m in re.finditer(r"entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers[^\n]*", log, re.S):
        smem = re.search(r"(\d+) bytes smem", m.group(0).split("\n")[-1])
        kernels[m.group(1)] = Kernel(m.group(1), int(m.group(3)), int(smem.group(1)) if smem else 0, int(m.group(2)))
    sass = subprocess.run([_tool("nvdisasm"), "-gi", "-c", str(cubin)], check=True, capture_output=True, text=True)
    read_listing(sass.stdout, kernels, unit.name)
    return kernels, text.splitlines()


def read_listing(listing: str, kernels: dict[str, Kernel], unit_name: str) -> None:
    """Fills ``kernels`` (by name) with the instructions, labels, inlining chains and called routines of an
    ``nvdisasm -gi`` listing whose source is the file named ``unit_name``.

    Before each run of instructions the listing gives their location as a group of rows, one a level: the
    innermost place (and the place it is inlined at), then each place that one is inlined at, out to the kernel.
    An instruction's chain is the translation unit's lines of the whole group, innermost first (CUDA's own
    headers -- atomicOr, __shfl_up_sync -- have lines of their own and are left out); its line, the chain's first.
    """
    current, line, grouped, pending = None, 0, False, []
    chain: tuple[int, ...] = ()
    levels: list[int] = []
    for row in listing.splitlines():
        if row.startswith("\t.section\t.text."):
            current = kernels.get(row.split(".text.")[1].split(",")[0])
            continue
        if current is None:
            continue
        if "//## File" in row:
            found = [(Path(f).name == unit_name, int(n)) for f, n in re.findall(r'"([^"]+)", line (\d+)', row)]
            if not grouped:
                levels = []
            levels += [n for ours, n in (found[1:] if grouped else found) if ours]  # (a later row's first place:
            # the row before's "inlined at")
            chain = tuple(levels) or (0,)
            line = chain[0]
            grouped = True
            continue
        grouped = False
        if (label := re.match(r"^(\.L_x_\d+|\$[\w$]+):", row.strip())) is not None:
            pending.append(label.group(1))  # at the address of the next instruction
        elif (ins := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", row)) is not None:
            addr = int(ins.group(1), 16)
            current.labels.update((name, addr) for name in pending)
            pending.clear()
            current.instrs.append((addr, ins.group(2).strip(), line))
            current.chains[addr] = chain
    for kern in kernels.values():  # a routine the compiler calls (64-bit division): its length to its RET
        for name, start in kern.labels.items():
            if name.startswith("$"):
                body = [t for a, t, _ in kern.instrs if a >= start]
                kern.routines[name] = next((i + 1 for i, t in enumerate(body) if re.match(r"(@\S+\s+)?RET\b", t)),
                                           len(body))  # fmt: skip


def loops(kernel: Kernel, source: list[str]) -> list[tuple[int, int, int, tuple]]:
    """``(start, end, closing source line, its inlining chain)`` of each loop: a branch back to an earlier
    label from a line of a ``for`` or ``while`` (other branches back come from blocks moved out of line); a
    branch that also tests a predicate operand (``@!P0 BRA P1, target``: a condition of two) counts."""
    out = []
    for addr, text, line in kernel.instrs:
        m = re.search(r"BRA\s+(?:!?P\d, )?`\((\.L_x_\d+)\)", text)  # (`BRA P1, ...`: also on a predicate)
        if m and kernel.labels.get(m.group(1)) is not None and kernel.labels[m.group(1)] <= addr:
            if 0 < line <= len(source) and re.search(r"\b(for|while)\b", source[line - 1]):
                out.append((kernel.labels[m.group(1)], addr, line, kernel.chains.get(addr, (line,))))
    return out


#: a copy or fill loop's iterations by the call it serves (a pattern on a line of its inlining chain)
CALLS = [
    (r"ZERO words are written by this", "units"),              # fpe's zeroed output
    (r"buddy_warp_fill\(warp, decoded, out", "units"),          # the decoded entry copied out
    (r"copy_sectors\(warp, slot, staging, in_slot\)", "gather"),  # the slot's sectors into staging
    (r"copy_sectors\(warp, overflow, staging", "none"),         # an entry within its slot: no overflow
    (r"buddy_warp_fill\(warp, nullptr, payload, k", "payload"),  # pack: the payload zeroed
    (r"copy_sectors\(warp, payload, slot, in_slot\)", "payload"),  # pack: the slot written
    (r"buddy_warp_fill\(warp, nullptr, slot \+ in_slot", "none"),
    (r"copy_sectors\(warp, payload \+ s", "none"),
]


def _loop_key(source: list[str], line: int, chain: tuple = ()) -> str | None:
    text = source[line - 1] if 0 < line <= len(source) else ""
    key = next((key for pattern, key in TRIPS if re.search(pattern, text)), None)
    if key == "fill16":  # which copy: the call it serves
        for at in chain[1:]:
            call = next((k for pattern, k in CALLS if re.search(pattern, source[at - 1])), None)
            if call is not None:
                return call
        return "none"  # the fills of the zero and raw entries and of flagged ones: not run on a coded entry
    return key


def headers(source: list[str]) -> list[str]:
    """Per line of the translation unit, the header it comes from (innermost; "" outside every header)."""
    stack, out = [""], []
    for text in source:
        if text.startswith("// ---- begin "):
            stack.append(text.removeprefix("// ---- begin ").strip())
        out.append(stack[-1])
        if text.startswith("// ---- end ") and len(stack) > 1:
            stack.pop()
    return out


#: the other members of auto2: their code is not run by the pack and unpack of an entry of fpe's mode
OTHER_MEMBERS = frozenset({"codec_zvc.h", "codec_fpx.h", "codec_bpc.h", "codec_auto.h"})


#: blocks of the decode walks taken for one code alone (ESC with its symbol; a lane's last codes), by the
#: comment that opens them: they run on that share of the steps (the lane simulation's), not every step
RARE_BLOCKS = ("} else {  // ESC with its symbol, or not a code", "} else {  // one code: ESC with its symbol")
#: code of the serial layout (tables of format 1 and 2), by its opening line: not run on what fits make now (nor
#: by the defaults)
SERIAL_BLOCKS = ("BUDDY_WARP_FN void encode_serial(", "BUDDY_HD uint32_t put(uint32_t* stream",
                 "BUDDY_HD uint32_t walk_serial(", "BUDDY_WARP_FN uint32_t decode_serial(",
                 "} else {  // a split table of another b", "} else {  // a table of another b (format 1's)",
                 # and a variant the defaults do not run: the count by ballots (Tuning(count_match=False))
                 "__device__ __forceinline__ void buddy_count_ballots(")  # fmt: skip


def block_lines(source: list[str], openings=RARE_BLOCKS) -> set[int]:
    """Lines (1-based) inside the blocks opened by a line starting with one of ``openings``: from the opening
    line to the brace that closes it (at the opening line's indent)."""
    out = set()
    for i, text in enumerate(source):
        if any(text.strip().startswith(b) for b in openings):
            indent = len(text) - len(text.lstrip())
            j = i + 1
            while j < len(source) and not (source[j].strip() == "}"
                                           and len(source[j]) - len(source[j].lstrip()) == indent):  # fmt: skip
                out.add(j + 1)
                j += 1
    return out


#: per loop key, a source line run once per iteration of the loop's source and compiled to one load: the
#: loads of it (not of the constant bank; the line itself or the one it is inlined at) in a compiled copy of
#: the loop are the iterations that copy's body does at once (its unroll)
ANCHORS = {
    # a lane's 16-byte unit of a round (buddy_round_unit): fpe's sizing in measure runs two rounds a pass
    "rounds16": r"return \*valid \? buddy_load<buddy_u128>\(entry_bytes \+ 16u \* u\) : zero;",
    "unit_words": r"const uint32_t c = table->enc\[sym\];",  # fpe's encode: a word's code from the table
    "fpx_words": r"const buddy_u128 unit = buddy_load<buddy_u128>\(entry_bytes \+ 16u \* u\);",  # fpx's unit
}


_LOAD = re.compile(r"(@\S+\s+)?LD[GS]?\.")  # a load of global or shared memory (not of the constant bank)


def unrolled(kernel: Kernel, source: list[str], a: int, b: int, anchor: str | None = None, inside=()) -> int:
    """Source iterations one pass of the compiled loop ``[a, b]`` does, from its loads (not those inside the
    loops ``inside`` it): with an ``anchor`` (a pattern of a source line loaded once an iteration: the line or
    the one it is inlined at) the anchor's loads; without one, the greatest common divisor of the loads each
    source line makes (for loops whose lines each load once an iteration: the fit's)."""
    per_line: dict[int, int] = {}
    for addr, text, line in kernel.instrs:
        if a <= addr <= b and _LOAD.match(text) and not any(a1 <= addr <= b1 for a1, b1 in inside):
            chain = kernel.chains.get(addr, (line,))
            if anchor is None or any(re.search(anchor, source[at - 1]) for at in chain):
                per_line[line] = per_line.get(line, 0) + 1
    if anchor is not None:
        return max(1, sum(per_line.values()))
    return math.gcd(*per_line.values()) if per_line else 1


def charged_copies(kernel: Kernel, groups, unroll) -> dict[tuple[int, int], float]:
    """Per compiled copy ``(a, b)`` of a source loop (``groups``: the lists of copies of one loop each), the
    passes charged per source iteration: ``1 / unroll(a, b)`` for the copy with the most instructions per
    source iteration, 0 for the others (unswitched copies: one of them runs; a remainder: its few iterations
    at the largest copy's cost)."""
    weight: dict[tuple[int, int], float] = {}
    for copies in groups:
        per = {ab: (sum(1 for addr, _, _ in kernel.instrs if ab[0] <= addr <= ab[1]), unroll(*ab)) for ab in copies}
        best = max(copies, key=lambda ab: per[ab][0] / per[ab][1])
        for ab in copies:
            weight[ab] = 1.0 / per[ab][1] if ab == best else 0.0
    return weight


def per_entry(kernel: Kernel, source: list[str], trips: dict[str, float], skip=frozenset(),
              parts: dict | None = None) -> tuple[float, list[str]]:
    """Warp instructions per entry (see the module doc) and the loops counted once for want of a trip count;
    instructions from the headers in ``skip`` are not run (code of the modes an entry does not have), those
    of the :data:`RARE_BLOCKS` (and of the functions inlined into them) on ``trips["single"]`` of the steps,
    those of the :data:`SERIAL_BLOCKS` never.

    A source loop the compiler made several copies of (unswitched on a condition that holds for the whole
    loop, or unrolled with a remainder: the same key, closing line, call site and enclosing loop) is charged
    once, as its largest copy per source iteration (:func:`charged_copies`, :func:`unrolled`) times the
    iterations. ``parts``, if given, gets the instructions per entry by the innermost loop they are in (its
    trip key; "body": in no loop but the grid's) and, under ``(key, "sass")``, the SASS instructions counted
    for it."""
    where = headers(source)
    rare, serial = block_lines(source, RARE_BLOCKS), block_lines(source, SERIAL_BLOCKS)
    found = [loop for loop in loops(kernel, source) if where[loop[2] - 1] not in skip]
    keyed = [(a, b, _loop_key(source, line, chain), line) for a, b, line, chain in found]
    # the walk inside the resynchronizing rounds steps only as far as a lane resynchronizes
    rounds = [(a, b) for a, b, key, _ in keyed if key == "rounds"]
    keyed = [(a, b, key.replace("find", "resync") if key and key.startswith("find_") and
              any(r0 < a and b < r1 for r0, r1 in rounds) else key, line) for a, b, key, line in keyed]  # fmt: skip
    grid = [(a, b) for a, b, key, _ in keyed if key == "grid"]
    if not grid:
        return float("nan"), ["no loop over entries"]
    g0, g1 = min(a for a, _ in grid), max(b for _, b in grid)

    def parent(a: int, b: int) -> tuple:
        around = [(b1 - a1, a1, b1) for a1, b1, key, _ in keyed if a1 < a and b < b1 and key != "grid"]
        return min(around)[1:] if around else ()

    # each copy's passes per source iteration: the copies of one loop but the largest, 0
    groups: dict[tuple, list] = {}  # a source loop: its key, the lines it closes at and is inlined at, the loop around
    sites = {(a, b): chain for a, b, _, chain in found}
    for a, b, key, line in keyed:
        if key != "grid":
            groups.setdefault((key, sites[a, b], parent(a, b)), []).append((a, b))
    anchors = {(a, b): ANCHORS.get(key or "") for a, b, key, _ in keyed}  # (no anchor: not unrolled)

    def unroll(a: int, b: int) -> int:
        anchor = anchors[a, b]
        return unrolled(kernel, source, a, b, anchor) if anchor else 1

    weight = charged_copies(kernel, groups.values(), unroll)
    unknown, total = set(), 0.0
    for addr, text, line in kernel.instrs:
        chain = kernel.chains.get(addr, (line,))
        if not g0 <= addr <= g1 or any(0 < at <= len(where) and where[at - 1] in skip for at in chain):
            continue  # once per warp, not per entry; or not run (a skipped header's code, or code inlined into it)
        share = trips.get("single", 1.0) if any(at in rare for at in chain) else 1.0
        share *= 0.0 if any(at in serial for at in chain) else 1.0
        inner = [(b - a, key, line, a, b) for a, b, key, line in keyed if a <= addr <= b and key != "grid"]
        if not inner:
            n, key = trips.get("grid", 1.0) * share, "body"
        else:
            _, key, loop_line, a, b = min(inner)
            # not run in a copy of an enclosing loop that is not charged
            scale = weight[a, b] * math.prod(1.0 if weight[a1, b1] else 0.0 for _, _, _, a1, b1 in inner)
            if key is None:
                unknown.add(f"line {loop_line}: {source[loop_line - 1].strip()[:60]}")
                n, key = share * scale, "unnamed"
            else:
                n = trips.get(key, 1.0) * share * scale
        if (callee := re.search(r"CALL\.\S+\s+`\((\$[\w$]+)\)", text)) is not None:
            n *= 1 + kernel.routines.get(callee.group(1), 0)  # the routine's instructions, once a call
        total += n
        if parts is not None:
            parts[key] = parts.get(key, 0.0) + n
            parts[(key, "sass")] = parts.get((key, "sass"), 0) + (n > 0)
    return total, sorted(unknown)


def fpx_block(word: int) -> int:
    """Units (16 bytes) a lane of fpx's choice histograms before it sums its fields (codec_fpx.h, ``block``):
    fields of ``64 // (e + 2)`` bits, each counting at most its largest value of words."""
    e = {1: 4, 2: 8, 4: 8, 8: 11}[word]
    return ((1 << (64 // (e + 2))) - 1) // (16 // word)


def occupancy(regs: int, smem_block: int, threads: int) -> int:
    """Resident warps per SM of a kernel: registers (allocated per warp in 256s), shared memory, block limits."""
    warps_block = max(1, threads // 32)
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = (H100["regs"] // per_warp) // warps_block
    by_smem = H100["smem"] // (smem_block + 1024) if smem_block else H100["max_blocks"]
    blocks = min(by_regs, by_smem, H100["max_blocks"], H100["max_warps"] // warps_block)
    return int(blocks * warps_block)


def lane_trips(dtype: torch.dtype, entry_bytes: int, sample: int, cache) -> dict[str, float]:
    """Mean iterations per entry of the split layout's loops on the capture workloads' tensors of ``dtype``."""
    from experiments.common import DEFAULT_POINTS
    from experiments.common import capture_all
    from experiments.lab.fpe_lanes import lane_work
    from experiments.workloads import CHECK_WORKLOADS, TUNING_WORKLOADS

    workloads = [*TUNING_WORKLOADS, *CHECK_WORKLOADS]
    caps = capture_all(workloads, size="quick", points=DEFAULT_POINTS["quick"], device="cpu", seed=0, show=False,
                       cache=cache)  # fmt: skip
    tensors = [s.tensor for w in workloads for c in caps[w] for s in c.tensors if s.tensor.dtype == dtype]
    sims = lane_work(tensors, entry_bytes, sample, torch.Generator().manual_seed(0))
    keys = ("passes", "rounds", "find", "resync", "warm", *FIND_LOOPS, "emit_steps", "emit_tails", "emit_rest",
            "single")
    mean = {key: statistics.mean(s[key] for s in sims) for key in keys}
    mean |= {f"lockstep_{part}": statistics.mean(s[f"lockstep_{part}"] for s in sims)
             for part in ("topup", "partial", "lazy")}  # fmt: skip
    mean["k"] = statistics.mean(s["k"] for s in sims)
    mean["entries"] = len(sims)
    return mean | bpc_stops(tensors, entry_bytes, sample, torch.Generator().manual_seed(1)) | select_passes(tensors)


def lockstep_counts(word: int, entry_bytes: int, folder: Path, sim: dict) -> dict:
    """The lockstep layout's decoder (``buddy_fpe_lockstep_decode``, fpe's module), counted as the budget counts:
    the SASS of its loop over rounds -- a round's (every lane a word), the partial top-up's block and the lazy
    loop's body (run on the rounds some lane needs them) -- and, with the simulation's rounds on the same entries
    (``sim``: :func:`lane_trips`), its instructions per entry in that loop."""
    kernels, source = build("fpe", word, entry_bytes, folder)
    k = kernels["buddy_fpe_lockstep_decode"]
    text = {a: source[line - 1] if 0 < line <= len(source) else "" for a, _, line in k.instrs}

    def branches(pattern: str) -> list[int]:  # the branches of the line that holds `pattern`
        return [a for a, t, _ in k.instrs if pattern in text[a] and re.search(r"\bBRA\b", t)]

    start, end = next((a, b) for a, b, line, _ in loops(k, source) if "r < rounds; ++r, at +=" in source[line - 1])
    inner = [a for a, _, _ in k.instrs if start <= a <= end]
    partial = branches("(a lane's last words)")[0]  # the branch over the partial top-up, to where it joins
    found = re.search(r"`\((\.L_x_\d+)\)", next(t for a, t, _ in k.instrs if a == partial))
    if found is None:
        raise RuntimeError("the partial top-up's branch has no target label")
    target = found.group(1)
    lazy = branches("if (!warp.ballot(want)) break;")  # out of the loop, ..., and back into it
    partial_block = sum(partial < a < k.labels[target] for a in inner)
    lazy_body = sum(lazy[0] < a <= lazy[-1] for a in inner)
    rnd = len(inner) - partial_block - lazy_body
    rounds = entry_bytes // word // 32
    trips = {"round": rounds, "partial": sim["lockstep_partial"], "lazy": sim["lockstep_lazy"]}
    return {"regs": k.regs, "round": rnd, "partial": partial_block, "lazy": lazy_body, "trips": trips,
            "per_entry": rounds * rnd + trips["partial"] * partial_block + trips["lazy"] * lazy_body}


def render_lockstep(weighed: dict, rows: list[dict]) -> list[str]:
    """The section on the lockstep layout's decoder (:func:`lockstep_counts` per dtype) beside the split layout's
    unpack (its instructions per entry but the body's)."""
    out = ["## A layout weighed: the lockstep decoder", "",
           "The lockstep layout ([format-v3.md](format-v3.md#a-layout-for-one-walk-weighed-not-kept)): its "
           "decoder's SASS a",
           "round (every lane a word), a partial top-up and a lazy round, with the simulation's rounds of each on "
           "the same",
           "entries, beside the split layout's unpack (its instructions per entry but the body's):",
           "",
           "| dtype | regs | SASS a round | rounds | SASS a partial top-up | partial rounds | SASS a lazy round | "
           "lazy rounds | instr/entry in the rounds | split unpack, its loops |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, w in weighed.items():
        split = next(r for r in rows if r["dtype"] == name and r["kernel"].endswith("unpack"))
        loops_only = split["instr/entry"] - split["parts"].get("body", 0.0)
        t = w["trips"]
        out.append(f"| {name} | {w['regs']} | {w['round']} | {t['round']} | {w['partial']} | {t['partial']:.1f} | "
                   f"{w['lazy']} | {t['lazy']:.1f} | {w['per_entry']:,.0f} | {loops_only:,.0f} |")
    return out + [""]


def radix_select(keys: np.ndarray, r: int) -> tuple[int, int, int]:
    """``buddy_fit_select`` on distinct ``keys`` (int64, below 2^44; at least ``r``): the r-th largest, the 4-bit
    digits passed over every key (from the top), and how many keys shared the digits found when the pass stopped
    (at most 32: ranked directly; 0: all 11 passed)."""
    found = 0
    for n, shift in enumerate(range(40, -1, -4), 1):
        mine = keys[(keys >> (shift + 4)) == (found >> (shift + 4))]
        count = np.bincount((mine >> shift) & 15, minlength=16)
        above = np.concatenate([np.cumsum(count[::-1])[::-1][1:], [0]])  # keys of greater digits
        digit = int(np.flatnonzero(above + count >= r).max())
        r -= int(above[digit])
        found |= digit << shift
        if shift > 0 and count[digit] <= 32:
            left = np.sort(mine[(mine >> shift) == (found >> shift)])[::-1]
            return int(left[r - 1]), n, int(count[digit])
    return found, 11, 0


def select_passes(tensors) -> dict:
    """The fit's radix select (``buddy_fit_select``, codec_fpe_fit.h) on each tensor's symbol counts, scaled as
    the fit scales them: the mean 4-bit digits it passes over every symbol for until at most 32 keys share the
    digits found (``select_passes``, of 11) and those keys (``select_few``), over the tensors with more than 255
    symbols (``select_of``: how many; the others select nothing)."""
    from buddy.codecs.fpe import MAX_CODED, fit_weights, symbol_counts

    passes, few = [], []
    for t in tensors:
        word = t.element_size()
        c = fit_weights(symbol_counts(t.detach().reshape(-1).view(torch.uint8), word), word).numpy()[: 1 << 12]
        idx = np.flatnonzero(c)
        if len(idx) <= MAX_CODED:
            continue
        _, n, left = radix_select(c[idx].astype(np.int64) << 12 | (4095 - idx), MAX_CODED)
        passes.append(n)
        if left:
            few.append(left)
    if not passes:
        return {"select_passes": 0.0, "select_few": 0.0, "select_of": 0}
    return {"select_passes": statistics.mean(passes), "select_few": statistics.mean(few) if few else 0.0,
            "select_of": len(passes)}  # fmt: skip


def bpc_stops(tensors, e: int, sample: int, g: torch.Generator) -> dict:
    """auto2's measure on up to ``sample`` entries drawn from ``tensors`` (any entry: measure sizes them all): the
    share whose bpc member is sized (zvc's and then fpx's size above one sector, as codec_auto.h) and the mean
    32-delta chunks bpc's plan steps for them before it stops (``measure_below``: once the planes sure to be raw
    make it no smaller than the size so far, checked after chunks 0, 1, 3, 7, 11, ...)."""
    from experiments.lab.fpe_lanes import fitted_entries

    from buddy.codecs.fpx import FPXCodec
    from buddy.codecs.zvc import ZVCCodec

    zvc, fpx = ZVCCodec(), FPXCodec()
    sized, chunks, seen, of = 0, [], 0, 0
    for i in torch.randperm(len(tensors), generator=g).tolist():
        got = fitted_entries(tensors[i], e)
        if got is None:
            continue
        entries, word, _ = got
        of = -(-(e // {2: 2, 8: 8}.get(word, 4) - 1) // 32)  # chunks of 32 deltas between bpc's words
        pick = entries[torch.randperm(entries.shape[0], generator=g)[:16]]
        kz = zvc.analyse(pick, word).sectors.clamp(max=e // 32)
        kf = fpx.analyse(pick, word).sectors
        for row in range(pick.shape[0]):
            seen += 1
            k = int(kz[row])
            if k > 1:
                k = min(k, int(kf[row]))
            if k > 1:
                sized += 1
                chunks.append(bpc_chunks_stepped(pick[row].numpy(), word, 256 * (k - 1) + 1))
        if seen >= sample:
            break
    return {"bpc_sized": sized / max(1, seen), "bpc_chunks": statistics.mean(chunks) if chunks else 0.0,
            "bpc_entries": seen, "bpc_of": of}  # fmt: skip


def bpc_chunks_stepped(entry, word: int, stop: int) -> int:
    """The chunks of 32 deltas bpc's plan (csrc/codec_bpc.h, ``plan<true>``) steps over the entry's bytes before
    the planes sure to be raw -- at least 3 set bits, not all ones, DBP not zero (the sign plane: any) -- make
    ``WS + raw * (L + 1) >= stop`` at a check (after chunks 0, 1, 3, 7, 11, ...); all of them if never."""
    import numpy as np

    ws = {2: 16, 8: 64}.get(word, 32)
    x = entry.view({16: np.uint16, 32: np.uint32, 64: np.uint64}[ws]).astype(np.uint64)
    top = np.uint64(1 << (ws - 1))
    lo = (x[1:] - x[:-1]) & np.uint64((1 << ws) - 1 if ws < 64 else 0xFFFFFFFFFFFFFFFF)
    neg = (x[1:] ^ top) < (x[:-1] ^ top)  # the delta's sign: the words compared as signed
    n_deltas = lo.shape[0]
    if ws == 16:  # DBX bits 0..16, the sign plane among them
        d = lo | (neg.astype(np.uint64) << np.uint64(16))
        rows, planes = d ^ (d >> np.uint64(1)), 17
    else:  # DBX bits 0..ws-1, the sign plane apart
        rows, planes = lo ^ (lo >> np.uint64(1)) ^ (neg.astype(np.uint64) << np.uint64(ws - 1)), ws
    bits = ((rows[None, :] >> np.arange(planes, dtype=np.uint64)[:, None]) & np.uint64(1)).astype(bool)
    if ws != 16:
        bits = np.vstack([bits, neg[None, :]])  # the sign plane last (j = ws)
    dbp = ((lo[None, :] >> np.arange(min(ws, 64), dtype=np.uint64)[:, None]) & np.uint64(1)).astype(bool)
    n_chunks = -(-n_deltas // 32)
    count = np.zeros(bits.shape[0], dtype=np.int64)
    ones = np.ones(bits.shape[0], dtype=bool)
    dor = np.zeros(bits.shape[0], dtype=bool)  # per plane: a delta so far has its bit (none past bit ws - 1)
    sign = np.arange(bits.shape[0]) >= ws  # the sign plane: never "DBP = 0"
    for c in range(n_chunks):
        piece = bits[:, 32 * c : 32 * c + 32]
        count += piece.sum(1)
        ones &= piece.all(1)
        dor[: dbp.shape[0]] |= dbp[:, 32 * c : 32 * c + 32].any(1)
        if c < 2 or c % 4 == 3:
            raw = int(((count >= 3) & ~ones & (sign | dor)).sum())
            if ws + raw * (n_deltas + 1) >= stop:
                return c + 1
    return n_chunks


def cycles_per_instruction(row: dict) -> float:
    """Cycles a warp took per instruction in a GPU run's launch of a kernel (a row of :func:`ncu_measured`): the
    launch's time x SM clock x SMs x resident warps an SM over the warp instructions it ran. Where the schedulers
    are far from busy (the first run's kernels: 9-18 cycles an instruction with 4 to 9 warps a scheduler), this
    is the latency of the kernel's dependent chains a warp waits out, which a count of instructions does not
    give (the clock: the run's, else the H100's; the H200's SMs are the H100's 132)."""
    clock = row["clock GHz"] if not math.isnan(row.get("clock GHz", math.nan)) else H100["clock_ghz"]
    return row["us"] * 1e-6 * clock * 1e9 * H100["sms"] * row["warps/SM"] / row["instr"]


def measured_launch(measured: dict | None, kernel: str, dtype: str, threads: int, shared: int,
                    default: bool = False) -> dict | None:  # fmt: skip
    """The GPU run's row (:func:`ncu_measured`) of ``kernel`` on ``dtype`` launched as estimated: of its layouts
    (``kernel`` and its variants ``kernel (... threads, ... B shared)``), the one of ``threads`` a block and
    ``shared`` bytes of dynamic shared memory; a run that did not read the shared memory has one layout a kernel.
    With ``default``, where the run has no such layout, the row of its layout of the most dynamic shared memory
    (``kernel``: a table codec's unpack with its table in shared memory), marked ``"layout": (block, smem)`` --
    for a kernel whose layout changed since the run."""
    rows = (measured or {}).get("rows", {})
    mine = [r for (name, d), r in rows.items() if d == dtype and (name == kernel or name.startswith(f"{kernel} ("))]
    for r in mine:
        if r.get("block") == threads and r.get("smem") == shared:
            return r
    ran = rows.get((kernel, dtype))
    if all(math.isnan(r.get("smem", math.nan)) for r in mine):
        return ran
    return ran | {"layout": (ran.get("block"), ran.get("smem"))} if default and ran is not None else None


def budget(codec: str, dtype: torch.dtype, entry_bytes: int, sim: dict, folder: Path,
           measured: dict | None = None) -> list[dict]:  # fmt: skip
    word = spec.word_bytes(dtype)
    kernels, source = build(codec, word, entry_bytes, folder)
    units = entry_bytes // 16 // 32  # 16-byte rounds of a warp over an entry
    k = sim["k"]
    rows = []
    for op in ("measure", "pack", "unpack", "count", "fit"):
        kern = kernels.get(f"buddy_{codec}_{op}")
        if kern is None:
            continue
        if op == "count":
            blocks, threads, shared = blaunch.launch_config(op, entry_bytes, 1 << 20, codec)
        elif op == "fit":
            blocks, threads, shared = blaunch.launch_config(op, entry_bytes, 1, codec)
        else:  # on an H100 (a table codec's unpack with its table in shared memory)
            blocks, threads, shared = blaunch.launch_config(op, entry_bytes, 1 << 20, codec, blaunch.HOPPER)
        trips = {"grid": 1.0, "one": 1.0, "rounds16": units, "serial_words": 0.0, "none": 0.0,
                 "units": units, "gather": math.ceil(2 * k / 32), "payload": math.ceil(2 * k / 32),
                 "unit_words": units * 16 // word, "bpc_chunks": sim["bpc_chunks"], "fpx_words": units,
                 "fpx_blocks": math.ceil(units / fpx_block(word)),
                 "bits_after": 0.0}  # fmt: skip
        if op == "unpack":  # a coded entry of the split layout: its gather (k sectors), zero fill, copy out
            trips |= {key: sim[key] for key in (*FIND_LOOPS, "passes", "rounds", "emit_steps", "emit_tails",
                                                 "emit_rest", "single")}  # fmt: skip
            moved = 32 * k + entry_bytes + spec.meta_bytes(entry_bytes)
        elif op == "pack":
            moved = entry_bytes + 32 * k + spec.meta_bytes(entry_bytes)
        elif op == "measure":
            moved = entry_bytes + spec.meta_bytes(entry_bytes)
        elif op == "count":
            trips["grid"] = entry_bytes / 16 / 32  # a warp takes 32 x 16 bytes an iteration
            moved = entry_bytes
        else:
            moved = 0
        skip = OTHER_MEMBERS if op in ("pack", "unpack") else frozenset()  # an entry of fpe's mode
        parts: dict = {}
        instr, unknown = per_entry(kern, source, trips, skip, parts) if op != "fit" else (float("nan"), [])
        warps = occupancy(kern.regs, kern.smem + shared // max(1, threads // 32) * max(1, threads // 32), threads)
        clock = H100["clock_ghz"] * 1e9
        row = {"kernel": f"{codec} {op}", "dtype": str(dtype).removeprefix("torch."), "regs": kern.regs,
               "smem/block": kern.smem + shared, "spills": kern.spills, "warps/SM": warps,
               "instr/entry": instr, "instr/byte": instr / entry_bytes, "bytes moved/entry": moved}  # fmt: skip
        if op != "fit":
            issue = H100["sms"] * H100["schedulers"] * clock / instr * entry_bytes / 1e9
            memory = H100["hbm_gbps"] * entry_bytes / moved
            bounds = {"issue": issue, "memory": memory}
            ran = measured_launch(measured, f"{codec} {op}", row["dtype"], threads, shared, default=True)
            if ran is not None:  # a warp's instructions at the cycles each took it in the GPU run
                row["cycles/instr"] = cpi = cycles_per_instruction(ran)
                row["issue % measured"] = ran.get("issue %")
                if "layout" in ran:  # (the run's layout of the most shared memory, not this one's)
                    row["measured layout"] = ran["layout"]
                bounds["latency"] = H100["sms"] * clock * warps / (instr * cpi) * entry_bytes / 1e9
            bound = min(bounds, key=bounds.__getitem__)
            row |= {f"{b} GB/s": v for b, v in bounds.items()} | {"estimate GB/s": bounds[bound], "bound": bound}
        row["loops counted once"] = unknown
        row["parts"] = parts
        rows.append(row)
    return rows


#: cycles an instruction of the fit takes: one warp alone on its SM waits out every latency (a dependent
#: add ~5, a load from its scratch in global memory ~35 from L1, more from L2)
FIT_CPI = 12

#: the fit's loops: iterations a warp runs them, for S = 4096 symbols all present and 257 leaves (a number, or a
#: key of the lane simulation's results and a factor: the radix select's passes on the captures' counts)
FIT_ITERATIONS: list[tuple] = [
    (r"i < S \+ 2u; i \+= BUDDY_WARP_SIZE", 129), (r"i < S \+ 1u; i \+= BUDDY_WARP_SIZE", 129),
    (r"i = warp.lane\(\); i < S; i \+= BUDDY_WARP_SIZE", "select_passes", 128), (r"int shift = 40", "select_passes", 1),
    (r"j < few", "select_few", 1),
    (r"base < S; base \+= BUDDY_WARP_SIZE", 128),
    (r"for \(uint32_t j = 0; j < n; \+\+j\)", 257), (r"k < BUDDY_FIT_PER_LANE", 9),
    (r"m \+ 1 < n", 256), (r"x-- > 0", 512), (r"i < n; \+\+i\) wk->len", 257),
    (r"v < BUDDY_FPE_ROWS; v \+= BUDDY_WARP_SIZE\) table->dec", 128), (r"i < BUDDY_FPE_SYMBOLS", 129),
    (r"i < BUDDY_FPE_SERIAL_BYTES", 25),
    (r"bit < len", 72), (r"v = stream; v < BUDDY_FPE_ROWS", 128), (r"base < n; base \+= BUDDY_WARP_SIZE", 9),
    (r"while \(pos < BUDDY_FPE_CODE_BITS\)", 512), (r"v = lane; v < BUDDY_FPE_ROWS; v \+= BUDDY_WARP_SIZE\) \{", 128),
]  # fmt: skip


def fit_time_us(codec: str, word: int, entry_bytes: int, folder: Path, sim: dict) -> tuple[int, float, float]:
    """The fit kernel (one warp): its SASS instructions, the instructions it runs and the time they take.

    Each loop's iterations (:data:`FIT_ITERATIONS`; the radix select's from ``sim``, :func:`select_passes`)
    times its instructions per iteration, the rest once, at
    :data:`FIT_CPI` cycles an instruction: a rough figure, its order of magnitude is what the compress totals
    need. Of the copies the compiler made of a loop (an unrolled body and its remainder) the largest per
    source iteration is charged for all of them (:func:`charged_copies`; a pass of an unrolled copy loads each
    line's values that many times: :func:`unrolled`).
    """
    kernels, source = build(codec, word, entry_bytes, folder)
    kern = kernels[f"buddy_{codec}_fit"]
    found = loops(kern, source)

    def inside(a: int, b: int) -> list:
        return [(a1, b1) for a1, b1, _, _ in found if a < a1 and b1 < b]

    lines = {line for _, _, line, _ in found}
    groups = [[(a, b) for a, b, other, _ in found if other == line] for line in lines]
    weight = charged_copies(kern, groups, lambda a, b: unrolled(kern, source, a, b, inside=inside(a, b)))
    for a, b, line, _ in found:  # times the loop's iterations
        weight[a, b] *= next((_iterations(list(n), sim) for pattern, *n in FIT_ITERATIONS
                              if re.search(str(pattern), source[line - 1])), 1)  # fmt: skip

    total = 0.0
    for addr, _, _ in kern.instrs:
        inner = [(b - a, a, b) for a, b, _, _ in found if a <= addr <= b]
        total += weight[min(inner)[1:]] if inner else 1
    return len(kern.instrs), total, total * FIT_CPI / (H100["clock_ghz"] * 1e3)


def _iterations(n: list, sim: dict) -> float:
    """A :data:`FIT_ITERATIONS` entry's iterations: a number, or a key of ``sim`` times a number."""
    return n[0] if len(n) == 1 else sim[n[0]] * n[1]


def _fmt(v) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:,.0f}" if v >= 100 else f"{v:.2f}"
    return str(v)


def render(rows, sims, totals, fit, args, machine: str, measured: dict | None = None,
           weighed: list[str] | None = None) -> str:
    cols = ["kernel", "dtype", "regs", "smem/block", "spills", "warps/SM", "instr/entry", "instr/byte",
            "bytes moved/entry", "issue GB/s", "memory GB/s", "cycles/instr", "latency GB/s", "estimate GB/s",
            "bound"]  # fmt: skip
    method = (
        f"What each kernel of `{_codec(rows)}` costs an H100, estimated without a GPU from its SASS (the method is in "
        "the docstring of `experiments/lab/kernel_budget.py`, which writes this page): registers, shared memory and "
        "occupancy from ptxas; instructions per entry, each loop charged its trip count on real data (the lane "
        "simulation of `experiments/lab/fpe_lanes.py`; both sides of a branch count, so an upper bound); and the GB/s "
        f"of input as the least of three bounds: **issue** ({H100['schedulers']} warp instructions a cycle an SM), "
        f"**memory** (HBM's {H100['hbm_gbps'] / 1000:.2f} TB/s) and **latency** (every resident warp issuing at the "
        "cycles an instruction it took in the GPU run below, at the warps allowed here)."
        + ("" if measured is not None else " No GPU run was given (`--ncu`): no latency bound.")
    )  # fmt: skip
    produced = (
        f"Produced by `python -m experiments.lab.kernel_budget {_shown_command(args, measured)}`"
        f"{_session_note(measured)} on {machine} for sm_90; H100: {H100['sms']} SMs x {H100['schedulers']} "
        f"schedulers at {H100['clock_ghz']} GHz."
    )  # fmt: skip
    out = [
        "# Kernel budget: the default codec at 4 KiB entries on an H100 (estimated)",
        "",
        *_wrap(method, 120),
        *_wrap(produced, 120),
        "",
        "| " + " | ".join(cols) + " |",
        "| " + " | ".join("---" for _ in cols) + " |",
    ]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    out += _other_layouts(rows)
    out += ["", "Trip counts of the split layout's decoder (mean per entry, the lane simulation on the capture "
            "workloads' coded entries; a warp's steps, the most any lane takes; find steps include the warm-up "
            "and resync steps):", "", "| dtype | entries | k (sectors) | passes | resync rounds | find steps | "
            "warm-up steps | resync steps | emit steps | emit tails | of them after a step's first code | one-code "
            "steps |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, s in sims.items():
        out.append(f"| {name} | {s['entries']} | {s['k']:.1f} | {s['passes']:.2f} | {s['rounds']:.2f} | "
                   f"{s['find']:.1f} | {s['warm']:.1f} | {s['resync']:.1f} | {s['emit_steps']:.1f} | "
                   f"{s['emit_tails']:.1f} | {s['emit_rest']:.1f} | {s['single']:.1%} |")  # fmt: skip
    out += ["", "auto2's measure and bpc (`bpc_stops`, entries drawn from the same captures; bpc is sized where zvc "
            "and then fpx leave an entry above one sector, and stops once the planes sure to be raw make it no "
            "smaller than the size so far):", "", "| dtype | entries | bpc sized | its 32-delta chunks stepped, of |",
            "| --- | --- | --- | --- |"]  # fmt: skip
    for name, s in sims.items():
        out.append(f"| {name} | {s['bpc_entries']} | {s['bpc_sized']:.0%} | {s['bpc_chunks']:.2f} of {s['bpc_of']} |")
    out += ["", "Where each kernel's instructions go (per entry, by the innermost loop they are in: its key in "
            "`TRIPS`; `body`: in no loop but the one over entries; the SASS instructions counted for it, and the "
            "instructions per entry over them: about the iterations a warp runs it):", "",
            "| kernel | dtype | part | SASS | instr/entry / SASS | instr/entry | share |",
            "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        parts = {k: v for k, v in r.get("parts", {}).items() if not isinstance(k, tuple) and v >= 0.5}
        for key, n in sorted(parts.items(), key=lambda kv: -kv[1])[:6]:
            sass = r["parts"][(key, "sass")]
            out.append(f"| {r['kernel']} | {r['dtype']} | {key} | {sass} | {n / max(1, sass):.1f} | {n:,.0f} | "
                       f"{n / r['instr/entry']:.0%} |")
    out += ["", "The fit kernel (one warp, once per compress with nothing learned, or whose learned statistics the "
            f"kept table no longer codes well): {fit[0]:,} SASS instructions, "
            f"about {fit[1]:,.0f} run for 257 leaves of 4,096 symbols, at {FIT_CPI} cycles each about {fit[2]:.0f} us "
            "(a rough figure: `fit_time_us`; bfloat16's tensors). Its radix select passes over every symbol for "
            + ", ".join(f"{v['select_passes']:.1f} of 11 digits ({k}, {v['select_of']} tensors with more than 255 "
                        f"symbols), then ranks the {v['select_few']:.0f} keys left" for k, v in sims.items())
            + " (`select_passes`: the captures' counts, scaled as the fit scales them).", ""]
    every, warmup = COUNT_EVERY, COUNT_WARMUP
    out += ["## Totals, against the targets", "",
            "Totals for a 256 MiB tensor (kernel times from the estimates above, plus "
            f"{LAUNCH_US:.0f} us a launch and {READBACK_US:.0f} us for a compress's one read back). With a learned "
            f"table the tracker counts a key's symbols at each of its first {warmup} steps, then at one step in "
            f"{every} (`buddy.Tracker(count_every={every}, count_warmup={warmup})`): a step that counts runs count, "
            "measure and pack, the others measure and pack; the steady state is their mean over "
            f"{every} steps:", "",
            "| dtype | decompress GB/s | compress GB/s, learned table: steady state | a step that counts | "
            "a step that does not | compress GB/s, nothing learned |",
            "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, t in totals.items():
        out.append(f"| {name} | {t['decompress']:,.0f} | {t['steady']:,.0f} | {t['learned']:,.0f} | "
                   f"{t['uncounted']:,.0f} | {t['cold']:,.0f} |")  # fmt: skip
    worst = {key: min(t[key] for t in totals.values()) for key in ("decompress", "steady", "learned", "cold")}
    out += ["", f"**Against the targets** (decompress >= 800 GB/s, compress >= 500 GB/s on an H100): the estimate "
            f"gives decompress {worst['decompress']:,.0f} GB/s at worst, compress {worst['steady']:,.0f} GB/s with "
            f"a learned table in the steady state ({worst['learned']:,.0f} on a step that counts) and "
            f"{worst['cold']:,.0f} GB/s with nothing learned -- "
            + ("the targets are met." if worst["decompress"] >= 800 and worst["steady"] >= 500 else
               _met(totals) + " Why, and what is left: the sections below.")]  # fmt: skip
    needs = _unpack_needs(rows)
    out += ["", needs] if needs else []
    unknown = sorted({u for r in rows for u in r["loops counted once"]})
    if unknown:
        out += ["", "Loops counted once per entry (no trip count named for them; compile-time short or not run on "
                "coded fpe entries):", ""] + [f"* {u}" for u in unknown] + [""]  # fmt: skip
    else:
        out += ["", "Every loop the kernels run on a coded fpe entry has its trip count (`TRIPS`).", ""]
    out += [*EXPLAINED.splitlines(), ""]
    out += weighed or []
    if measured is None:
        out += ["## Measured on a GPU", "", *_wrap(NCU + " No run given here (`--ncu FOLDER`: a GPU session's folder "
                                                   "under `experiments/results/gpu/`).", 117)]  # fmt: skip
    return "\n".join(out) + "\n"


def _wrap(text: str, width: int) -> list[str]:
    """``text`` as the page's lines of at most ``width`` characters (a long code span stays whole)."""
    return textwrap.wrap(text, width=width, break_on_hyphens=False, break_long_words=False)


def _codec(rows: list[dict]) -> str:
    """The codec the rows are of (their kernels' first word)."""
    return rows[0]["kernel"].split()[0] if rows else "?"


def _shown_command(args: list[str], measured: dict | None) -> str:
    """The command's arguments as the page shows them: without ``--out`` (the page is where it went), and the GPU
    session's folder as ``<session>`` (:func:`_session_note` names it)."""
    shown, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == "--out" or a.startswith("--out="):
            skip = a == "--out"
            continue
        if measured is not None and i and args[i - 1] == "--ncu":
            a = "<session>"
        elif measured is not None and a.startswith("--ncu="):
            a = "--ncu=<session>"
        shown.append(a)
    return " ".join(shown)


def _session_note(measured: dict | None) -> str:
    """Which GPU session ``<session>`` is: its device and commit (its folder under experiments/results/gpu/)."""
    if measured is None:
        return ""
    device = str(measured.get("device") or "GPU").removeprefix("NVIDIA ")
    return (f" (`<session>`: the {device} session of commit {str(measured['commit'])[:10]} under "
            "`experiments/results/gpu/`)")  # fmt: skip


def _unpack_needs(rows: list[dict], target: float = 800.0) -> str:
    """What unpack's instructions must come to for ``target`` GB/s, at every issue slot busy and at the share of
    them the GPU run kept busy, beside what they are (the dtypes whose unpack's estimate is short of it)."""
    short = [r for r in rows if r["kernel"].endswith(" unpack") and r.get("estimate GB/s", target) < target]
    if not short:
        return ""
    full = short[0]["issue GB/s"] * short[0]["instr/entry"] / target  # (the issue bound is a constant / instr)
    have = "; ".join(f"{r['dtype']}'s takes {r['instr/entry']:,.0f}, an issue bound of {r['issue GB/s']:,.0f} GB/s"
                     for r in short)  # fmt: skip
    busy = [r["issue % measured"] for r in short if r.get("issue % measured")]
    def span(low: str, high: str) -> str:  # "low-high", or one figure where they read alike
        return low if low == high else f"{low}-{high}"

    run = (f", and {span(f'{full * min(busy) / 100:,.0f}', f'{full * max(busy) / 100:,.0f}')} at the "
           f"{span(f'{min(busy):.0f}', f'{max(busy):.0f}')} % of issue slots the GPU run kept busy in unpack"
           if busy else "")  # fmt: skip
    return (f"**Decompress needs fewer instructions, not only less waiting**: for {target:,.0f} GB/s an unpack may "
            f"take at most {full:,.0f} instructions an entry with every issue slot of an H100 busy ({have}){run}.")


def _met(totals: dict) -> str:
    """Which targets the estimate meets, per dtype (the steady state's compress; decompress)."""
    parts = []
    for what, key, target in (("compress", "steady", 500), ("decompress", "decompress", 800)):
        met = [name for name, t in totals.items() if t[key] >= target]
        short = [name for name, t in totals.items() if t[key] < target]
        parts.append(f"{what}: met for {' and '.join(met)}" + (f", short for {' and '.join(short)}" if short else "")
                     if met else f"{what}: short for every dtype")
    return "; ".join(parts) + "."


EXPLAINED = """## What bounds the kernels

* **Latency, in every kernel.** By the instructions counted alone every kernel but count would be issue-bound
  (memory would allow 1.9-3.3 TB/s of input). On the GPU every kernel waits on latency instead: a warp takes 8-21
  cycles an instruction (count 67-92) with 4 to 7 warps a scheduler, so that bound binds every kernel. Fewer
  instructions pay in proportion only while the cycles an instruction hold; more warps in flight, more independent
  work a warp and shorter dependent chains are the other levers, and only a GPU measures them.
* **Where a warp's cycles go.** Unpack's decoder reads a table row a code, at random, and from global memory half
  of those reads miss L1 beside 24 warps' staging, so unpack copies the table's decode rows (32 of its 40 KiB) into
  each block's shared memory ([gpu.md](gpu.md#the-gpu-engine)); with `Tuning(shared_tables=False)` (the "128
  threads" rows below) it is 1.7x (float32) and 2.1x (bfloat16) slower. Shared memory (the rows, then 4 KiB of
  payload and 4 KiB of output a warp) holds unpack at 24 warps an SM; its 64 registers would allow 32. Count's warps
  wait on shared memory for most of their cycles (the match and atomic adds, most on a few bins).
* **Pack's table of whole fields** (`Tuning(pack_fields=True)`; 16 KiB in shared memory: per symbol its code, escape
  included, its bits and whether a tail follows) takes a quarter to a third fewer instructions by this count, but runs
  slower: on the H200 148 / 161 us at 64 MiB (float32 / bfloat16; the "auto2 pack" rows below, that run's default)
  against 110 / 126 us reading the table in global memory (the "256 threads" rows), with 72 registers, fewer warps an
  SM and fewer L1 hits. So pack reads the table in global memory by default, and the count charges that.
* **Count's two forms.** For 2-byte words a warp counts its zero words by ballots, which made the bfloat16 compress
  1.3-1.4x faster on the H200; other words take the match (`Tuning.count_matches`; `Tuning(count_match=True)` or
  `False` for every word size). The count above charges the match.
* **Warps the run did not have.** Pack's and measure's estimates take the cycles an instruction of the run (pack
  17-22 warps an SM, measure 29) at the warps they allow now (pack 40 for float32 and 32 for bfloat16, measure 40);
  whether those cycles hold with more warps beside them only a GPU tells.

## What the kernels spend their instructions on

**Unpack** steps over every code twice, by the find walk and then by the emit walk that writes it, after a warm-up
([format-v3.md](format-v3.md#how-a-warp-decodes-it)): each step a 32-bit read of the payload, one or two table
lookups and the lanes' bookkeeping. **Measure** sizes every entry with all four members of auto2 (bpc stopping once
it cannot win, `measure_below`; fpx in two passes of 16-byte loads, zvc's size from fpx's first). **Pack** spends
about half its instructions on fpe's fields (a word's code from the table and the selects around it), the rest on
ORing codes and tails into the payload. With **nothing learned**, the fit, one warp's serial work (ranking 257
leaves, a radix select, two Huffman builds), takes about as long as the rest of a 256 MiB compress.

## Open questions for a GPU run

How unpack's speed grows with its warps an SM (the bench's `--unpack-warps`: 8, 16 and 24; `Tuning.unpack_warps`)
says whether a layout of 32 warps an SM pays; `--pack-fields` and `--other-count` time pack's and count's other
forms. Beyond them: two entries a warp, their walks interleaved; one walk instead of two, each code's symbol kept in
shared memory at a cost in warps; a histogram a warp for count; a fit of more warps."""

#: what the runbook's ncu phase measures (the section "Measured on a GPU" starts with it)
NCU = (
    "The GPU runbook's `ncu` phase runs `experiments.bench_cuda` on the default codec under Nsight Compute (the "
    "metrics of `experiments.lab.gpu_session.NCU_METRICS`, a row per kernel launch): instructions per entry "
    "(`smsp__inst_executed.sum`), bytes moved (`dram__bytes.sum`), occupancy (`sm__warps_active`), time, and the "
    "cycles an instruction took a warp (`smsp__average_warps_active_per_issue_active`) with the part spent waiting "
    "on L1TEX (`long_scoreboard`: global loads, the table's rows) and on shared memory (`short_scoreboard`)."
)


# ---- the estimate checked: an ncu run of the GPU runbook ----------------------------------------------
def _other_layouts(rows: list[dict]) -> list[str]:
    """A note on the kernels whose cycles an instruction come from a layout of the GPU run other than theirs."""
    seen: dict[str, list[dict]] = {}
    for r in rows:
        if "measured layout" in r:
            seen.setdefault(r["kernel"], []).append(r)
    out = []
    for kernel, mine in seen.items():
        block, smem = mine[0]["measured layout"]
        out += ["", f"{kernel} ({', '.join(r['dtype'] for r in mine)}): its `cycles/instr` are those the GPU run "
                f"measured in its layout of {block:.0f} threads and {smem:,.0f} B of dynamic shared memory a block "
                f"(the layout of that run's code); here it runs {mine[0]['warps/SM']} warps an SM in blocks of "
                f"{mine[0]['smem/block']:,} B, and the latency bound assumes a warp's cycles an instruction hold "
                "there -- a run of this code measures them."]  # fmt: skip
    return out


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else math.nan


#: Nsight Compute's units of bytes, in bytes (its other units are read as they are)
_UNITS = {"kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9}


def ncu_measured(folder: Path) -> dict:
    """Per (kernel, dtype): the medians of the ``ncu`` step's launches (``ncu.csv``, and ``ncu.json`` or
    ``essentials.json``, in ``folder``).

    The bench under ncu runs its tensors one after the other, each with the same calls: a kernel's launches are
    split among the tensors in that order, evenly (a count that does not split evenly is an error). Input bytes
    per launch are the tensor's; entries per launch its bytes over the entry size.
    """
    import csv
    import json

    # the ncu phase's record, or the essentials phase's (whose ncu step is the same)
    record = next(r for r in (json.loads(p.read_text()) for p in (folder / "ncu.json", folder / "essentials.json")
                              if p.exists()) if any(s["name"] == "ncu" for s in r["steps"]))  # fmt: skip
    bench = next(s for s in record["steps"] if s["name"] == "ncu")["result"]
    # each tensor once (the bench may time a codec more ways than one on it: --global-table)
    tensors = list({r["tensor"]: r for r in bench["rows"] if r["method"].startswith("buddy:")}.values())
    lines = [ln for ln in (folder / "ncu.csv").read_text().splitlines() if not ln.startswith("==")]
    launches: dict[str, dict[str, dict[str, float]]] = {}
    order: dict[str, list[str]] = {}
    for row in csv.DictReader(lines):
        name, launch = row["Kernel Name"], row["ID"]
        if launch not in launches.setdefault(name, {}):
            launches[name][launch] = {"block": _number(row["Block Size"].strip("()").split(",")[0])}
            order.setdefault(name, []).append(launch)
        value = _number(row["Metric Value"]) * _UNITS.get(row.get("Metric Unit", "").strip().lower(), 1.0)
        launches[name][launch][row["Metric Name"]] = value
    # a kernel launched in more layouts than one (the bench's --global-table: the table codecs' pack and unpack also
    # with the table in global memory): each layout -- its dynamic shared memory (where the run read it) and its
    # block's threads -- its own kernel, the largest under the kernel's name, the others named by it
    def layout(x: str, name: str) -> tuple[float, float]:
        smem = launches[name][x].get("launch__shared_mem_per_block_dynamic", math.nan)
        return (-1.0 if math.isnan(smem) else smem), launches[name][x]["block"]

    for name in list(order):
        kinds = sorted({layout(x, name) for x in order[name]}, reverse=True)
        for smem, block in kinds[1:]:
            variant = f"{name} ({block:.0f} threads" + ("" if smem < 0 else f", {smem:,.0f} B shared") + ")"
            ids = [x for x in order[name] if layout(x, name) == (smem, block)]
            launches[variant] = {x: launches[name][x] for x in ids}
            order[variant] = ids
            order[name] = [x for x in order[name] if x not in launches[variant]]
    out: dict = {}
    for name, ids in order.items():
        if len(ids) % len(tensors):
            raise ValueError(f"{name}: {len(ids)} launches do not split among {len(tensors)} tensors")
        per = len(ids) // len(tensors)
        for i, tensor in enumerate(tensors):
            mine = [launches[name][x] for x in ids[i * per : (i + 1) * per]]

            def median(metric: str, mine: list = mine) -> float:
                return statistics.median(m.get(metric, math.nan) for m in mine)

            entries = tensor["bytes"] / tensor["entry_bytes"]
            seconds = median("gpu__time_duration.sum") * 1e-9
            out[name.removeprefix("buddy_").replace("_", " "), tensor["dtype"]] = {
                "launches": len(mine),
                "us": seconds * 1e6,
                "GB/s": tensor["bytes"] / seconds / 1e9,
                "instr/entry": median("smsp__inst_executed.sum") / entries,
                "bytes/entry": median("dram__bytes.sum") / entries,
                "dram %": median("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                "warps/SM": median("sm__warps_active.avg.pct_of_peak_sustained_active") / 100 * H100["max_warps"],
                "regs": median("launch__registers_per_thread"),
                "grid": median("launch__grid_size"),
                "instr": median("smsp__inst_executed.sum"),
                "issue %": median("smsp__issue_active.avg.pct_of_peak_sustained_active"),
                "clock GHz": median("sm__cycles_elapsed.avg.per_second") / 1e9,
                "cycles/issue": median("smsp__average_warps_active_per_issue_active.ratio"),
                "long sb": median("smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"),
                "short sb": median("smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio"),
                "L1 hit %": median("l1tex__t_sector_hit_rate.pct"),
                "block": median("block"),
                "smem": median("launch__shared_mem_per_block_dynamic"),
            }
    return {"device": record.get("device"), "commit": record.get("commit"), "command": record.get("command"),
            "mib": bench["args"]["mib"], "rows": out}  # fmt: skip


def render_measured(measured: dict, rows: list[dict], where: str) -> list[str]:
    """The ncu run beside the estimate, kernel by kernel."""
    est = {(r["kernel"], r["dtype"]): r for r in rows}
    run = (f"{NCU} Below: an {measured['device']} (`{measured['command']}`, commit {str(measured['commit'])[:10]}; "
           f"{measured['mib']} MiB of each activation, one compress and decompress timed, median of a kernel's "
           "launches). The estimate is for an H100 (HBM 3.35 TB/s; the H200's is 4.8 TB/s, the SMs and clocks the "
           "same): the kernels are not memory bound, so the two compare. The instructions counted are 0.7-1.2 times "
           "those run.")  # fmt: skip
    out = ["## Measured on a GPU", "", *_wrap(run, 117), "",
           "| kernel | dtype | us a launch | GB/s measured | GB/s estimated | instr/entry measured | instr/entry "
           "estimated | warps/SM measured | warps/SM allowed | regs | DRAM % of peak | issue slots busy % | cycles "
           "a warp per instruction (of them: waiting on L1TEX, on shared memory) | L1 hit % |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for (kernel, dtype), m in sorted(measured["rows"].items(), key=lambda kv: (kv[0][1], kv[0][0])):
        e = est.get((kernel, dtype), {})
        once = kernel.endswith(" fit")  # one warp, once a compress: a time, not a rate
        gbps = "(once)" if once else f"{m['GB/s']:,.0f}"
        instr = f"{m['instr']:,.0f} a launch" if once else f"{m['instr/entry']:,.0f}"
        issue = "" if math.isnan(m["issue %"]) else f"{m['issue %']:.0f}"
        cpi = f"{cycles_per_instruction(m):.1f} (from the time)"
        if not math.isnan(m.get("cycles/issue", math.nan)):
            cpi = f"{m['cycles/issue']:.1f} ({m['long sb']:.1f}, {m['short sb']:.1f})"
        hit = "" if math.isnan(m.get("L1 hit %", math.nan)) else f"{m['L1 hit %']:.0f}"
        out.append(f"| {kernel} | {dtype} | {m['us']:,.0f} | {gbps} | {_fmt(e.get('estimate GB/s', ''))} | {instr} | "
                   f"{_fmt(e.get('instr/entry', ''))} | {m['warps/SM']:.1f} | {_fmt(e.get('warps/SM', ''))} | "
                   f"{m['regs']:.0f} | {m['dram %']:.1f} | {issue} | {'' if once else cpi} | {hit} |")  # fmt: skip
    return out + [""]


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", default="auto2", choices=sorted(bsources.TABLED_KERNELS))
    p.add_argument("--entry-bytes", type=int, default=spec.DEFAULT_ENTRY_BYTES)
    p.add_argument("--sample", type=int, default=200, help="coded entries simulated per dtype")
    cli.add_cache_argument(p, help="captures kept here between runs (as decide's)")
    p.add_argument("--out", default="docs/kernel_budget.md", help="the markdown file ('-': print only)")
    p.add_argument("--ncu", type=Path, default=None,
                   help="a folder with the runbook's ncu.csv and ncu.json: the measured figures beside the estimate")
    p.add_argument("--ncu-only", action="store_true", help="print the measured table of --ncu alone (no nvcc)")
    args = p.parse_args(argv)
    measured = ncu_measured(args.ncu) if args.ncu else None
    if args.ncu_only:
        if measured is None:
            p.error("--ncu-only needs --ncu FOLDER")
        text = "\n".join(render_measured(measured, [], str(args.ncu)))
        print(text)
        return text
    from buddy import env

    e = env.environment()
    machine = f"{e.get('cpu')} ({e.get('cpu_count')} cores), torch {e.get('torch')}, {_nvcc_version()}"
    rows, sims, totals, weighed = [], {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for dtype in (torch.float32, torch.bfloat16):
            sim = lane_trips(dtype, args.entry_bytes, args.sample, args.cache)
            name = str(dtype).removeprefix("torch.")
            sims[name] = sim
            mine = budget(args.codec, dtype, args.entry_bytes, sim, folder, measured)
            rows += mine
            weighed[name] = lockstep_counts(spec.word_bytes(dtype), args.entry_bytes, folder, sim)
            by = {r["kernel"].split()[-1]: r for r in mine}
            fit = fit_time_us(args.codec, spec.word_bytes(dtype), args.entry_bytes, folder, sim)
            n = TENSOR_BYTES

            def seconds(op: str) -> float:
                return n / (by[op]["estimate GB/s"] * 1e9) + LAUNCH_US * 1e-6

            every = COUNT_EVERY
            learned = seconds("measure") + seconds("pack") + READBACK_US * 1e-6  # a step the tracker does not count
            totals[name] = {
                "decompress": n / seconds("unpack") / 1e9,
                # a step that counts the tensor's symbols (the statistics the tracker learns from): the warm-up's,
                # then one in count_every
                "learned": n / (seconds("count") + learned) / 1e9,
                "uncounted": n / learned / 1e9,
                "steady": n / (learned + seconds("count") / every) / 1e9,
                "cold": n / (seconds("count") + fit[2] * 1e-6 + LAUNCH_US * 1e-6 + seconds("measure") + seconds("pack")
                             + READBACK_US * 1e-6) / 1e9,
            }  # fmt: skip
    text = render(rows, sims, totals, fit, argv, machine, measured, render_lockstep(weighed, rows))
    if measured is not None:
        text += "\n".join(render_measured(measured, rows, str(args.ncu)))
    if args.out == "-":
        print(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(text)
        print(f"wrote {args.out}")
    return text


def _nvcc_version() -> str:
    out = subprocess.run([_tool("nvcc"), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+)", out)
    return f"nvcc {m.group(1)}" if m else "nvcc"


if __name__ == "__main__":
    main()
