"""scripts/static_cache_gpu_check.py runs on a bare machine (the lent GPU has no world cache) and compares modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_check_script_generates_the_world_and_compares_static_with_auto(tmp_path):
    env = {**os.environ, "MMFAST_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "scripts/static_cache_gpu_check.py", "--device", "cpu", "--dtype", "float32"]
    cmd += ["--recipes", "greedy,zipvl@1", "--tokens", "4", "--samples", "1"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout[res.stdout.index("{\n") :])  # after the per-recipe lines
    greedy = out["recipes"]["greedy"]
    assert greedy["static_equals_auto"] and greedy["off_equals_static"]
    zipvl = out["recipes"]["zipvl@1"]  # a one-token answer: the static cache's prefill (captured on CUDA)
    assert zipvl["static_equals_auto"] and zipvl["off_equals_static"]
    assert out["differ_or_failed"] == [] and greedy["auto"]["norms_fused"] == 0  # off unless asked
    assert (tmp_path / "cache").is_dir()  # the world was generated where MMFAST_CACHE points


def test_check_script_fuses_the_norms_of_every_recipe_when_asked():
    """``--fuse-norms``: each mode's session of every recipe runs the LM's norms as compiled kernels, and the static
    and auto tokens are still compared (what turning the key on by default waits for on the GPU)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "scripts/static_cache_gpu_check.py", "--device", "cpu", "--dtype", "float32"]
    cmd += ["--recipes", "greedy,divprune", "--tokens", "4", "--samples", "1", "--fuse-norms"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout[res.stdout.index("{\n") :])
    assert out["fuse_norms"] is True and out["differ_or_failed"] == []
    for name in ("greedy", "divprune"):
        row = out["recipes"][name]
        assert row["static_equals_auto"], name
        assert all(row[mode]["norms_fused"] > 0 for mode in ("off", "static", "auto")), row


def test_cycle_time_script_splits_a_cycle_into_its_graphs():
    """scripts/cycle_time.py on the CPU (the CUDA-graph emulator): greedy replays one LM step a token; a FLASH cycle
    replays its five graphs once each (greedy and sampled cycles on the device, one round and two), and the decode time
    covers the graphs'."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "scripts/cycle_time.py", "--device", "cpu", "--dtype", "float32"]
    cmd += ["--recipes", "greedy,flash,sample_flash,flash_rounds2", "--samples", "1", "--max-new-tokens", "12"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {r["row"]: r for r in json.loads(res.stdout.splitlines()[-1])["rows"]}
    greedy, flash = rows["greedy"], rows["flash"]
    assert greedy["replays_per_cycle"] == {"LM step": 1.0}  # every decode step a replay
    kinds = {"LM step", "verdict", "keep", "draft proposal", "draft accept"}
    assert flash["replays_per_cycle"] == dict.fromkeys(kinds, 1.0), flash
    # sampled cycles on the device too: the same five graphs (the sampled verdict counted as the verdict)
    assert rows["sample_flash"]["replays_per_cycle"] == dict.fromkeys(kinds, 1.0), rows["sample_flash"]
    # two rounds: the second block's draft forward inside the one proposal graph
    assert rows["flash_rounds2"]["replays_per_cycle"] == dict.fromkeys(kinds, 1.0), rows["flash_rounds2"]
    assert 0 < flash["cycles"] < flash["tokens"] - 1  # more than one token a cycle
    for r in (greedy, flash):
        assert r["cycle_ms"] >= sum(r["graphs_ms_per_cycle"].values()) and r["outside_graphs_ms_per_cycle"] >= 0
