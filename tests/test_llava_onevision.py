"""LLaVA-OneVision (SigLIP without CLS, anyres-max tiles, Qwen2 LLM) on a tiny random model, fp32:
mmfast's runtime reproduces transformers exactly, sessions restore the model, the probe equals eager
attention, batches of mixed image sizes equal batch 1, no-op pruning equals the baseline, drafts are
lossless, and the methods that need a square grid or a CLS token are refused before compute."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

import mmfast
from mmfast import compat
from mmfast.capabilities import caps_of, videos_only_on
from mmfast.config import Recipe, load_recipe
from mmfast.errors import IncompatibleRecipeError
from mmfast.hooks import count_hooks
from mmfast.pipeline import Session
from mmfast.registry import PRUNERS

FAMILY = "llava_onevision"
# (H, W): a small image (2x2 tiles), a near-square large one whose 4x4 mosaic exceeds 9 base views
# (anyres_max_9 downscales it), and a wide one (1x3 tiles, unpadded rows)
SIZES = [(40, 48), (120, 128), (30, 90)]


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory):
    from mmfast.models.factory import random_llava_onevision, save_model

    model, processor = random_llava_onevision("tiny")
    return save_model(model, processor, tmp_path_factory.mktemp("onevision"))


@pytest.fixture(scope="module")
def ov_mm(ov_dir):
    return mmfast.load(ov_dir, device="cpu")


@pytest.fixture(scope="module")
def ov_images():
    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def _hf_inputs(mm, image, prompt):
    text = mm.prepare([image], [prompt]).texts[0]
    return mm.processor(images=image, text=text, return_tensors="pt")


def _hf_greedy(mm, image, prompt, n):
    inputs = _hf_inputs(mm, image, prompt)
    out = mm.model.generate(**inputs, max_new_tokens=n, do_sample=False)[0, inputs["input_ids"].shape[1] :].tolist()
    return out[: out.index(2)] if 2 in out else out


def _expected_tokens(mm, size) -> tuple[int, bool]:
    """Vision tokens of an image of ``size`` by the anyres-max rule, computed here from the config
    (base view + unpadded mosaic, downscaled past max_num_patches base views, one newline per row),
    and whether the downscaling branch applies."""
    from transformers.image_processing_utils import select_best_resolution

    cfg = mm.model.config
    tile, patch = cfg.vision_config.image_size, cfg.vision_config.patch_size
    side = tile // patch
    h, w = size
    best_h, best_w = select_best_resolution([h, w], cfg.image_grid_pinpoints)
    rows, cols = best_h // tile * side, best_w // tile * side
    if w / h > cols / rows:
        rows -= 2 * ((rows - int(round(h * cols / w, 7))) // 2)
    else:
        cols -= 2 * ((cols - int(round(w * rows / h, 7))) // 2)
    max_views = int(cfg.vision_aspect_ratio.removeprefix("anyres_max_"))
    ratio = math.sqrt(rows * cols / (max_views * side * side))
    if ratio > 1.1:
        rows, cols = int(rows // ratio), int(cols // ratio)
    return side * side + rows * (cols + 1), ratio > 1.1


def test_loads_with_config_facts(ov_mm, ov_dir):
    from transformers import AutoConfig

    from mmfast.capabilities import ModelFacts

    assert ov_mm.adapter.family == FAMILY and not ov_mm.adapter.has_cls
    facts = ModelFacts.of_config(AutoConfig.from_pretrained(ov_dir))
    assert facts == ModelFacts.of_adapter(ov_mm.adapter)
    assert facts.has_cls is False and facts.grid == (4, 4)


def test_a_clip_tower_declares_no_cls_token(ov_dir):
    """OneVision's encoding drops any CLS token (``with_cls=False``): with a CLIP tower the features declared a
    CLS token (LLaVA's rule, by tower type), so a method that reads it was accepted, then had none."""
    from transformers import AutoConfig, CLIPVisionConfig

    from mmfast.models.llava_onevision import LlavaOnevisionAdapter

    cfg = AutoConfig.from_pretrained(ov_dir)
    v = cfg.vision_config
    cfg.vision_config = CLIPVisionConfig(
        hidden_size=v.hidden_size,
        num_attention_heads=v.num_attention_heads,
        num_hidden_layers=v.num_hidden_layers,
        image_size=v.image_size,
        patch_size=v.patch_size,
    )
    assert LlavaOnevisionAdapter.features_of(cfg).cls_token is False


def test_loads_a_checkpoint_that_ships_a_video_processor(ov_dir, tmp_path, ov_images, prompts):
    """Hub checkpoints carry a video processor (torchvision-backed in transformers 5.23); mmfast's
    image-only processor loads them without it and expands image tokens as HF's processor does."""
    import json
    import shutil

    hub = tmp_path / "hub"
    shutil.copytree(ov_dir, hub)
    cfg = json.loads((hub / "processor_config.json").read_text())
    assert cfg["processor_class"] == "LlavaOnevisionProcessor"
    cfg["video_processor"] = {
        "video_processor_type": "LlavaOnevisionVideoProcessor",
        "size": {"height": 32, "width": 32},
    }
    (hub / "processor_config.json").write_text(json.dumps(cfg))
    mm = mmfast.load(hub, device="cpu")
    assert mm.processor.image_token == "<image>" and not hasattr(mm.processor, "video_processor")
    assert mm.generate(ov_images[:1], prompts[:1], max_new_tokens=4)[0].token_ids == _hf_greedy(
        mm, ov_images[0], prompts[0], 4
    )


def test_token_counts_follow_the_anyres_max_rule(ov_mm, ov_images, prompts):
    out = ov_mm.generate(ov_images, prompts[:3], max_new_tokens=1)
    downscaled = []
    for r, size in zip(out, SIZES):
        want, down = _expected_tokens(ov_mm, size)
        assert r.n_vision_tokens == want
        downscaled.append(down)
    assert downscaled == [False, True, False]  # the test images exercise both branches


@torch.inference_mode()
def test_prefill_logits_equal_model_forward(ov_mm, ov_images, prompts):
    with Session(ov_mm, Recipe()) as s:
        for image, prompt in zip(ov_images, prompts):
            batch = ov_mm.prepare([image], [prompt])
            inputs = s.build_inputs(batch, s.encode(batch))
            hf = _hf_inputs(ov_mm, image, prompt)
            assert torch.equal(inputs.input_ids, hf["input_ids"])  # same placeholder run as HF's processor
            state, out = s.runner.prefill(inputs, all_hidden=True)
            with torch.no_grad():
                want = ov_mm.model(**hf, output_hidden_states=True)
            with torch.no_grad():
                last = ov_mm.model(**hf, logits_to_keep=1).logits
            assert torch.equal(out.logits, last.float())  # bitwise, against HF's own last-row projection
            # the full-sequence projection differs from the last-row one by fp32 rounding of a matmul over
            # more rows (~1e-6); token identity is checked against model.generate below
            torch.testing.assert_close(out.logits, want.logits[:, -1:], atol=1e-5, rtol=1e-5)  # last position
            torch.testing.assert_close(
                ov_mm.adapter.lm_head(out.hidden), want.logits, atol=1e-5, rtol=1e-5
            )  # every one
            step = s.runner.step(state, out.logits[:, -1].argmax(-1)[:, None])
            with torch.no_grad():
                nxt = ov_mm.model(
                    input_ids=out.logits[:, -1].argmax(-1)[:, None],
                    **compat.cache_kwargs(compat.output_cache(want)),
                    attention_mask=torch.ones(1, hf["input_ids"].shape[1] + 1, dtype=torch.long),
                ).logits
            torch.testing.assert_close(step.logits, nxt, atol=1e-5, rtol=1e-5)  # a decode step on the cache


def test_greedy_equals_generate_and_mixed_batch_equals_batch_1(ov_mm, ov_images, prompts):
    n = 10
    batched = ov_mm.generate(ov_images, prompts[:3], max_new_tokens=n)
    for r, image, prompt in zip(batched, ov_images, prompts):
        single = ov_mm.generate([image], [prompt], max_new_tokens=n)[0]
        assert r.token_ids == single.token_ids == _hf_greedy(ov_mm, image, prompt, n)


def test_session_restores_model(ov_mm, ov_images, prompts):
    model = ov_mm.model
    inputs = _hf_inputs(ov_mm, ov_images[1], prompts[1])
    with torch.no_grad():
        before = model(**inputs).logits
    impl, hooks = compat.get_attn_implementation(model), count_hooks(model)
    recipe = load_recipe({"pruning": [{"method": "fastv", "params": {"keep": 5}}], "decoding": {"method": "vcd"}})
    with Session(ov_mm, recipe) as s:
        s.probe.watch("vis.1", ov_mm.adapter.vision_layers[1].self_attn, rows=lambda q, k: torch.tensor([0]))
        assert count_hooks(model) > hooks and compat.get_attn_implementation(model) != impl
        out = s.generate(ov_images[:2], prompts[:2], max_new_tokens=3)
        assert out[0].vision_tokens_layer_avg < out[0].n_vision_tokens
    assert count_hooks(model) == hooks and compat.get_attn_implementation(model) == impl
    for module in model.modules():
        assert "_mmfast_attn" not in module.__dict__
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)


