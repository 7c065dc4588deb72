"""The kernel budget's counting rules (experiments/lab/kernel_budget.py) on small made-up SASS listings.

The budget itself needs nvcc and nvdisasm and is run by hand (docs/kernel_budget.md); what is checked here
is how it turns a listing into instructions per entry: a loop the compiler copied (unswitched, unrolled)
charged once per source iteration, a called routine charged at each call, blocks that do not run on what is
written now charged nothing.
"""

from __future__ import annotations

import pytest

from experiments.lab.kernel_budget import Kernel, per_entry, read_listing

SOURCE = [
    "for (long long i = buddy_first_warp(); i < n_entries; i += buddy_warp_stride()) {",  # 1: the grid
    "  const uint32_t c = table->enc[sym];",  # 2: the unit_words loop's anchor
    "  for (uint32_t i = 0; i < unit_words; ++i) {",  # 3
    "  x = y;",  # 4
    "  BUDDY_WARP_FN void encode_serial(const Warp& warp, uint32_t* stream) const {",  # 5: the serial layout's
    "    z = w;",  # 6
    "  }",  # 7
]


def _kernel(copy_a: int, serial: int = 0) -> Kernel:
    """A grid loop holding two compiled copies of the unit_words loop -- A unrolled twice (two anchor loads
    and ``copy_a`` instructions in all), B not (three) -- a call of a three-instruction routine and
    ``serial`` instructions of the serial layout's block."""
    k = Kernel("k")
    code = [(0x00, "MOV R0, R1", 4)]
    addr = 0x10
    k.labels[".L_x_1"] = addr
    code += [(addr, "LDG.E.U16 R1, desc[UR4][R2.64]", 2), (addr + 0x10, "LDG.E.U16 R3, desc[UR4][R4.64]", 2)]
    addr += 0x20
    for _ in range(copy_a - 3):
        code.append((addr, "IADD3 R5, R5, 0x1, RZ", 4))
        addr += 0x10
    code.append((addr, "BRA `(.L_x_1)", 3))
    addr += 0x10
    k.labels[".L_x_2"] = addr
    code += [(addr, "LDG.E.U16 R1, desc[UR4][R2.64]", 2), (addr + 0x10, "IADD3 R5, R5, 0x1, RZ", 4),
             (addr + 0x20, "BRA `(.L_x_2)", 3)]  # fmt: skip
    addr += 0x30
    for _ in range(serial):
        code.append((addr, "SHF.L.U32 R6, R6, 0x1, RZ", 6))
        addr += 0x10
    code += [(addr, "CALL.REL.NOINC `($__internal_0_div)", 4), (addr + 0x10, "BRA `(.L_x_0)", 1)]
    k.labels[".L_x_0"] = 0x00
    addr += 0x100
    k.labels["$__internal_0_div"] = addr
    code += [(addr, "IMAD R0, R1, R2, RZ", 4), (addr + 0x10, "IADD3 R0, R0, 0x1, RZ", 4),
             (addr + 0x20, "RET.ABS.NODEC R20 0x0", 4)]  # fmt: skip
    k.instrs = code
    k.routines["$__internal_0_div"] = 3
    return k


@pytest.mark.parametrize("copy_a, expected", [(4, 1 + 3 * 8 + 4 + 1), (8, 1 + 8 * 8 / 2 + 4 + 1)])
def test_a_copied_loop_is_charged_once(copy_a, expected):
    # A does 2 source iterations a pass: 4 instructions are 2 an iteration (B's 3 win), 8 are 4 (A's win)
    parts: dict = {}
    total, unknown = per_entry(_kernel(copy_a), SOURCE, {"grid": 1.0, "unit_words": 8.0}, parts=parts)
    assert total == pytest.approx(expected)
    assert unknown == []
    assert parts["unit_words"] == pytest.approx(expected - 6)  # the rest: the MOV, the call and its routine, the BRA


def test_the_serial_layout_is_not_charged():
    plain, _ = per_entry(_kernel(4), SOURCE, {"grid": 1.0, "unit_words": 8.0})
    with_serial, _ = per_entry(_kernel(4, serial=5), SOURCE, {"grid": 1.0, "unit_words": 8.0})
    assert with_serial == plain


