"""The kernels of csrc/buddy_kernels.cu under the block emulator, byte for byte against the torch reference.

The sources are compiled unchanged for the host and run with every thread of
a block a fiber, in seeded random orders, several schedules per launch
(``tests/emulator.py``, ``tests/host/emulator``), under two builds: ``tsan``
(a race in shared or global memory is reported with both source lines) and
``asan`` (AddressSanitizer and UBSan: misaligned loads, a byte read or written
past any buffer, undefined behaviour). Every launch goes through the engine's own
glue: a :func:`buddy.engines.cuda.CudaEngine` whose launches run in the emulator
is registered as the ``"cuda"`` backend of CPU tensors, so ``backend="cuda"``
runs the whole engine path -- the entries and the zero-padded tail, the
overflow prefix sum, the fit's readout, the error flag -- with the grid,
block and shared memory of :func:`buddy.engines.launch.launch_config`, and in some
cases fewer blocks than the entries need, so the warps' grid-stride loops
loop.

* every kernel of every codec (count and fit for fpe and auto2, measure,
  pack, unpack) on real activations captured from the experiment workloads
  (float32, bfloat16, float64 and int64 activations, uint8 text bytes) at
  E = 512 and 4096: the reference's histogram, metadata, table, symbol
  counts, slots and overflow exactly; the reference's buffers decoded by
  the kernels and the kernels' by the reference; a partial last entry and
  tensors of one entry;
* the golden vectors of every format version and table format: the kernels
  write their bytes (sets still written) and decode all of them;
* damaged buffers: the kernels flag an error where the reference raises,
  and only there;
* the emulator bites: a copy of the sources with one barrier removed (or a
  load misaligned, a loop run one step too far, a fill skipped) is reported
  -- see ``MUTATIONS``; the unmodified sources run the same launches clean.

Run alone with ``pytest -m emulator``; the builds are cached by source hash
(docs/emulator.md).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import emulator
import pytest
import torch
from conftest import assert_bitexact
from emulator import BUILDS, CSRC, Emulator, EmulatorError
from kernel_cases import (
    CASES,
    Case,
    _same_buffers,
    check_damage_flagged,
    check_golden,
    check_reference_buffers,
    check_tensors_of_one_entry,
    straddling_entries,
)
from test_device_codecs import tensor_ends
from test_golden import CASES as GOLDEN_CASES
from test_golden import SETS as GOLDEN_SETS
from test_golden import load_vectors

import buddy
from buddy.engines import cuda as bcuda
from buddy.codecs import fpe_device
from buddy.engines import kernels as bkernels
from buddy.engines import launch as blaunch
from buddy.engines import sources as bsources
from buddy.engines.tuning import Tuning, tuned
from buddy import spec
from buddy.layout import Layout

pytestmark = [
    pytest.mark.emulator,
    pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++"),
]

CODECS = tuple(bsources.KERNEL_CODECS)
TABLED = bsources.TABLED_KERNELS


def _seed(request) -> int:
    """A seed of its own for each test, the same on every run."""
    return zlib.crc32(request.node.nodeid.encode())


#: the emulators of the unmodified sources, one per build: their processes serve every test of the module
_EMULATORS: dict[str, Emulator] = {}


#: the mutated copies of the sources (test_the_emulator_reports_a_broken_kernel), by mutation id
_TREES: dict[str, Path] = {}


def _params(item) -> dict:
    return item.callspec.params if hasattr(item, "callspec") else {}


#: word sizes of the activations (``activations`` below)
_WORD_BYTES = {"f32": 4, "f64": 8, "i64": 8, "bf16": 2, "u8": 1}


def _builds_of(item) -> set[tuple]:
    """``(build, entry size, codecs, sources, word size)`` of the emulator builds a collected test of this module
    runs (a module per word size, as the loader builds them)."""
    params = _params(item)
    if "mutation" in params:
        m = params["mutation"]
        return {(m.build, 512, "all", CSRC, 4), (m.build, 512, m.codec, _TREES[m.id], 4)}
    if "build" not in params:
        return set()
    if "cases" in params:  # golden vectors
        case = params["cases"][0]
        return {(params["build"], case["entry_bytes"], "all", CSRC, getattr(torch, case["dtype"]).itemsize)}
    if "case" in params:
        case = params["case"]
        return {(params["build"], case.entry_bytes, "all", CSRC, _WORD_BYTES[case.data])}
    if "dtype" in params:
        return {(params["build"], 512, "all", CSRC, params["dtype"].itemsize)}
    return {(params["build"], 512, "all", CSRC, w) for w in (4, 8)}  # float32 and int64 entries


@pytest.fixture(scope="module", autouse=True)
def _builds(request, tmp_path_factory):
    """Every build the selected tests of the module run, compiled up front on every core (each is cached by
    source hash: a later session compiles none); the emulator processes are ended after the module."""
    items = [item for item in request.session.items if item.module is request.module]
    mutated = {_params(item)["mutation"] for item in items if "mutation" in _params(item)}
    root = tmp_path_factory.mktemp("mutations")
    for i, mutation in enumerate(sorted(mutated, key=lambda m: m.id)):
        _TREES[mutation.id] = mutation.apply(root / str(i))
    wanted = set().union(*(_builds_of(item) for item in items))
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        builds = sorted(wanted, key=str)
        list(pool.map(lambda b: emulator.build(b[0], b[1], codec=b[2], csrc=b[3], word_bytes=b[4]), builds))
    yield
    for emu in _EMULATORS.values():
        emu.close()
    _EMULATORS.clear()


@contextlib.contextmanager
def emulated_cuda(build: str, *, seed: int, schedules: int = 2, max_blocks: int | None = None, csrc: Path = CSRC,
                  codecs: str = "all"):  # fmt: skip
    """``backend="cuda"`` on CPU tensors: the kernels' engine, every launch run by an :class:`Emulator` (of the
    unmodified sources: the module's, set to this seed; of a mutated copy: one of its own)."""
    if csrc == CSRC and codecs == "all":
        emu = _EMULATORS[build] if build in _EMULATORS else _EMULATORS.setdefault(build, Emulator(build))
        emu.seed, emu.schedules, emu.max_blocks = seed, schedules, max_blocks
        emu.launches.clear()
        own = contextlib.nullcontext(emu)
    else:
        own = Emulator(build, seed=seed, schedules=schedules, max_blocks=max_blocks, csrc=csrc, codecs=codecs)
    with own as emu:
        engine = functools.partial(bcuda.CudaEngine, launch=emu, device_type="cpu")
        for name in CODECS:
            buddy.dispatch.register(name, "cpu", "cuda", engine)
        try:
            yield emu
        finally:
            for name in CODECS:
                buddy.dispatch.unregister(name, "cpu", "cuda")


