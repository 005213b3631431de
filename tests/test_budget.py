"""The budget vocabulary of pruning stages: strict config, per-method mappings, calibration, bench expansion."""

from __future__ import annotations

import pytest

from mmfast.config import load_recipe
from mmfast.errors import ConfigError
from mmfast.pruning._budget import in_llm_keep

PROMPTS = ["Describe the image.", "Is there a cat in the image?"]


def _stage(method, tokens, **params):
    return {"pruning": [{"method": method, "params": params, "budget": {"tokens": tokens}}]}


# -- strict config -----------------------------------------------------------------------------------


def test_budget_parses_and_roundtrips():
    r = load_recipe(_stage("random", 8))
    assert r.pruning[0].budget.tokens == 8 and r.pruning[0].budget.flops is None
    again = load_recipe(r.to_dict())  # the dump omits the knobs the budget sets
    assert again.pruning[0] == r.pruning[0] and again.hash() == r.hash()
    assert load_recipe({"pruning": [{"method": "fastv", "budget": {"flops": 0.2}}]}).pruning[0].budget.flops == 0.2


@pytest.mark.parametrize(
    "budget, path",
    [
        ({"tokens": 8, "flops": 0.5}, "pruning[0].budget"),
        ({}, "pruning[0].budget"),
        ({"tokns": 8}, "pruning[0].budget.tokns"),
        ({"tokens": 0}, "pruning[0].budget.tokens"),
        ({"flops": 1.5}, "pruning[0].budget.flops"),
        ({"tokens": "64"}, "pruning[0].budget.tokens"),
    ],
)
def test_budget_strict_errors(budget, path):
    with pytest.raises(ConfigError) as exc:
        load_recipe({"pruning": [{"method": "random", "budget": budget}]})
    assert exc.value.path == path


def test_unknown_stage_key_suggests_budget():
    with pytest.raises(ConfigError, match="did you mean 'budget'") as exc:
        load_recipe({"pruning": [{"method": "random", "budgt": {"tokens": 8}}]})
    assert exc.value.path == "pruning[0].budgt"


@pytest.mark.parametrize(
    "method, knob, value",
    [
        ("fastv", "keep", 5),
        ("fastv", "drop_ratio", 0.5),
        ("random", "keep", 4),
        ("mustdrop", "preset", "64"),
        ("zipvl", "tau", 0.9),
        ("tome", "r", 2),
        ("cdpruner", "ratio", 0.3),  # overrides keep, so the budget would be ignored
    ],
)
def test_budget_and_knob_together_fail_naming_both(method, knob, value):
    with pytest.raises(ConfigError) as exc:
        load_recipe(_stage(method, 8, **{knob: value}))
    assert exc.value.path == f"pruning[0].params.{knob}" and "pruning[0].budget.tokens" in str(exc.value)


# -- mappings on the tiny model (4x4 grid = 16 vision tokens, 4-layer LLM) -----------------------------------

EXTRA = {
    "hicom": {"global_queries": 0, "clip_model": "random"},
    "dynamic_llava": {"predictors": "random", "layer_mapping": "proportional"},
    "fastv": {"layer_mapping": "proportional"},
}


@pytest.mark.parametrize("method", ["random", "visionzip", "tome", "fastv", "dynamic_llava"])
@pytest.mark.parametrize("tokens", [8, 4])
def test_budget_lands_within_5_percent(tiny_mm, images, method, tokens):
    out = tiny_mm.generate(
        images[:2], PROMPTS, recipe=_stage(method, tokens, **EXTRA.get(method, {})), max_new_tokens=2
    )
    for r in out:
        assert abs(r.vision_tokens_layer_avg - tokens) <= 0.05 * tokens, (method, tokens, r.vision_tokens_layer_avg)


@pytest.mark.parametrize("method", ["avgpool", "hicom"])
@pytest.mark.parametrize("tokens", [8, 4, 6])
def test_grid_methods_follow_the_near_square_rule(tiny_mm, images, method, tokens):
    from mmfast.pruning._grid import near_square_grid

    oh, ow = near_square_grid(tokens, 4, 4)
    out = tiny_mm.generate(
        images[:2], PROMPTS, recipe=_stage(method, tokens, **EXTRA.get(method, {})), max_new_tokens=2
    )
    assert [r.vision_tokens_layer_avg for r in out] == [oh * ow] * 2


def test_fastv_closed_form(tiny_mm):
    from mmfast.pruning.fastv import FastV

    cfg = (
        load_recipe({"pruning": [{"method": "fastv", "params": {"k": 8, "layer_mapping": "proportional"}}]})
        .pruning[0]
        .params
    )
    # L = 4, K = round(8 * 4 / 32) = 1, N = 16: keep = round((4B - 16) / 3)
    for b, keep in [(16, 16), (10, 8), (8, 5), (4, 0)]:
        assert FastV.budget_params(b, 16, tiny_mm.adapter, cfg, "b") == {"keep": keep}
    assert in_llm_keep(200, 576, 2, 32, "b") == round((32 * 200 - 2 * 576) / 30)
    with pytest.raises(ConfigError, match="smallest feasible budget is 4") as exc:
        FastV.budget_params(3, 16, tiny_mm.adapter, cfg, "pruning[0].budget")
    assert exc.value.path == "pruning[0].budget.tokens"


