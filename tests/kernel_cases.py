"""What the tests of the compiled kernels share: real activations, the cases cut from them, damaged buffers, and
the checks against the torch reference, each run with the backend under test.

The block emulator's tests (``test_emulator.py``: the kernels under random
schedules and sanitizers, as ``backend="cuda"`` on CPU tensors) and the native
engine's (``test_native.py``: the same sources built for the host,
``backend="native"``) compare the kernels with the torch reference on these,
byte for byte.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conftest import assert_bitexact
import torch

import buddy
from buddy import spec


# ---------------------------------------------------------------------------
# real activations
# ---------------------------------------------------------------------------
@functools.cache
def activations() -> dict[str, torch.Tensor]:
    """Saved tensors of two experiment workloads one step into training, and text bytes (all real data).

    ``f32``: a VGG's ReLU output (about half zeros, whole zero entries at 512 B);
    ``f64``: its max-pool output, widened; ``i64``: the max-pool indices;
    ``bf16``: a GPT block's activation; ``u8``: the standard library's source.
    """
    from experiments.data import stdlib_text_bytes
    from experiments.workloads import capture

    vgg = capture("vgg-fp32", "tiny", points=(1,))[0].tensors
    gpt = capture("gpt-bf16", "tiny", points=(1,))[0].tensors
    relu = next(s.tensor for s in vgg if s.op == "ReluBackward0" and s.tensor.shape[1] == 16)
    pooled = next(s.tensor for s in vgg if s.op == "MaxPool2DWithIndicesBackward0")
    indices = next(s.tensor for s in vgg if s.tensor.dtype == torch.int64)
    hidden = max((s.tensor for s in gpt if s.tensor.dtype == torch.bfloat16), key=torch.Tensor.numel)
    out = {
        "f32": relu,
        "f64": pooled.double(),
        "i64": indices,
        "bf16": hidden,
        "u8": stdlib_text_bytes(64 << 10),
    }
    return {k: v.detach().contiguous().reshape(-1) for k, v in out.items()}


@dataclass(frozen=True)
class Case:
    data: str  # key of the activations
    entry_bytes: int
    entries: float  # the tensor's size in entries (a fraction: a partial last entry)
    slot: int | None  # sectors per slot; None: the median entry's size (some entries overflow, some not)
    max_blocks: int | None  # launch at most this many blocks

    @property
    def id(self) -> str:
        blocks = f"-blocks<={self.max_blocks}" if self.max_blocks else ""
        return f"{self.data}-E={self.entry_bytes}{blocks}"

    def tensor(self, activations) -> torch.Tensor:
        """``entries`` entries of the data from two before its first all-zero entry (from the start if none)."""
        data = activations[self.data]
        size = data.element_size()
        n = int(self.entries * self.entry_bytes) // size
        whole = data[: data.numel() // (self.entry_bytes // size) * (self.entry_bytes // size)]
        zero = (whole.view(torch.uint8).view(-1, self.entry_bytes) == 0).all(1).nonzero()
        start = max(0, int(zero[0]) - 2) * (self.entry_bytes // size) if zero.numel() else 0
        start = min(start, data.numel() - n)
        return data[start : start + n].clone()

    def slot_for(self, histogram) -> int:
        if self.slot is not None:
            return self.slot
        ks = [k for k, count in enumerate(histogram) for _ in range(count)]
        return ks[len(ks) // 2]


CASES = [
    Case("f32", 512, 20.3, None, max_blocks=2),  # 21 entries: measure wants 3 blocks of 8 warps
    Case("bf16", 4096, 5.5, None, max_blocks=None),
    Case("u8", 512, 12.7, 0, max_blocks=None),  # the zero slot: every sector to the overflow
    Case("f64", 4096, 9.2, None, max_blocks=1),  # 10 entries, 8 warps a block
]


def _same_buffers(a: buddy.BuddyTensor, b: buddy.BuddyTensor) -> None:
    assert a.histogram == b.histogram, "histogram"
    for name, x, y in zip(("metadata", "slots", "overflow"), a.buffers(), b.buffers()):
        assert torch.equal(x, y), f"{name} differ"
    assert (a.table is None) == (b.table is None) and (a.table is None or torch.equal(a.table, b.table)), "table"


# ---------------------------------------------------------------------------
# damaged buffers
# ---------------------------------------------------------------------------
def _damaged(meta: torch.Tensor, slots: torch.Tensor, overflow: torch.Tensor, slot: int, e: int):
    """``(what, meta, slots, overflow)``: the buffers as they are, then damaged in every way the format can see."""
    words = meta.view(torch.int16)
    spe = spec.sectors_per_entry(e)
    k = (words & 0xFFF).long()
    coded = int(((k > 0) & (k < spe) & (k > slot)).nonzero()[0])  # an entry with overflow
    inside = int(((k > 0) & (k < spe)).nonzero()[-1])

    def with_word(i: int, value: int) -> torch.Tensor:
        out = words.clone()
        out[i] = value
        return out.view(torch.uint8)

    sector = spec.SECTOR_BYTES
    payload = slots.clone()
    payload[inside * slot * sector : (inside + 1) * slot * sector] = 0xFF
    return [
        ("as written", meta, slots, overflow),
        ("k beyond the entry", with_word(coded, spe + 1 | int(words[coded]) & ~0xFFF), slots, overflow),
        ("a mode the codec never writes", with_word(coded, int(words[coded]) | 0xF000 - 0x10000), slots, overflow),
        ("k one more", with_word(coded, int(words[coded]) + 1), slots, overflow),
        ("overflow a sector short", meta, slots, overflow[:-sector]),
        ("overflow a sector long", meta, slots, torch.cat([overflow, torch.zeros(sector, dtype=torch.uint8)])),
        ("slot bytes set", meta, payload, overflow),
    ]


def _decode(backend: str, bt: buddy.BuddyTensor, meta, slots, overflow):
    try:
        return buddy.unpack(
            meta, slots, overflow, codec=bt.codec, entry_bytes=bt.entry_bytes, slot_sectors=bt.slot_sectors,
            shape=bt.shape, dtype=bt.dtype, table=bt.table, backend=backend,
        )  # fmt: skip
    except buddy.CorruptDataError:
        return None




# ---------------------------------------------------------------------------
# the checks, with the backend under test
# ---------------------------------------------------------------------------
def check_reference_buffers(backend: str, codec: str, t: torch.Tensor, e: int, slot_for, store, tabled: bool):
    """``backend`` measures and packs ``t`` into the reference's bytes (histogram, metadata, table, symbol counts,
    slots, overflow at ``slot_for(histogram)``), each decodes the other's; with learned statistics (``tabled``) the
    same. Returns ``(slot, what backend measured)``."""
    got = buddy.measure(t, codec, entry_bytes=e, backend=backend)
    want = buddy.measure(t, codec, entry_bytes=e, backend="reference")
    assert got.histogram == want.histogram
    assert torch.equal(got.measurement.meta, want.measurement.meta), "metadata"
    if tabled:  # counted and fitted by the kernels: the reference's table, and its symbol counts as statistics
        assert torch.equal(got.table, want.table) and torch.equal(got.statistics, want.statistics)
    slot = slot_for(want.histogram)
    a, b = buddy.pack(got, slot, store=store), buddy.pack(want, slot, store=store)
    _same_buffers(a, b)
    assert_bitexact(b.decompress(backend=backend, check=True), t)  # the kernels decode the reference's buffers
    assert_bitexact(a.decompress(backend="reference"), t)  # and the reference theirs
    a.free()
    b.free()
    if tabled:  # with learned statistics (and no table to keep) the table is fitted to their weights, as the host fits
        # the statistics themselves (fpe.fit_weights): count, fit, then measure with it
        prior = got.statistics.double() + 1
        again = buddy.measure(t, codec, entry_bytes=e, backend=backend, prior=prior)
        want = buddy.measure(t, codec, entry_bytes=e, backend="reference", prior=prior)
        assert torch.equal(again.table, want.table) and again.histogram == want.histogram
        assert torch.equal(again.measurement.meta, want.measurement.meta)
        assert torch.equal(again.statistics, got.statistics)
    return slot, got


def straddling_entries(dtype: torch.dtype, e: int) -> torch.Tensor:
    """Entries of ``e`` bytes made so auto's members' sizes straddle each other (their early stops, measure_below):
    per entry a ramp plus noise of 0 to all bits, zeros from none to most -- bpc winning by a plane or losing by
    one, zvc or fpx ahead or not."""
    per = e // torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(11)
    bits = 16 if dtype == torch.bfloat16 else 64 if dtype == torch.int64 else 32
    entries = []
    for noise in range(bits + 1):
        for zeros in (0.0, 0.3, 0.7):
            ramp = torch.arange(per, dtype=torch.int64) * (noise + 1)
            jitter = torch.randint(0, 2 ** min(noise, 62), (per,), generator=g) if noise else 0
            words = (ramp + 1000 + jitter) & ((1 << min(bits, 63)) - 1)
            words[torch.rand(per, generator=g) < zeros] = 0
            entries.append(words)
    raw = torch.cat(entries)
    if dtype == torch.int64:
        return raw
    if dtype == torch.float32:
        return raw.to(torch.int32).view(torch.float32).clone()
    return raw.to(torch.int16).view(torch.bfloat16).clone()


def check_tensors_of_one_entry(backend: str, codec: str, activations, store) -> None:
    """One whole entry, one partial entry (the tail alone: no whole entry, so count reads only the tail), and a
    tensor of one element; int64 max-pool indices and float32 activations."""
    e = 512
    tensors = [activations["i64"][: e // 8], activations["f32"][: e // 4 // 3], activations["f32"][7:8]]
    compress = functools.partial(buddy.compress, codec=codec, entry_bytes=e, store=store)
    for t in tensors:
        for slot in (0, 2):
            ratio = spec.ratio_for_slot(slot, e)
            a, b = compress(t, ratio, backend=backend), compress(t, ratio, backend="reference")
            assert a.n_entries == 1
            _same_buffers(a, b)
            assert_bitexact(b.decompress(backend=backend, check=True), t)
            assert_bitexact(a.decompress(backend="reference"), t)
            a.free()
            b.free()


def check_damage_flagged(backend: str, codec: str, activations, store) -> None:
    """Damaged buffers (:func:`_damaged`): ``backend`` raises ``CorruptDataError`` exactly where the reference does,
    and decodes the same bytes elsewhere."""
    e, slot = 512, 4
    t = Case("f32", e, 9.5, slot, None).tensor(activations)
    bt = buddy.compress(t, spec.ratio_for_slot(slot, e), codec, entry_bytes=e, backend="reference", store=store)
    buffers = [x.clone() for x in bt.buffers()]
    for what, meta, slots, overflow in _damaged(*buffers, slot, e):
        want = _decode("reference", bt, meta, slots, overflow)
        got = _decode(backend, bt, meta, slots, overflow)
        assert (got is None) == (want is None), f"{what}: {backend} {'raises' if got is None else 'decodes'}"
        assert want is None or torch.equal(got.view(torch.uint8), want.view(torch.uint8)), what
        assert what != "as written" or want is not None
    bt.free()


def check_golden(backend: str, cases: list[dict], vectors: dict, sets: dict, store) -> None:
    """``backend`` writes the golden bytes of every input of ``cases`` (sets still written) and decodes all."""
    for case in cases:
        name, codec, e = case["set"], case["codec"], case["entry_bytes"]
        dtype = getattr(torch, case["dtype"])
        t = vectors[f"{name}/{case['input']}/input"].view(dtype)
        key = f"{name}/{case['input']}/{codec}"
        table = vectors.get(f"{key}/table")
        measured = buddy.measure(t, codec, entry_bytes=e, backend=backend) if sets[name] else None
        if measured is not None:
            assert torch.equal(measured.measurement.meta, vectors[f"{key}/meta"]), f"{key}: metadata"
            assert table is None or torch.equal(measured.table, table), f"{key}: table"
        for slot in case["slots"]:
            slots, overflow = vectors[f"{key}/s{slot}/slots"], vectors[f"{key}/s{slot}/overflow"]
            if measured is not None:
                bt = buddy.pack(measured, slot, store=store)
                _, got_slots, got_overflow = bt.buffers()
                assert torch.equal(got_slots, slots) and torch.equal(got_overflow, overflow), f"{key}: slot {slot}"
                bt.free()
            out = buddy.unpack(
                vectors[f"{key}/meta"], slots, overflow, codec=codec, entry_bytes=e, slot_sectors=slot,
                shape=t.shape, dtype=dtype, table=table, backend=backend,
            )  # fmt: skip
            assert_bitexact(out, t)
