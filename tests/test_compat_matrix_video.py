"""The compatibility matrix on videos: every registered pruner x every decoder x {no drafter, a drafter},
and every ordered pair of the pruners that run on a family's videos, stacked, on tiny random Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and LLaVA-OneVision models fed a batch of two videos of different frame counts
(tests/test_compat_matrix.py feeds images). Each pruner at its ``test_params``, plus what it needs on a
video (on OneVision, FastVID's ``siglip_head`` and HICom's SigLIP ``guide_model``, directories built as a user
downloads them; HICom's test setting has ``global_queries: 0``).

Each combination either generates (batch 2) or is refused before any compute (the vision tower never
runs) with a reason that names the method; nothing else may be raised. A pruner runs (with greedy)
exactly on the families it declares; where it runs it changes something against greedy, the batch of
two equals each video alone, and prompt-lookup drafting gives greedy's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

import mmfast
from mmfast.config import load_recipe
from mmfast.errors import IncompatibleRecipeError
from mmfast.pipeline import Session
from mmfast.registry import DECODERS, PRUNERS

DECODER_PARAMS = {
    "beam": {"num_beams": 2},
    "opera": {"num_beams": 2, "num_attn_candidates": 2},
}
DRAFTER = "prompt_lookup"  # needs no trained weights
FAMILIES = ("qwen2_5_vl", "llava_onevision", "qwen2_vl", "qwen3_vl")
PROMPTS = ["Describe the video.", "What happens?"]
N_NEW = 3
_MODELS: dict[str, object] = {}


def _mm(family: str):
    if family not in _MODELS:
        from mmfast.models.factory import random_llava_onevision, random_qwen_vl

        model, proc = random_llava_onevision(seed=1) if family == "llava_onevision" else random_qwen_vl(family, seed=1)
        _MODELS[family] = mmfast.load(model, proc)
    return _MODELS[family]


def _video(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, 28, 28, 3), dtype=np.uint8)


VIDEOS = [_video(4, 1), _video(5, 2)]  # different frame counts: different token counts per sample


@pytest.fixture(scope="module")
def siglip_head(tmp_path_factory) -> str:
    """FastVID on OneVision: a SigLIP checkpoint of the tower's width with a (random) pooling head."""
    import torch
    from transformers import SiglipVisionConfig, SiglipVisionModel

    tower = _mm("llava_onevision").adapter.vision_config
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("siglip_head")
    SiglipVisionModel(SiglipVisionConfig(**{**tower.to_dict(), "vision_use_head": True})).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def siglip_guide(tmp_path_factory) -> str:
    """HICom on OneVision video, as tests/test_hicom_video.py builds it: a SigLIP directory (with the
    tokenizer) whose vision layers are the tower's plus one, as a user downloads the tower's checkpoint."""
    import torch

    from mmfast.pruning._hicom_video import random_siglip

    mm = _mm("llava_onevision")
    vc = mm.adapter.vision_config
    model = random_siglip(vc, mm.tokenizer, vc.num_hidden_layers, seed=3)
    with torch.no_grad():
        missing = model.vision_model.load_state_dict(mm.adapter.vision_tower.state_dict(), strict=False).missing_keys
    assert all(k.startswith(("head.", f"encoder.layers.{vc.num_hidden_layers}.")) for k in missing)
    path = tmp_path_factory.mktemp("siglip_guide")
    model.save_pretrained(path)
    mm.tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def extra(siglip_head, siglip_guide) -> dict[str, dict]:
    """What a pruner needs, beyond its test setting, on a OneVision video: checkpoints OneVision lacks."""
    return {"fastvid": {"siglip_head": siglip_head}, "hicom": {"guide_model": siglip_guide}}


def _params(name: str, mm, extra: dict) -> dict:
    """The method's test setting, plus what it needs to run on a video of this model."""
    params = dict(PRUNERS.get(name).cls.test_params(mm.adapter))
    if mm.adapter.family == "llava_onevision":
        params.update(extra.get(name, {}))
    return params


def _stage(name: str, mm, extra: dict) -> dict:
    return {"method": name, "params": _params(name, mm, extra)}


def _outcome(mm, recipe_data: dict, videos=VIDEOS, prompts=PROMPTS) -> tuple[str, list]:
    """('ran', the results), or ('refused: <reason>', []) raised before the vision tower ran; anything
    else raised propagates (a failure)."""
    try:
        recipe = load_recipe(recipe_data)
        session = Session(mm, recipe)
    except IncompatibleRecipeError as exc:
        return f"refused: {exc}", []
    calls = []
    handle = mm.adapter.vision_tower.register_forward_hook(lambda *a: calls.append(1))
    try:
        with session:
            try:
                out = session.generate(None, prompts, videos=videos, max_new_tokens=N_NEW)
            except IncompatibleRecipeError as exc:
                assert not calls, f"refused after the vision tower ran: {exc}"
                return f"refused: {exc}", []
    finally:
        handle.remove()
    assert len(out) == len(prompts)
    return "ran", out


def _footprint(results) -> list[tuple]:
    """What a pruner can change, per sample: the LLM's input, its cache, its compute, the answer."""
    return [
        (r.n_vision_tokens, r.kv_bytes_prefill, r.kv_bytes_end, round(r.flops_prefill), tuple(r.token_ids))
        for r in results
    ]