def test_fastv_keep_is_per_image(tiny_mm, images):
    rec = {"pruning": [{"method": "fastv", "params": {"keep": 3, "layer_mapping": "proportional"}}]}
    out = tiny_mm.generate([images[:2], images[2]], PROMPTS, recipe=rec, max_new_tokens=2)
    assert out[0].stats["fastv"]["kept"] == 6 and out[1].stats["fastv"]["kept"] == 3


def test_flops_budget_converts_to_tokens(tiny_mm, images):
    from mmfast.flops import LMShape, layer_flops, tokens_for_flops_ratio

    shape = LMShape.of(tiny_mm.adapter.text_config)
    t = tokens_for_flops_ratio(0.9, shape, 16)
    assert 0 < t < 16 and abs(layer_flops(64 + t, shape) / layer_flops(64 + 16, shape) - 0.9) < 0.01
    with pytest.raises(ValueError, match="smallest feasible"):
        tokens_for_flops_ratio(0.01, shape, 16)
    out = tiny_mm.generate(
        images[:1], PROMPTS[:1], recipe={"pruning": [{"method": "random", "budget": {"flops": 0.9}}]}, max_new_tokens=1
    )
    assert out[0].n_vision_tokens == t


# -- calibration (MustDrop, ZipVL) on the calibration set itself --------------------------------------------


@pytest.mark.parametrize(
    "method, params, tokens", [("mustdrop", {"window": 2, "layer_mapping": "proportional"}, 8), ("zipvl", {}, 6)]
)
def test_calibration_converges(tiny_mm, method, params, tokens):
    from mmfast.pruning._budget import CALIBRATION_IMAGES, calibration_prompt
    from mmfast.world import render_image

    n = CALIBRATION_IMAGES  # the calibration set itself
    images = [render_image(0, "val", 20 * i).image.convert("RGB") for i in range(n)]
    prompts = [calibration_prompt(i) for i in range(n)]
    out = tiny_mm.generate(images, prompts, recipe=_stage(method, tokens, **params), max_new_tokens=1)
    cal = out[0].stats[method]["calibration"]
    assert cal["target"] == tokens and abs(cal["tokens"] - tokens) <= 0.02 * tokens
    mean = sum(r.vision_tokens_layer_avg for r in out) / len(out)
    assert abs(mean - tokens) <= 0.1 * tokens  # same images, the session's own prompts


def test_calibration_on_an_evaluation_set_of_any_size(tiny_mm, tmp_path):
    """An evaluation's calibration set has its own size (64 samples, not the 24 of the default world
    set): every sample is measured with its own image."""
    from mmfast.pipeline import apply
    from mmfast.pruning._budget import EVAL_CALIBRATION_SAMPLES, CalibrationSet, calibration_prompt
    from mmfast.world import render_image

    n = EVAL_CALIBRATION_SAMPLES
    paths = []
    for i in range(n):
        paths.append(str(tmp_path / f"{i}.png"))
        render_image(1, "val", i).image.convert("RGB").save(paths[-1])
    cal = CalibrationSet(tuple(paths), tuple(calibration_prompt(i) for i in range(n)))
    with apply(tiny_mm, _stage("zipvl", 6), calibration=cal) as session:
        out = session.run(
            tiny_mm.prepare([render_image(1, "val", 0).image.convert("RGB")], ["Is there a dog?"]), max_new_tokens=1
        )
    cal_stats = out[0].stats["zipvl"]["calibration"]
    assert cal_stats["target"] == 6 and abs(cal_stats["tokens"] - 6) <= 0.02 * 6


def test_mustdrop_calibrates_the_merge_when_thresholds_cannot_reach(tiny_mm):
    """Budget 4 of 16 on the tiny model: the largest lambda scale still keeps more, so the merge
    threshold is lowered (more windows merge) until the calibration set lands on the budget."""
    from mmfast.pipeline import Session
    from mmfast.pruning._budget import CALIBRATION_TOLERANCE

    recipe = load_recipe(_stage("mustdrop", 4, window=2, layer_mapping="proportional"))
    with Session(tiny_mm, recipe) as s:
        md = s.pruners[0]
        assert md.sim_threshold < md.config.sim_threshold == 0.8
        assert abs(md.calibration.tokens - 4) <= CALIBRATION_TOLERANCE * 4
        assert md.calibration.value == md.sim_threshold


def test_calibration_refuses_unreachable_budget(tiny_mm, images):
    with pytest.raises(ConfigError, match="out of reach") as exc:
        tiny_mm.generate(
            images[:1],
            PROMPTS[:1],
            recipe=_stage("mustdrop", 1, window=2, layer_mapping="proportional"),
            max_new_tokens=1,
        )
    assert exc.value.path == "pruning[0].budget.tokens"


# -- bench expansion ---------------------------------------------------------------------------------------


