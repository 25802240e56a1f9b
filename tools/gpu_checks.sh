#!/usr/bin/env bash
# One prepared run for a lent GPU machine (one H200; Python 3.12, torch 2.11.0+cu130, no TE, no
# megatron-core, no network): Transformer Engine from the kit, the package installed with
# scripts/install_into_env.sh, tests/gpu, the GPU benchmarks. Logs and JSON go to $OUT
# (default runs/gpu_checks): gpu_checks.json (what ran, which kit risks applied, test counts),
# gpu_checks.log, pytest.log, junit.xml, bench_gpu_block.json, bench_situ.json.
#
#   bash tools/fetch_gpu_kit.sh        # here, once: kit + SHA256SUMS -> .tekit/ (ignored)
#   run(command="bash tools/gpu_checks.sh", carry=[".tekit"], timeout_s=600)   # device tool
#   bash tools/gpu_checks.sh --check   # CPU dry run: checksums, unpack to a temp dir, layout,
#                                      # GLIBCXX, imports (skipped without CUDA / Python 3.12);
#                                      # runs .venv/bin/python (scripts/setup_env.sh) if present
#   bash tools/gpu_checks.sh --help    # this text
#
# Budget (estimates; no GPU run yet): set-up ~1 min, tests/gpu ~2-3 min (timeout 210 s),
# benchmarks ~1.5 min (timeouts 120 s + 45 s): ~5-6 min, at most ~8 min, under the 10-minute call.
# Kit risks handled (README of the kit): the prebuilt extension's GLIBCXX needs are compared with
# the system libstdc++; TE's NVRTC-built norm kernels are probed and, if they fail, rerun with
# NVTE_NORM_FWD_USE_CUDNN=1 NVTE_NORM_BWD_USE_CUDNN=1 (kept for everything after); cuBLASLt
# grouped GEMM (a 13.0-era symbol may be missing) is probed and, if it fails, tests and benchmarks
# run with grouped GEMM off (GPU_CHECKS_NO_GROUPED_GEMM=1, --no-grouped-gemm). Each is recorded.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 2
mode=full
usage="usage: bash tools/gpu_checks.sh [--check | --help]; got '$*'"
[ "$#" -le 1 ] || { echo "$usage" >&2; exit 2; }  # "--check extra" ran the check, extra ignored
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;  # the header
  *) echo "$usage" >&2; exit 2 ;;
esac
out="${OUT:-$repo/runs/gpu_checks}"
kit="${KIT:-$repo/.tekit}"
# The GPU run uses the machine's python3; the CPU dry run the venv of scripts/setup_env.sh if any.
py="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [ "$mode" = check ] && [ -x "$repo/.venv/bin/python" ]; then
  py="$repo/.venv/bin/python"
fi
mkdir -p "$out"
log="$out/gpu_checks.log"
: > "$log"
say() { echo "[gpu_checks] $*" | tee -a "$log"; }
declare -A R=()  # recorded facts -> gpu_checks.json
status=0
fail() { say "FAIL: $*"; status=1; }
t_start=$(date +%s)

# ---------------------------------------------------------------- 1. kit: verify and unpack
if [ ! -f "$kit/SHA256SUMS" ] || [ ! -f "$kit/te_site.tar.xz" ]; then
  say "no kit in $kit (run: bash tools/fetch_gpu_kit.sh, and carry .tekit)"; exit 2
fi
if (cd "$kit" && sha256sum -c SHA256SUMS) >> "$log" 2>&1; then R[kit_checksum]=ok
else say "kit checksum mismatch: refusing to unpack"; R[kit_checksum]=mismatch; exit 2; fi
sum="$(cut -d' ' -f1 "$kit/SHA256SUMS" | head -1)"
if [ "$mode" = check ]; then site="$(mktemp -d)"; trap 'rm -rf "$site"' EXIT
else site="${SITE:-$repo/.tekit_site}"; fi  # ignored; survives while the machine stays warm
if [ "$(cat "$site/.sha256" 2>/dev/null)" != "$sum" ]; then
  rm -rf "$site" && mkdir -p "$site"
  t=$(date +%s)
  tar -xJf "$kit/te_site.tar.xz" -C "$site" --strip-components=1 || { say "untar failed"; exit 2; }
  echo "$sum" > "$site/.sha256"
  say "kit unpacked into $site in $(( $(date +%s) - t )) s"