def test_llm_probe_equals_eager(ov_mm, ov_dir, ov_images, prompts):
    eager = mmfast.load(ov_dir, device="cpu", attn_implementation="eager")
    with Session(ov_mm, Recipe()) as s:
        batch = ov_mm.prepare(ov_images, prompts[:3])  # mixed sizes: left padding
        inputs = s.build_inputs(batch, s.encode(batch))
        rows = torch.tensor([inputs.length - 1, inputs.length - 20, 7])
        for layer in (0, 3):
            s.probe.watch(f"llm.{layer}", ov_mm.adapter.layers[layer].self_attn, rows=lambda q, k: rows)
        kwargs = dict(
            inputs_embeds=inputs.embeds, attention_mask=inputs.attention_mask, position_ids=inputs.position_ids
        )
        with torch.no_grad():
            ov_mm.adapter.language_model(**kwargs)
            want = eager.adapter.language_model(**kwargs, output_attentions=True).attentions
        valid = inputs.attention_mask.bool()
        for layer in (0, 3):
            got = s.probe[f"llm.{layer}"].probs  # [B, H, R, L]
            for b in range(3):
                for i, r in enumerate(rows.tolist()):
                    if valid[b, r]:
                        torch.testing.assert_close(got[b, :, i], want[layer][b, :, r].float(), atol=1e-5, rtol=1e-4)


