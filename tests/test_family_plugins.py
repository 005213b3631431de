"""Families as declared plug-ins (issue 28, item 4): each adapter declares its model's features once,
each method declares what it needs, and one check (``mmfast.capabilities.refusal``) derives support or
a refusal from the two. No method file names a family; a new family is one adapter class (and its
tiny-model factory), with every method's decision following from its declared features."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

import mmfast
from mmfast.capabilities import (
    ModelFacts,
    caps_of,
    check_model,
    check_model_config,
    refusal,
    runs_on,
    supported_families,
    unmet_need,
)
from mmfast.config import load_recipe
from mmfast.errors import IncompatibleRecipeError
from mmfast.models import ADAPTERS
from mmfast.models.features import ModelFeatures, Need
from mmfast.models.llava import LlavaAdapter
from mmfast.pipeline import Session
from mmfast.registry import DECODERS, DRAFTERS, PRUNERS

REGISTRIES = (PRUNERS, DECODERS, DRAFTERS)
QWEN = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
NOT_LLAVA = {"llava_next", "llava_onevision"} | QWEN
SIX = {"llava"} | NOT_LLAVA
#: the families each method was refused on when families were listed per method (before the features):
#: the derived decisions must be exactly these
REFUSED = {
    "pruning:avgpool": NOT_LLAVA,
    # OneVision added for video input (its images are refused per batch: image_needs)
    "pruning:hicom": {"llava_next"} | QWEN,
    # images in the tower where it can; elsewhere videos only (a temporal merge; Qwen3-VL's frame-group
    # items joined into one per video by the session)
    "pruning:tome": {"llava_next"},
    "pruning:mustdrop": NOT_LLAVA,
    "pruning:cdpruner": {"llava_onevision"},
    "pruning:dynamic_llava": QWEN,
    "pruning:visionzip": {"llava_next", "llava_onevision"},
    "decoding:damro": NOT_LLAVA,
    "decoding:ritual": NOT_LLAVA,
    "speculative:msd": QWEN,
    "speculative:flash": QWEN,
    # added after the features: video only, one vision item per video (Qwen3-VL: joined by the session)
    "pruning:dycoke": {"llava", "llava_next"},
    # video only, one item per video, Qwen's merge units (OneVision: only with siglip_head, the pooling head)
    "pruning:fastvid": {"llava", "llava_next", "llava_onevision"},
}


def _facts(family: str, features=None) -> ModelFacts:
    return ModelFacts(family, 4, 4, (24, 24), features or ADAPTERS[family].features)


def test_every_family_declares_its_features():
    assert SIX <= set(ADAPTERS)
    for family, adapter in ADAPTERS.items():
        assert adapter.family == family and isinstance(adapter.features, ModelFeatures), family
    assert ADAPTERS["qwen2_5_vl"].features.tower_attention == "windowed"  # a subclass's own declaration
    assert ADAPTERS["qwen2_vl"].features.tower_attention == "global"


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.kind)
def test_support_is_unchanged_on_the_six_families(registry):
    """Every method runs where it ran and is refused where it was, with a refusal naming the method,
    the unmet need and the family."""
    for e in registry.entries():
        refused = REFUSED.get(f"{registry.kind}:{e.name}", set())
        caps = caps_of(e.cls, None)
        assert SIX - set(supported_families(caps)) == refused, e.name
        for family in sorted(refused):
            msg = refusal(f"{registry.kind} ({e.name})", caps, _facts(family), registry)
            need = unmet_need(caps, ADAPTERS[family].features)
            assert msg is not None and need is not None
            assert f"({e.name}) needs {need.value}, which this model ({family}) does not have" in msg
            assert f"{registry.kind} methods that run there: " in msg and e.name not in msg.split("run there: ")[1]


def test_the_cls_substitute_needs_a_dynamic_grid():
    """VisionZip's received-attention substitute covers CLS-less dynamic-grid towers, not a CLS-less
    square-grid one (a SigLIP LLaVA)."""
    caps = caps_of(PRUNERS.get("visionzip").cls, None)
    assert unmet_need(caps, ADAPTERS["qwen2_5_vl"].features) is None
    siglip_llava = replace(LlavaAdapter.features, cls_token=False)
    assert unmet_need(caps, siglip_llava) is Need.CLS


# -- no method file names a family -------------------------------------------------------------------
METHOD_DIRS = ("pruning", "decoding", "speculative")


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _family_mentions(path: Path) -> list[str]:
    """Code (not docstrings or comments) in ``path`` that names a family: a string that is or contains a
    registered model type as a word, a ``*_FAMILIES`` set, or a comparison with an adapter's ``family``."""
    import re

    families = re.compile(r"(?<![\w])(" + "|".join(sorted(ADAPTERS, key=len, reverse=True)) + r")(?![\w])")
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path.parent.name}/{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if families.search(node.value):
                found.append(f"{where}: string {node.value[:60]!r}")
        elif isinstance(node, ast.Name) and node.id.endswith("_FAMILIES"):
            found.append(f"{where}: {node.id}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Attribute) and o.attr == "family" for o in operands):
                found.append(f"{where}: compares .family")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Attribute) and node.slice.attr == "family":
            found.append(f"{where}: indexes by .family")
    return found


def test_no_method_file_names_a_family():
    root = Path(mmfast.__file__).parent
    files = [p for d in METHOD_DIRS for p in sorted((root / d).glob("*.py"))]
    assert len(files) > 30
    found = [m for p in files for m in _family_mentions(p)]
    assert not found, "method files that name a family (declare a need instead):\n" + "\n".join(found)


def test_the_family_check_catches_what_it_should(tmp_path):
    """The scan above fails on the forms the old method files used."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""Docstrings may say qwen2_vl."""\n'
        "from ..capabilities import QWEN_FAMILIES\n"
        'M = {"llava_next": 320}\n'
        "def f(adapter):\n"
        "    return adapter.family in QWEN_FAMILIES or adapter.family != 'llava'\n"
    )
    found = _family_mentions(bad)
    assert len(found) == 5, found  # the import's name is an alias, not a Name: 2 Names, 1 string, 2 compares