def test_bench_budgets_expand_to_variants():
    from mmfast.bench.common import only_variants, variants

    r = load_recipe(
        {
            "bench": {
                "kind": "pruning",
                "budgets": [192, 64],
                "methods": ["random", {"method": "mustdrop", "params": {"window": 2}}],
                "compare": [{"name": "fastv-paper", "pruning": [{"method": "fastv", "params": {"keep": 64}}]}],
            }
        }
    )
    vs = variants(r)
    assert [v.name for v in vs] == ["baseline", "fastv-paper", "random-192", "random-64", "mustdrop-192", "mustdrop-64"]
    md = vs[-1].recipe.pruning[0]
    assert md.method == "mustdrop" and md.budget.tokens == 64 and md.params.window == 2
    assert [v.name for v in variants(only_variants(r, ["random-64"]))] == ["baseline", "random-64"]
    with pytest.raises(ConfigError, match="bench.methods and bench.budgets go together"):
        variants(load_recipe({"bench": {"kind": "pruning", "budgets": [64]}}))
    bad = load_recipe(
        {"bench": {"kind": "pruning", "budgets": [64], "methods": [{"method": "random", "params": {"keep": 3}}]}}
    )
    with pytest.raises(ConfigError) as exc:
        variants(bad)
    assert exc.value.path.startswith("bench.methods[0].pruning[0].params.keep")


def test_pruning_bench_recipe_expands():
    from mmfast.bench.common import variants

    names = [v.name for v in variants(load_recipe("configs/bench/pruning.yaml"))]
    for m in ("visionzip", "tome", "random", "avgpool", "mustdrop", "hicom", "zipvl"):
        assert {f"{m}-192", f"{m}-128", f"{m}-64"} <= set(names)
    assert "fastv-192" in names and "zipvl-tau0.975" in names


def test_calibration_is_reused_for_the_same_stages_and_model(tiny_mm, monkeypatch):
    """A benchmark opens each variant several times: the same stages on the same, unmodified model
    reuse the first calibration; a model modified in place since is calibrated anew."""
    import torch

    from mmfast.pipeline import Session
    from mmfast.pruning import _budget
    from mmfast.pruning.mustdrop import MustDrop

    monkeypatch.setattr(_budget, "_CALIBRATED", {})
    calls = []
    real = MustDrop.calibrate

    def counting(self, tokens):
        calls.append(tokens)
        return real(self, tokens)

    monkeypatch.setattr(MustDrop, "calibrate", counting)
    recipe = load_recipe(_stage("mustdrop", 8, window=2, layer_mapping="proportional"))
    with Session(tiny_mm, recipe) as s:
        first = (s.pruners[0].lambda_g, s.pruners[0].sim_threshold, s.pruners[0].calibration)
    with Session(tiny_mm, recipe) as s:
        assert (s.pruners[0].lambda_g, s.pruners[0].sim_threshold, s.pruners[0].calibration) == first
    assert calls == [8]
    p = next(tiny_mm.model.parameters())
    with torch.no_grad():
        p.add_(0.0)  # an in-place change (as training makes): a new calibration
    with Session(tiny_mm, recipe):
        pass
    assert calls == [8, 8]


def test_stacked_bench_recipe_expands_and_every_row_is_one_the_composition_core_accepts():
    """The stacked bench: DivPrune at 64 with OPERA and, in another row, with the FLASH draft; OPERA
    and the draft in one recipe are refused (beam search is not what draft verification reproduces)."""
    from mmfast.bench.common import variants
    from mmfast.config import load_recipe

    vs = {v.name: v.recipe for v in variants(load_recipe("bench/stacked"))}
    assert set(vs) == {"baseline", "divprune-64", "opera", "flash", "divprune-64+opera", "divprune-64+flash"}
    both = vs["divprune-64+opera"]
    assert (
        [st.method for st in both.pruning] == ["divprune"]
        and both.decoding.method == "opera"
        and both.speculative is None
    )
    assert vs["divprune-64+flash"].speculative.method == "flash" and vs["divprune-64+flash"].decoding.method == "greedy"
    assert load_recipe("bench/stacked").eval.tasks[0] == "chair"  # the timing passes time caption generation


def test_calibration_spread_covers_distinct_images_in_task_shares():
    """An evaluation asks several questions per image: the spread keeps each task's share of the
    positions but takes a new image at each one where its stretch has one (on the pruning bench's
    records, every 15th sample repeats images and misses MustDrop's evaluation mean by 4-9%)."""
    from types import SimpleNamespace as S

    from mmfast.pruning._budget import CalibrationSet

    # POPE's three splits ask about the same 10 images (6 questions each), then 20 captions
    pope = [S(image=f"pope{i // 6 % 10}.png", prompt=f"q{i}") for i in range(180)]
    chair = [S(image=f"chair{i}.png", prompt="describe") for i in range(20)]
    cal = CalibrationSet.spread(pope + chair, n=20)  # step 10
    assert len(cal.images) == 20
    assert sum(im.startswith("pope") for im in cal.images) == 18  # 180 of 200 samples -> 18 of 20 positions
    assert len({im for im in cal.images if im.startswith("pope")}) == 10  # every image, repeats only after
    assert all(p in {s.prompt for s in pope + chair} for p in cal.prompts)
    everykth = (pope + chair)[::10][:20]
    assert len({s.image for s in everykth if s.image.startswith("pope")}) < 10