def ops_of(emu: Emulator) -> list[str]:
    return [kernel.rsplit("_", 1)[1] for kernel, *_ in emu.launches]


@pytest.mark.parametrize("build", BUILDS)
def test_the_ends_kernel_is_the_formats_prefix_sum(build, request):
    """The ends kernel's one block under the emulator: runs of entries a thread, put together by its first, on
    counts of entries around its threads' (every output byte written, the same on every schedule)."""
    gen = torch.Generator().manual_seed(_seed(request))
    with emulated_cuda(build, seed=_seed(request)) as emu:
        kernels = bkernels.Kernels("zvc", launch=emu, device_type="cpu")
        for n in (1, 255, 257, 1000):
            layout = Layout(512, n * 512, 4)
            meta = torch.randint(0, 256, (layout.meta_bytes,), dtype=torch.uint8, generator=gen)
            for slot in (0, 5, 16):
                ends = torch.empty(n, dtype=torch.int64)
                kernels.ends(layout, meta, slot, ends)
                assert torch.equal(ends, tensor_ends(meta, slot, 512)), (n, slot)
    assert {kernel for kernel, *_ in emu.launches} == {"buddy_zvc_ends"}


def _sizes(emu, t: torch.Tensor, slot: int, table=None, codec: str = "zvc"):
    """The sizes kernel's metadata, histogram (with its count of blocks done) and prefix sums of ``t`` (512-byte
    entries), launched by ``emu``."""
    layout = Layout(512, t.numel() * t.element_size(), t.element_size())
    kernels = bkernels.Kernels(codec, launch=emu, device_type="cpu")
    flat = t.reshape(-1).view(torch.uint8)
    whole = layout.n_full * 512
    tail = torch.zeros(512, dtype=torch.uint8)
    tail[: layout.tail_bytes] = flat[whole:]
    meta, ends = torch.empty(layout.meta_bytes, dtype=torch.uint8), torch.empty(layout.n_entries, dtype=torch.int64)
    histogram, place = torch.zeros(layout.bins, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    kernels.sizes(layout, flat[:whole], tail, meta, histogram, slot, ends, place, table=table)
    return meta, histogram, ends, place


@pytest.mark.parametrize("build", BUILDS)
def test_the_sizes_kernel_sums_in_the_block_done_last(build, activations, request):
    """The sizes kernel -- measure, then the overflow's prefix sums in whichever block is done last -- on grids of
    one block to many, blocks in random orders: measure's metadata and histogram, the ends kernel's sums, and its
    count of blocks done is the grid."""
    t = activations["f32"][: 200 * 128 + 77]  # 201 entries of 512 bytes, the last partial: 26 blocks of 8 warps
    reference = buddy.measure(t, "zvc", entry_bytes=512, backend="reference")
    for max_blocks in (1, 3, None):
        with emulated_cuda(build, seed=_seed(request), max_blocks=max_blocks) as emu:
            for slot in (0, 3, 16):
                meta, histogram, ends, place = _sizes(emu, t, slot)
                assert torch.equal(meta, reference.measurement.meta.view(torch.uint8).reshape(-1))
                assert tuple(histogram.tolist()) == reference.histogram
                assert torch.equal(ends, tensor_ends(meta, slot, 512)), (max_blocks, slot)
        grids = [grid for kernel, grid, *_ in emu.launches]
        assert grids == [max_blocks or 26] * 3 and place.tolist() == [int(ends[-1]), 0, 0, grids[-1]]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("codec", ("zvc", "auto2"))
def test_a_pack_ahead_splits_its_overflow_with_the_reserve(build, codec, activations, request):
    """The kernels, unchanged, under the emulator: a pack ahead whose step's bound leaves room for a few of its
    overflow sectors sends the next ones to the step's reserve and the rest to buddy memory (each buffer exactly
    the size its placement says: a write past it is caught); unpack reads them back where they are, bit-exact."""
    t = activations["f32"][: 200 * 128 + 77]
    slot, b = 3, 32
    measured = buddy.measure(t, codec, entry_bytes=512, backend="reference")
    prior = None if measured.statistics is None else measured.statistics.double()
    with emulated_cuda(build, seed=_seed(request), max_blocks=4) as emu:
        engine = bcuda.CudaEngine(buddy.get_codec(codec), launch=emu, device_type="cpu")
        layout = Layout(512, t.numel() * 4, 4)
        sizes = torch.zeros(4 + layout.bins, dtype=torch.int64)
        step, reserve = torch.zeros(2, dtype=torch.int64), torch.zeros(40 * b, dtype=torch.uint8)
        into = torch.zeros(layout.slots_bytes(16) - layout.slots_bytes(slot), dtype=torch.uint8)
        _, meta, slots, ends = engine.pack_ahead(
            t.view(torch.uint8), layout, slot, sizes, into, prior=prior, keep=measured.codec, room=25, step=step,
            reserve=reserve,
        )  # fmt: skip
        total = int(ends[-1])
        assert sizes[:3].tolist() == [25, 40, 0] and total > 65 and step.tolist() == [total - 40, total - 25]
        held = into[: (total - 40) * b].clone()
        out = engine.unpack(meta, slots, held, slot, layout, check=True, ends=ends, place=sizes[:4], reserve=reserve)
        # through an overflow ring: packed into a region of it, then drained (each launch given exactly the bytes
        # it reads and writes): the same bytes in buddy memory
        staged, drained = torch.zeros_like(into), torch.zeros_like(into)
        sizes2, step2, reserve2 = torch.zeros_like(sizes), torch.zeros(2, dtype=torch.int64), torch.zeros_like(reserve)
        _, _, _, ends2 = engine.pack_ahead(
            t.view(torch.uint8), layout, slot, sizes2, staged, prior=prior, keep=measured.codec, room=25, step=step2,
            reserve=reserve2,
        )  # fmt: skip
        engine.drain(layout, staged, ends2, sizes2[:4], drained)
        assert [k for k, *_ in emu.launches[-2:]] == [f"buddy_{codec}_pack", f"buddy_{codec}_drain"]
    assert torch.equal(out, t.view(torch.uint8))
    assert torch.equal(drained[: held.numel()], held) and torch.equal(reserve2, reserve)


def test_the_emulator_reports_a_sizes_kernel_that_sums_too_early(activations, request, tmp_path):
    """The block that sums the overflow must be the last done: taken as the first, the emulator's TSan build reports
    it or the sums come out wrong. (Whether the last block sees what the others wrote -- the arrival's release and
    acquire -- the emulator cannot tell: it runs a launch's blocks one after another, ordered.)"""
    old, new = "buddy_arrive(done) + 1 == (unsigned long long)gridDim.x", "buddy_arrive(done) == 0"
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    source = csrc / "buddy_kernels.cu"
    assert source.read_text().count(old) == 1
    source.write_text(source.read_text().replace(old, new))
    t = activations["f32"][: 200 * 128 + 77]
    reference = buddy.measure(t, "zvc", entry_bytes=512, backend="reference")
    with Emulator("tsan", seed=_seed(request), schedules=3, csrc=csrc, codecs="zvc") as emu:
        try:
            meta, _, ends, _ = _sizes(emu, t, 3)
        except EmulatorError as error:
            assert error.what in ("race", "schedules"), error
            return
    assert not torch.equal(ends, tensor_ends(reference.measurement.meta.view(torch.uint8).reshape(-1), 3, 512)), "not caught"


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernels_write_and_read_the_reference_buffers(build, codec, case, activations, store, request):
    t = case.tensor(activations)
    e = case.entry_bytes
    with emulated_cuda(build, seed=_seed(request), max_blocks=case.max_blocks) as emu:
        _, got = check_reference_buffers("cuda", codec, t, e, case.slot_for, store, codec in TABLED)
    tabled = codec in TABLED
    assert ops_of(emu) == [*(["count", "fit"] if tabled else []), "measure", "ends", "pack", "ends", "unpack"] + (
        ["count", "fit", "measure"] if tabled else []  # the table fitted to the prior: fpe.fit_weights
    )
    if case.max_blocks:
        blocks = {op: grid for op, (_, grid, _, _) in zip(ops_of(emu), emu.launches)}
        assert blocks["measure"] == case.max_blocks < blaunch.launch_config("measure", e, got.n_entries)[0]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("codec", sorted(TABLED))
@pytest.mark.parametrize(("match", "case"), [(False, CASES[0]), (True, CASES[1])],
                         ids=["ballots-" + CASES[0].id, "match-" + CASES[1].id])  # fmt: skip
def test_the_other_count_counts_as_the_reference(build, codec, match, case, activations, store, request):
    """The count kernel's form a word size does not take by default (tuned count_match: ReLU float32 with a partial
    last entry on a grid of 2 blocks by ballots, its zero words by ballots and its other words added one by one;
    bfloat16 at 4 KiB by a warp's match) gives the reference's symbol counts, so its table and buffers. The default
    tests run the other two."""
    word = case.tensor(activations).element_size()
    assert Tuning().count_matches(word) != match, "the form this word size takes by default"
    with tuned(count_match=match), emulated_cuda(build, seed=_seed(request), max_blocks=case.max_blocks) as emu:
        check_reference_buffers("cuda", codec, case.tensor(activations), case.entry_bytes, case.slot_for, store, True)
    assert "count" in ops_of(emu)


@pytest.mark.parametrize("build", BUILDS[:1])
@pytest.mark.parametrize("codec", sorted(TABLED))
def test_unpack_at_fewer_warps_an_sm(build, codec, activations, store, request):
    """Tuned unpack_warps=2 (what the runbook's bench times unpack at, --unpack-warps): unpack's blocks of two
    warps, their table in shared memory; one block, its warps striding over bfloat16's six entries of 4 KiB, writes
    the reference's buffers."""
    case = CASES[1]
    with tuned(unpack_warps=2), emulated_cuda(build, seed=_seed(request), max_blocks=1) as emu:
        _, got = check_reference_buffers("cuda", codec, case.tensor(activations), 4096, case.slot_for, store, True)
    assert got.n_entries == 6
    unpacks = [(grid, block, shared) for kernel, grid, block, shared in emu.launches if kernel.endswith("_unpack")]
    assert unpacks == [(1, 64, fpe_device.DECODE_ROWS_BYTES + 2 * 2 * 4096)]


@pytest.mark.parametrize("build", BUILDS[:1])
@pytest.mark.parametrize("codec", ("auto", "auto2"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int64), ids=str)
def test_auto_choice_with_early_stops(build, codec, dtype, store, request):
    """auto's and auto2's measure stop sizing bpc once it cannot win (measure_below, 32 lanes: after chunks 0, 1, 3,
    7, ...): on entries made so the members' sizes straddle each other, every entry's metadata and the slots are the
    reference's."""
    with emulated_cuda(build, seed=_seed(request)):
        check_reference_buffers("cuda", codec, straddling_entries(dtype, 512), 512, lambda h: 6, store, codec in TABLED)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
def test_tensors_of_one_entry(build, codec, activations, store, request):
    with emulated_cuda(build, seed=_seed(request)):
        check_tensors_of_one_entry("cuda", codec, activations, store)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
def test_unpack_flags_damage_where_the_reference_raises(build, codec, activations, store, request):
    with emulated_cuda(build, seed=_seed(request)):
        check_damage_flagged("cuda", codec, activations, store)


# ---------------------------------------------------------------------------
# the golden vectors
# ---------------------------------------------------------------------------
#: (entry size, dtype) groups of the golden vectors run under both builds; the others run under the asan build
GOLDEN_BOTH = {(512, "float32"), (512, "bfloat16"), (4096, "float64")}


def _golden_groups():
    groups: dict[tuple, list[dict]] = {}
    for case in GOLDEN_CASES:
        if case["codec"] in CODECS:
            groups.setdefault((case["set"], case["entry_bytes"], case["dtype"], case["codec"]), []).append(case)
    for (name, e, dtype, codec), cases in sorted(groups.items()):
        for build in BUILDS if (e, dtype) in GOLDEN_BOTH else ("asan",):
            yield pytest.param(build, cases, id=f"{build}-{name}-E={e}-{dtype}-codec={codec}")


@pytest.fixture(scope="module")
def golden_vectors():
    return load_vectors()


@pytest.mark.parametrize(("build", "cases"), list(_golden_groups()))
def test_golden_vectors(build, cases, golden_vectors, store, request):
    """The kernels write the golden bytes of every input (sets still written) and decode all of them."""
    with emulated_cuda(build, seed=_seed(request)):
        check_golden("cuda", cases, golden_vectors, GOLDEN_SETS, store)


# ---------------------------------------------------------------------------
# the emulator bites
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutation:
    """A change to one line of a copy of the sources, and what must catch it.

    ``catch``: ``race`` (TSan; ``where``: a frame of each access, file and function), ``stuck``
    (deadlock), ``memory`` (ASan), ``undefined`` (UBSan), ``schedules``
    (schedules wrote different bytes). The launches: compress and decompress
    ``data`` with ``codec`` at E = 512 (``max_blocks`` per launch).
    """

    id: str
    file: str
    old: str  # occurs exactly once in the file
    new: str
    codec: str
    build: str
    catch: str
    where: tuple[tuple[str, str], ...] = ()  # (file, function) in each racing access's stack, in either order
    max_blocks: int | None = None
    says: str = ""  # in the report
    tuning: tuple[tuple[str, object], ...] = ()  # tuned so while it runs, unmodified and mutated (a layout's)

    def apply(self, root: Path) -> Path:
        """A copy of csrc/ under ``root`` with the change made; its path."""
        out = root / "csrc"
        shutil.copytree(CSRC, out)
        path = out / self.file
        text = path.read_text()
        assert text.count(self.old) == 1, f"{self.id}: the text to change is not in {self.file} exactly once"
        path.write_text(text.replace(self.old, self.new))
        return out


MUTATIONS = [
    Mutation(
        "measure: no __syncthreads after zeroing the block's counts", "buddy_kernels.cu",
        "counts[j] = 0;\n  __syncthreads();", "counts[j] = 0;\n", "zvc", "tsan", "race",
        (("buddy_kernels.cu", "buddy_measure_body"), ("buddy_kernels.cu", "buddy_measure_body")),
    ),
    Mutation(
        "measure: no __syncthreads before adding the block's counts to the histogram", "buddy_kernels.cu",
        "  }\n  __syncthreads();\n  for (uint32_t j = threadIdx.x; j <= BUDDY_SECTORS_PER_ENTRY;",
        "  }\n  for (uint32_t j = threadIdx.x; j <= BUDDY_SECTORS_PER_ENTRY;", "zvc", "tsan", "race",
        (("buddy_kernels.cu", "buddy_measure_body"), ("buddy_kernels.cu", "buddy_measure_body")),
    ),
    Mutation(
        "count: no __syncthreads after zeroing the block's counts", "buddy_kernels.cu",
        "local[j] = 0;\n  __syncthreads();", "local[j] = 0;\n", "fpe", "tsan", "race",
        (("buddy_kernels.cu", "buddy_count_body"), ("codec_fpe_fit.h", "buddy_fpe_count_unit16")),
    ),
    Mutation(
        "count: no __syncthreads before adding the block's counts", "buddy_kernels.cu",
        "local);\n  }\n  __syncthreads();", "local);\n  }\n", "fpe", "tsan", "race",
        (("buddy_kernels.cu", "buddy_count_body"), ("codec_fpe_fit.h", "buddy_fpe_count_unit16")),
    ),
    Mutation(
        "pack: no warp.sync() after the encode into staging", "buddy_ops.h",
        "  warp.sync();  // the lanes wrote the staging buffer; every lane copies from it\n", "", "zvc",
        "tsan", "race", (("buddy_ops.h", "buddy_op_pack"), ("codec_zvc.h", "encode")),
    ),
    Mutation(
        "pack: no warp.sync() before the warp's next entry reuses staging (warps loop: one block)", "buddy_ops.h",
        "  warp.sync();  // the staging buffer is read before the warp's next entry writes it\n}",
        # (the next entry's payload written into the staging buffer -- encoded, or a raw entry's bytes -- while a
        # lane still copies the entry before out: both in buddy_op_pack)
        "}", "zvc", "tsan", "race", (("buddy_ops.h", "buddy_op_pack"), ("buddy_ops.h", "buddy_op_pack")), max_blocks=1,
    ),
    Mutation(
        "unpack: no warp.sync() after gathering the payload", "buddy_ops.h",
        "  warp.sync();  // the gathered payload is complete before any lane decodes from it\n", "", "zvc", "tsan",
        "race", (("buddy_ops.h", "buddy_warp_copy_sectors"), ("buddy_entry.h", "buddy_entry_decode")),
    ),
    Mutation(
        "unpack: no __syncthreads between copying the table into shared memory and reading it", "buddy_kernels.cu",
        "  __syncthreads();\n  return reinterpret_cast", "  return reinterpret_cast", "fpe", "tsan", "race",
        (("buddy_kernels.cu", "buddy_unpack_body"), ("codec_fpe.h", "BuddyFpe")),
    ),
    Mutation(
        "pack: no __syncthreads between making the table of whole fields and reading it", "buddy_kernels.cu",
        "    __syncthreads();\n    codec.use_fields(", "    codec.use_fields(", "fpe", "tsan", "race",
        (("codec_fpe.h", "make_fields"), ("codec_fpe.h", "encode_split")), tuning=(("pack_fields", True),),
    ),
    Mutation(
        "fpe encode: no warp.sync() between zeroing the payload and ORing the fields in", "codec_fpe.h",
        "    buddy_warp_fill(warp, nullptr, payload, k * BUDDY_SECTOR_BYTES);\n    warp.sync();\n",
        "    buddy_warp_fill(warp, nullptr, payload, k * BUDDY_SECTOR_BYTES);\n", "fpe", "tsan", "race",
        (("codec_fpe.h", "put_unit"), ("buddy_warp.h", "buddy_warp_fill")),
    ),
    Mutation(
        "fpe decode (split layout): no warp.sync() between zeroing the output and the lanes writing words",
        "codec_fpe.h", "  // ZERO words are written by this\n    warp.sync();", "  // ZERO words are written by this\n",
        "fpe", "tsan", "race", (("codec_fpe.h", "emit"), ("buddy_warp.h", "buddy_warp_fill")),
    ),
    Mutation(
        "fit: no warp.sync() in buddy_fit_sum64 between writing and reading the partials", "codec_fpe_fit.h",
        "  part[warp.lane()] = v;\n  warp.sync();\n", "  part[warp.lane()] = v;\n", "fpe", "tsan", "race",
        (("codec_fpe_fit.h", "buddy_fit_sum64"), ("codec_fpe_fit.h", "buddy_fit_sum64")),
    ),
    Mutation(
        "fit: buddy_fit_sum64's warp.sync() replaced by a ballot (no barrier: it orders no memory)", "codec_fpe_fit.h",
        "  part[warp.lane()] = v;\n  warp.sync();\n", "  part[warp.lane()] = v;\n  (void)warp.ballot(true);\n", "fpe",
        "tsan", "race", (("codec_fpe_fit.h", "buddy_fit_sum64"), ("codec_fpe_fit.h", "buddy_fit_sum64")),
    ),
    Mutation(
        "measure: __syncthreads reached by lane 0 of each warp only", "buddy_kernels.cu",
        "if (warp.lane() == 0) atomicAdd(&counts[k], 1u);",
        "if (warp.lane() == 0) { atomicAdd(&counts[k], 1u); __syncthreads(); }", "zvc", "tsan", "stuck",
        says="threads returned while others wait for them",
    ),
    Mutation(
        "lane 0 at a shuffle while the other lanes are at a ballot", "buddy_warp.h",
        "  return warp.ballot(mine) != 0;\n",
        "  if (warp.lane() == 0) return warp.shfl(mine, 0u) != 0;\n  return warp.ballot(mine) != 0;\n", "zvc", "tsan",
        "stuck", says="lanes of a warp at different collectives",
    ),
    Mutation(
        "measure: the block's counts never zeroed (static shared memory starts as garbage)", "buddy_kernels.cu",
        "  for (uint32_t j = threadIdx.x; j <= BUDDY_SECTORS_PER_ENTRY; j += blockDim.x) counts[j] = 0;\n", "", "zvc",
        "tsan", "schedules",
    ),
    Mutation(
        "measure: zeroing one count past the static shared array", "buddy_kernels.cu",
        "j <= BUDDY_SECTORS_PER_ENTRY; j += blockDim.x) counts[j] = 0;",
        "j <= BUDDY_SECTORS_PER_ENTRY + 1; j += blockDim.x) counts[j] = 0;", "zvc", "asan", "undefined",
        says="index 17 out of bounds",
    ),
    Mutation(
        "count: zeroing one count past the static shared array, through a pointer", "buddy_kernels.cu",
        "j < symbols; j += blockDim.x) local[j] = 0;", "j <= symbols; j += blockDim.x) local[j] = 0;", "fpe", "asan",
        "memory", says="global-buffer-overflow",
    ),
    Mutation(
        "pack: each warp's staging one entry further (the last past the dynamic shared buffer)", "buddy_kernels.cu",
        "(threadIdx.x / BUDDY_WARP_SIZE) * entries * BUDDY_ENTRY_BYTES;",
        "(threadIdx.x / BUDDY_WARP_SIZE + 1) * entries * BUDDY_ENTRY_BYTES;", "zvc", "asan", "memory",
        says="heap-buffer-overflow",
    ),
    Mutation(
        "count: 16-byte loads 8 bytes off alignment", "buddy_kernels.cu",
        "buddy_load<buddy_u128>(data + 16 * u)", "buddy_load<buddy_u128>(data + 16 * u + 8)", "fpe", "asan",
        "undefined", says="which requires 16 byte alignment",
    ),
    Mutation(
        "count: one 16-byte unit past the data", "buddy_kernels.cu",
        "n16 = n_units / 2;", "n16 = n_units / 2 + 1;", "fpe", "asan", "memory", says="heap-buffer-overflow",
    ),
    Mutation(
        "pack: the rest of a slot left unwritten", "buddy_ops.h",
        "  buddy_warp_fill(warp, nullptr, slot + in_slot * BUDDY_SECTOR_BYTES, (s - in_slot) * BUDDY_SECTOR_BYTES);\n",
        "", "zvc", "tsan", "schedules",
    ),
]  # fmt: skip


def _bitten(mutation: Mutation, csrc: Path, t: torch.Tensor, store, seed: int) -> EmulatorError | None:
    """Compress and decompress ``t`` on the kernels of ``csrc``: what the emulator reported, or ``None``
    (then the bytes must be the reference's)."""
    e, slot = 512, 4
    compress = functools.partial(buddy.compress, codec=mutation.codec, entry_bytes=e, store=store)
    codecs = "all" if csrc == CSRC else mutation.codec  # a mutated copy builds only the kernels it runs
    options = dict(seed=seed, schedules=3, max_blocks=mutation.max_blocks, csrc=csrc, codecs=codecs)
    with emulated_cuda(mutation.build, **options):
        try:
            a = compress(t, spec.ratio_for_slot(slot, e), backend="cuda")
            out = a.decompress(check=True)
        except EmulatorError as error:
            return error
    b = compress(t, spec.ratio_for_slot(slot, e), backend="reference")
    _same_buffers(a, b)
    assert_bitexact(out, t)
    a.free()
    b.free()
    return None


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.id for m in MUTATIONS])
def test_the_emulator_reports_a_broken_kernel(mutation, activations, store, request):
    t = Case("f32", 512, 24.5, 4, None).tensor(activations)
    with tuned(**dict(mutation.tuning)):
        assert _bitten(mutation, CSRC, t, store, _seed(request)) is None, "the unmodified sources are reported"
        error = _bitten(mutation, _TREES[mutation.id], t, store, _seed(request))
    assert error is not None, f"{mutation.id}: not reported"
    assert error.what == mutation.catch, f"{mutation.id}: reported as {error.what}, not {mutation.catch}\n{error}"
    assert mutation.says in error.report, error
    if mutation.catch == "race":
        stacks = error.race_stacks()

        def holds(stack, where) -> bool:
            return any(f.file == where[0] and where[1] in f.function for f in stack)

        a, b = mutation.where
        assert len(stacks) == 2, error
        assert (holds(stacks[0], a) and holds(stacks[1], b)) or (holds(stacks[0], b) and holds(stacks[1], a)), error