def test_siglip_probe_equals_eager(ov_mm, ov_dir, ov_images, prompts):
    eager = mmfast.load(ov_dir, device="cpu", attn_implementation="eager")
    pixels = ov_mm.prepare(ov_images[:1], prompts[:1]).pixel_values[0]  # the image's tiles [T, 3, H, W]
    with torch.no_grad():
        want = eager.adapter.vision_tower(pixels, output_attentions=True).attentions
    with Session(ov_mm, Recipe()) as s:
        s.probe.watch("vis", ov_mm.adapter.vision_layers[1].self_attn, rows=lambda q, k: torch.tensor([0, 5, 15]))
        with torch.no_grad():
            ov_mm.adapter.vision_tower(pixels)
        got = s.probe["vis"].probs
    torch.testing.assert_close(got, want[1][:, :, [0, 5, 15]].float(), atol=1e-5, rtol=1e-4)


def _families(name):
    from mmfast.capabilities import caps_of, supported_families

    return supported_families(caps_of(PRUNERS.get(name).cls, None))


@pytest.mark.parametrize("name", sorted(n for n in PRUNERS.names() if FAMILY in _families(n)))
def test_noop_pruning_equals_baseline(name, ov_mm, ov_images, prompts):
    cls = PRUNERS.get(name).cls
    if videos_only_on(caps_of(cls, None), ov_mm.adapter.features):
        pytest.skip(f"needs a video input here: its no-op and batch checks are in tests/test_{name}*.py")
    try:
        params = cls.noop_params(ov_mm.adapter)
    except NotImplementedError:
        pytest.skip(f"{name} defines no no-op setting")
    base = ov_mm.generate(ov_images, prompts[:3], max_new_tokens=6)
    noop = ov_mm.generate(
        ov_images, prompts[:3], recipe={"pruning": [{"method": name, "params": params}]}, max_new_tokens=6
    )
    assert [r.token_ids for r in noop] == [r.token_ids for r in base]
    assert [r.n_vision_tokens for r in noop] == [r.n_vision_tokens for r in base]


