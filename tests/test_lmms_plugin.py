"""The lmms-eval plugin: registered through the entry point, runs a recipe on a tiny model.
Skipped unless lmms-eval is installed (optional extra)."""

from __future__ import annotations

import importlib.metadata

import pytest

lmms_eval = pytest.importorskip("lmms_eval.api.model")


class _Req:
    def __init__(self, args):
        self.args = args


def test_entry_point_declared():
    eps = importlib.metadata.entry_points(group="lmms_eval.models")
    assert any(ep.name == "mmfast" and ep.value == "mmfast.eval.lmms_plugin:manifest" for ep in eps)


def test_plugin_runs_a_recipe(tiny_dir, images, tmp_path):
    from lmms_eval.models.registry_v2 import ModelRegistryV2

    from mmfast.eval.lmms_plugin import MMFast, manifest

    reg = ModelRegistryV2()
    reg.register_manifest(manifest())
    cls = reg.get_model_class("mmfast")
    assert cls is MMFast
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name: {tiny_dir}, device: cpu}}\npruning: [{{method: fastv, params: {{keep: 5}}}}]\n")
    model = cls.create_from_arg_string(f"recipe={recipe}", {"batch_size": 1, "device": "cpu"})
    model.task_dict = {"pope": {"test": {0: {"image": images[0]}}}}
    visual = lambda doc: [doc["image"]]
    out = model.generate_until([_Req(("Is there a cat in the image?", {"max_new_tokens": 4, "until": ["\n"]}, visual, 0, "pope", "test"))])
    assert isinstance(out[0], str)
    (lp, greedy), = model.loglikelihood([_Req(("Is there a cat?", " Yes", visual, 0, "pope", "test"))])
    assert lp < 0 and isinstance(greedy, bool)