def test_more_iterations_cost_more():
    few, _ = per_entry(_kernel(4), SOURCE, {"grid": 1.0, "unit_words": 8.0})
    many, _ = per_entry(_kernel(4), SOURCE, {"grid": 1.0, "unit_words": 16.0})
    assert many - few == pytest.approx(3 * 8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_bpc_stops_only_where_it_cannot_win(dtype):
    """The budget's model of bpc's early stop in auto's measure (``bpc_chunks_stepped``, the rule of
    csrc/codec_bpc.h's ``plan<true>``): where it stops before the last chunk, bpc's whole size is no smaller
    than the size so far -- so the choice is the same -- and noisy entries stop within two chunks."""
    import torch

    import buddy
    from experiments.lab.kernel_budget import bpc_chunks_stepped
    from kernel_cases import straddling_entries

    e = 1024
    entries = straddling_entries(getattr(torch, dtype), e).view(torch.uint8).view(-1, e)
    word = getattr(torch, dtype).itemsize
    sizes = buddy.get_codec("bpc").analyse(entries, word).sectors.tolist()
    chunks = -(-(e // {2: 2, 8: 8}.get(word, 4) - 1) // 32)  # of 32 deltas between the entry's bpc words
    stopped = 0
    for row, size in enumerate(sizes):
        for limit in (2, 8, e // 32, size, size + 1):  # (size + 1: bpc wins, so it must never stop)
            got = bpc_chunks_stepped(entries[row].numpy(), word, 256 * (limit - 1) + 1)
            assert 1 <= got <= chunks
            if got < chunks:
                assert size >= limit, (row, limit, got)
                stopped += 1
    assert stopped > len(sizes)  # the rule does stop (most noisy entries, at every limit)
    noise = torch.randint(0, 256, (e,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert bpc_chunks_stepped(noise.numpy(), word, 256 * 7 + 1) <= 2


LISTING = """\t.section\t.text.k,"ax",@progbits
\t//## File "/x/kernels.cu", line 40 inlined at "/x/kernels.cu", line 30
\t//## File "/x/kernels.cu", line 30 inlined at "/x/kernels.cu", line 20
\t//## File "/x/kernels.cu", line 20
        /*0000*/                   IMAD R1, R2, 0x4, R3 ;
\t//## File "/cuda/include/device_atomic_functions.hpp", line 187 inlined at "/x/kernels.cu", line 9
\t//## File "/x/kernels.cu", line 9 inlined at "/x/kernels.cu", line 41
\t//## File "/x/kernels.cu", line 41 inlined at "/x/kernels.cu", line 30
\t//## File "/x/kernels.cu", line 30 inlined at "/x/kernels.cu", line 20
\t//## File "/x/kernels.cu", line 20
        /*0010*/                   ATOMS.OR RZ, [R1], R4 ;
.L_x_1:
\t//## File "/x/kernels.cu", line 20
        /*0020*/                   BRA `(.L_x_1) ;
"""


def test_an_instruction_is_charged_to_every_place_it_is_inlined_at():
    # the atomic's innermost place is CUDA's header: its chain is still every line of the translation unit that
    # holds it, so a block around line 30 or 41 (the serial layout's, say) covers it
    kernels = {"k": Kernel("k")}
    read_listing(LISTING, kernels, "kernels.cu")
    k = kernels["k"]
    assert [(a, line) for a, _, line in k.instrs] == [(0x00, 40), (0x10, 9), (0x20, 20)]
    assert k.chains == {0x00: (40, 30, 20), 0x10: (9, 41, 30, 20), 0x20: (20,)}
    assert k.labels == {".L_x_1": 0x20}


@pytest.mark.parametrize("branch", ["BRA `(.L_x_1)", "@P0 BRA `(.L_x_1)", "@!P0 BRA P1, `(.L_x_1)"])
def test_a_branch_back_from_a_loop_line_is_a_loop(branch):
    # a loop of two conditions closes with a branch that tests a second predicate (`BRA P1, ...`); a branch
    # back from a line that is no loop's (a block moved out of line) and a forward one are not loops
    from experiments.lab.kernel_budget import loops

    source = ["while (pos < limit && pos < early) {", "  x = y;", "}"]
    k = Kernel("k")
    k.labels[".L_x_1"] = 0x10
    k.labels[".L_x_2"] = 0x60
    k.instrs = [(0x10, "IADD3 R1, R1, 0x1, RZ", 2), (0x20, branch, 1), (0x30, "BRA `(.L_x_1)", 2),
                (0x40, "BRA `(.L_x_2)", 1)]  # fmt: skip
    assert loops(k, source) == [(0x10, 0x20, 1, (1,))]


def test_cycles_per_instruction_of_a_gpu_run():
    # a launch of 242 us at 16 warps an SM that ran 4,322 warp instructions an entry over 16,384 entries: with the
    # H100's clock (the run recorded none) and 132 SMs, a warp took about 12.7 cycles an instruction
    from experiments.lab.kernel_budget import cycles_per_instruction

    row = {"us": 242.0, "warps/SM": 16.0, "instr": 4322.0 * 16384, "clock GHz": float("nan")}
    assert cycles_per_instruction(row) == pytest.approx(242e-6 * 1.755e9 * 132 * 16 / (4322 * 16384))
    assert cycles_per_instruction(row | {"clock GHz": 1.98}) == pytest.approx(12.66 * 1.98 / 1.755, rel=1e-3)


def test_ncu_launches_of_two_layouts_are_two_kernels(tmp_path):
    # the bench under ncu with --global-table: per tensor, auto2's unpack once with the table in shared memory
    # (736 threads a block) and once in global memory (128), pack twice with one block size and two sizes of
    # dynamic shared memory (49,168 and 32,768 bytes; ncu may say Kbyte), measure twice alike
    import json

    from experiments.lab.kernel_budget import ncu_measured

    mib = 1 << 20
    rows = [{"tensor": t, "dtype": d, "bytes": mib, "entry_bytes": 4096, "method": m}
            for t, d in (("a", "float32"), ("b", "bfloat16"))
            for m in ("buddy:auto2/cuda", "buddy:auto2/cuda+global-table")]  # fmt: skip
    record = {"device": "GPU", "commit": "c", "command": "x",
              "steps": [{"name": "ncu", "result": {"rows": rows, "args": {"mib": 1}}}]}  # fmt: skip
    (tmp_path / "essentials.json").write_text(json.dumps(record))
    head = '"ID","Kernel Name","Block Size","Metric Name","Metric Unit","Metric Value"'
    lines, launch = ["==PROF== Connected", head], 0
    smem = "launch__shared_mem_per_block_dynamic"
    for _tensor in "ab":
        for kernel, block, ns, shared in (("measure", 256, 1000, '"byte","0"'), ("pack", 256, 5000, '"Kbyte","49.17"'),
                                          ("unpack", 736, 2000, '"Kbyte","229.39"'), ("measure", 256, 3000, '"byte","0"'),
                                          ("pack", 256, 6000, '"byte","32,768"'),
                                          ("unpack", 128, 4000, '"byte","32,768"')):  # fmt: skip
            lines.append(f'"{launch}","buddy_auto2_{kernel}","({block}, 1, 1)","gpu__time_duration.sum","ns","{ns}"')
            lines.append(f'"{launch}","buddy_auto2_{kernel}","({block}, 1, 1)","{smem}",{shared}')
            launch += 1
    (tmp_path / "ncu.csv").write_text("\n".join(lines) + "\n")
    got = ncu_measured(tmp_path)["rows"]
    kernels = ("auto2 measure", "auto2 pack", "auto2 pack (256 threads, 32,768 B shared)", "auto2 unpack",
               "auto2 unpack (128 threads, 32,768 B shared)")  # fmt: skip
    assert sorted(got) == sorted((k, d) for k in kernels for d in ("float32", "bfloat16"))
    assert got["auto2 unpack", "float32"]["us"] == pytest.approx(2.0)
    assert got["auto2 unpack (128 threads, 32,768 B shared)", "bfloat16"]["us"] == pytest.approx(4.0)
    assert got["auto2 pack", "float32"]["us"] == pytest.approx(5.0)
    assert got["auto2 pack (256 threads, 32,768 B shared)", "float32"]["us"] == pytest.approx(6.0)
    assert got["auto2 measure", "float32"]["us"] == pytest.approx(2.0) and got["auto2 measure", "float32"]["launches"] == 2
    # the estimate of a launch reads the layout it estimates: pack reading the table in global memory, unpack its copy
    from experiments.lab.kernel_budget import measured_launch

    measured = {"rows": got}
    assert measured_launch(measured, "auto2 pack", "float32", 256, 32768)["us"] == pytest.approx(6.0)
    assert measured_launch(measured, "auto2 pack", "float32", 256, 49170)["us"] == pytest.approx(5.0)
    assert measured_launch(measured, "auto2 unpack", "bfloat16", 736, 229390)["us"] == pytest.approx(2.0)
    assert measured_launch(measured, "auto2 unpack", "bfloat16", 256, 65536) is None  # a layout that did not run
    # ... unless the estimate asks for the run's layout of the most shared memory, marked as another layout
    other = measured_launch(measured, "auto2 unpack", "bfloat16", 768, 229376, default=True)
    assert other["us"] == pytest.approx(2.0) and other["layout"] == (736, pytest.approx(229390))
    assert "layout" not in measured_launch(measured, "auto2 unpack", "bfloat16", 736, 229390, default=True)
    old = {"rows": {("auto2 pack", "float32"): {"us": 7.0, "block": 256, "smem": float("nan")}}}  # smem not read
    assert measured_launch(old, "auto2 pack", "float32", 256, 32768)["us"] == 7.0


@pytest.mark.parametrize("seed", range(4))
def test_the_radix_select_simulated_finds_the_rth_largest(seed):
    # as buddy_fit_select: the 255th largest of distinct keys c << 12 | (4095 - symbol), stopping its passes once
    # at most 32 keys share the digits found
    import numpy as np

    from experiments.lab.kernel_budget import radix_select

    rng = np.random.default_rng(seed)
    symbols = rng.choice(4096, size=int(rng.integers(256, 4097)), replace=False)
    c = np.maximum(1, (rng.pareto(1.0 + seed / 2, size=len(symbols)) * 2**14).astype(np.int64)) % (1 << 30)
    keys = np.maximum(c, 1) << 12 | (4095 - symbols)
    kth, passes, left = radix_select(keys, 255)
    assert kth == np.sort(keys)[::-1][254]
    assert 1 <= passes <= 11 and (left == 0) == (passes == 11) and left <= 32


def test_a_latency_bound_from_another_layout_is_said():
    """Where a kernel's cycles an instruction come from the GPU run's layout, not the one estimated (its layout
    changed since the run), the budget says so under its table: which layout ran, which is estimated."""
    from experiments.lab.kernel_budget import _other_layouts

    rows = [{"kernel": "auto2 unpack", "dtype": d, "warps/SM": 24, "smem/block": 229376,
             "measured layout": (736.0, 229392.0)} for d in ("float32", "bfloat16")]  # fmt: skip
    rows.append({"kernel": "auto2 pack", "dtype": "float32", "warps/SM": 24, "smem/block": 32768})
    note = "\n".join(_other_layouts(rows))
    assert "auto2 unpack (float32, bfloat16)" in note and "736 threads and 229,392 B" in note
    assert "24 warps an SM in blocks of 229,376 B" in note and "auto2 pack" not in note
    assert _other_layouts(rows[2:]) == []


def test_what_unpack_needs_for_the_target_is_said():
    """Where an unpack's estimate is short of 800 GB/s, the budget says what its instructions an entry must come to:
    at every issue slot busy (4 KiB entries on an H100: 132 x 4 x 1.755 GHz x 4096 B / 800 GB/s), and at the
    share of issue slots the GPU run kept busy; nothing where every unpack reaches it."""
    from experiments.lab.kernel_budget import H100, _unpack_needs

    most = H100["sms"] * H100["schedulers"] * H100["clock_ghz"] * 4096 / 800

    def unpack(dtype, instr, busy, estimate):
        issue = H100["sms"] * H100["schedulers"] * H100["clock_ghz"] * 4096 / instr
        return {"kernel": "auto2 unpack", "dtype": dtype, "instr/entry": instr, "issue GB/s": issue,
                "estimate GB/s": estimate, "issue % measured": busy}  # fmt: skip

    rows = [unpack("float32", 3000.0, 50.0, 900.0), unpack("bfloat16", 6000.0, 70.0, 400.0),
            {"kernel": "auto2 pack", "dtype": "bfloat16", "instr/entry": 9e9, "issue GB/s": 1.0, "estimate GB/s": 1.0}]
    said = _unpack_needs(rows)
    assert f"at most {most:,.0f} instructions" in said and "bfloat16's takes 6,000" in said
    assert "float32" not in said.replace("bfloat16", "") and "9,000,000,000" not in said  # (float32's reaches it)
    assert f"and {most * 0.7:,.0f} at the 70 % of issue slots" in said
    both = _unpack_needs([rows[1], unpack("float32", 5000.0, 62.6, 700.0)])
    assert f"and {most * 0.626:,.0f}-{most * 0.7:,.0f} at the 63-70 %" in both and "float32's takes 5,000" in both
    assert _unpack_needs(rows[:1]) == ""
    assert "GPU run" not in _unpack_needs([rows[1] | {"issue % measured": None}])