def test_calibration_spread_keeps_the_share_of_a_task_listed_last():
    """Evenly spaced over every sample: with 100 POPE questions then 20 captions (120 samples, 64 positions) a
    whole step of 1 took the first 64 samples, all POPE, and no caption; 255 samples took the first 192."""
    from types import SimpleNamespace as S

    from mmfast.pruning._budget import CalibrationSet

    for n_pope, n_chair in ((100, 20), (200, 55)):
        pope = [S(image=f"pope{i}.png", prompt="q") for i in range(n_pope)]
        chair = [S(image=f"chair{i}.png", prompt="describe") for i in range(n_chair)]
        cal = CalibrationSet.spread(pope + chair)
        assert len(cal.images) == 64 and len(set(cal.images)) == 64
        share = 64 * n_chair / (n_pope + n_chair)
        assert abs(sum(im.startswith("chair") for im in cal.images) - share) <= 1, (n_pope, n_chair)


def test_pruning_bench_times_every_method_on_a_random_shape():
    """The bench's real-shape timing (here on the embedded model's shape with random weights: 576
    patches, 4 LLM layers, the code path of ``llava-1.5-7b-slice``) runs methods with trained parts on
    seeded stand-ins and calibrates threshold budgets on the timed sample, so each row runs at its budget."""
    import torch

    from mmfast.bench.common import variants
    from mmfast.bench.pruning import _shaped_speed

    names = [
        "hicom-64",
        "mustdrop-64",
        "zipvl-64",
        "dynamic_llava-rate0.111",
        "fastv-192",
        "pyramiddrop-192",
        "sparsevlm-192",
    ]
    data = load_recipe("configs/bench/pruning.yaml").to_dict()
    data["bench"].update(shape="world", warmup=0, repeats=1)
    data["bench"]["params"]["shaped_variants"] = names
    recipe = load_recipe(data)
    speed = _shaped_speed(recipe, variants(recipe), torch.device("cpu"))
    assert speed["skipped"] == []
    rows = {r["variant"]: r for r in speed["rows"]}
    assert set(rows) == {"baseline", *names}
    for name in ("mustdrop-64", "zipvl-64"):  # calibrated on the timed sample (2% tolerance)
        assert abs(rows[name]["layer_avg_tokens"] - 64) <= 0.02 * 64, rows[name]
    assert rows["hicom-64"]["vision_tokens"] == 62  # 30 local (a 5 x 6 grid) + 32 global queries
    for name in ("fastv-192", "pyramiddrop-192", "sparsevlm-192"):
        assert abs(rows[name]["layer_avg_tokens"] - 192) <= 0.05 * 192, rows[name]
    assert rows["dynamic_llava-rate0.111"]["layer_avg_tokens"] < 576


# -- the rule per image (issue 28): tokens keep N of every image, ratio keeps round(r N_i) -------------------


@pytest.mark.parametrize(
    "budget, path, match",
    [
        ({"ratio": 0}, "pruning[0].budget.ratio", "allowed \\(0, 1\\]"),
        ({"ratio": 1.5}, "pruning[0].budget.ratio", "out of range"),
        ({"ratio": -0.1}, "pruning[0].budget.ratio", "allowed \\(0, 1\\]"),
        ({"tokens": 8, "ratio": 0.5}, "pruning[0].budget", "exactly one of tokens, ratio or flops"),
        ({"ratoi": 0.5}, "pruning[0].budget.ratoi", "did you mean 'ratio'"),
        ({"keep": 64}, "pruning[0].budget.keep", "allowed keys: flops, ratio, tokens"),
    ],
)
def test_ratio_budget_strict_errors(budget, path, match):
    with pytest.raises(ConfigError, match=match) as exc:
        load_recipe({"pruning": [{"method": "random", "budget": budget}]})
    assert exc.value.path == path


def test_ratio_budget_parses_and_roundtrips():
    r = load_recipe({"pruning": [{"method": "divprune", "budget": {"ratio": 0.25}}]})
    assert r.pruning[0].budget.ratio == 0.25 and r.pruning[0].budget.label == "r0.25"
    assert load_recipe(r.to_dict()).hash() == r.hash() and r.to_dict()["pruning"][0]["budget"] == {"ratio": 0.25}


@pytest.mark.parametrize("method", ["random", "divprune"])
def test_tokens_keep_exactly_n_and_ratio_round_r_n_on_llava(tiny_mm, images, method):
    for budget, want in (({"tokens": 7}, 7), ({"ratio": 0.3}, round(0.3 * 16)), ({"ratio": 1.0}, 16)):
        out = tiny_mm.generate(
            images[:2], PROMPTS, recipe={"pruning": [{"method": method, "budget": budget}]}, max_new_tokens=1
        )
        assert [r.n_vision_tokens for r in out] == [want, want], (method, budget)


