"""The gpu_speed bench end to end on a CPU with the tiny shape: rows, columns, medians, HF = mmfast tokens,
resume after an interruption, the CPU's n/a columns, and the target checks."""

from __future__ import annotations

import json

import pytest

from mmfast.bench import gpu_speed as gs
from mmfast.bench import run_bench
from mmfast.config import load_recipe
from mmfast.errors import ConfigError, InputError

RECIPE = "configs/bench/gpu_speed.yaml"


def _recipe(
    *extra: str, rows=("hf *", "mmfast *", "divprune-8"), batches=(1, 2), workloads=("pope", "caption"), repeats=2
):
    sets = [
        "model.device=cpu",
        "bench.params.shapes=[tiny]",
        f"bench.params.batches={list(batches)}",
        f"bench.params.workloads={list(workloads)}",
        "bench.params.caption_tokens=4",
        "bench.params.dtype=float32",
        "bench.params.embedded_speculative=false",
        f"bench.repeats={repeats}",
        "bench.warmup=1",
        "bench.budgets=[8]",
        "bench.methods=[divprune]",
        "bench.compare=[]",
        f"bench.params.rows={json.dumps(list(rows))}",
        *extra,
    ]
    return load_recipe(RECIPE, overrides=sets)


def _rows(out):
    return [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]


def test_cpu_run_rows_columns_medians_and_hf_tokens(tmp_path, monkeypatch):
    calls = []
    timed = gs._timed
    monkeypatch.setattr(gs, "_timed", lambda fn, device: calls.append(1) or timed(fn, device))
    tmp_path = tmp_path / "new" / "folder"  # --output need not exist yet
    result = run_bench(_recipe(), output=str(tmp_path))
    rows = {(r["batch"], r["workload"], r["row"]): r for r in _rows(tmp_path)}
    names = [gs.HF_EAGER, gs.HF_STATIC, gs.UNPRUNED, gs.COMPILED, gs.FUSED, "divprune-8"]
    assert set(rows) == {(b, w, n) for b in (1, 2) for w in ("pope", "caption") for n in names}
    for (_b, w, n), r in rows.items():
        assert r["status"] == "ok" and r["repeats"] == 2 and r["new_tokens"] == (1 if w == "pope" else 4)
        assert r["peak_mem_bytes"] is None and r["ttft_s"] > 0 and r["e2e_s"] >= (r["ttft_s"] if w == "pope" else 0)
        if not n.startswith("hf"):  # the median LLM prefill of the timed one-token calls, inside their TTFT
            assert 0 < r["prefill_s"] < r["ttft_s"]
    for b in (1, 2):
        for w in ("pope", "caption"):  # greedy in fp32 on a CPU: HF's generate and mmfast agree token for token
            same = (gs.HF_EAGER, gs.HF_STATIC, gs.UNPRUNED, gs.COMPILED)
            assert len({rows[(b, w, n)]["tokens_sha"] for n in same}) == 1
            assert (
                rows[(b, w, "divprune-8")]["n_vision_tokens"] == 8 < rows[(b, w, gs.UNPRUNED)]["n_vision_tokens"] == 16
            )
            assert rows[(b, w, gs.HF_EAGER)]["n_vision_tokens"] == 16
    # per timed row: the first call, then 2 repeats of (TTFT [+ end to end]); warm-ups are untimed
    n_ok = 6
    assert len(calls) == 2 * n_ok * ((1 + 2 * 2) + (1 + 2))
    md = (tmp_path / "results.md").read_text()
    for col in (
        "TTFT ms",
        "decode ms/token",
        "tokens/s",
        "peak mem GiB",
        "FLOPs ratio",
        "decode % BW limit",
        "prefill % peak FLOP/s",
        "first call s",
        "tokens = hf eager",
        "## Targets",
    ):
        assert col in md
    import torch
    import transformers

    assert (
        f"torch {torch.__version__}" in md
        and f"transformers {transformers.__version__}" in md
        and "Device: **cpu" in md
    )
    line = next(x for x in md.splitlines() if x.startswith("| tiny | 2 | caption | mmfast unpruned |"))
    header = next(x for x in md.splitlines() if x.startswith("| shape |"))
    names = [c.strip() for c in header.strip("|").split("|")]
    col = dict(zip(names, (c.strip() for c in line.strip("|").split("|"))))
    assert col["budget"] == ""  # no budget asked for
    for name in ("peak mem GiB", "decode % BW limit", "prefill % peak FLOP/s", "capture ms first / timed"):
        assert col[name] == "n/a", name  # a CPU has none of these (no graph is captured on a CPU)
    assert col["tokens = hf eager"] == "yes" and float(col["FLOPs ratio"]) == 1.0
    pruned = next(x for x in md.splitlines() if x.startswith("| tiny | 2 | caption | divprune-8 |"))
    pcol = dict(zip(names, (c.strip() for c in pruned.strip("|").split("|"))))
    assert (pcol["budget"], pcol["vision tok"]) == ("tokens 8", "8")  # asked for, kept
    assert result["device"]["peak_bandwidth"] is None and result["table"] == md


