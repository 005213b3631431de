#!/usr/bin/env bash
# The GPU speed bench on a lent GPU machine, in one call (see benchmarks/README.md, "GPU speed bench").
#
#   OUT=/some/dir bash scripts/gpu_bench.sh          # from the repository root; results in $OUT/gpu_speed
#
# Installs nothing: the machine's torch (2.11 + CUDA 13) and transformers are used as they are; a pure-Python
# transformers carried under .dev/pydeps (pip install --no-deps --target .dev/pydeps 'transformers>=5.22,<5.24'
# on the development machine) is put first on PYTHONPATH when present.
#
# A subset that fits about 7 minutes (GPU_BENCH_TIMEOUT, default 420 s, all phases together) of a 15-minute
# device budget; every phase appends to $OUT/bench.log:
#   phase 1: qwen2.5-vl-7b at batch 1, one-token answers: HF eager, mmfast unpruned, DivPrune-64 (tower and
#            prefill: TTFT - LLM prefill is the tower's share), and scripts/time_qwen_tower.py on the GPU
#            (HF's per-window tower attention against mmfast's fused one) into $OUT/tower.txt;
#   phase 2: llava-1.5-7b: the embedded model's speculative part (the captured greedy step vs FLASH, real
#            tau), then one-token answers and 128-token captions at batch 1 and 8: HF eager / static-cache
#            generate, mmfast unpruned and compiled (model.compile: auto), DivPrune-64 (pre-LLM);
#   phase 3, with the time left: FastV-64 (in-LLM, reads attention), FLASH and DivPrune-64 + FLASH at batch 1.
# Rows are written as they finish, so a phase stopped by its limit keeps every finished row; the same command
# resumes (finished rows are kept). Seven files come back: environment.txt, bench.log, tower.txt and the
# bench's rows.jsonl, results.md, summary.json, bench.json.
set -uo pipefail
OUT=${OUT:?set OUT to the output folder}
PY=${PYTHON:-python3}
LIMIT=${GPU_BENCH_TIMEOUT:-420}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .dev/pydeps ] && export PYTHONPATH="$PWD/.dev/pydeps:$PYTHONPATH"
mkdir -p "$OUT"
LOG="$OUT/bench.log"
start=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "gpu", torch.cuda.is_available())'
} | tee "$OUT/environment.txt"
"$PY" -c 'import mmfast' >>"$LOG" 2>&1 || { cat "$LOG"; echo "mmfast does not import on this machine; nothing ran" >&2; exit 3; }

left() { echo $((LIMIT - (SECONDS - start))); }
bench() {  # bench SECONDS NAME --set ...
  local secs=$1 name=$2; shift 2
  echo "== $name: up to $secs s" >>"$LOG"
  # shellcheck disable=SC2086
  timeout --signal=TERM "$secs" "$PY" -m mmfast bench configs/bench/gpu_speed.yaml --output "$OUT/gpu_speed" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $name: exit status $rc after $((SECONDS - start)) s (124: stopped by its limit; finished rows are kept)" | tee -a "$LOG"
  return $rc
}

# shellcheck disable=SC2086
bench 90 phase1 --set 'bench.params.shapes=[qwen2.5-vl-7b]' --set 'bench.params.batches=[1]' \
  --set 'bench.params.workloads=[pope]' --set "bench.params.rows=['hf eager','mmfast unpruned','divprune-64']" \
  --set 'bench.params.embedded_speculative=false' ${GPU_BENCH_SETS:-}
rc=$?
timeout 45 "$PY" scripts/time_qwen_tower.py --device cuda --dtype float16 --shape qwen2.5-vl-7b --repeats 5 >"$OUT/tower.txt" 2>&1
echo "== tower: exit status $? after $((SECONDS - start)) s" | tee -a "$LOG"

# shellcheck disable=SC2086
bench "$(left)" phase2 --set 'bench.params.shapes=[llava-1.5-7b]' --set 'bench.params.batches=[1,8]' \
  --set 'bench.params.workloads=[pope,caption]' --set "bench.params.rows=['hf *','mmfast *','divprune-64']" \
  --set "bench.params.embedded_rows=[flash]" ${GPU_BENCH_SETS:-}
rc2=$?
[ "$rc" = 0 ] && rc=$rc2
if [ "$(left)" -ge 60 ]; then
  # shellcheck disable=SC2086
  bench "$(left)" phase3 --set 'bench.params.shapes=[llava-1.5-7b]' --set 'bench.params.batches=[1]' \
    --set 'bench.params.workloads=[pope,caption]' \
    --set "bench.params.rows=['mmfast unpruned','fastv-64','flash','divprune-64+flash']" \
    --set "bench.params.embedded_rows=[flash]" ${GPU_BENCH_SETS:-}
else
  echo "== phase3 skipped ($(left) s left of $LIMIT s)" | tee -a "$LOG"
fi
grep -E "ERROR|Traceback|Error:|captured graph|== " "$LOG" | tail -n 40
cat "$OUT/tower.txt" | tail -n 15
[ -f "$OUT/gpu_speed/results.md" ] && cat "$OUT/gpu_speed/results.md"
exit "$rc"