def test_in_llm_ratio_budget_is_layer_averaged_on_llava(tiny_mm, images):
    """FastV with ratio r: the layer average is round(r N) (within the closed form's rounding)."""
    stage = {"method": "fastv", "params": {"layer_mapping": "proportional"}, "budget": {"ratio": 0.5}}
    out = tiny_mm.generate(images[:2], PROMPTS, recipe={"pruning": [stage]}, max_new_tokens=1)
    for r in out:  # L = 4, K = 1, N = 16: target 8, keep = round((32 - 16) / 3) = 5
        assert r.stats["fastv"]["kept"] == 5 and abs(r.vision_tokens_layer_avg - 8) <= 3 / 8


def test_tokens_larger_than_the_input_is_refused_before_compute_on_llava(tiny_mm):
    """LLaVA-1.5's images all have N tokens: the refusal comes when the session opens, naming both counts."""
    from mmfast.pipeline import Session

    with pytest.raises(ConfigError, match="17 vision tokens per image is more than this image has \\(16 ") as exc:
        Session(tiny_mm, load_recipe({"pruning": [{"method": "random", "budget": {"tokens": 17}}]}))
    assert exc.value.path == "pruning[0].budget.tokens"


def test_validate_refuses_tokens_above_the_models_count_from_its_config(monkeypatch, tmp_path, capsys):
    """``mmfast validate`` reads LLaVA-1.5's one count (576 on the embedded model) from the config and
    refuses, at the stage's budget path, more tokens than every image has, in any stage; a budget that
    fits and a fraction pass."""
    from mmfast.cli import main

    monkeypatch.chdir(tmp_path)
    stage = "pruning=[{method: random, budget: {tokens: %d}}, {method: divprune, budget: {%s}}]"
    assert main(["validate", "world_eval", "--set", stage % (577, "ratio: 0.5")]) == 2
    err = capsys.readouterr().err
    assert "pruning[0].budget.tokens" in err and "more than this image has (576 vision tokens" in err
    assert main(["validate", "world_eval", "--set", stage % (64, "tokens: 600")]) == 2
    assert "pruning[1].budget.tokens" in capsys.readouterr().err
    for ok in (stage % (576, "tokens: 64"), stage % (64, "ratio: 1.0")):
        assert main(["validate", "world_eval", "--set", ok]) == 0
        assert "recipe hash" in capsys.readouterr().out


def test_a_later_stage_budget_follows_what_earlier_stages_left_on_llava(tiny_mm, images):
    """On LLaVA-1.5 (one count, 16 here) a second stage after ``random {tokens: 8}`` measures its budget on
    the 8 tokens it receives, as on the per-image families: ``ratio`` is of those 8, ``tokens`` averages
    over the layers on them, and more than 8 is refused; more than the model's 16 when the session opens."""
    from mmfast.pipeline import Session

    def run(stage):
        recipe = {"pruning": [{"method": "random", "budget": {"tokens": 8}}, stage]}
        return tiny_mm.generate(images[:2], PROMPTS, recipe=recipe, max_new_tokens=1)

    assert [r.n_vision_tokens for r in run({"method": "divprune", "budget": {"ratio": 0.5}})] == [4, 4]
    fastv = {"method": "fastv", "params": {"layer_mapping": "proportional"}}
    for budget in ({"tokens": 6}, {"ratio": 0.75}):  # L = 4, K = 1, N = 8: keep = round((24 - 8) / 3) = 5
        for r in run({**fastv, "budget": budget}):
            assert r.stats["fastv"]["kept"] == 5 and r.vision_tokens_layer_avg == 5.75, budget
    with pytest.raises(ConfigError, match="9 vision tokens per image is more than this image has \\(8 ") as exc:
        run({"method": "divprune", "budget": {"tokens": 9}})
    assert exc.value.path == "pruning[1].budget.tokens"
    stages = [{"method": "random", "budget": {"tokens": 8}}, {"method": "divprune", "budget": {"tokens": 17}}]
    with pytest.raises(ConfigError, match="more than this image has \\(16 "):
        Session(tiny_mm, load_recipe({"pruning": stages}))


@pytest.fixture(scope="module")
def qwen_mm(tmp_path_factory):
    import mmfast
    from mmfast.models.factory import random_qwen_vl, save_model

    model, processor = random_qwen_vl("qwen2_5_vl")
    return mmfast.load(save_model(model, processor, tmp_path_factory.mktemp("qwen_budget")), device="cpu")


@pytest.fixture(scope="module")
def qwen_images():
    """Two sizes: dynamic resolution gives each its own vision-token count (none of them 576)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(56, 84), (40, 48)]]


def test_tokens_keep_exactly_n_of_every_image_and_ratio_round_r_n_on_qwen(qwen_mm, qwen_images):
    """On Qwen-VL ``tokens: N`` keeps N of every image (not N / 576 of it), ``ratio: r`` round(r N_i);
    in-LLM FastV averages N over the layers on each image's own count."""
    base = qwen_mm.generate(qwen_images, PROMPTS, max_new_tokens=1)
    n = [b.n_vision_tokens for b in base]
    assert len(set(n)) == 2 and 576 not in n
    for method in ("random", "divprune"):
        for budget, want in (({"tokens": 5}, [5, 5]), ({"ratio": 0.4}, [round(0.4 * x) for x in n])):
            recipe = {"pruning": [{"method": method, "budget": budget}]}
            out = qwen_mm.generate(qwen_images, PROMPTS, recipe=recipe, max_new_tokens=1)
            assert [r.n_vision_tokens for r in out] == want, (method, budget)
    L = len(qwen_mm.adapter.layers)
    tokens = (3 * min(n)) // 4  # feasible at K = 1 on every image (>= N_i / L) and <= N_i
    stage = {"method": "fastv", "params": {"k": 8, "layer_mapping": "proportional"}, "budget": {"tokens": tokens}}
    out = qwen_mm.generate(qwen_images, PROMPTS, recipe={"pruning": [stage]}, max_new_tokens=1)
    for r, ni in zip(out, n):
        assert r.stats["fastv"]["kept"] == round((L * tokens - ni) / (L - 1))
        assert abs(r.vision_tokens_layer_avg - tokens) <= (L - 1) / (2 * L) + 1e-9


