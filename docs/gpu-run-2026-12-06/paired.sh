#!/bin/bash
# The paired run: the mlx-lm matrix's tests with the fused decode kernel on (auto) and
# off (vectorized), at TF32 and at float32, four pytest processes at once (3 xdist
# workers each), beside diagnose_ties.py's margins and tf32_probe.py's roundings. The
# TQBATCH_DECODE_TF32=rna lines need tf32-operand-rounding.diff here (an experiment, not
# kept). Only its first eight files came back (the rest were rerun one at a time).
# From the project root on the GPU machine, after ../shared/gpu's on-device.sh; logs to $1.
O=${1:?output directory}
mkdir -p "$O"
D=docs/gpu-run-2026-12-06
{ nvidia-smi -L; python3 -c "from tqbatch.testing import backend; print(backend.describe_line())"; } >"$O/device.txt" 2>&1
MLX_ENABLE_TF32=1 timeout 120 python3 $D/tf32_probe.py >"$O/tf32-probe-tf32.txt" 2>&1
MLX_ENABLE_TF32=0 timeout 120 python3 $D/tf32_probe.py >"$O/tf32-probe-float32.txt" 2>&1
T=tests/e2e/test_mlx_lm_matrix.py
for p in tf32 float32; do
  tf=$([ $p = tf32 ] && echo 1 || echo 0)
  for k in auto vectorized; do
    ( start=$SECONDS
      TQBATCH_PRECISION=$p TQBATCH_DEVICE=gpu MLX_ENABLE_TF32=$tf TQBATCH_DECODE_KERNEL=$k \
        timeout ${PYTEST_TIMEOUT:-330} python3 -m pytest -p no:cacheprovider -n 3 -q -rfE $T \
        >"$O/matrix-$p-$k.log" 2>&1
      echo "rc=$? ${p} TQBATCH_DECODE_KERNEL=$k $((SECONDS - start))s" >>"$O/matrix-$p-$k.log" ) &
  done
done
( start=$SECONDS
  TQBATCH_PRECISION=tf32 TQBATCH_DEVICE=gpu MLX_ENABLE_TF32=1 TQBATCH_DECODE_KERNEL=auto \
    TQBATCH_DECODE_TF32=rna timeout ${PYTEST_TIMEOUT:-330} python3 -m pytest -p no:cacheprovider \
    -n 2 -q -rfE $T >"$O/matrix-tf32-auto-rna.log" 2>&1
  echo "rc=$? tf32 TQBATCH_DECODE_KERNEL=auto TQBATCH_DECODE_TF32=rna $((SECONDS - start))s" \
    >>"$O/matrix-tf32-auto-rna.log" ) &
( for cfg in "1 auto -" "1 vectorized -" "1 auto rna" "1 auto rz" "0 auto -" "0 vectorized -"; do
    set -- $cfg
    r=$3; [ "$r" = - ] && r=
    MLX_ENABLE_TF32=$1 TQBATCH_DECODE_KERNEL=$2 TQBATCH_DECODE_TF32=$r timeout 120 \
      python3 $D/diagnose_ties.py >"$O/ties-$1-$2${r:+-$r}.txt" 2>&1
  done ) &
wait
tail -n 3 "$O"/matrix-*.log
# The kernel's own tests at TF32: the float32_only marks, and the equivalence property
# with the kernel's operands as they are and rounded to TF32 (nearest).
TQBATCH_PRECISION=tf32 TQBATCH_DEVICE=gpu MLX_ENABLE_TF32=1 TQBATCH_EQUIVALENCE_LOG="$O/equivalence-tf32.txt" \
  timeout 200 python3 -m pytest -p no:cacheprovider -n 4 -q -rfEs tests/unit/test_cuda_decode.py \
  tests/unit/test_simulated_metal.py >"$O/unit-kernel-tf32.log" 2>&1 &
TQBATCH_PRECISION=tf32 TQBATCH_DEVICE=gpu MLX_ENABLE_TF32=1 TQBATCH_DECODE_TF32=rna \
  TQBATCH_EQUIVALENCE_LOG="$O/equivalence-tf32-rna.txt" TQBATCH_EQUIVALENCE_EXAMPLES=30 \
  timeout 200 python3 -m pytest -p no:cacheprovider -q tests/unit/test_cuda_decode.py \
  -k matches_vectorized >"$O/equivalence-tf32-rna.log" 2>&1 &
wait
tail -n 2 "$O"/unit-kernel-tf32.log "$O"/equivalence-tf32-rna.log
if nvidia-smi -L | grep -q H200; then
  MLX_ENABLE_TF32=0 timeout 200 python3 -m tqbatch bench --decode --kernel --batch 8 \
    >"$O/bench-decode-kernel-b8-float32.log" 2>&1
  tail -n 16 "$O/bench-decode-kernel-b8-float32.log"
fi