def test_interrupted_run_resumes_without_redoing_or_duplicating(tmp_path, monkeypatch):
    ran, interrupt = [], [True]
    real_mm, real_hf = gs._mmfast_row, gs._hf_row

    def mm_row(shape, v, b, w, n, cfg, compiled, m):
        ran.append(m.row)
        if m.row == "divprune-8" and interrupt.pop() if interrupt else False:
            raise KeyboardInterrupt  # killed mid-run, after hf eager, hf static and mmfast unpruned finished
        return real_mm(shape, v, b, w, n, cfg, compiled, m)

    monkeypatch.setattr(gs, "_mmfast_row", mm_row)
    monkeypatch.setattr(gs, "_hf_row", lambda *a: ran.append(a[-1].row) or real_hf(*a))
    recipe = _recipe(batches=(1,), workloads=("pope",), rows=("hf *", "mmfast unpruned", "divprune-8"))
    with pytest.raises(KeyboardInterrupt):
        run_bench(recipe, output=str(tmp_path))
    assert [r["row"] for r in _rows(tmp_path)] == [gs.HF_EAGER, gs.HF_STATIC, gs.UNPRUNED]
    with (tmp_path / "rows.jsonl").open("a") as f:
        f.write('{"shape": "tiny", "batch": 1, "wor')  # a torn last line
    ran.clear()
    run_bench(recipe, output=str(tmp_path))
    assert ran == ["divprune-8"]  # only the row in flight re-runs
    keys = [(r["batch"], r["workload"], r["row"]) for r in _rows(tmp_path)]
    assert len(keys) == len(set(keys)) == 4
    ran.clear()  # other settings (repeats): the stored rows are stale and every row re-runs
    run_bench(
        _recipe(batches=(1,), workloads=("pope",), rows=("hf *", "mmfast unpruned", "divprune-8"), repeats=1),
        output=str(tmp_path),
    )
    assert sorted(ran) == sorted([gs.HF_EAGER, gs.HF_STATIC, gs.UNPRUNED, "divprune-8"])
    assert {r["repeats"] for r in _rows(tmp_path)} == {1} and len(_rows(tmp_path)) == 4


def test_bad_selection_is_refused_before_compute():
    with pytest.raises(ConfigError, match=r"bench.params.shapez.*shapes"):
        _recipe("bench.params.shapez=[tiny]")
    with pytest.raises(ConfigError, match=r"bench.params.workloads"):
        _recipe(workloads=("captions",))
    with pytest.raises(InputError, match=r"bench.params.shapes\[0\].*llava-1.5-7b"):
        gs.GpuBenchParams.of(_recipe("bench.params.shapes=[llava-1.5-7B]"))