def test_tokens_larger_than_an_image_is_refused_before_the_llm_on_qwen(qwen_mm, qwen_images):
    """Images of their own counts: the count is read from the image's grid, so the check runs before the
    vision tower and any pruning or LLM layer."""
    n = qwen_mm.generate(qwen_images[1:], PROMPTS[:1], max_new_tokens=1)[0].n_vision_tokens
    calls = []
    handle = qwen_mm.adapter.vision_tower.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ConfigError, match=f"{n + 1} vision tokens per image is more than this image has \\({n} "):
            qwen_mm.generate(
                qwen_images[1:],
                PROMPTS[:1],
                recipe={"pruning": [{"method": "divprune", "budget": {"tokens": n + 1}}]},
                max_new_tokens=1,
            )
    finally:
        handle.remove()
    assert calls == []  # not even the tower ran


@pytest.mark.parametrize(
    "method, old, new",
    [("fastv", {"ratio": 0.5}, {"drop_ratio": 0.5}), ("dart", {"ratio": 0.5}, {"drop_ratio": 0.5})],
)
def test_drop_ratios_are_spelled_drop_ratio_and_the_old_name_is_refused(tiny_mm, images, method, old, new):
    with pytest.raises(ConfigError, match="renamed; .*'ratio' .*DROPPED.*drop_ratio") as exc:
        load_recipe({"pruning": [{"method": method, "params": old}]})
    assert exc.value.path == "pruning[0].params.ratio"
    params = {**new, "layer_mapping": "proportional"} if method == "fastv" else {**new, "k": 1}
    out = tiny_mm.generate(
        images[:1], PROMPTS[:1], recipe={"pruning": [{"method": method, "params": params}]}, max_new_tokens=1
    )
    kept = out[0].stats[method]["kept"]
    assert kept == 8 if method == "fastv" else kept < 16  # FastV: round(16 x (1 - 0.5)) kept after layer K


def test_bench_budget_entries_may_be_ratios():
    from mmfast.bench.common import variants

    r = load_recipe({"bench": {"kind": "pruning", "budgets": [8, {"ratio": 0.5}], "methods": ["random"]}})
    vs = {v.name: v.recipe.pruning[0].budget for v in variants(r) if v.recipe.pruning}
    assert vs == {"random-8": load_recipe(_stage("random", 8)).pruning[0].budget, "random-r0.5": vs["random-r0.5"]}
    assert vs["random-r0.5"].ratio == 0.5 and vs["random-r0.5"].tokens is None
    with pytest.raises(ConfigError) as exc:
        load_recipe({"bench": {"budgets": [{"ratio": 2}]}})
    assert exc.value.path == "bench.budgets[0].ratio"


def test_results_tables_show_the_budget_asked_for_beside_the_tokens_kept():
    from mmfast.bench.render import _stage_budget, budget_text, with_budget_column

    results = {
        "baseline": {"accounting": {"n_vision_tokens": 576.0}},
        "random-r0.3333": {"pruning": [{"method": "random", "budget": {"ratio": 0.3333}}]},
        "fastv-192": {"pruning": [{"method": "fastv", "budget": {"tokens": 192}}]},
    }
    result = {
        "header": ["variant", "vision tok @LLM"],
        "rows": [["baseline", 576], ["random-r0.3333", 192], ["fastv-192", 576]],
        "results": results,
    }
    with_budget_column(result)
    assert result["header"] == ["variant", "budget", "vision tok @LLM"]
    assert [row[1] for row in result["rows"]] == ["", "ratio 0.3333", "tokens 192"]
    assert budget_text([{"method": "x", "budget": {"flops": 0.2}}]) == "flops 0.2"
    assert _stage_budget(results["random-r0.3333"], 576.0) == ("random", 192)  # leaders: ratio at the model's count


def test_eval_report_methods_column_shows_the_budget_asked_for():
    from mmfast.report import _method_label

    protocol = {"pruning": [{"method": "fastv", "params": {"k": 2}, "budget": {"tokens": 192}}], "decoding": {}}
    assert _method_label(protocol) == "fastv(k=2)[tokens 192] + greedy()"
    assert _method_label({"pruning": [{"method": "fastv", "params": {"k": 2}}]}) == "fastv(k=2) + greedy()"


