"""The video_cost bench: end to end on the tiny video shapes (rows per method, the tokens column equal to
what each pruner keeps through mmfast's own generate, refused rows with their reasons, resume, the report's
labels), the 7B shapes' token counts at 16 and 64 frames of the recipe's clip (meta device), and the
reduced-depth shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmfast.bench import run_bench
from mmfast.bench import video_cost as vc
from mmfast.config import load_recipe
from mmfast.errors import ConfigError, InputError
from mmfast.model import MMModel
from mmfast.models.factory import BENCH_MODELS, build_bench_model, reduced_shape

RECIPE = "configs/bench/video_cost.yaml"


def _recipe(*extra: str, frames=(8,), shapes=("tiny-qwen", "tiny-onevision")):
    sets = [
        "model.device=cpu",
        f"bench.params.shapes={json.dumps(list(shapes))}",
        f"bench.params.frames={list(frames)}",
        "bench.params.image_size=32",
        "bench.params.dtype=float32",
        "bench.warmup=0",
        "bench.repeats=1",
        "bench.methods=[divprune, random, fastv]",
        "bench.budgets=[{ratio: 0.25}]",
        *extra,
    ]
    return load_recipe(RECIPE, overrides=sets)


def _rows(out) -> dict:
    return {
        (r["shape"], r["frames"], r["row"]): r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())
    }


def test_tiny_shapes_end_to_end_rows_tokens_and_refusals(tmp_path):
    recipe = _recipe()
    result = run_bench(recipe, output=str(tmp_path))
    rows = _rows(tmp_path)
    names = ["unpruned", "dycoke", "divprune-r0.25", "random-r0.25", "fastv-r0.25"]
    assert set(rows) == {(s, 8, n) for s in ("tiny-qwen", "tiny-onevision") for n in names}
    cp = vc.VideoCostParams.of(recipe)
    frames = vc.clip_frames(cp)
    assert len(frames) == cp.clip_frames == 64 and frames[0].size == (32, 32)  # every frame count samples it
    for shape in ("tiny-qwen", "tiny-onevision"):
        model, processor = build_bench_model(shape, dtype=torch.float32, init_std=0.2)
        mm = MMModel(model, processor, shape)
        base = rows[(shape, 8, "unpruned")]
        n = vc.video_tokens(mm, frames, 8)
        assert base["status"] == "ok" and base["vision_tokens"] == n == base["layer_avg"]
        assert base["repeats"] == 1 and base["ttft_s"] >= base["prefill_s"] > 0 and base["peak_mem_bytes"] is None
        for name, stage in (
            ("dycoke", {"method": "dycoke"}),
            ("divprune-r0.25", {"method": "divprune", "budget": {"ratio": 0.25}}),
            ("random-r0.25", {"method": "random", "budget": {"ratio": 0.25}}),
        ):
            r = rows[(shape, 8, name)]
            assert r["status"] == "ok", r["status"]
            direct = mm.generate(None, [cp.prompt], videos=[frames], num_frames=8, recipe={"pruning": [stage]})[0]
            assert r["vision_tokens"] == direct.n_vision_tokens < n  # the column is what the pruner kept
            assert r["kv_bytes"] == direct.kv_bytes_prefill and r["flops"] == direct.flops_prefill
            assert r["prompt_tokens"] - r["vision_tokens"] == base["prompt_tokens"] - n  # the same text
            if name != "dycoke":
                assert r["vision_tokens"] == round(0.25 * n) and r["budget"] == "ratio 0.25"
        fastv = rows[(shape, 8, "fastv-r0.25")]  # the 4-layer LLM's floor: K N / L tokens on average
        assert fastv["status"].startswith("refused:") and "infeasible" in fastv["status"]
        assert fastv["vision_tokens"] is None
    md = result["table"]
    assert md == (tmp_path / "results.md").read_text() and "REDUCED DEPTH" not in md
    assert "GPU rows (full depth, fp16) are unmeasured here" in md and "Device: **cpu" in md
    line = next(x for x in md.splitlines() if x.startswith("| tiny-qwen | 8 | divprune-r0.25 |"))
    header = next(x for x in md.splitlines() if x.startswith("| shape |"))
    col = dict(zip((c.strip() for c in header.strip("|").split("|")), (c.strip() for c in line.strip("|").split("|"))))
    base = rows[("tiny-qwen", 8, "unpruned")]
    assert col["vision tok @LLM"] == str(round(0.25 * base["vision_tokens"])) and col["kept %"] == "25.0"
    r = rows[("tiny-qwen", 8, "divprune-r0.25")]
    assert float(col["FLOPs ratio"]) == pytest.approx(r["flops"] / base["flops"], abs=5e-4)
    assert float(col["KV ratio"]) == pytest.approx(r["kv_bytes"] / base["kv_bytes"], abs=5e-4)
    assert col["peak mem GiB"] == "n/a"
    refused = next(x for x in md.splitlines() if x.startswith("| tiny-onevision | 8 | fastv-r0.25 |"))
    assert "refused:" in refused and "infeasible" in refused
    assert {r["row"] for r in result["rows"]} == set(names)


def test_hicom_row_runs_on_onevision_with_stand_ins_and_is_refused_on_qwen(tmp_path):
    """HICom (a video method; its guide and text towers trained parts) gets a cost row with seeded random
    stand-ins of its trained parts on OneVision, and a refusal that names why on Qwen."""
    # 64 frames: a quarter of the tiny OneVision's 257 video tokens leaves local tokens beside the 32 global ones
    run_bench(_recipe("bench.methods=[hicom]", "bench.compare=[]", frames=(64,)), output=str(tmp_path))
    rows = _rows(tmp_path)
    ov, qwen = rows[("tiny-onevision", 64, "hicom-r0.25")], rows[("tiny-qwen", 64, "hicom-r0.25")]
    base = rows[("tiny-onevision", 64, "unpruned")]
    assert ov["status"] == "ok" and 0 < ov["vision_tokens"] < base["vision_tokens"], ov
    assert qwen["status"].startswith("refused:") and "hicom" in qwen["status"], qwen["status"]


def test_a_rerun_keeps_finished_rows_and_reruns_stale_ones(tmp_path, monkeypatch):
    ran = []
    real = vc._measure_row
    monkeypatch.setattr(
        vc, "_measure_row", lambda mm, b, t, v, w, r, m: ran.append(m.row) or real(mm, b, t, v, w, r, m)
    )
    recipe = _recipe("bench.methods=[divprune]", "bench.compare=[]", shapes=("tiny-qwen",))
    run_bench(recipe, output=str(tmp_path))
    assert ran == ["unpruned", "divprune-r0.25"]
    ran.clear()
    run_bench(recipe, output=str(tmp_path))
    assert ran == []  # every row is stored with the same settings
    run_bench(
        _recipe("bench.methods=[divprune]", "bench.compare=[]", "bench.repeats=2", shapes=("tiny-qwen",)),
        output=str(tmp_path),
    )
    assert ran == ["unpruned", "divprune-r0.25"] and len(_rows(tmp_path)) == 2
    assert {r["repeats"] for r in _rows(tmp_path).values()} == {2}


def test_rerender_points_to_the_recorded_command(tmp_path):
    from mmfast.bench.rerender import rerender_bench

    run_bench(_recipe("bench.methods=[divprune]", "bench.compare=[]", shapes=("tiny-qwen",)), output=str(tmp_path))
    with pytest.raises(InputError, match=r"video_cost bench: run its recorded command again"):
        rerender_bench(tmp_path)


def test_reduced_depth_is_labelled_and_keeps_the_widths(tmp_path):
    recipe = _recipe(
        "bench.params.layers=2", "bench.params.tower_layers=1", "bench.methods=[divprune]", shapes=("tiny-qwen",)
    )
    md = run_bench(recipe, output=str(tmp_path))["table"]
    assert "REDUCED DEPTH" in md and "tiny-qwen: 2 of 4 LLM layers, 1 of 3 tower blocks" in md
    dycoke = _rows(tmp_path)[("tiny-qwen", 8, "dycoke")]  # its DP layer 3 is gone at this depth: said so
    assert dycoke["status"].startswith("refused:") and "layer 3 does not exist" in dycoke["status"]
    full = reduced_shape(BENCH_MODELS["qwen2.5-vl-7b"])
    cut = reduced_shape(BENCH_MODELS["qwen2.5-vl-7b"], 2, 10)
    assert (cut.text_layers, cut.vision_layers, cut.fullatt_blocks) == (2, 10, (7,))
    assert (cut.text_hidden, cut.vision_hidden, cut.text_intermediate) == (full.text_hidden, full.vision_hidden, 18944)
    assert reduced_shape(BENCH_MODELS["qwen2.5-vl-7b"], None, 3).fullatt_blocks == (2,)  # a full block remains
    ov = reduced_shape(BENCH_MODELS["llava-onevision-7b"], 1, 1)
    assert (ov.text_layers, ov.vision_layers, ov.text_hidden, ov.vision_hidden) == (1, 1, 3584, 1152)


def test_bad_parameters_are_refused_before_compute(tmp_path):
    with pytest.raises(InputError, match=r"bench.params.shapes\[0\].*not a video shape.*qwen2.5-vl-7b"):
        run_bench(_recipe(shapes=("llava-1.5-7b",)), output=str(tmp_path / "a"))
    with pytest.raises(InputError, match=r"bench.params.layers.*text_layers must be in \[1, 28\]"):
        run_bench(_recipe("bench.params.layers=40", shapes=("qwen2.5-vl-7b",)), output=str(tmp_path / "b"))
    with pytest.raises(InputError, match=r"bench.params.frames"):
        run_bench(_recipe(frames=(0,)), output=str(tmp_path / "c"))
    with pytest.raises(InputError, match=r"bench.params.frames: frame counts must be in \[1, 32\].*clip_frames"):
        run_bench(_recipe("bench.params.clip_frames=32", frames=(16, 64)), output=str(tmp_path / "d"))
    with pytest.raises(InputError, match=r"bench.params.clip_frames: must be in \[8, 64\]"):
        run_bench(_recipe("bench.params.clip_frames=65"), output=str(tmp_path / "e"))
    with pytest.raises(ConfigError, match=r"bench.params.frame\b.*frames"):
        _recipe("bench.params.frame=[16]")
    assert not any((tmp_path / d).exists() for d in "abcde")  # refused before the output folder is made


@pytest.mark.parametrize(
    "name,tokens", [("qwen2.5-vl-7b", {16: 2048, 64: 8192}), ("llava-onevision-7b", {16: 3137, 64: 12545})]
)
def test_7b_shapes_video_tokens_at_16_and_64_frames(name, tokens):
    """The recipe's clip size (448 x 448) on the full-depth 7B shapes, built on the meta device: Qwen2.5-VL
    256 tokens per 2-frame group, OneVision 196 per frame (27 x 27 pooled to 14 x 14) + one newline."""
    from PIL import Image

    cp = vc.VideoCostParams.of(load_recipe(RECIPE))
    assert cp.frames == (16, 64) and cp.image_size == 448 and cp.clip_frames == 64
    assert cp.layers is None and cp.tower_layers is None  # full depth by default
    model, processor = build_bench_model(name, device="meta", dtype=torch.float16)
    mm = MMModel(model, processor, name)
    assert len(mm.adapter.layers) == 28
    frames = [Image.fromarray(np.zeros((cp.image_size, cp.image_size, 3), dtype=np.uint8))] * max(cp.frames)
    assert {f: vc.video_tokens(mm, frames, f) for f in cp.frames} == tokens