fi
for need in transformer_engine/pytorch megatron/core pydantic transformer_engine/wheel_lib; do
  [ -e "$site/$need" ] || fail "kit lacks $need"
done
ext="$(ls "$site"/transformer_engine_torch*.so 2>/dev/null | head -1)"
[ -n "$ext" ] || fail "kit lacks the prebuilt transformer_engine_torch extension"

# ---------------------------------------------------------------- 2. GLIBCXX of the extension
libstdcxx="$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')"
if [ -n "$ext" ] && [ -n "$libstdcxx" ]; then
  need_v="$(strings "$ext" | grep -o 'GLIBCXX_[0-9.]*[0-9]' | sort -uV | tail -1)"
  # (grep without -q: under pipefail, -q's early exit would fail the pipeline with SIGPIPE)
  if strings "$libstdcxx" | grep -x "$need_v" > /dev/null; then R[glibcxx]="ok: needs $need_v, $libstdcxx has it"
  else  # fallback: a newer libstdc++ in the Python environment (conda-style) or /usr/local
    R[glibcxx]="MISSING: needs $need_v, $libstdcxx lacks it"
    prefix="$("$py" -c 'import sys; print(sys.prefix)' 2>/dev/null)"
    for cand in "$prefix"/lib/libstdc++.so.6 /usr/local/lib*/libstdc++.so.6; do
      if [ -f "$cand" ] && strings "$cand" | grep -x "$need_v" > /dev/null; then
        LD_LIBRARY_PATH="$(dirname "$cand")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export LD_LIBRARY_PATH
        R[glibcxx]="fallback: $libstdcxx lacks $need_v; using $cand via LD_LIBRARY_PATH"; break
      fi
    done
    case "${R[glibcxx]}" in MISSING*) fail "${R[glibcxx]}" ;; esac
  fi
else R[glibcxx]="not checked (no extension or no libstdc++ found by ldconfig)"; fi
say "GLIBCXX: ${R[glibcxx]}"

export PYTHONPATH="$site:$repo" NVTE_FRAMEWORK=pytorch PYTHONUNBUFFERED=1 NO_VCS_VERSION=1 \
  CUDA_DEVICE_MAX_CONNECTIONS=1

# ---------------------------------------------------------------- 3. install + import probes
R[python]="$py"
"$py" -c "import torch" >> "$log" 2>&1 \
  || fail "PYTHON=$py cannot import torch; allowed: a python with torch (set PYTHON=...)"
if [ "$mode" = check ]; then
  inst=(env DRY_RUN=1 OFFLINE=1 PYTHON="$py" bash scripts/install_into_env.sh)
else inst=(env OFFLINE=1 PYTHON="$py" bash scripts/install_into_env.sh); fi
if "${inst[@]}" >> "$log" 2>&1; then R[install]="ok (${inst[*]})"
else R[install]="failed (${inst[*]}), see gpu_checks.log"; fail "${R[install]}"; fi
say "install: ${R[install]}"

# the CPU dry run asks once (the probes would each start Python to skip, ~4 s apiece)
no_cuda=
if [ "$mode" = check ] \
  && ! "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" >> "$log" 2>&1; then
  no_cuda=1