def test_qwen_bench_recipe_keeps_what_its_committed_run_kept():
    """benchmarks/pruning_qwen2_5_vl ran when a token budget B meant B / 576 of a Qwen image: its recipe now
    asks for ratios (and PyramidDrop's lambda) that keep the same counts on both of its models, the
    embedded LLaVA (576 tokens, the accuracy columns) and the 4-layer Qwen slice (999, the speed columns)."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from mmfast.bench.common import variants
    from mmfast.pruning._budget import ImageBudget
    from mmfast.pruning._common import map_layers
    from mmfast.pruning.fastv import FastV
    from mmfast.pruning.pyramiddrop import layer_average, stage_ratios

    summary = Path(__file__).resolve().parents[1] / "benchmarks/pruning_qwen2_5_vl/summary.json"
    if not summary.exists():
        pytest.skip("no committed benchmarks/pruning_qwen2_5_vl in this checkout")
    done = json.loads(summary.read_text())
    embedded = {k: v["accounting"] for k, v in done["results"].items()}
    sliced = {r["variant"]: r for r in done["shaped_speed"]["rows"]}
    vs = {v.name: v.recipe.pruning[0] for v in variants(load_recipe("bench/pruning_qwen2_5_vl")) if v.recipe.pruning}
    four = SimpleNamespace(layers=[None] * 4)  # both models have 4 LLM layers
    for method in ("random", "divprune"):
        for old, new in ((192, "r0.3333"), (128, "r0.2222"), (64, "r0.1111")):
            rule = ImageBudget(vs[f"{method}-{new}"].budget, None, "b")
            assert rule.target(576) == embedded[f"{method}-{old}"]["n_vision_tokens"]
            assert rule.target(999) == sliced[f"{method}-{old}"]["vision_tokens"]
    st = vs["fastv-192"]
    for n, want in (
        (576, embedded["fastv-192"]["vision_tokens_layer_avg"]),
        (999, sliced["fastv-192"]["layer_avg_tokens"]),
    ):
        keep = FastV.budget_params(ImageBudget(st.budget, None, "b").target(n), n, four, st.params, "b")["keep"]
        assert (n + 3 * keep) / 4 == want  # K = 1 of 4
    st = vs["pyramiddrop-192"]
    starts = [layer for layer, _ in map_layers(st.params.layers, 4, st.params.layer_mapping)]
    for n, want in (
        (576, embedded["pyramiddrop-192"]["vision_tokens_layer_avg"]),
        (999, sliced["pyramiddrop-192"]["layer_avg_tokens"]),
    ):
        assert layer_average(n, starts, stage_ratios(st.params), 4) == want


def test_an_infeasible_ratio_budget_names_its_key_and_the_target(tiny_mm):
    """FastV at K = 1 of 4 cannot average fewer than 4 of 16 tokens: ratio 0.1 (target 2) is refused at
    ``budget.ratio``, naming the target and the image's count."""
    from mmfast.pipeline import Session

    stage = {"method": "fastv", "params": {"layer_mapping": "proportional"}, "budget": {"ratio": 0.1}}
    with pytest.raises(
        ConfigError, match="ratio: 0.1 is 2 tokens for an image of 16 vision tokens; .*smallest feasible budget is 4"
    ) as exc:
        Session(tiny_mm, load_recipe({"pruning": [stage]}))
    assert exc.value.path == "pruning[0].budget.ratio"


#: budgeted methods for which a budget of every token is not the unpruned model, by design
NOT_A_NOOP_AT_EVERY_TOKEN = {
    "zipvl": "its budget counts important tokens; the others' KV is still quantised (quantize_kv)",
    "mustdrop": "calibrated: its vision-stage merge keeps acting, so every token is out of reach and refused",
}


def _budgeted_image_methods():
    from mmfast.capabilities import caps_of
    from mmfast.registry import PRUNERS

    images = [n for n in PRUNERS.names() if not caps_of(PRUNERS.get(n).cls, None).videos_only]
    return sorted(n for n in images if PRUNERS.get(n).cls.budget_knobs and n not in NOT_A_NOOP_AT_EVERY_TOKEN)


@pytest.mark.parametrize("method", _budgeted_image_methods())
def test_a_budget_of_every_token_is_the_baseline_on_llava(tiny_mm, images, method):
    """``ratio: 1.0`` keeps every vision token of every image, layer-averaged for in-LLM methods: the
    unpruned model's tokens (DART's pivots plus whole multiples of them fell 4 short of 16)."""
    from mmfast.registry import PRUNERS

    cls = PRUNERS.get(method).cls  # its tiny-model settings (layers, windows), without the knobs a budget sets
    params = {k: v for k, v in cls.test_params(tiny_mm.adapter).items() if k not in cls.budget_knobs}
    base = tiny_mm.generate(images[:2], PROMPTS, max_new_tokens=4)
    stage = {"method": method, "params": params, "budget": {"ratio": 1.0}}
    out = tiny_mm.generate(images[:2], PROMPTS, recipe={"pruning": [stage]}, max_new_tokens=4)
    assert [r.token_ids for r in out] == [r.token_ids for r in base]
    assert [r.vision_tokens_layer_avg for r in out] == [16.0, 16.0]


