#!/usr/bin/env bash
# The whole harness on a GPU, at one float32 matmul precision, each step's outcome logged.
#
#   bash scripts/gpu-suite.sh PRECISION OUTDIR [STEP ...]
#
# PRECISION: float32 (MLX_ENABLE_TF32=0) or tf32 (what CUDA and Apple M5 GPUs serve with).
# STEPs (default: all, in this order):
#   pytest  the default test suite (the README's test command), on $WORKERS xdist workers
#   fuzz    tqbatch fuzz --examples 200 (over $FUZZ_WORKERS processes, default 1)
#   e2e     tqbatch e2e
#   models  tqbatch models (the model-family matrix)
#   bench   tqbatch bench --full, then tqbatch bench --decode --full
# Each step writes OUTDIR/<step>-<precision>.log; OUTDIR/summary-<precision>.txt gets one
# line per step: its exit code and wall time; $STEP_TIMEOUT (seconds) bounds each step.
# The script runs every step whatever the earlier ones returned, and exits non-zero if any
# failed.
#
# It runs `python3 -m tqbatch` and `python3 -m pytest` from the project root with whatever
# MLX the interpreter imports: `nox -s gpu` installs MLX's CUDA build and calls it; on a
# machine without registry access, ../shared/gpu/stage.sh stages the wheels instead.
set -uo pipefail
cd "$(dirname "$0")/.."
precision=${1:?precision: float32 or tf32}
out=${2:?output directory}
shift 2
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(pytest fuzz e2e models bench)
case "$precision" in float32 | tf32) ;; *) echo "precision: float32 or tf32, not $precision" >&2; exit 2 ;; esac
mkdir -p "$out"
PY=${PYTHON:-python3}
export TQBATCH_PRECISION=$precision TQBATCH_DEVICE=${TQBATCH_DEVICE:-gpu}
if [ "$precision" = float32 ]; then export MLX_ENABLE_TF32=0; else export MLX_ENABLE_TF32=1; fi
summary="$out/summary-$precision.txt"
"$PY" -c "from tqbatch.testing import backend; print(backend.describe_line())" >"$summary" 2>&1

status=0
for step in "${steps[@]}"; do
    case "$step" in
        pytest) cmd=("$PY" -m pytest -p no:cacheprovider -n "${WORKERS:-8}" -q) ;;
        fuzz) cmd=("$PY" -m tqbatch fuzz --examples 200 --workers "${FUZZ_WORKERS:-1}") ;;
        e2e) cmd=("$PY" -m tqbatch e2e) ;;
        models) cmd=("$PY" -m tqbatch models) ;;
        bench) cmd=(bash -c "'$PY' -m tqbatch bench --full && '$PY' -m tqbatch bench --decode --full") ;;
        *) echo "unknown step: $step" >&2; exit 2 ;;
    esac
    start=$SECONDS
    timeout "${STEP_TIMEOUT:-0}" "${cmd[@]}" >"$out/$step-$precision.log" 2>&1
    rc=$?
    printf '%-7s rc=%-3s %5ss\n' "$step" "$rc" "$((SECONDS - start))" | tee -a "$summary"
    [ "$rc" -eq 0 ] || status=1
done
exit "$status"