_BASELINES: dict[str, list[tuple]] = {}


def _baseline(family: str, mm) -> list[tuple]:
    if family not in _BASELINES:
        result, out = _outcome(mm, {"decoding": {"method": "greedy"}})
        assert result == "ran"
        _BASELINES[family] = _footprint(out)
    return _BASELINES[family]


def _names_a_method(reason: str, recipe_data: dict) -> bool:
    names = [s["method"] for s in recipe_data.get("pruning", [])]
    names.append(recipe_data["decoding"]["method"])
    if "speculative" in recipe_data:
        names.append(recipe_data["speculative"]["method"])
    return any(n in reason for n in names)


def _declared_on(family: str, stage_data: dict) -> bool:
    """Whether the pruning stage declares (at its params) that it runs on ``family``."""
    from mmfast.capabilities import caps_of, supported_families

    stage = load_recipe({"pruning": [stage_data]}).pruning[0]
    return family in supported_families(caps_of(PRUNERS.get(stage.method).cls, stage.params))


def test_the_video_stages_run_on_qwen3_videos(extra):
    """Qwen3-VL writes every frame group as its own vision item; the session joins each video's items
    for the stages that need one item per video, so the matrix runs them there."""
    mm = _mm("qwen3_vl")
    for name in ("dycoke", "fastvid", "tome"):
        assert _declared_on("qwen3_vl", _stage(name, mm, extra)), name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pruner", PRUNERS.names())
def test_pruner_x_decoder_x_drafter_on_videos(family, pruner, extra):
    mm = _mm(family)
    problems, ran, tokens = [], set(), {}
    for decoder in DECODERS.names():
        for drafter in (None, DRAFTER):
            data = {
                "pruning": [_stage(pruner, mm, extra)],
                "decoding": {"method": decoder, "params": DECODER_PARAMS.get(decoder, {})},
            }
            if drafter:
                data["speculative"] = {"method": drafter}
            try:
                result, out = _outcome(mm, data)
            except Exception as exc:  # noqa: BLE001 - the point: report every combination that crashes
                problems.append(f"{pruner} x {decoder} x {drafter}: {type(exc).__name__}: {exc}")
                continue
            if result != "ran":
                if not _names_a_method(result, data):
                    problems.append(f"{pruner} x {decoder} x {drafter}: refusal names no method: {result}")
                continue
            ran.add((decoder, drafter))
            tokens[decoder, drafter] = [r.token_ids for r in out]
            if decoder == "greedy" and drafter is None:
                assert _footprint(out) != _baseline(family, mm), f"{pruner} ran on {family} but changed nothing"
                for b in range(2):  # the batch of two equals each video alone
                    _, alone = _outcome(mm, data, VIDEOS[b : b + 1], PROMPTS[b : b + 1])
                    assert _footprint(alone) == _footprint(out[b : b + 1]), f"{pruner} on {family}: sample {b}"
    assert not problems, "\n".join(problems)
    # what runs is what the pruner declares for the family (at its params), and drafting stays lossless
    assert (("greedy", None) in ran) == _declared_on(family, _stage(pruner, mm, extra)), ran
    if ("greedy", DRAFTER) in ran:
        assert tokens["greedy", DRAFTER] == tokens["greedy", None], f"{pruner} x {DRAFTER} on {family} is not lossless"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("first", PRUNERS.names())
def test_stacked_pruners_on_videos(family, first, extra):
    """Every ordered pair of the pruners that run alone on the family's videos."""
    mm = _mm(family)
    alone = [p for p in PRUNERS.names() if _declared_on(family, _stage(p, mm, extra))]
    if first not in alone:
        pytest.skip(f"{first} does not run on {family} videos (the matrix above checks its refusal)")
    problems, ran = [], []
    for second in alone:
        data = {
            "pruning": [_stage(first, mm, extra), _stage(second, mm, extra)],
            "decoding": {"method": "greedy"},
        }
        try:
            result, _ = _outcome(mm, data)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{first} + {second}: {type(exc).__name__}: {exc}")
            continue
        if result == "ran":
            ran.append(second)
        elif not _names_a_method(result, data):
            problems.append(f"{first} + {second}: refusal names no method: {result}")
    assert not problems, "\n".join(problems)
    assert ran, f"{first} stacks with no pruner on {family}"


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_x_drafter_on_videos_without_a_pruner(family):
    """The matrix's row without a pruner: every decoder x {no drafter, a drafter} on the video batch runs
    or is refused naming a method; greedy runs and prompt-lookup drafting gives its tokens."""
    mm = _mm(family)
    problems, tokens = [], {}
    for decoder in DECODERS.names():
        for drafter in (None, DRAFTER):
            data = {"decoding": {"method": decoder, "params": DECODER_PARAMS.get(decoder, {})}}
            if drafter:
                data["speculative"] = {"method": drafter}
            try:
                result, out = _outcome(mm, data)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{decoder} x {drafter}: {type(exc).__name__}: {exc}")
                continue
            if result == "ran":
                tokens[decoder, drafter] = [r.token_ids for r in out]
            elif not _names_a_method(result, data):
                problems.append(f"{decoder} x {drafter}: refusal names no method: {result}")
    assert not problems, "\n".join(problems)
    assert tokens["greedy", DRAFTER] == tokens["greedy", None]
