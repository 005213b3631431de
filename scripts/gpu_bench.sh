#!/usr/bin/env bash
# The GPU speed bench on a lent GPU machine, in one call (see benchmarks/README.md, "GPU speed bench").
#
#   OUT=/some/dir bash scripts/gpu_bench.sh          # from the repository root; results in $OUT/gpu_speed
#
# Installs nothing: the machine's torch (2.11 + CUDA 13) and transformers are used as they are; a pure-Python
# transformers carried under .dev/pydeps (pip install --no-deps --target .dev/pydeps 'transformers>=5.22,<5.24'
# on the development machine) is put first on PYTHONPATH when present. Runs a subset that fits in about
# 8 minutes of a 15-minute device budget: llava-1.5-7b at batch 1 and 8, one-token answers and 128-token
# captions, HF eager / static-cache generate, mmfast unpruned (and compiled where model.compile exists),
# DivPrune / VisionZip / FastV at 64 tokens, FLASH and DivPrune-64 + FLASH, and the embedded model's
# speculative part. Rows are written as they finish, so the time limit below leaves every finished row.
# Extra overrides: GPU_BENCH_SETS="--set bench.params.shapes=[llava-next-7b] --set bench.params.batches=[1,32]".
set -uo pipefail
OUT=${OUT:?set OUT to the output folder}
PY=${PYTHON:-python3}
LIMIT=${GPU_BENCH_TIMEOUT:-480}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .dev/pydeps ] && export PYTHONPATH="$PWD/.dev/pydeps:$PYTHONPATH"
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "gpu", torch.cuda.is_available())'
} | tee "$OUT/environment.txt"
"$PY" -c 'import mmfast' || { echo "mmfast does not import on this machine (missing dependency above); nothing ran" >&2; exit 3; }
# shellcheck disable=SC2086
timeout --signal=TERM "$LIMIT" "$PY" -m mmfast bench configs/bench/gpu_speed.yaml --output "$OUT/gpu_speed" \
  --set 'bench.params.shapes=[llava-1.5-7b]' \
  --set 'bench.params.batches=[1,8]' \
  --set 'bench.params.workloads=[pope,caption]' \
  --set "bench.params.rows=['hf *','mmfast *','divprune-64','visionzip-64','fastv-64','flash','divprune-64+flash']" \
  ${GPU_BENCH_SETS:-} 2>&1 | tail -n 400 > "$OUT/gpu_bench.log"
rc=${PIPESTATUS[0]}
echo "exit status $rc (124: stopped by the ${LIMIT}s limit; the finished rows are in rows.jsonl and results.md)" | tee -a "$OUT/gpu_bench.log"
tail -n 60 "$OUT/gpu_bench.log"
exit "$rc"