# -- a new family: one adapter class declaring its features ----------------------------------------------
class WindowedLlava(LlavaAdapter):
    """A throwaway family: LLaVA whose tower is declared to attend within windows."""

    family = "llava_windowed_test"
    features = replace(LlavaAdapter.features, tower_attention="windowed")


class MropeLlava(LlavaAdapter):
    """A throwaway family declaring multimodal RoPE and anyres tiles (features only; never loaded)."""

    family = "llava_mrope_test"
    features = replace(LlavaAdapter.features, rope="mrope", tiles="anyres")


def _refused(features) -> dict[str, Need]:
    out = {}
    for registry in REGISTRIES:
        for e in registry.entries():
            need = unmet_need(caps_of(e.cls, None), features)
            if need is not None:
                out[e.name] = need
    return out


def test_a_new_familys_decisions_follow_from_its_features():
    """Only the methods that need what the new family lacks are refused, each for that need."""
    assert _refused(WindowedLlava.features) == {
        "tome": Need.GLOBAL_TOWER_ATTENTION,
        "mustdrop": Need.GLOBAL_TOWER_ATTENTION,
        "dycoke": Need.VIDEO,  # a LLaVA takes no video either way
        "fastvid": Need.VIDEO,  # NEED_ORDER checks video input before the grid (siglip_head cannot help)
    }
    refused = _refused(MropeLlava.features)
    assert {n for n, need in refused.items() if need is Need.ROPE_1D} == {"dynamic_llava", "msd", "flash"}
    assert {n for n, need in refused.items() if need is Need.UNTILED} == {
        "avgpool",
        "hicom",
        "tome",
        "mustdrop",
        "visionzip",
        "damro",
        "ritual",
    }
    assert set(refused) == {"dynamic_llava", "msd", "flash", "avgpool", "hicom", "tome", "mustdrop"} | {
        "visionzip",
        "damro",
        "ritual",
        "dycoke",
        "fastvid",
    }
    msg = check_model(load_recipe({"speculative": {"method": "msd"}}), _facts(MropeLlava.family, MropeLlava.features))
    assert "speculative (msd) needs 1-D RoPE positions, which this model (llava_mrope_test) does not have" in msg
    assert "multimodal RoPE" in msg and "speculative methods that run there: layer_skip, prompt_lookup" in msg


def test_a_registered_adapter_runs_and_refuses_by_its_features(monkeypatch, tiny_dir, images, prompts):
    """Registered in place of the LLaVA adapter (no method file touched): methods run or are refused
    on the loaded model, and from its config before weights load, as its features say."""
    monkeypatch.setitem(ADAPTERS, "llava", WindowedLlava)
    mm = mmfast.load(tiny_dir, device="cpu", dtype="float32")
    assert isinstance(mm.adapter, WindowedLlava) and mm.adapter.features.tower_attention == "windowed"
    tome = {"pruning": [{"method": "tome", "params": {"budget": 8}}]}
    with pytest.raises(IncompatibleRecipeError, match=r"\(tome\) needs a vision tower whose layers attend") as exc:
        Session(mm, load_recipe(tome))
    assert "this model (llava_windowed_test) does not have (its vision tower attends within windows)" in str(exc.value)
    assert "tome" not in str(exc.value).split("run there: ")[1].split(", ")
    with pytest.raises(IncompatibleRecipeError, match=r"\(tome\) needs .*llava_windowed_test"):
        check_model_config(load_recipe({**tome, "model": {"name": str(tiny_dir)}}))
    assert "tome" not in runs_on(PRUNERS, mm.adapter.features)
    out = mm.generate(
        images[:2],
        prompts[:2],
        recipe={"pruning": [{"method": "visionzip", "params": {"dominant": 4, "contextual": 3}}]},
        max_new_tokens=3,
    )
    assert [r.n_vision_tokens for r in out] == [7, 7]  # CLS, square grid, untiled: VisionZip runs
    assert "llava_windowed_test" in supported_families(caps_of(PRUNERS.get("fastv").cls, None))


def test_a_config_refines_the_declared_features():
    """A LLaVA checkpoint with a SigLIP tower has no CLS token: read from its config before any weights
    load, so CLS-needing methods are refused there and the rest of LLaVA's decisions stand."""
    from transformers import LlavaConfig

    siglip = LlavaConfig(vision_config={"model_type": "siglip_vision_model"})
    assert LlavaAdapter.features_of(LlavaConfig()) == LlavaAdapter.features
    facts = ModelFacts.of_config(siglip)
    assert facts.family == "llava" and facts.features == replace(LlavaAdapter.features, cls_token=False)
    msg = check_model(load_recipe({"pruning": [{"method": "visionzip"}]}), facts)
    assert "pruning[0] (visionzip) needs a CLS token in the vision tower, which this model (llava) does not have" in msg
    assert check_model(load_recipe({"pruning": [{"method": "avgpool"}]}), facts) is None