def test_sparsevlm_budget_of_every_token_keeps_every_token_at_every_filter(tiny_mm, images):
    """A tie between scaled keep counts of the same layer average goes to the larger counts: at ``tokens: N``
    (16, 16, 15) also averages 16 (15 kept + 1 recycled) but merges a token and reorders the image, so the
    mapping must give (16, 16, 16), whose prefill is the unpruned model's exactly."""
    import torch

    from mmfast.capabilities import ModelFacts
    from mmfast.pipeline import Session
    from mmfast.pruning.sparsevlm import SparseVLM

    cfg = SparseVLM.Config(layers=(0, 1, 2))
    SparseVLM.check_facts(cfg, ModelFacts.of_adapter(tiny_mm.adapter))
    assert SparseVLM.budget_params(16, 16, tiny_mm.adapter, cfg, "b") == {"keep": (16, 16, 16)}

    def last_logits(recipe):
        with Session(tiny_mm, load_recipe(recipe)) as s:
            batch = s.mm.prepare(images[:2], PROMPTS)
            _, out = s.runner.prefill(s.build_inputs(batch, s.encode(batch)))
            return out.logits[:, -1]

    stage = {"method": "sparsevlm", "params": {"layers": [0, 1, 2]}, "budget": {"ratio": 1.0}}
    torch.testing.assert_close(last_logits({"pruning": [stage]}), last_logits({}), rtol=0, atol=0)


def test_fastv_drop_ratio_keeps_round_n_times_one_minus_r_in_double_precision(qwen_mm, qwen_images):
    """FastV's ``drop_ratio`` R keeps round(N (1 - R)) of each image, N (1 - R) computed in double precision
    as the release's Python ``round(image_token_length * (1 - r))``: in fp32 the product of an image of 30
    tokens crosses .5 (R = 0.55: 13.4999... -> 13.5000001; R = 0.85: 4.5000... -> 4.4999...)."""
    base = qwen_mm.generate(qwen_images, PROMPTS, max_new_tokens=1)
    n = [b.n_vision_tokens for b in base]
    assert 30 in n
    for drop in (0.55, 0.85):
        stage = {"method": "fastv", "params": {"k": 1, "drop_ratio": drop}}
        out = qwen_mm.generate(qwen_images, PROMPTS, recipe={"pruning": [stage]}, max_new_tokens=1)
        assert [r.stats["fastv"]["kept"] for r in out] == [round(ni * (1 - drop)) for ni in n], drop


def test_an_in_llm_budget_below_every_image_names_the_smallest_budget_the_whole_batch_takes(qwen_mm, qwen_images):
    """FastV's smallest layer average grows with the image's count (ceil(K N_i / L)): a budget below it on every
    image is refused naming the largest image's minimum, which the batch then takes; it named the smaller
    image's, which the larger image refused again."""
    n = [r.n_vision_tokens for r in qwen_mm.generate(qwen_images, PROMPTS, max_new_tokens=1)]
    L = len(qwen_mm.adapter.layers)
    lo = [-(-x // L) for x in n]  # K = 1
    assert lo[0] != lo[1]
    stage = {"method": "fastv", "params": {"k": 8, "layer_mapping": "proportional"}}
    with pytest.raises(ConfigError, match=f"smallest feasible budget is {max(lo)} "):
        qwen_mm.generate(qwen_images, PROMPTS, recipe={"pruning": [{**stage, "budget": {"tokens": 1}}]})
    out = qwen_mm.generate(qwen_images, PROMPTS, recipe={"pruning": [{**stage, "budget": {"tokens": max(lo)}}]})
    assert len(out) == 2
    # above every image: the most the smallest image has (the largest's would be refused again)
    with pytest.raises(ConfigError, match=f"ask for at most {min(n)},"):
        qwen_mm.generate(qwen_images, PROMPTS, recipe={"pruning": [{**stage, "budget": {"tokens": max(n) + 1}}]})


def test_a_too_large_budget_suggests_a_ratio_only_where_the_stage_takes_one(qwen_mm, qwen_images):
    """A ``tokens`` budget above an image's count suggested ``budget: {ratio: r}`` also for a stage that maps one
    ``tokens`` budget for images of different counts (CDPruner here; MustDrop / ZipVL alike), which refuses a ratio."""
    n = min(r.n_vision_tokens for r in qwen_mm.generate(qwen_images, PROMPTS, max_new_tokens=1))
    for method, suggested in (("divprune", True), ("cdpruner", False)):
        stage = {"method": method, "budget": {"tokens": n + 1}}
        with pytest.raises(ConfigError, match=f"ask for at most {n}") as exc:
            qwen_mm.generate(qwen_images, PROMPTS, recipe={"pruning": [stage]}, max_new_tokens=1)
        assert ("{ratio: r}" in str(exc.value)) is suggested, (method, str(exc.value))
    with pytest.raises(ConfigError, match="give budget: {tokens: N}"):  # what the hint would have led to
        qwen_mm.generate(qwen_images, PROMPTS, recipe={"pruning": [{"method": "cdpruner", "budget": {"ratio": 0.5}}]})
