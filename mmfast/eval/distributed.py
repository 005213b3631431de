"""Data-parallel evaluation with accelerate: shards, per-shard resume, one merged result.

``accelerate launch --num_processes N -m mmfast eval RECIPE`` (or ``mmfast eval --num-processes N``)
gives each process every N-th planned sample; each writes ``samples.rank{r}.jsonl`` (so each shard
resumes on its own), and after a barrier the main process merges the shards in plan order into
``samples.jsonl`` and writes the single ``summary.json``.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def shard_info() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside a distributed launch."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    from accelerate import PartialState

    state = PartialState()
    return state.process_index, state.num_processes