@pytest.mark.parametrize(
    "override, key",
    [
        ("bench.params.caption_tokens=0", "caption_tokens"),
        ("bench.params.caption_tokens=-3", "caption_tokens"),
        ("bench.params.embedded_samples=0", "embedded_samples"),
        ("bench.params.embedded_samples=-1", "embedded_samples"),
    ],
)
def test_counts_that_cannot_run_are_refused_before_compute(override, key):
    """A caption of no tokens made every caption row fail (or be refused) one by one after each 7B build, and
    embedded_samples -1 silently took every image but the last (0: a table of empty rows): refused up front."""
    with pytest.raises(InputError, match=rf"bench.params.{key}"):
        gs.GpuBenchParams.of(_recipe(override))


def _m(shape, b, w, row, **kw):
    return gs.Measurement(shape, b, w, row, "s", **kw)


def test_targets_pass_fail_and_not_measured():
    rows = [
        _m("llava-1.5-7b", 1, "caption", gs.HF_STATIC, new_tokens=128, ttft_s=0.1, e2e_s=0.1 + 127 * 0.010),
        _m("llava-1.5-7b", 1, "caption", gs.UNPRUNED, new_tokens=128, ttft_s=0.1, e2e_s=0.1 + 127 * 0.0105),
        _m("llava-1.5-7b", 8, "caption", gs.HF_STATIC, new_tokens=128, ttft_s=0.1, e2e_s=0.1 + 127 * 0.010),
        _m("llava-1.5-7b", 8, "caption", gs.UNPRUNED, new_tokens=128, ttft_s=0.1, e2e_s=0.1 + 127 * 0.013),
        _m("llava-1.5-7b", 32, "caption", gs.UNPRUNED, new_tokens=128, ttft_s=1.0, e2e_s=6.0),
        _m("llava-1.5-7b", 32, "caption", "divprune-64", new_tokens=128, ttft_s=0.3, e2e_s=4.0),
        _m(
            "llava-1.5-7b",
            8,
            "pope",
            gs.UNPRUNED,
            new_tokens=1,
            ttft_s=0.2,
            e2e_s=0.2,
            prefill_s=0.1,
            n_vision_tokens=576,
            flops_prefill=10.0,
        ),
        _m(
            "llava-1.5-7b",
            8,
            "pope",
            "divprune-64",
            new_tokens=1,
            ttft_s=0.1,
            e2e_s=0.1,
            prefill_s=0.02,
            n_vision_tokens=64,
            flops_prefill=1.8,
        ),
        _m(
            "llava-1.5-7b",
            8,
            "pope",
            "fastv-64",
            new_tokens=1,
            ttft_s=0.1,
            e2e_s=0.1,
            prefill_s=0.05,
            n_vision_tokens=576,
            flops_prefill=2.0,
        ),
        _m("llava-1.5-7b", 8, "pope", "zipvl-64", new_tokens=1, ttft_s=0.25, e2e_s=0.25, prefill_s=0.12),
        _m("llava-1.5-7b", 1, "pope", gs.UNPRUNED, new_tokens=1, ttft_s=0.05, e2e_s=0.05, prefill_s=0.02),
        _m("llava-1.5-7b", 1, "pope", "fastv-64", new_tokens=1, ttft_s=0.04, e2e_s=0.04, prefill_s=0.01),
    ]
    recipe = load_recipe(RECIPE)
    from mmfast.bench.common import variants

    checks = {c.target: c for c in gs.targets({m.key: m for m in rows}, variants(recipe))}
    assert checks["llava-1.5-7b b1: mmfast unpruned decode ms/token <= 1.1 x hf static"].status == "pass"  # 1.05x
    assert checks["llava-1.5-7b b8: mmfast unpruned decode ms/token <= 1.1 x hf static"].status == "fail"  # 1.3x
    assert checks["llava-1.5-7b b32: divprune-64 end-to-end throughput >= 1.4 x unpruned"].value == pytest.approx(1.5)
    assert checks["llava-1.5-7b b32: divprune-64 end-to-end throughput >= 1.4 x unpruned"].status == "pass"
    assert checks["llava-next-7b b32: divprune-64 end-to-end throughput >= 2.5 x unpruned"].status == "not measured"
    ideal = checks["llava-1.5-7b b8: divprune-64 prefill >= 0.85 of the FLOPs ideal"]
    assert ideal.value == pytest.approx(5 * 0.18) and ideal.status == "pass"
    # in-LLM: not a pre-LLM pruner (576 tokens at the LLM input)
    assert not any("fastv-64 prefill" in t for t in checks)
    assert any(t.startswith("embedded:") and c.status == "not measured" for t, c in checks.items())
    # no pruner's TTFT above the unpruned model's: ZipVL's is at batch 8 (0.2 / 0.25), FastV's is not at batch 1
    slow = checks["llava-1.5-7b b8: no pruner's TTFT above the unpruned model's (slowest: zipvl-64)"]
    assert slow.value == pytest.approx(0.8) and slow.status == "fail"
    fast = checks["llava-1.5-7b b1: no pruner's TTFT above the unpruned model's (slowest: fastv-64)"]
    assert fast.value == pytest.approx(1.25) and fast.status == "pass"
    zipvl = checks["llava-1.5-7b b8: zipvl-64 prefill <= 1.1 x unpruned prefill"]
    assert zipvl.value == pytest.approx(0.1 / 0.12) and zipvl.status == "fail"


