#!/usr/bin/env bash
# The GPU speed bench on a lent GPU machine, in one call (see benchmarks/README.md, "GPU speed bench").
#
#   OUT=/some/dir bash scripts/gpu_bench.sh          # from the repository root; results in $OUT/gpu_speed
#
# Installs nothing: the machine's torch (2.11 + CUDA 13) and transformers are used as they are; a pure-Python
# transformers carried under .dev/pydeps (pip install --no-deps --target .dev/pydeps 'transformers>=5.22,<5.24'
# on the development machine) is put first on PYTHONPATH when present.
#
# Phases (GPU_BENCH_PHASES, in the order given, default "qwen llava extra"), within GPU_BENCH_TIMEOUT seconds (default 420) of a
# 15-minute device budget; every phase appends to $OUT/bench.log:
#   check: scripts/static_cache_gpu_check.py (GPU_BENCH_CHECK_ARGS: its options) on the embedded model in fp16 (model.compile static = auto
#          tokens for decoders, drafters and pruners: the captured step replays exactly) into $OUT/check.txt;
#   cycle: scripts/cycle_time.py (GPU_BENCH_CYCLE_ARGS: its options) on the embedded model in fp16 into $OUT/cycle.txt: the
#          captured greedy step's and each drafter's cycle time per token, split into the graphs' device time by
#          kind (LM / verify step, verdict, keep, draft proposal and accept) and the rest (host, eager kernels, waits);
#   qwen:  qwen2.5-vl-7b at batch 1, one-token answers: HF eager, mmfast unpruned, DivPrune-64 (TTFT and LLM
#          prefill), and scripts/time_qwen_tower.py on the GPU (HF's per-window tower attention against
#          mmfast's fused one) into $OUT/tower.txt;
#   qdecode: qwen2.5-vl-7b 128-token captions at batch 1: HF static-cache generate against mmfast's captured step,
#          plain and with fused norms (the decode target on that shape);
#   llava: llava-1.5-7b: the embedded model's speculative part (the captured greedy step vs FLASH, real tau),
#          then one-token answers and 128-token captions at batch 1 and 8: HF eager / static-cache generate,
#          mmfast unpruned and compiled (model.compile: auto), DivPrune-64 (pre-LLM) (GPU_BENCH_LLAVA_ROWS);
#   b32:   llava-1.5-7b captions at batch 32: mmfast compiled and DivPrune-64 (the same decode path);
#   next:  llava-next-7b (anyres, 2,928 vision tokens): mmfast compiled and DivPrune-64, one-token answers at batch 1
#          (the TTFT target), then captions at batch 32 (the throughput target), each in one process;
#   extra: with the time left, at batch 1 (GPU_BENCH_EXTRA_ROWS: its rows): the captured unpruned baseline, the
#          in-LLM pruners FastV / DART / PyramidDrop / SparseVLM at 64 (their prefill in captured segments: the TTFT
#          target), DivPrune-64, FLASH, MSD and DivPrune-64 + FLASH; the embedded model's FLASH and MSD (real tau);
#   ttft:  llava-1.5-7b one-token answers at batch 1 and 8 (GPU_BENCH_TTFT_ROWS: its rows): the captured baseline and
#          every pruner at 64 tokens (PyramidDrop at 192, its smallest feasible budget there being 144): the
#          TTFT target at both batch sizes, ZipVL's prefill target, and at batch 8 the pre-LLM pruners' FLOPs-ideal
#          target; the embedded model's FLASH;
#   video: configs/bench/video_cost.yaml at full depth in fp16 (results in $OUT/video_cost): Qwen2.5-VL-7B and
#          LLaVA-OneVision-7B on one video-world clip at 16 and 64 frames, unpruned against every video pruner at
#          equal budgets and DyCoke (tokens, KV bytes, FLOPs, TTFT, peak memory); not in the default phases:
#          GPU_BENCH_PHASES=video runs it alone (GPU_BENCH_VIDEO_SETS: extra --set options for it).
# Rows are written as they finish, so a phase stopped by its limit keeps every finished row; the same command
# resumes (finished rows are kept: seed $OUT/gpu_speed with a committed rows.jsonl to run only what it lacks).
# At most eight files come back (with more, all of them are packed in all.tgz, kept beside the results.md tables,
# environment.txt, check.txt and cycle.txt): environment.txt, bench.log, tower.txt, check.txt, cycle.txt and the bench's rows.jsonl,
# results.md, summary.json, bench.json (the video phase: its results.md, rows.jsonl and summary.json).
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

