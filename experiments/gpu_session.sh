#!/usr/bin/env bash
# One call on a lent GPU machine: set up, run one phase, write everything under $OUT.
#
#   bash experiments/gpu_session.sh PHASE      PHASE: check | tests | sanitize | bench | step | all
#
#   check     the environment (GPU, driver, versions) and a first CUDA compress/decompress per codec
#   tests     the whole suite, GPU-marked tests included, on the GPU machine's 16 cores
#   sanitize  compute-sanitizer memcheck and racecheck over the kernel tests (small sizes)
#   bench     experiments.bench_cuda on 256 MiB of real activations, fp32 and bf16 (JSON under $OUT/bench)
#   step      experiments.step_time: ResNet-50 and GPT-2-small steps under every method (JSON, PNG under $OUT/step_time)
#   all       check, tests, sanitize, bench, step (longer than one call's 10 minutes: use the phases)
#
# The machine is bare and cannot reach a registry: wheels it lacks travel in .whl/ (git ignores it)
# and are installed from there. Fill it once, here, with (Python 3.12, x86-64):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl nvidia-nvcomp-cu13 zstandard lz4
# and carry .whl in the call. Everything the phase prints also goes to $OUT/<phase>.log; $OUT/env.txt
# says where it ran. Results are written beside them (at most 8 files come back from $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-check}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi

environment() {
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvcc --version | tail -n 2
    python3 -c "import buddy.env as e; print(e.format_environment())"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

check() {
  python3 - <<'EOF'
import torch, buddy
x = torch.relu(torch.randn(1 << 22, device="cuda"))
for codec in ("zvc", "fpx", "bpc", "auto", "fpe", "auto2"):
    bt = buddy.compress(x, codec=codec, backend="cuda")
    ref = buddy.compress(x, codec=codec, backend="reference")
    same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(bt.buffers(), ref.buffers()))
    same = same and (bt.table is None) == (ref.table is None) and (bt.table is None or torch.equal(bt.table, ref.table))
    exact = torch.equal(bt.decompress(check=True).view(torch.int32), x.view(torch.int32))
    print(f"{codec}: buffers equal to the reference {same}, round trip exact {exact}, ratio {bt.effective_ratio:.3f}")
# the table fitted on the GPU (one read) against the host's, on other word sizes and an awkward size
for dtype in (torch.bfloat16, torch.float64, torch.uint8):
    y = torch.relu(torch.randn(1_000_003, device="cuda")).to(dtype)
    m = buddy.measure(y, "auto2", backend="cuda")
    r = buddy.measure(y, "auto2", backend="reference")
    print(f"auto2 {dtype}: table equal {torch.equal(m.table, r.table)}, histogram equal {m.histogram == r.histogram}, "
          f"reads {m.engine.readbacks}")
# every golden vector decoded by the kernels: fpe/auto2 tables of format 1 (format_v2), 2 (format_v2_table2) and
# 3 (format_v3: the split layout, every lane)
import json, numpy
for name in ("format_v1", "format_v2", "format_v2_table2", "format_v3"):
    cases = json.load(open(f"tests/golden/{name}.json"))["cases"]
    vectors = numpy.load(f"tests/golden/{name}.npz")
    get = lambda k: torch.from_numpy(vectors[k].copy()).cuda()
    bad = 0
    for case in cases:
        dtype, key = getattr(torch, case["dtype"]), f"{case['input']}/{case['codec']}"
        want = get(f"{case['input']}/input").view(dtype)
        table = get(f"{key}/table") if f"{key}/table" in vectors.files else None
        for slot in case["slots"]:
            overflow = torch.from_numpy(vectors[f"{key}/s{slot}/overflow"].copy())  # buddy memory: the host
            out = buddy.unpack(get(f"{key}/meta"), get(f"{key}/s{slot}/slots"), overflow,
                               codec=case["codec"], entry_bytes=case["entry_bytes"], slot_sectors=slot,
                               shape=want.shape, dtype=dtype, table=table,
                               backend=None if case["codec"] == "raw" else "cuda")  # raw has no kernels
            bad += not torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    print(f"golden {name}: {len(cases)} cases decoded by the kernels, {bad} differ")
EOF
}

tests() {
  # -n 8 where xdist is installed; each file's tests stay in one worker (fixtures at module scope)
  local parallel=()
  python3 -c "import xdist" 2>/dev/null && parallel=(-n 8 --dist loadfile)
  local timeout=()
  python3 -c "import pytest_timeout" 2>/dev/null && timeout=(--timeout 900)
  python3 -m pytest -q -p no:cacheprovider "${parallel[@]}" "${timeout[@]}" -ra tests/
}

sanitize() {
  # every codec, two dtypes, one kind of data, the default entry size: memcheck runs tens of times slower
  local select=(tests/test_gpu_cuda.py -k "write_the_reference_buffers and 4096 and (f32 or bf16) and relu" -x)
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all \
      python3 -m pytest -q -p no:cacheprovider "${select[@]}" -o addopts="" -m gpu || return $?
  done
}

bench() {
  python3 -m experiments.bench_cuda --out "$OUT/bench" --repeats 10 --warmup 2
}

step() {
  python3 -m experiments.step_time --device cuda --out "$OUT/step_time" --no-progress
}

environment
status=0
for step in $([ "$phase" = all ] && echo check tests sanitize bench step || echo "$phase"); do
  case "$step" in
  check | tests | sanitize | bench | step) "$step" 2>&1 | tee "$OUT/$step.log" || status=$? ;;
  *)
    echo "unknown phase $step: check | tests | sanitize | bench | step | all" >&2
    exit 2
    ;;
  esac
done
exit $status