def test_fastv_keeps_per_image_top_attended(ov_mm, ov_images, prompts):
    """FastV on the spliced anyres sequence: ``keep`` tokens of every image, the newline slots included
    among the candidates (they are vision slots, as in llava_next), chosen by the last token's attention."""
    recipe = {"pruning": [{"method": "fastv", "params": {"keep": 9}}]}
    out = ov_mm.generate(ov_images, prompts[:3], recipe=recipe, max_new_tokens=2)
    for r in out:
        assert r.stats["fastv"]["kept"] == 9


def test_fastv_decisions_equal_a_direct_computation(ov_mm, ov_dir, ov_images, prompts):
    """FastV's rule computed here on eager attention: at layer K-1, the last prompt token's attention
    (head mean) ranks every slot of each image (base view, mosaic, newlines); the top ``keep`` of each
    image survive, every text token too, at their original positions."""
    keep, k = 9, 2
    eager = mmfast.load(ov_dir, device="cpu", attn_implementation="eager")
    with Session(ov_mm, load_recipe({"pruning": [{"method": "fastv", "params": {"k": k, "keep": keep}}]})) as s:
        batch = ov_mm.prepare(ov_images, prompts[:3])  # mixed sizes: left padding
        inputs = s.build_inputs(batch, s.encode(batch))
        state, _ = s.runner.prefill(inputs)
    with torch.no_grad():
        att = (
            eager.adapter.language_model(
                inputs_embeds=inputs.embeds,
                attention_mask=inputs.attention_mask,
                position_ids=inputs.position_ids,
                output_attentions=True,
            )
            .attentions[k - 1][:, :, -1]
            .mean(1)
        )  # [B, L] last token, head mean
    grp = next(g for g in state.groups if g.start == k)
    for b in range(3):
        img = inputs.image_mask[b].nonzero().squeeze(1)
        want = img[att[b, img].topk(keep).indices].sort().values
        src = grp.source[b][grp.key_mask[b]]
        assert torch.equal(src[inputs.image_mask[b, src]], want)
        text = (inputs.attention_mask[b].bool() & ~inputs.image_mask[b]).nonzero().squeeze(1)
        assert torch.equal(src[~inputs.image_mask[b, src]], text)
        assert torch.equal(grp.positions[b][grp.key_mask[b]], inputs.position_ids[b, src])


def test_budget_is_mapped_on_each_images_own_token_count(ov_mm, ov_images, prompts):
    """``budget: {ratio: r}`` on FastV: an image of N_i tokens averages round(r N_i) tokens over the
    layers (keep_i = round((L t_i - K N_i) / (L - K)) after layer K), never a count scaled from N0."""
    r_kept, k, n_layers = 0.6, 2, len(ov_mm.adapter.layers)
    recipe = {"pruning": [{"method": "fastv", "params": {"k": k}, "budget": {"ratio": r_kept}}]}
    out = ov_mm.generate(ov_images, prompts[:3], recipe=recipe, max_new_tokens=2)
    counts = [r.n_vision_tokens for r in out]
    assert len(set(counts)) == 3  # three different token counts
    for r, n in zip(out, counts):
        t = round(r_kept * n)
        assert r.stats["fastv"]["kept"] == round((n_layers * t - k * n) / (n_layers - k))
        assert abs(r.vision_tokens_layer_avg - t) <= (n_layers - k) / n_layers * 0.5 + 1e-6


def test_tokens_budget_infeasible_for_an_image_is_refused_before_the_llm(ov_mm, ov_images, prompts):
    """``tokens: N`` larger than an image's vision tokens, or below what an in-LLM stage can average on
    it, is refused naming the counts, before the LLM runs (the session's check after the tower)."""
    from mmfast.errors import ConfigError

    n = ov_mm.generate(ov_images[:1], prompts[:1], max_new_tokens=1)[0].n_vision_tokens
    with pytest.raises(ConfigError, match=f"{n + 1} vision tokens per image is more than this image has \\({n} ") as e:
        ov_mm.generate(
            ov_images[:1], prompts[:1], recipe={"pruning": [{"method": "divprune", "budget": {"tokens": n + 1}}]}
        )
    assert e.value.path == "pruning[0].budget.tokens"
    with pytest.raises(ConfigError, match=f"with {n} vision tokens in this image: the smallest feasible budget"):
        ov_mm.generate(
            ov_images[:1],
            prompts[:1],
            recipe={"pruning": [{"method": "fastv", "params": {"k": 2}, "budget": {"tokens": 2}}]},
        )