fi
probe() {  # probe NAME -> sets R[probe_NAME] = ok | failed | skipped
  if [ -n "$no_cuda" ]; then R[probe_$1]=skipped; say "probe $1: skipped (no CUDA)"; return; fi
  "$py" tools/te_probe.py "$1" >> "$log" 2>&1
  case $? in 0) R[probe_$1]=ok ;; 3) R[probe_$1]=skipped ;; *) R[probe_$1]=failed ;; esac
  say "probe $1: ${R[probe_$1]}"
}
probe imports
if [ "${R[probe_imports]}" = failed ]; then fail "TE / megatron-core import"; fi
R[nvrtc_norm_fallback]=no
probe norm
if [ "${R[probe_norm]}" = failed ]; then
  export NVTE_NORM_FWD_USE_CUDNN=1 NVTE_NORM_BWD_USE_CUDNN=1
  R[nvrtc_norm_fallback]="yes: NVTE_NORM_FWD_USE_CUDNN=1 NVTE_NORM_BWD_USE_CUDNN=1"
  probe norm
  [ "${R[probe_norm]}" = ok ] || fail "TE norms fail with the cuDNN fallback too"
fi
probe fp8
[ "${R[probe_fp8]}" = failed ] && fail "FP8 te.Linear"
R[grouped_gemm]=on
probe grouped
bench_grouped=()
if [ "${R[probe_grouped]}" = failed ]; then
  export GPU_CHECKS_NO_GROUPED_GEMM=1
  R[grouped_gemm]="off: cuBLASLt grouped GEMM failed (CUDA 13.0 runtime); tests skip grouped variants"
  bench_grouped=(--no-grouped-gemm)
fi
say "grouped GEMM: ${R[grouped_gemm]}"

# ---------------------------------------------------------------- 4. tests/gpu and benchmarks
if [ "$mode" = full ]; then
  timeout 210 "$py" -m pytest -q -rs -p no:cacheprovider --junitxml="$out/junit.xml" tests/gpu \
    2>&1 | tee "$out/pytest.log" >> "$log"
  rc=${PIPESTATUS[0]}
  R[pytest]="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$out/pytest.log" | tail -1)"
  [ "$rc" = 0 ] || fail "tests/gpu exit $rc: ${R[pytest]}"
  say "tests/gpu: ${R[pytest]} (exit $rc)"
  timeout 120 "$py" benchmarks/bench_gpu_block.py "${bench_grouped[@]}" \
    --out "$out/bench_gpu_block.json" >> "$log" 2>&1 || fail "bench_gpu_block"
  timeout 45 "$py" benchmarks/bench_situ.py --device cuda --tokens 16384 --ffn 3072 \
    --dtypes bf16 fp32 --reps 10 --out "$out/bench_situ.json" >> "$log" 2>&1 || fail "bench_situ"
  R[benchmarks]="bench_gpu_block.json, bench_situ.json"
else
  R[pytest]="not run (--check)"
  "$py" -m pytest -q -p no:cacheprovider --co tests/gpu >> "$log" 2>&1 \
    && R[pytest]="collected (--check)" || fail "tests/gpu do not collect"
  "$py" benchmarks/bench_gpu_block.py --out "$site/bench_gpu_block.json" >> "$log" 2>&1 \
    && R[benchmarks]="bench_gpu_block skipped cleanly (--check)" || fail "bench_gpu_block --check"
fi

# ---------------------------------------------------------------- 5. summary
R[mode]=$mode
R[seconds]=$(( $(date +%s) - t_start ))
R[status]=$([ $status = 0 ] && echo ok || echo failed)
R[gpu]="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
for k in "${!R[@]}"; do printf '%s\t%s\n' "$k" "${R[$k]}"; done | "$py" -c '
import json, sys
d = dict(line.rstrip("\n").split("\t", 1) for line in sys.stdin)
tmp = sys.argv[1] + ".tmp"
open(tmp, "w").write(json.dumps(dict(sorted(d.items())), indent=2) + "\n")
__import__("os").replace(tmp, sys.argv[1])
print(json.dumps(dict(sorted(d.items())), indent=2))' "$out/gpu_checks.json" | tee -a "$log"
exit $status
