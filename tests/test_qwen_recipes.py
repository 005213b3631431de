"""The shipped Qwen-VL recipes (configs/qwen/*) validate, and ``mmfast run`` / ``mmfast eval --limit 2``
work end to end on a tiny random model of each Qwen family saved to a directory, with a pruner, a
decoder and a drafter stacked (the recipe's FastV + greedy + prompt lookup), and with a contrastive
decoder (VCD) after FastV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmfast.cli import main
from mmfast.config import load_recipe

FAMILIES = {
    "qwen2_vl": "Qwen/Qwen2-VL-7B-Instruct",
    "qwen2_5_vl": "Qwen/Qwen2.5-VL-7B-Instruct",
    "qwen3_vl": "Qwen/Qwen3-VL-8B-Instruct",
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from mmfast.world import write_world

    root = tmp_path_factory.mktemp("qworld")
    write_world(root, seed=0, n_train=0, n_val=4, pope_images=4, progress=False)
    return root


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_recipe_run_and_eval_on_tiny_stand_in(family, world, images, tmp_path, capsys):
    from mmfast.models.factory import random_qwen_vl, save_model

    shipped = load_recipe(f"qwen/{family}_pope")
    assert shipped.model.name == FAMILIES[family]
    assert [s.method for s in shipped.pruning] == ["fastv"] and shipped.speculative.method == "prompt_lookup"
    model, processor = random_qwen_vl(family)
    stand_in = save_model(model, processor, tmp_path / "model")
    data = shipped.to_dict()
    data["model"].update(name=str(stand_in), device="cpu", dtype="float32")
    # the tiny stand-in has 4 LLM layers and images of a few dozen tokens: 128 layer-averaged tokens per
    # image is more than it has; a kept fraction above K / L = 1/2 is feasible at K = 2
    data["pruning"][0]["budget"] = {"ratio": 0.7}
    data["eval"]["data"] = {"dataset": "world", "root": str(world)}
    data["eval"]["pope"]["splits"] = ["random"]
    data["eval"]["batch_size"] = 2
    data["output"] = {"dir": str(tmp_path / "out"), "overwrite": False}
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(json.dumps(data))
    assert main(["-q", "validate", str(cfg)]) == 0
    img = tmp_path / "x.png"
    images[0].save(img)
    capsys.readouterr()
    assert (
        main(["-q", "run", str(cfg), "--image", str(img), "--prompt", "Describe.", "--max-new-tokens", "4", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    rec = out[0] if isinstance(out, list) else out
    assert rec["vision_tokens_layer_avg"] < rec["n_vision_tokens"]
    assert main(["-q", "eval", str(cfg), "--limit", "2"]) == 0
    samples = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all("error" not in s for s in samples)
    data["decoding"] = {"method": "vcd"}
    data.pop("speculative")
    data["output"] = {"dir": str(tmp_path / "out_vcd"), "overwrite": False}
    cfg.write_text(json.dumps(data))
    assert main(["-q", "eval", str(cfg), "--limit", "2"]) == 0


def test_shaped_prefill_bench_runs_on_a_qwen_slice():
    """The bench's real-shape prefill timing builds a Qwen2.5-VL model for a Qwen shape (here the tiny
    stand-in of ``qwen2.5-vl-7b-slice``, same code path) and times the variants the family runs."""
    import torch

    from mmfast.bench.common import variants
    from mmfast.bench.pruning import _shaped_speed
    from mmfast.models.factory import QWEN_SHAPES

    recipe = load_recipe("bench/pruning_qwen2_5_vl")
    assert recipe.bench.shape == "qwen2.5-vl-7b-slice" and QWEN_SHAPES[recipe.bench.shape].text_hidden == 3584
    data = recipe.to_dict()
    data["bench"].update(shape="qwen2.5-vl-tiny-slice", warmup=0, repeats=1)
    recipe = load_recipe(data)
    speed = _shaped_speed(recipe, variants(recipe), torch.device("cpu"))
    rows = {r["variant"]: r for r in speed["rows"]}
    want = {"baseline", "random-r0.1111", "fastv-192", "divprune-r0.1111", "dart-64at28L", "sparsevlm-preset64"}
    assert want <= set(rows)
    n = rows["baseline"]["vision_tokens"]
    assert rows["random-r0.1111"]["vision_tokens"] == round(0.1111 * n)  # budget: {ratio: 0.1111} of the image
    assert rows["random-r0.1111"]["flops_ratio"] < 1 and rows["fastv-192"]["layer_avg_tokens"] < n
    assert rows["divprune-r0.1111"]["vision_tokens"] == rows["random-r0.1111"]["vision_tokens"]  # the same rule


def test_lmms_plugin_runs_a_qwen_recipe(images, tmp_path, monkeypatch):
    """The lmms-eval plugin runs a Qwen recipe unchanged: answers equal mmfast's own generation."""
    import importlib
    import sys

    from mmfast.models.factory import random_qwen_vl, save_model

    try:
        import lmms_eval.api.model  # noqa: F401
    except ImportError:  # the API stand-in (where lmms-eval is installed, its own `tests` package shadows ours)
        from tests.test_lmms_plugin import _standin_modules

        for name, mod in _standin_modules().items():
            monkeypatch.setitem(sys.modules, name, mod)
    import mmfast
    import mmfast.eval.lmms_plugin as plugin

    plugin = importlib.reload(plugin)
    model, processor = random_qwen_vl("qwen2_5_vl")
    path = save_model(model, processor, tmp_path / "m")
    data = load_recipe("qwen/qwen2_5_vl_pope").to_dict()
    data["model"].update(name=str(path), device="cpu", dtype="float32")
    data["pruning"][0]["budget"] = {"ratio": 0.7}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps(data))
    lm = plugin.MMFast.create_from_arg_string(f"recipe={recipe}", {"batch_size": 2, "device": "cpu"})
    docs = {d: {"image": images[d].resize((32 + 16 * d, 48))} for d in range(3)}
    lm.task_dict = {"pope": {"test": docs}}

    class Req:
        def __init__(self, args):
            self.args = args

    qs = ["Is there a cat in the image?", "Describe the image.", "How many dogs are there?"]
    reqs = [
        Req((f"<image>\n{qs[d]}", {"max_new_tokens": 4}, lambda doc: [doc["image"]], d, "pope", "test"))
        for d in range(3)
    ]
    got = [getattr(g, "text", g) for g in lm.generate_until(reqs)]  # lmms-eval >= 0.7: GenerationResult
    mm = mmfast.load(path, device="cpu")
    want = [r.text for r in mm.generate([docs[d]["image"] for d in range(3)], qs, recipe=str(recipe), max_new_tokens=4)]
    assert got == want and all(want)
    monkeypatch.undo()
    importlib.reload(plugin)
