"""Data-parallel evaluation with accelerate: shards, per-shard resume, one merged result.

``accelerate launch --num_processes N -m mmfast eval RECIPE`` on GPUs, ``torchrun --nproc_per_node N
-m mmfast eval RECIPE`` anywhere, or ``mmfast eval --num-processes N`` (which runs the torchrun form)
gives process ``r`` every N-th planned sample; it writes
``samples.rank{r}.jsonl`` (so each shard resumes on its own), and after a barrier the main process
merges the shards in plan order into ``samples.jsonl`` and writes the single ``summary.json``. Because
mmfast's answers do not depend on batch composition, the merged answers and metrics equal a
single-process run's. On CPU the processes use the gloo backend.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ..errors import MMFastError

logger = logging.getLogger(__name__)


def shard_info() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside a distributed launch."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    state = _state()
    return state.process_index, state.num_processes


def _state():
    import torch
    from accelerate import PartialState

    # on CPU-only machines accelerate picks gloo only when asked for the CPU explicitly
    return PartialState(cpu=not torch.cuda.is_available())


def barrier() -> None:
    _state().wait_for_everyone()


def launch_data_parallel(recipe, *, limit: int | None, output: str | None, num_processes: int) -> dict[str, Any]:
    """Run this evaluation under ``accelerate launch`` with ``num_processes`` processes; return the summary."""
    from .runner import output_dir

    out = output_dir(recipe, output)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        yaml.safe_dump(recipe.to_dict(), fh, sort_keys=False)
        recipe_path = fh.name
    # torchrun sets RANK / WORLD_SIZE / LOCAL_RANK like `accelerate launch` does; accelerate's
    # PartialState then picks nccl on GPUs and gloo on CPUs (accelerate's own CPU launcher needs MPI)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_processes),
        "--master_port", str(_free_port()), "-m", "mmfast", "-q", "eval", recipe_path, "--output", str(out),
    ]
    if limit:
        cmd += ["--limit", str(limit)]
    logger.info("launching %d processes: %s", num_processes, " ".join(cmd))
    try:
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    finally:
        os.unlink(recipe_path)
    if proc.returncode != 0:
        raise MMFastError(f"data-parallel evaluation failed (exit {proc.returncode}); finished samples are kept per shard in {out}")
    return json.loads((out / "summary.json").read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gather_and_finish(recipe, out: Path, plan, mm, elapsed: float) -> dict[str, Any]:
    """Barrier, then the main process merges the shards in plan order and writes the summary."""
    from .records import RecordStore
    from .runner import finish

    rank, world = shard_info()
    barrier()
    if rank == 0:
        shards = [RecordStore(out / f"samples.rank{r}.jsonl") for r in range(world)]
        merged: dict[str, dict] = {}
        for shard in shards:
            merged.update(shard.records)
        order = [s.doc_id for _, ss in plan for s in ss]
        target = out / "samples.jsonl"
        tmp = target.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for doc_id in order:
                if doc_id in merged:
                    fh.write(json.dumps(merged[doc_id], ensure_ascii=False) + "\n")
        tmp.replace(target)
        summary = finish(recipe, out, plan, RecordStore(target), mm, elapsed)
        summary["protocol"]["processes"] = world
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    barrier()
    return json.loads((out / "summary.json").read_text())
