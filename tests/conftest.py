"""Shared fixtures and helpers of the buddy test suite.

Everything here compares *bytes*: a lossless compressor must give back the
very bits it was given (NaN payloads, -0.0 and denormals included), so no test
uses floating-point equality.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, settings

import buddy

MiB = 1 << 20

# ---------------------------------------------------------------------------
# hypothesis profiles of the fuzz tests (test_fuzz.py, test_corruption.py)
# ---------------------------------------------------------------------------
# "ci" (the default) is quick and derandomized: the same examples on every run.
# "long" is for hunting: BUDDY_FUZZ_PROFILE=long python -m pytest -q tests/test_fuzz.py tests/test_corruption.py
# They are registered as "buddy-fuzz-<name>" and not loaded globally, so hypothesis's
# own "ci" profile and the suite's other property tests keep their settings.
_FUZZ_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
settings.register_profile(
    "buddy-fuzz-ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=_FUZZ_HEALTH,
)
settings.register_profile(
    "buddy-fuzz-long",
    max_examples=5_000,
    deadline=None,
    database=None,
    print_blob=True,  # a failure prints the @reproduce_failure blob that replays it
    suppress_health_check=_FUZZ_HEALTH,
)
FUZZ_PROFILE = os.environ.get("BUDDY_FUZZ_PROFILE", "ci")
if FUZZ_PROFILE not in ("ci", "long"):
    raise ValueError(f"BUDDY_FUZZ_PROFILE must be 'ci' or 'long', got {FUZZ_PROFILE!r}")
FUZZ_SETTINGS = settings.get_profile(f"buddy-fuzz-{FUZZ_PROFILE}")
#: the share of the "ci" profile's examples a property test draws in the fast tier (see "the test tiers" below)
FAST_TIER_SHARE = 0.2


def fuzz_settings(share: float = 1.0, **overrides) -> settings:
    """Settings of one property test: the selected profile with ``share`` of its examples.

    In the fast tier the "ci" profile draws :data:`FAST_TIER_SHARE` of that;
    the exhaustive tier and the "long" profile draw all of it. ``overrides``
    are further settings (extra health checks are added to the profile's).
    """
    share *= FAST_TIER_SHARE if FUZZ_PROFILE == "ci" and not _TIER["exhaustive"] else 1.0
    if "suppress_health_check" in overrides:
        overrides["suppress_health_check"] = [*FUZZ_SETTINGS.suppress_health_check, *overrides["suppress_health_check"]]
    return settings(FUZZ_SETTINGS, max_examples=max(1, round(FUZZ_SETTINGS.max_examples * share)), **overrides)


# ---------------------------------------------------------------------------
# dtypes, with short names for readable test ids
# ---------------------------------------------------------------------------
DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
}
if hasattr(torch, "float8_e4m3fn"):
    DTYPE_NAMES[torch.float8_e4m3fn] = "f8e4m3"

ALL_DTYPES = list(DTYPE_NAMES)
DATA_KINDS = ("zeros", "relu", "random_bytes", "special")

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_id(dtype: torch.dtype) -> str:
    return f"dtype={DTYPE_NAMES.get(dtype, str(dtype).replace('torch.', ''))}"


def ids(name: str, values, fmt=str) -> list:
    """``pytest.param``s with ids ``name=value`` (``fmt`` renders the value)."""
    return [pytest.param(v, id=f"{name}={fmt(v)}") for v in values]


def dtype_params(dtypes=None) -> list:
    return [pytest.param(d, id=dtype_id(d)) for d in (ALL_DTYPES if dtypes is None else dtypes)]


def ratio_name(r: float) -> str:
    if math.isinf(r):
        return "inf"
    return {4 / 3: "4/3"}.get(r, f"{r:g}")


def is_float8(dtype: torch.dtype) -> bool:
    return "float8" in str(dtype)


# ---------------------------------------------------------------------------
# byte-level comparison
# ---------------------------------------------------------------------------
def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's data as a flat ``uint8`` CPU tensor, C order.

    Works for 0-dim, empty, bool, complex and float8 tensors; conjugate and
    negative views are materialised first (their bytes are what they read as).
    """
    t = t.detach().resolve_conj().resolve_neg()
    if t.numel() == 0:  # an empty tensor may keep any strides, which view() would refuse
        return torch.empty(0, dtype=torch.uint8)
    if t.element_size() == 1:
        t = t.view(torch.uint8)  # sub-byte dtypes (uint4, int3 ...) have no copy kernel of their own
    t = t.contiguous()
    # contiguous, but size-1 dimensions may keep any stride: flatten by hand so view() accepts it
    t = t.as_strided((t.numel(),), (1,))
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return t.cpu()


def assert_bitexact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape, device and the very same bytes."""
    assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.device == expected.device, f"device {actual.device} != {expected.device}"
    a, b = raw_bytes(actual), raw_bytes(expected)
    assert a.numel() == b.numel(), f"{a.numel()} bytes != {b.numel()} bytes"
    if not torch.equal(a, b):
        bad = (a != b).nonzero().view(-1)
        i = int(bad[0])
        raise AssertionError(
            f"{bad.numel()} of {a.numel()} bytes differ; first at byte {i}: {int(a[i]):#04x} != {int(b[i]):#04x}"
        )


def unpack_like(bt: buddy.BuddyTensor, meta, slots, overflow, **kwargs) -> torch.Tensor:
    """``buddy.unpack`` of the given buffers with ``bt``'s codec, entry size, slot, shape, dtype (and table)."""
    kwargs.setdefault("table", None if bt.table is None else bt.table.clone())
    return buddy.unpack(
        meta,
        slots,
        overflow,
        codec=bt.codec,
        entry_bytes=bt.entry_bytes,
        slot_sectors=bt.slot_sectors,
        shape=bt.shape,
        dtype=bt.dtype,
        **kwargs,
    )


def assert_roundtrip(bt: buddy.BuddyTensor, original: torch.Tensor) -> torch.Tensor:
    """``bt.decompress()`` is a new tensor bit-identical to ``original``.

    Dense layouts (contiguous, transposed, channels-last) keep their strides;
    anything else comes back contiguous.
    """
    out = bt.decompress()
    if buddy.layout.dense_strides(original.shape, original.stride()):
        assert out.stride() == original.stride() or original.numel() <= 1
    else:
        assert out.is_contiguous()
    assert not out.requires_grad
    assert_bitexact(out, original)
    return out


class Encoded(NamedTuple):
    """Entries encoded under the format rules: payloads ``(n, E)`` (zero past ``k`` sectors), ``k``, modes."""

    payload: torch.Tensor
    sectors: torch.Tensor
    modes: torch.Tensor


def encode(codec, entries: torch.Tensor, word_bytes: int) -> Encoded:
    """``buddy.format.encode`` of ``(n, E)`` entries with a codec (name or instance)."""
    return Encoded(*buddy.format.encode(buddy.get_codec(codec), entries, word_bytes))


def sizes(codec, entries: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """``k`` of each of ``(n, E)`` entries under the format rules (``buddy.format.measure_entries``)."""
    return buddy.format.measure_entries(buddy.get_codec(codec), entries.contiguous(), word_bytes)[0]


def decode(codec, payload: torch.Tensor, sectors: torch.Tensor, modes: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """``buddy.format.decode_entries`` with a codec (name or instance); sizes and modes as any int tensors."""
    return buddy.format.decode_entries(
        buddy.get_codec(codec), payload, sectors.to(torch.int32), modes.to(torch.int32), word_bytes
    )


def encode_values(codec, values: torch.Tensor, entry_bytes: int) -> tuple[torch.Tensor, Encoded]:
    """``(entries, Encoded)`` of a 1-D tensor filling whole entries, after checking sizes and the round trip."""
    w = buddy.spec.word_bytes(values.dtype)
    entries = raw_bytes(values).view(-1, entry_bytes)
    enc = encode(codec, entries, w)
    assert torch.equal(sizes(codec, entries, w), enc.sectors)
    assert torch.equal(decode(codec, enc.payload, enc.sectors, enc.modes, w), entries)
    return entries, enc


def entry_payloads(t: torch.Tensor, codec: str, entry_bytes: int, table: torch.Tensor | None = None):
    """Independent reference: the entry-level encoding of ``t``'s zero-padded entries (with a tensor's ``table``)."""
    codec = buddy.get_codec(codec).bind(table, buddy.spec.word_bytes(t.dtype))
    data = raw_bytes(t).to(t.device)
    n = -(-data.numel() // entry_bytes)
    padded = torch.zeros(n * entry_bytes, dtype=torch.uint8, device=t.device)
    padded[: data.numel()] = data
    entries = padded.view(n, entry_bytes)
    return entries, encode(codec, entries, buddy.spec.word_bytes(t.dtype))


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------
def _float_specials(dtype: torch.dtype) -> list[int]:
    """Bit patterns of the awkward values of a floating dtype, as unsigned ints."""
    bits = torch.empty((), dtype=dtype).element_size() * 8
    if is_float8(dtype):
        # e4m3fn has no inf: 0x7f/0xff are its NaNs; e5m2 is IEEE-like.
        return [0x7F, 0xFF, 0x80, 0x01, 0x07, 0x87, 0x7C, 0x7D, 0xFC, 0x7E]
    mant = round(-math.log2(torch.finfo(dtype).eps))
    sign = 1 << (bits - 1)
    inf = ((1 << (bits - 1 - mant)) - 1) << mant
    quiet = 1 << (mant - 1)
    return [
        inf,  # +inf
        sign | inf,  # -inf
        inf | 1,  # signalling NaN, payload 1
        inf | quiet | 0x5,  # quiet NaN with a payload
        sign | inf | quiet | 0x3,  # negative quiet NaN with a payload
        sign | inf | ((1 << mant) - 1),  # negative NaN, all mantissa bits set
        inf | quiet,  # the canonical NaN
        sign,  # -0.0
        1,  # smallest denormal
        (1 << mant) - 1,  # largest denormal
        sign | 1,  # negative denormal
    ]


def _to_signed(p: int, bits: int) -> int:
    return p - (1 << bits) if p >= 1 << (bits - 1) else p


def _random_bytes(numel: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g).view(dtype)


def make_data(kind: str, numel: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A deterministic 1-D tensor of ``numel`` elements.

    kinds: ``zeros``; ``relu`` (ReLU of a normal sample, about half zero);
    ``random_bytes`` (uniform random bytes: incompressible, forces overflow;
    for bool, random False/True since other bytes are not valid bools);
    ``special`` (NaNs with non-canonical payloads, +-inf, -0.0 and denormals
    mixed into normal values; random values for integer and bool dtypes).
    """
    g = generator
    if kind == "zeros":
        return torch.zeros(numel, dtype=dtype)
    if dtype == torch.bool:
        if kind in ("relu", "random_bytes", "special"):
            return torch.randint(0, 2, (numel,), generator=g).bool()
        raise ValueError(f"unknown data kind {kind!r}")
    if kind == "random_bytes":
        return _random_bytes(numel, dtype, g)
    if kind == "relu":
        if dtype.is_complex:
            re = torch.relu(torch.randn(numel, generator=g))
            im = torch.relu(torch.randn(numel, generator=g))
            return torch.complex(re, im).to(dtype)
        if dtype.is_floating_point:
            return torch.relu(torch.randn(numel, generator=g, dtype=torch.float64)).to(dtype)
        hi = min(torch.iinfo(dtype).max, 1 << 20)
        return torch.randint(-hi, hi + 1, (numel,), generator=g, dtype=torch.int64).clamp_(min=0).to(dtype)
    if kind == "special":
        if dtype.is_complex:
            part = {torch.complex64: torch.float32, torch.complex128: torch.float64}[dtype]
            return torch.view_as_complex(make_data("special", 2 * numel, part, g).view(numel, 2))
        if not dtype.is_floating_point:
            return _random_bytes(numel, dtype, g)
        bits = torch.empty((), dtype=dtype).element_size() * 8
        ivt = _INT_VIEW[bits // 8]
        if is_float8(dtype):
            base = _random_bytes(numel, dtype, g)
        else:
            base = (torch.randn(numel, generator=g, dtype=torch.float64) * 100).to(dtype)
        ints = base.view(ivt).clone()
        pats = torch.tensor([_to_signed(p, bits) for p in _float_specials(dtype)], dtype=ivt)
        # every pattern at least once (when there is room), then about a quarter of the values
        count = min(numel, max(numel // 4, pats.numel()))
        where = torch.randperm(numel, generator=g)[:count]
        ints[where] = pats[torch.arange(count) % pats.numel()]
        return ints.view(dtype)
    raise ValueError(f"unknown data kind {kind!r}")


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------
@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded CPU generator: every test sees the same data on every run."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def store() -> buddy.BuddyStore:
    """A fresh store per test (small blocks, so tests exercise several of them)."""
    return buddy.BuddyStore(capacity_bytes=512 * MiB, block_bytes=1 * MiB, pin=False)


@pytest.fixture(scope="session")
def activations() -> dict[str, torch.Tensor]:
    """Real activations for the kernels' tests (kernel_cases.activations: captured once a session)."""
    import kernel_cases

    return kernel_cases.activations()


@pytest.fixture
def tracker() -> buddy.Tracker:
    """A fresh tracker per test (no history from other tests)."""
    return buddy.Tracker()


def tracker_step(tracker: buddy.Tracker, policy, tensors, entry_bytes: int) -> list:
    """One training step through ``tracker``: every ``(key, histogram)`` planned and recorded, in order, each
    tensor ``sum(histogram) * entry_bytes`` bytes; ``[(key, histogram, placement)]``."""
    from buddy.layout import Layout

    tracker.begin_step(policy)
    out = []
    for key, hist in tensors:
        layout = Layout(entry_bytes, sum(hist) * entry_bytes)
        place = tracker.plan(key, hist, layout=layout, policy=policy)
        predicted = place.predicted_overflow_bytes
        tracker.record(key, hist, slot=place.slot, layout=layout, predicted_overflow_bytes=predicted)
        out.append((key, hist, place))
    return out


@pytest.fixture
def fresh_default_store():
    """Isolates tests that touch the process-wide default store."""
    previous = buddy.default_store()
    buddy.set_default_store(None)
    yield
    buddy.set_default_store(previous)


@pytest.fixture
def temporary_codec():
    """``temporary_codec(codec)`` registers a codec (and its reference implementation) for one test only."""
    names = []

    def register(codec: buddy.codecs.Codec, **kwargs) -> buddy.codecs.Codec:
        buddy.codecs.register_codec(codec, **kwargs)
        names.append(codec.name)
        return codec

    yield register
    for name in names:
        buddy.codecs.unregister_codec(name)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """buddy warns once per cause per process: every test sees its first warning."""
    monkeypatch.setattr(buddy.saved, "_warned", set())


@pytest.fixture(autouse=True)
def ledger() -> buddy.ledger.DeviceLedger:
    """A fresh process-wide ledger for every test: the device bytes held start at zero."""
    fresh = buddy.ledger.DeviceLedger()
    previous = buddy.ledger.set_default_ledger(fresh)
    yield fresh
    buddy.ledger.set_default_ledger(previous)


def held(store: buddy.BuddyStore | None = None) -> tuple[int, int, int]:
    """``(buddy bytes held by store, device bytes held, tensors held)``: all zero when nothing is held."""
    st = buddy.ledger.default_ledger().stats()
    return (store.bytes_held if store is not None else 0), st.device_bytes_held, st.tensors_held


HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture
def cuda() -> torch.device:
    """The CUDA device; skips the test when there is none."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.hookimpl(tryfirst=True)  # the tiers' markers must be there before -m deselects by them
def pytest_collection_modifyitems(config, items):
    """The test tiers' markers (see "the test tiers" below); tests marked ``gpu`` skip cleanly without CUDA."""
    mark_tiers(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------
# the test tiers
# ---------------------------------------------------------------------------
# The fast tier is the README's `python -m pytest -q` (pyproject's addopts deselect `slow` and `exhaustive`). Of
# each test function with more than FAST_TIER_CASES parametrized cases it runs a covering subset: cases that
# together hold every pair of parameter values some case holds (every codec with every dtype, every dtype with
# every size, ...), found greedily in collection order, so the same cases on every run. The other cases are
# marked `exhaustive`; `-m exhaustive` runs them. Property tests run in both tiers: with FAST_TIER_SHARE of their
# examples in the fast one, with all of them in the exhaustive one. GPU tests are never thinned (they skip here,
# and on a GPU machine all of them are the point). CI runs the fast tier, then the exhaustive one.
FAST_TIER_CASES = 24
#: filled by pytest_configure, before any test module is imported (fuzz_settings reads it at import)
_TIER = {"exhaustive": True}


def _selects_exhaustive(markexpr: str) -> bool:
    """Whether a ``-m`` expression selects a test marked ``exhaustive`` alone: then the exhaustive tier runs."""
    if not markexpr:
        return True
    from _pytest.mark.expression import Expression

    return Expression.compile(markexpr).evaluate(lambda name, **_: name == "exhaustive")


def pytest_configure(config):
    _TIER["exhaustive"] = _selects_exhaustive(config.option.markexpr)


def _value_key(value):
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def covering_cases(cases: list[dict]) -> set[int]:
    """Indices of ``cases`` (parameter name -> value) that together hold every pair of values any case holds.

    Greedy: each step takes the first case that adds the most pairs not yet
    held. A function with one parameter keeps every value once.
    """
    pairs = []
    for case in cases:
        items = sorted(((name, _value_key(v)) for name, v in case.items()), key=lambda kv: kv[0])
        pairs.append(set(itertools.combinations(items, 2)) if len(items) > 1 else set(items))
    uncovered = set().union(*pairs)
    chosen: set[int] = set()
    while uncovered:
        best = max(range(len(cases)), key=lambda i: len(pairs[i] & uncovered))
        chosen.add(best)
        uncovered -= pairs[best]
    return chosen


def mark_tiers(items) -> None:
    """Mark ``exhaustive`` what the fast tier leaves out, and in the exhaustive tier the property tests too."""
    exhaustive = pytest.mark.exhaustive
    # slow tests are never exhaustive: `-m exhaustive` replaces pyproject's `-m`, and would select them
    tiered = [item for item in items if item.get_closest_marker("slow") is None]
    functions: dict[str, list] = {}
    for item in tiered:
        if item.get_closest_marker("gpu") is not None or not hasattr(item, "callspec"):
            continue
        if _DEFAULTS_IDS["library"] in item.callspec.id.split("-"):
            item.add_marker(exhaustive)  # the library's defaults: test_defaults.py runs them in the fast tier
        else:
            functions.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    for cases in functions.values():
        if len(cases) > FAST_TIER_CASES:
            keep = covering_cases([item.callspec.params for item in cases])
            for i, item in enumerate(cases):
                if i not in keep:
                    item.add_marker(exhaustive)
    if _TIER["exhaustive"]:
        for item in tiered:
            if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
                item.add_marker(exhaustive)  # again, with every example


def field(value: int, width: int) -> str:
    """An unsigned field as stream bits: least significant bit first (the codecs' bit streams)."""
    assert 0 <= value < 1 << width, (value, width)
    return "".join(str((value >> i) & 1) for i in range(width))


def stream_bytes(bits: str, nbytes: int) -> list[int]:
    """Stream-order bits -> payload bytes (bit t is bit t % 8 of byte t // 8), zero padded."""
    assert len(bits) <= 8 * nbytes
    out = [0] * nbytes
    for t, bit in enumerate(bits):
        out[t // 8] |= int(bit) << (t % 8)
    return out


#: the defaults most tests were written against: the paper's entry size and the cheapest codec
SUITE_CODEC, SUITE_ENTRY_BYTES = "zvc", 128
#: the two configurations of modules marked ``both_defaults``
_DEFAULTS_IDS = {"pinned": f"defaults={SUITE_CODEC}@{SUITE_ENTRY_BYTES}", "library": "defaults=library"}


def pytest_generate_tests(metafunc):
    """Tests marked ``both_defaults`` run twice: under zvc at E = 128 and under the library's own defaults."""
    if metafunc.definition.get_closest_marker("both_defaults") and "suite_defaults" in metafunc.fixturenames:
        metafunc.parametrize("suite_defaults", list(_DEFAULTS_IDS), indirect=True, ids=list(_DEFAULTS_IDS.values()))


@pytest.fixture(autouse=True)
def suite_defaults(request):
    """Run each test with ``zvc`` at E = 128 unless it runs under the library's defaults.

    Tests state what they depend on: those marked ``library_defaults`` see
    the library's own defaults (``auto2`` at 4096 B, chosen by
    ``experiments.decide``) untouched; those marked ``both_defaults`` run
    under each. The previous defaults come back afterwards, the backend
    too: an experiment's main() sets the one it runs process-wide.
    """
    which = getattr(request, "param", "pinned")
    previous = buddy.defaults()
    try:
        if which == "library" or request.node.get_closest_marker("library_defaults"):
            yield which
        else:
            buddy.set_defaults(codec=SUITE_CODEC, entry_bytes=SUITE_ENTRY_BYTES)
            yield which
    finally:
        buddy.set_defaults(codec=previous.codec, entry_bytes=previous.entry_bytes, backend=previous.backend)


# ---------------------------------------------------------------------------
# the host harness of the device code
# ---------------------------------------------------------------------------
_CSRC = Path(__file__).resolve().parents[1] / "csrc"
_HOST_SOURCE = Path(__file__).resolve().parent / "host" / "codec_host.cpp"


@pytest.fixture(scope="session")
def host_exe():
    """``host_exe(E)``: tests/host/codec_host.cpp built for entry size E (skips without g++).

    It runs the device codecs of csrc/ on the host under an emulated warp
    (see tests/test_device_codecs.py). A build takes 20-30 s, so it is cached on disk beside the emulator's, by
    the hash of the sources, the flags and the compiler (a test run's workers and the next run share it).
    """
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    import emulator

    built: dict[int, Path] = {}

    def get(entry_bytes: int) -> Path:
        if entry_bytes not in built:
            defines = [f"-D{k}={v}" for k, v in buddy.spec.c_defines(entry_bytes).items()]
            base = ["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{_CSRC}", *defines]
            # undefined behaviour (bad shifts, overflows) aborts when the sanitizer is available
            ubsan = ["-fsanitize=undefined", "-fno-sanitize-recover=undefined"]
            name, key = f"codec_host-E{entry_bytes}", (_HOST_SOURCE.read_bytes(), base, ubsan)
            try:
                exe = emulator.cached_build(name, [*base, *ubsan, str(_HOST_SOURCE)], *key, folders=(_CSRC,))
            except RuntimeError:  # no sanitizer runtime: built without it, kept under the same name
                exe = emulator.cached_build(name, [*base, str(_HOST_SOURCE)], *key, folders=(_CSRC,))
            built[entry_bytes] = exe
        return built[entry_bytes]

    return get


@contextlib.contextmanager
def emulated_cpu_kernels(codec: str, seed: int):
    """``codec``'s kernels, the real sources under the emulator (its ASan build), as the codec's default on CPU
    tensors (backend "cuda"); the table as it was afterwards. Yields the emulator (its ``launches``)."""
    import functools

    from buddy import selftest
    from buddy.engines import cuda as bcuda

    if shutil.which("g++") is None:
        pytest.skip("the emulator needs g++")
    from emulator import Emulator

    selftest.reset()
    before = buddy.dispatch.implementations(codec, device="cpu")
    with Emulator("asan", seed=seed) as emu:
        factory = functools.partial(bcuda.CudaEngine, launch=emu, device_type="cpu")
        buddy.dispatch.register(codec, "cpu", "cuda", factory, default=True, replace=True)
        try:
            yield emu
        finally:  # the codec's CPU default as it was (the native engine), in its place in the table
            buddy.dispatch.unregister(codec, "cpu", "cuda")
            for row in (r for r in before if r.default):
                buddy.dispatch.register(
                    codec, "cpu", row.backend, row.factory, default=True, requires=row.requires, replace=True
                )
            selftest.reset()


def record_results(monkeypatch, owner, name: str) -> list:
    """Replace ``owner.name`` (a function) for the test by one that calls it and appends what it returns to the list
    returned, in order (e.g. the BuddyTensors a session packs)."""
    made: list = []
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        made.append(result)
        return result

    monkeypatch.setattr(owner, name, spy)
    return made