def test_projected_decode_uses_the_captured_step_where_it_ran():
    eager = _m("llava-1.5-7b", 1, "caption", gs.UNPRUNED, new_tokens=129, ttft_s=0.1, e2e_s=0.1 + 128 * 0.030)
    compiled = _m("llava-1.5-7b", 1, "caption", gs.COMPILED, new_tokens=129, ttft_s=0.1, e2e_s=0.1 + 128 * 0.0075)
    # 128 tokens in 32 cycles of 20 ms each
    flash = _m("llava-1.5-7b", 1, "caption", "flash", new_tokens=129, ttft_s=0.1, e2e_s=0.1 + 32 * 0.020, cycles=32)
    both = {m.key: m for m in (eager, compiled, flash)}
    assert gs.projected_decode(both, flash, 4.0) == pytest.approx(4.0 * 0.0075 / 0.020)  # not 4 x 30 / 20
    assert gs.projected_decode({m.key: m for m in (eager, flash)}, flash, 4.0) == pytest.approx(4.0 * 0.030 / 0.020)
    assert gs.projected_decode(both, flash, None) is None


def test_embedded_flash_row_has_real_tau_and_is_lossless(tmp_path):
    recipe = _recipe(
        "bench.params.embedded_speculative=true",
        "bench.params.embedded_samples=1",
        "bench.compare=[{name: flash, speculative: {method: flash, params: {top_k: 4, total_tokens: 12}}}, "
        "{name: prompt_lookup, speculative: {method: prompt_lookup}}]",
        "bench.params.shapes=[tiny]",
        "bench.params.embedded_rows=[flash]",
        rows=(),
        repeats=1,
    )  # prompt_lookup: not selected
    result = run_bench(recipe, output=str(tmp_path))
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {gs.UNPRUNED, "flash"} and {r["shape"] for r in rows.values()} == {gs.EMBEDDED}
    assert rows["flash"]["tau"] > 1.0 and rows["flash"]["tokens_sha"] == rows[gs.UNPRUNED]["tokens_sha"]
    assert "## Speculative decoding on the embedded model (real tau)" in result["table"]
    assert any(t["target"].startswith("embedded: flash") and t["status"] in ("pass", "fail") for t in result["targets"])