rc=0
run_phase() { "$@" || rc=$?; }
cap() { local l; l=$(left); echo $(($1 < l ? $1 : l)); }  # cap SECONDS: at most SECONDS, at most what is left
phase_check() {  # static / captured steps give identical tokens on this GPU
  # shellcheck disable=SC2086
  timeout "$(cap 150)" "$PY" scripts/static_cache_gpu_check.py ${GPU_BENCH_CHECK_ARGS:-} >"$OUT/check.txt" 2>&1
  local r=$?; [ $r = 0 ] || rc=$r
  echo "== check: exit status $r after $((SECONDS - start)) s" | tee -a "$LOG"
}
phase_cycle() {  # where the embedded model's greedy step and drafters' cycles spend their time (the FLASH target)
  # shellcheck disable=SC2086
  timeout "$(cap 90)" "$PY" scripts/cycle_time.py ${GPU_BENCH_CYCLE_ARGS:-} >"$OUT/cycle.txt" 2>&1
  local r=$?; [ $r = 0 ] || rc=$r
  echo "== cycle: exit status $r after $((SECONDS - start)) s" | tee -a "$LOG"
}
phase_qwen() {
  # shellcheck disable=SC2086
  run_phase bench "$(cap 90)" qwen --set 'bench.params.shapes=[qwen2.5-vl-7b]' --set 'bench.params.batches=[1]' \
    --set 'bench.params.workloads=[pope]' --set "bench.params.rows=['hf eager','mmfast unpruned','divprune-64']" \
    --set 'bench.params.embedded_speculative=false' ${GPU_BENCH_SETS:-}
  timeout "$(cap 45)" "$PY" scripts/time_qwen_tower.py --device cuda --dtype float16 --shape qwen2.5-vl-7b --repeats 5 \
    >"$OUT/tower.txt" 2>&1
  echo "== tower: exit status $? after $((SECONDS - start)) s" | tee -a "$LOG"
}
phase_qdecode() {  # qwen2.5-vl-7b's decode target: 128-token captions at batch 1, against HF's static-cache generate
  # shellcheck disable=SC2086
  run_phase bench "$(cap 150)" qdecode --set 'bench.params.shapes=[qwen2.5-vl-7b]' --set 'bench.params.batches=[1]' \
    --set 'bench.params.workloads=[caption]' \
    --set "bench.params.rows=['hf static','mmfast unpruned (compiled)','mmfast unpruned (fused norms)']" \
    --set 'bench.params.embedded_speculative=false' ${GPU_BENCH_SETS:-}
}
phase_llava() {
  # shellcheck disable=SC2086
  run_phase bench "$(cap "${GPU_BENCH_LLAVA_SECS:-100000}")" llava --set 'bench.params.shapes=[llava-1.5-7b]' \
    --set 'bench.params.batches=[1,8]' --set 'bench.params.workloads=[pope,caption]' \
    --set "bench.params.rows=${GPU_BENCH_LLAVA_ROWS:-['hf *','mmfast *','divprune-64']}" \
    --set "bench.params.embedded_rows=[flash]" ${GPU_BENCH_SETS:-}
}
phase_b32() {  # pruning's throughput at batch 32, same decode path
  # shellcheck disable=SC2086
  run_phase bench "$(left)" b32 --set 'bench.params.shapes=[llava-1.5-7b]' --set 'bench.params.batches=[32]' \
    --set 'bench.params.workloads=[caption]' --set "bench.params.rows=['mmfast unpruned (compiled)','divprune-64']" \
    --set "bench.params.embedded_rows=[flash]" ${GPU_BENCH_SETS:-}
}
phase_next() {  # llava-next-7b's two targets: TTFT at batch 1, throughput at batch 32
  local r
  for bw in "1 pope" "32 caption"; do
    set -- $bw
    # shellcheck disable=SC2086
    run_phase bench "$(left)" "next b$1 $2" --set 'bench.params.shapes=[llava-next-7b]' --set "bench.params.batches=[$1]" \
      --set "bench.params.workloads=[$2]" --set "bench.params.rows=['mmfast unpruned (compiled)','divprune-64']" \
      --set 'bench.params.embedded_speculative=false' ${GPU_BENCH_SETS:-}
    r=$(left); [ "$r" -lt 30 ] && break
  done
}
# the captured baseline, the in-LLM pruners (prefill in captured segments), a pre-LLM one, the drafters
EXTRA_ROWS="['mmfast unpruned (compiled)','fastv-64','dart-64','pyramiddrop-64','sparsevlm-64','divprune-64','flash','msd','divprune-64+flash']"
phase_extra() {
  # shellcheck disable=SC2086
  run_phase bench "$(left)" extra --set 'bench.params.shapes=[llava-1.5-7b]' --set 'bench.params.batches=[1]' \
    --set 'bench.params.workloads=[pope,caption]' \
    --set "bench.params.rows=${GPU_BENCH_EXTRA_ROWS:-$EXTRA_ROWS}" \
    --set "bench.params.embedded_rows=[flash,msd]" ${GPU_BENCH_SETS:-}
}
phase_ttft() {
  # shellcheck disable=SC2086
  run_phase bench "$(left)" ttft --set 'bench.params.shapes=[llava-1.5-7b]' --set 'bench.params.batches=[1,8]' \
    --set 'bench.params.workloads=[pope]' \
    --set "bench.params.rows=${GPU_BENCH_TTFT_ROWS:-['mmfast unpruned (compiled)','*-64','pyramiddrop-192']}" \
    --set "bench.params.embedded_rows=[flash]" ${GPU_BENCH_SETS:-}
}
phase_video() {  # the video pruners' cost at full depth
  echo "== video: up to $(left) s" >>"$LOG"
  # shellcheck disable=SC2086
  timeout --signal=TERM "$(left)" "$PY" -m mmfast bench configs/bench/video_cost.yaml --output "$OUT/video_cost" \
    ${GPU_BENCH_VIDEO_SETS:-} >>"$LOG" 2>&1
  local r=$?; [ $r = 0 ] || rc=$r
  echo "== video: exit status $r after $((SECONDS - start)) s (124: stopped by its limit; finished rows are kept)" | tee -a "$LOG"
}
# phases run in the order given; any but the first needs a minute left
first=1
for phase in ${GPU_BENCH_PHASES:-qwen llava extra}; do
  case $phase in check | cycle | qwen | qdecode | llava | b32 | next | extra | ttft | video) ;; *) echo "unknown phase $phase" >&2; exit 2 ;; esac
  if [ $first = 0 ] && [ "$(left)" -lt 60 ]; then echo "== $phase skipped: $(left) s left of $LIMIT s" | tee -a "$LOG"; continue; fi
  first=0
  "phase_$phase"
done
grep -E "ERROR|Traceback|Error:|captured graph|== " "$LOG" | tail -n 40
[ -f "$OUT/tower.txt" ] && tail -n 3 "$OUT/tower.txt"
[ -f "$OUT/check.txt" ] && grep -v "^ \|^{\|^}" "$OUT/check.txt" | tail -n 20
[ -f "$OUT/cycle.txt" ] && grep -v "^{" "$OUT/cycle.txt" | tail -n 8
[ -f "$OUT/gpu_speed/results.md" ] && cat "$OUT/gpu_speed/results.md"
[ -f "$OUT/video_cost/results.md" ] && cat "$OUT/video_cost/results.md"
# the device returns at most eight files: with more, everything goes in all.tgz beside the tables and the check
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/gpu_bench_all.tgz -C "$OUT" . && mv /tmp/gpu_bench_all.tgz "$OUT/all.tgz" &&
    find "$OUT" -type f ! -name all.tgz ! -name environment.txt ! -name results.md ! -name check.txt ! -name cycle.txt -delete
fi
exit "$rc"
