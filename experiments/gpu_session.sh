#!/usr/bin/env bash
# One phase of a GPU session, in one call on a lent machine: install the carried wheels, run the phase,
# write <phase>.json and <phase>.log under $OUT (flat names; experiments/lab/gpu_session.py says what each holds).
#
#   bash experiments/gpu_session.sh lease         a lease of 15 minutes in one call: essentials, tests 1/1,
#                                                 sanitize, each step cut to the call's deadline (540 s)
#   bash experiments/gpu_session.sh essentials    check, step time (6 methods, the read-free step under sync
#                                                 debug mode "error", each buddy step profiled), bench (5
#                                                 repeats) and ncu in one phase
#   bash experiments/gpu_session.sh check         golden vectors through every kernel both ways
#   bash experiments/gpu_session.sh tests 1/2     the curated GPU tests, shard 1 of 2 (then 2/2)
#   bash experiments/gpu_session.sh sanitize      compute-sanitizer memcheck, racecheck, synccheck, initcheck
#   bash experiments/gpu_session.sh bench         every codec's kernels vs nvcomp and memcpy, 256 MiB, fp32 + bf16
#   bash experiments/gpu_session.sh step          step time and the largest batch under a real memory cap
#   bash experiments/gpu_session.sh frontier      step time against capacity: every method, the buddy budgets
#   bash experiments/gpu_session.sh ncu           (optional) Nsight Compute over the default codec's kernels
#   bash experiments/gpu_session.sh --dry-run     anywhere: the travelling size, then every phase's entry
#                                                 points up to their first CUDA call (CI runs this)
#
# Each phase is one call of at most 8 minutes; experiments/lab/README.md gives the calls, the expected times and
# how to commit what comes back.
#
# The machine is bare and reaches no registry: the wheels it lacks travel in .whl/ (git ignores it) and the
# call carries them (carry: [".whl"]). Fill .whl/ once, here (CUDA 13, CPython 3.12, x86-64), with exactly:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12 zstandard==0.25.0 lz4==4.4.5 \
#     pytest-timeout==2.4.0
#
# nvidia-nvcomp-cu13 is nvcomp's Python API; the library it loads is nvidia-libnvcomp-cu13, which buddy's
# nvcomp codecs bind too. For a machine on CUDA 12, download the -cu12 pair instead: the phases install the
# pair of the machine's CUDA major version and fail, saying which wheel is missing, without it.
# Then, before the first call: python3 experiments/lab/travel_size.py (it must print "fits").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "${1:-}" = "--dry-run" ]; then
  shift
  "$PY" experiments/lab/travel_size.py || exit 1
  exec "$PY" -m experiments.lab.gpu_session --dry-run "$@"
fi

phase=${1:-}
shard=${2:-}
case "$phase" in
lease | essentials | check | sanitize | bench | step | frontier | ncu) [ -z "$shard" ] || { echo "only tests takes a shard" >&2; exit 2; } ;;
tests) shard=${shard:-1/2} ;; # 2: TEST_SHARDS in experiments/lab/gpu_session.py
*)
  echo "usage: bash experiments/gpu_session.sh lease | essentials | check | tests I/N | sanitize | bench | step | frontier | ncu | --dry-run" >&2
  exit 2
  ;;
esac
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
label=$phase${shard:+-${shard/\//of}}

# The carried wheels, into the interpreter's environment (else a folder on PYTHONPATH); what is missing is
# named in BUDDY_WHEELS_MISSING, which fails the phase with the reason.
install_wheels() {
  local major found wanted=() present=() missing=()
  major=$("$PY" -c 'import torch; print((torch.version.cuda or "").split(".")[0])' 2>/dev/null)
  wanted=(zstandard lz4 pytest_timeout "nvidia_nvcomp_cu${major:-?}" "nvidia_libnvcomp_cu${major:-?}")
  [ -n "$major" ] || missing+=("nvcomp's pair: PyTorch names no CUDA version, so no CUDA major to match")
  for name in "${wanted[@]}"; do
    found=$(compgen -G ".whl/$name-*.whl" | head -n 1)
    if [ -n "$found" ]; then present+=("$found"); elif [ -n "$major" ]; then missing+=("$name"); fi
  done
  if [ ${#present[@]} -gt 0 ]; then
    local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir)
    if ! "${pip[@]}" "${present[@]}"; then
      local site
      site=$(mktemp -d)
      echo "installing into the environment failed: into $site (on PYTHONPATH) instead"
      if "${pip[@]}" --upgrade --target "$site" "${present[@]}"; then
        export PYTHONPATH="$site:$PYTHONPATH"
      else
        missing+=("every wheel: pip could not install ${present[*]##*/}")
        present=()
      fi
    fi
  fi
  # entries joined by "; " (gpu_session.py splits them there)
  BUDDY_WHEELS_INSTALLED=$(printf '%s; ' "${present[@]##*/}")
  BUDDY_WHEELS_MISSING=$(printf '%s; ' "${missing[@]}")
  export BUDDY_WHEELS_INSTALLED="${BUDDY_WHEELS_INSTALLED%; }" BUDDY_WHEELS_MISSING="${BUDDY_WHEELS_MISSING%; }"
  echo "wheels installed: ${BUDDY_WHEELS_INSTALLED:-none}"
  echo "wheels missing: ${BUDDY_WHEELS_MISSING:-none}"
}

{
  echo "== what travelled"
  "$PY" experiments/lab/travel_size.py --carry .whl || echo "(over the limit: see experiments/lab/README.md)"
  echo "== wheels (.whl/)"
  install_wheels
  "$PY" -m experiments.lab.gpu_session "$phase" ${shard:+"$shard"} --out "$OUT" \
    --command "bash experiments/gpu_session.sh $phase${shard:+ $shard}"
} 2>&1 | tee "$OUT/$label.log"
exit "${PIPESTATUS[0]}"