@pytest.mark.parametrize(
    "drafter, params",
    [
        ("prompt_lookup", {}),
        ("layer_skip", {"skip": [2], "gamma": 3, "threshold": 0.0}),
        ("msd", {"depth": 3, "top_k": 4, "total_tokens": 16}),
        ("flash", {"top_k": 4, "total_tokens": 12, "rounds": 2}),
    ],
)
def test_drafts_are_token_identical_to_greedy(drafter, params, ov_mm, ov_images, prompts):
    from mmfast.speculative._eagle_model import _model_dir, write_random_draft

    d = _model_dir(ov_mm)
    if drafter == "msd" and not (d / "msd").exists():
        write_random_draft(ov_mm, "msd", d / "msd")
    if drafter == "flash" and not (d / "flash").exists():
        write_random_draft(ov_mm, "flash", d / "flash", sar_k=3, n_latents=4)
    base = ov_mm.generate(ov_images, prompts[:3], max_new_tokens=16)
    spec = ov_mm.generate(
        ov_images, prompts[:3], recipe={"speculative": {"method": drafter, "params": params}}, max_new_tokens=16
    )
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]
    assert spec[0].stats["speculative"]["cycles"] >= 1


@pytest.mark.parametrize(
    "recipe, why",
    [
        ({"pruning": [{"method": "visionzip", "params": {"tokens": 8}}]}, "needs a CLS token"),
        ({"pruning": [{"method": "mustdrop"}]}, "needs a CLS token"),
        (
            {"pruning": [{"method": "avgpool", "params": {"keep": 4}}]},
            r"needs one tower input per image .*this model \(llava_onevision\)",
        ),
        ({"decoding": {"method": "damro"}}, "needs a CLS token"),
        ({"decoding": {"method": "ritual"}}, r"needs one tower input per image .*this model \(llava_onevision\)"),
    ],
)
def test_refused_before_compute(recipe, why, ov_mm, ov_dir):
    from mmfast.capabilities import check_model_config

    calls = []
    handle = ov_mm.adapter.vision_tower.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(IncompatibleRecipeError, match=why):
            Session(ov_mm, load_recipe(recipe))
        with pytest.raises(IncompatibleRecipeError, match=why):  # from the config alone, before weights load
            check_model_config(load_recipe({**recipe, "model": {"name": str(ov_dir)}}))
    finally:
        handle.remove()
    assert not calls


# --------------------------------------------------------------------------- recipe and CLI end to end


def test_shipped_recipe_validates_on_a_tiny_stand_in(ov_dir, capsys):
    from mmfast.capabilities import check_model_config
    from mmfast.cli import main

    recipe = load_recipe("llava_onevision_pope")
    assert recipe.model.name == "llava-hf/llava-onevision-qwen2-7b-ov-hf"
    import dataclasses

    stand_in = recipe.replace(model=dataclasses.replace(recipe.model, name=str(ov_dir)))
    check_model_config(stand_in)  # families, layers against the stand-in's config
    assert main(["-q", "validate", "llava_onevision_pope", "--set", f"model.name={ov_dir}"]) == 0
    assert "fastv" in capsys.readouterr().out


PRUNE = [{"method": "fastv", "params": {"k": 2}, "budget": {"ratio": 0.6}}]
DRAFT = {"method": "layer_skip", "params": {"skip": [2], "gamma": 3, "threshold": 0.0}}