@pytest.mark.parametrize("shape", ["tiny-next", "tiny-qwen", "tiny-onevision"])
def test_anyres_and_qwen_shapes_hf_rows_equal_mmfast(tmp_path, shape):
    recipe = _recipe(
        f"bench.params.shapes=[{shape}]",
        rows=("hf *", "mmfast unpruned"),
        batches=(2,),
        workloads=("caption",),
        repeats=1,
    )
    rows = {r["row"]: r for r in run_bench(recipe, output=str(tmp_path))["rows"]}
    assert {r["status"] for r in rows.values()} == {"ok"}
    assert rows[gs.HF_EAGER]["tokens_sha"] == rows[gs.HF_STATIC]["tokens_sha"] == rows[gs.UNPRUNED]["tokens_sha"]


@pytest.mark.parametrize(
    "name,tokens,layers", [("llava-next-7b", 2928, 32), ("qwen2.5-vl-7b", 999, 28), ("llava-onevision-7b", 4725, 28)]
)
def test_full_depth_shapes_build_without_weights(name, tokens, layers):
    """The 7B shapes build (on the meta device here: no memory, no init) with their real token geometry."""
    import numpy as np
    import torch
    from PIL import Image

    from mmfast.model import MMModel
    from mmfast.models.factory import BENCH_MODELS, build_bench_model

    model, processor = build_bench_model(name, device="meta", dtype=torch.float16)
    mm = MMModel(model, processor, name)
    image = Image.fromarray(np.zeros((*BENCH_MODELS[name].image, 3), dtype=np.uint8))
    ids = processor(images=[image], text=mm.prepare([image], ["Is there a dog?"]).texts, return_tensors="pt")[
        "input_ids"
    ]
    assert int((ids == mm.adapter.image_token_id).sum()) == tokens and len(mm.adapter.layers) == layers
    assert mm.dtype == torch.float16 and mm.eos_token_ids == [
        model.config.get_text_config().vocab_size
    ]  # never generated


