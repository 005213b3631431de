#!/usr/bin/env bash
# The GPU speed bench on a lent GPU machine, in one call (see benchmarks/README.md, "GPU speed bench").
#
#   OUT=/some/dir bash scripts/gpu_bench.sh          # from the repository root; results in $OUT/gpu_speed
#
# Installs nothing: the machine's torch (2.11 + CUDA 13) and transformers are used as they are; a pure-Python
# transformers carried under .dev/pydeps (pip install --no-deps --target .dev/pydeps 'transformers>=5.22,<5.24'
# on the development machine) is put first on PYTHONPATH when present.
#
# A subset that fits about 8 minutes (GPU_BENCH_TIMEOUT, default 480 s, for both phases together) of a
# 15-minute device budget, llava-1.5-7b only:
#   phase 1: the embedded model's speculative part (greedy vs FLASH, real tau), then one-token answers and
#            128-token captions at batch 1 and 8: HF eager / static-cache generate, mmfast unpruned (and
#            compiled where model.compile exists), DivPrune-64 (pre-LLM) and FastV-64 (in-LLM);
#   phase 2, with the time left: FLASH and DivPrune-64 + FLASH at batch 1 (their per-cycle cost; speculative
#            decoding verifies one sample at a time, so batch 8 would take minutes).
# Rows are written as they finish, so a phase stopped by its limit keeps every finished row; the same command
# resumes. Other subsets: GPU_BENCH_SETS="--set bench.params.shapes=[llava-next-7b] --set bench.params.batches=[1,32]"
# (added to both phases; GPU_BENCH_PHASE2=0 skips phase 2).
set -uo pipefail
OUT=${OUT:?set OUT to the output folder}
PY=${PYTHON:-python3}
LIMIT=${GPU_BENCH_TIMEOUT:-480}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .dev/pydeps ] && export PYTHONPATH="$PWD/.dev/pydeps:$PYTHONPATH"
mkdir -p "$OUT"
start=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "gpu", torch.cuda.is_available())'
} | tee "$OUT/environment.txt"
"$PY" -c 'import mmfast' || { echo "mmfast does not import on this machine (missing dependency above); nothing ran" >&2; exit 3; }

bench() {  # bench SECONDS LOG --set ...
  local secs=$1 log=$2; shift 2
  # shellcheck disable=SC2086
  timeout --signal=TERM "$secs" "$PY" -m mmfast bench configs/bench/gpu_speed.yaml --output "$OUT/gpu_speed" \
    --set 'bench.params.shapes=[llava-1.5-7b]' "$@" > "$OUT/$log" 2>&1
  local rc=$?
  echo "$log: exit status $rc after $((SECONDS - start)) s (124: stopped by its limit; finished rows are kept)" | tee -a "$OUT/$log"
  return $rc
}

# shellcheck disable=SC2086
bench $((LIMIT - (SECONDS - start))) phase1.log --set 'bench.params.batches=[1,8]' --set 'bench.params.workloads=[pope,caption]' \
  --set "bench.params.rows=['hf *','mmfast *','divprune-64','fastv-64']" --set "bench.params.embedded_rows=[flash]" ${GPU_BENCH_SETS:-}
rc=$?
left=$((LIMIT - (SECONDS - start)))
if [ "${GPU_BENCH_PHASE2:-1}" = 1 ] && [ "$left" -ge 90 ]; then
  # shellcheck disable=SC2086
  bench "$left" phase2.log --set 'bench.params.batches=[1]' --set 'bench.params.workloads=[pope,caption]' \
    --set "bench.params.rows=['mmfast unpruned','divprune-64','flash','divprune-64+flash']" --set "bench.params.embedded_rows=[flash]" \
    ${GPU_BENCH_SETS:-}
  rc2=$?
  [ "$rc" = 0 ] && rc=$rc2
else
  echo "phase 2 skipped (${left} s left of ${LIMIT} s)" | tee "$OUT/phase2.log"
fi
tail -n 40 "$OUT"/phase*.log
[ -f "$OUT/gpu_speed/results.md" ] && cat "$OUT/gpu_speed/results.md"
exit "$rc"