def _recipe_file(ov_dir, tmp_path, name, **sections) -> str:
    import yaml

    data = {
        "name": name,
        "model": {"name": str(ov_dir), "device": "cpu", "dtype": "float32"},
        "pruning": PRUNE,
        **sections,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_cli_run_with_pruning_and_drafter(ov_mm, ov_dir, ov_images, tmp_path, capsys):
    import json

    from mmfast.cli import main

    image = tmp_path / "wide.png"
    ov_images[2].save(image)
    cfg = _recipe_file(ov_dir, tmp_path, "run", decoding={"method": "greedy", "max_new_tokens": 6}, speculative=DRAFT)
    assert main(["-q", "run", cfg, "--image", str(image), "--prompt", "Describe the image.", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plain = ov_mm.generate([image], ["Describe the image."], recipe={"pruning": PRUNE}, max_new_tokens=6)[0]
    assert out["text"] == plain.text and out["n_new_tokens"] == len(plain.token_ids)  # the drafter is lossless
    assert out["vision_tokens_layer_avg"] == round(plain.vision_tokens_layer_avg, 3) < out["n_vision_tokens"]
    assert out["stats"]["speculative"]["cycles"] >= 1


@pytest.mark.parametrize(
    "sections",
    [
        {"decoding": {"method": "greedy", "max_new_tokens": 6}, "speculative": DRAFT},  # pruning + drafter
        {"decoding": {"method": "vcd", "max_new_tokens": 6}},  # pruning + a contrastive decoder
    ],
    ids=["fastv+greedy+layer_skip", "fastv+vcd"],
)
def test_cli_eval_limit_2_stacked(sections, ov_dir, tmp_path):
    import json

    from mmfast.cli import main
    from mmfast.world import write_world

    world = tmp_path / "world"
    write_world(world, seed=0, n_train=0, n_val=4, pope_images=4, progress=False)
    evaluation = {
        "tasks": ["pope", "chair"],
        "data": {"dataset": "world", "root": str(world)},
        "pope": {"max_new_tokens": 3, "splits": ["random"]},
        "chair": {"n_images": 2, "max_new_tokens": 4},
        "batch_size": 2,
    }
    cfg = _recipe_file(ov_dir, tmp_path, "eval", eval=evaluation, **sections)
    out = tmp_path / "out"
    assert main(["-q", "eval", cfg, "--limit", "2", "--output", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["pope"]["random"]["n"] == 2 and summary["metrics"]["chair"]["n"] == 2


def test_list_verbose_names_each_methods_families(capsys):
    from mmfast.cli import main

    assert main(["list", "methods", "-v"]) == 0
    out = capsys.readouterr().out.splitlines()
    families = {
        line.split()[0]: out[i + 1] for i, line in enumerate(out[:-1]) if out[i + 1].strip().startswith("families:")
    }
    assert FAMILY in families["fastv"] and FAMILY in families["greedy"] and FAMILY in families["prompt_lookup"]
    assert FAMILY not in families["visionzip"] and FAMILY not in families["damro"]


def test_real_geometry_token_count(tmp_path):
    """The 7B checkpoints' geometry (SigLIP 384 px / 14 px patches = 27 x 27 base view, 1..6 x 1..6
    tiles of 384 px, anyres_max_9) with tiny widths: a 1024 x 768 image gives HF's placeholder count
    (computed by HF's processor) and the same greedy tokens as ``model.generate``."""
    from transformers import LlavaOnevisionConfig

    from mmfast.models.factory import LlavaShape, random_llava_onevision, save_model

    model, processor = random_llava_onevision(LlavaShape(384, 14, 32, 1, 2, 64, 2, 4, 2, 128, 300, 32768), max_tiles=6)
    assert model.config.image_grid_pinpoints == LlavaOnevisionConfig().image_grid_pinpoints  # the hub default
    mm = mmfast.load(save_model(model, processor, tmp_path / "ov7b_geometry"), device="cpu")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (768, 1024, 3), dtype=np.uint8))
    ours = mm.generate([image], ["Describe the image."], max_new_tokens=2)[0]
    hf = _hf_inputs(mm, image, "Describe the image.")
    assert (
        ours.n_vision_tokens
        == int((hf["input_ids"] == mm.adapter.image_token_id).sum())
        == _expected_tokens(mm, (768, 1024))[0]
    )
    assert ours.n_vision_tokens == 4725  # 729 base view + 2 x 3 tiles unpadded to 54 x 73 patches + 54 newlines
    assert ours.token_ids == _hf_greedy(mm, image, "Describe the image.", 2)


def test_pyramiddrop_keeps_a_fraction_of_each_image_and_batch_equals_single(ov_mm, ov_images, prompts):
    """PyramidDrop on the packed anyres-max spans: every image keeps int(N_i lambda^s) of its own N_i
    tokens at stage s (so a lambda is a fraction of every image), and a mixed-size batch equals batch 1."""
    from mmfast.pruning.pyramiddrop import PyramidDrop

    params = PyramidDrop.test_params(ov_mm.adapter)
    recipe = {"pruning": [{"method": "pyramiddrop", "params": params}]}
    batched = ov_mm.generate(ov_images, prompts[:3], recipe=recipe, max_new_tokens=6)
    base = ov_mm.generate(ov_images, prompts[:3], max_new_tokens=1)
    lam = params["ratio"]
    for r, b, image, prompt in zip(batched, base, ov_images, prompts):
        assert r.token_ids == ov_mm.generate([image], [prompt], recipe=recipe, max_new_tokens=6)[0].token_ids
        n = b.n_vision_tokens
        assert r.stats["pyramiddrop"]["kept"] == [
            int(n * lam ** (s + 1)) for s in range(len(r.stats["pyramiddrop"]["kept"]))
        ]
    assert len({b.n_vision_tokens for b in base}) > 1  # the images really differ in token count


def test_divprune_keeps_the_budget_of_each_image_and_batch_equals_single(ov_mm, ov_images, prompts):
    """DivPrune on the packed anyres-max tokens: ``tokens: N`` keeps exactly N of every image,
    ``ratio: r`` round(r N_i) of each image's own N_i tokens; a mixed-size batch equals batch 1."""
    base = ov_mm.generate(ov_images, prompts[:3], max_new_tokens=1)
    n = [b.n_vision_tokens for b in base]
    for budget, want in (({"tokens": min(n) // 2}, [min(n) // 2] * 3), ({"ratio": 0.3}, [round(0.3 * x) for x in n])):
        recipe = {"pruning": [{"method": "divprune", "budget": budget}]}
        batched = ov_mm.generate(ov_images, prompts[:3], recipe=recipe, max_new_tokens=6)
        assert [r.n_vision_tokens for r in batched] == want
        for r, image, prompt in zip(batched, ov_images, prompts):
            assert r.token_ids == ov_mm.generate([image], [prompt], recipe=recipe, max_new_tokens=6)[0].token_ids


def test_dart_default_truncation_is_a_fraction_and_batch_equals_single(ov_mm, ov_images, prompts):
    """DART on the packed spans with no release M: M_i = N_i x 128 / 576 of each image (docstring);
    each image keeps pivot_image + (M_i // pivots) x pivots, whatever batch it is in."""
    params = {"k": 1, "pivot_image": 2, "pivot_text": 2}
    recipe = {"pruning": [{"method": "dart", "params": params}]}
    base = ov_mm.generate(ov_images, prompts[:3], max_new_tokens=1)
    batched = ov_mm.generate(ov_images, prompts[:3], recipe=recipe, max_new_tokens=6)
    for r, b, image, prompt in zip(batched, base, ov_images, prompts):
        n = b.n_vision_tokens
        assert r.stats["dart"]["kept"] == 2 + int(min(n * 128 / 576, n - 2) // 4) * 4
        assert r.token_ids == ov_mm.generate([image], [prompt], recipe=recipe, max_new_tokens=6)[0].token_ids


def test_sparsevlm_counts_are_per_image_and_batch_equals_single(ov_mm, ov_images, prompts):
    """SparseVLM's given counts ``keep`` are kept by every image as given (capped at its N_i)."""
    from mmfast.pruning.sparsevlm import SparseVLM

    params = SparseVLM.test_params(ov_mm.adapter)
    recipe = {"pruning": [{"method": "sparsevlm", "params": params}]}
    base = ov_mm.generate(ov_images, prompts[:3], max_new_tokens=1)
    batched = ov_mm.generate(ov_images, prompts[:3], recipe=recipe, max_new_tokens=6)
    for r, b, image, prompt in zip(batched, base, ov_images, prompts):
        st, n = r.stats["sparsevlm"], b.n_vision_tokens
        assert st["kept"][0] - st["recycled"][0] == min(n, params["keep"][0])
        assert r.token_ids == ov_mm.generate([image], [prompt], recipe=recipe, max_new_tokens=6)[0].token_ids