def test_onevision_7b_shape_has_the_released_sizes():
    """The OneVision-7B shape's config (built without weights) has llava-onevision-qwen2-7b-ov-hf's sizes:
    SigLIP-so400m/14 at 384 (26 layers, 729 tokens per view, no CLS), anyres_max_9 over 6 x 6 tiles of
    384 px, Qwen2-7B."""
    import torch

    from mmfast.models.factory import build_bench_model

    model, _ = build_bench_model("llava-onevision-7b", device="meta", dtype=torch.float16)
    c = model.config
    v, t = c.vision_config, c.text_config
    assert (v.model_type, v.hidden_size, v.intermediate_size, v.num_hidden_layers, v.num_attention_heads) == (
        "siglip_vision_model",
        1152,
        4304,
        26,
        16,
    )
    assert (v.image_size // v.patch_size) ** 2 == 729 and not v.vision_use_head
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (3584, 28, 28, 4)
    assert (t.intermediate_size, t.vocab_size, t.max_position_embeddings) == (18944, 152064, 32768)
    assert c.vision_aspect_ratio == "anyres_max_9" and c.vision_feature_select_strategy == "full"
    assert sorted(map(tuple, c.image_grid_pinpoints)) == [(384 * r, 384 * k) for r in range(1, 7) for k in range(1, 7)]


def test_a_failing_row_is_recorded_loudly_and_re_runs(tmp_path, monkeypatch):
    real = gs._mmfast_row
    broken = [True]

    def mm_row(shape, v, b, w, n, cfg, compiled, m):
        if m.row == "divprune-8" and broken[0]:
            raise RuntimeError("kernel exploded")
        return real(shape, v, b, w, n, cfg, compiled, m)

    monkeypatch.setattr(gs, "_mmfast_row", mm_row)
    recipe = _recipe(batches=(1,), workloads=("pope",), rows=("mmfast unpruned", "divprune-8"), repeats=1)
    result = run_bench(recipe, output=str(tmp_path))
    status = {r["row"]: r["status"] for r in result["rows"]}
    assert status == {gs.UNPRUNED: "ok", "divprune-8": "failed: RuntimeError: kernel exploded"}
    assert "**1 rows failed**" in result["table"] and "failed: RuntimeError: kernel exploded" in result["table"]
    broken[0] = False
    result = run_bench(recipe, output=str(tmp_path))
    assert {r["row"]: r["status"] for r in result["rows"]} == {gs.UNPRUNED: "ok", "divprune-8": "ok"}
    assert [r["status"] for r in _rows(tmp_path)] == ["ok", "ok"]  # the failed line is replaced, not duplicated


def test_timed_calls_replay_the_first_calls_graphs(tmp_path, monkeypatch):
    """With captured steps (here CUDA-graph semantics emulated on the CPU) the first call captures and the
    timed calls replay: the graphs and static buffers outlive the call, and a one-token (TTFT) call in
    between takes the same buffers (its prefill replays the kept prefill graph) without letting them go."""
    from mmfast._graph_emulator import ReplayEmulator
    from mmfast.pipeline import Session

    monkeypatch.setattr(Session, "_captures", lambda self: self.recipe.model.compile == "auto")
    monkeypatch.setattr(Session, "_capture_factory", lambda self: ReplayEmulator if self._captures() else None)
    run_bench(_recipe(rows=["mmfast *"], batches=[2], workloads=["caption"]), output=str(tmp_path))
    rows = {r["row"]: r for r in _rows(tmp_path)}
    assert rows[gs.COMPILED]["capture_s"] > 0 and rows[gs.COMPILED]["capture_timed_s"] == 0
    assert rows[gs.UNPRUNED]["capture_s"] is None  # model.compile: off
    assert len({r["tokens_sha"] for r in rows.values()}) == 1
    line = next(x for x in (tmp_path / "results.md").read_text().splitlines() if f"| {gs.COMPILED} |" in x)
    assert " / 0.0 |" in line


def test_output_dir_under_the_home_directory(tmp_path, monkeypatch):
    """``output.dir: ~/benches/{name}`` is under the home directory (as for ``mmfast eval``), not a directory named
    ``~`` under the working directory."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    recipe = _recipe(
        "output.dir=~/benches/{name}", rows=("mmfast unpruned",), batches=(1,), workloads=("pope",), repeats=1
    )
    run_bench(recipe)
    assert (home / "benches" / recipe.name / "summary.json").is_file() and not (cwd / "~").exists()


def test_cpu_build_too_big_for_memory_is_refused_before_any_compute():
    """`mmfast bench bench/gpu_speed` (or bench/video_cost) on a CPU machine with less memory than a 7B
    model's float32 random init needs was killed by the kernel (exit 137, no message) after its first
    rows; the build is now refused up front with the memory it needs and what to do instead."""
    from mmfast.models.factory import check_cpu_build_fits

    with pytest.raises(InputError, match=r"'llava-1\.5-7b' .*needs about 2\d\.\d GiB.*8\.0 GiB is available.*GPU"):
        check_cpu_build_fits("llava-1.5-7b", "cpu", available=8 * 2**30)
    check_cpu_build_fits("llava-1.5-7b", "cpu", text_layers=1, vision_layers=1, available=8 * 2**30)  # fits
    check_cpu_build_fits("llava-1.5-7b", "cuda", available=1)  # a GPU's memory is not the host's
    check_cpu_build_fits("tiny", "cpu")  # the kernel's MemAvailable


def test_run_gpu_speed_refuses_a_shape_too_big_before_the_embedded_rows(tmp_path, monkeypatch):
    from mmfast.models import factory

    monkeypatch.setattr(factory, "_available_memory", lambda: 2**30)
    recipe = _recipe(
        "bench.params.embedded_speculative=true",
        "bench.params.shapes=[llava-1.5-7b]",
        rows=("hf eager",),
        batches=(1,),
        workloads=("pope",),
        repeats=1,
    )
    with pytest.raises(InputError, match="'llava-1.5-7b' .*needs about"):
        run_bench(recipe, output=str(tmp_path))
    rows = tmp_path / "rows.jsonl"
    assert not rows.exists() or not rows.read_text().strip()  # not even the embedded model's rows ran
