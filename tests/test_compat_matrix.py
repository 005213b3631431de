"""The compatibility matrix: every registered pruner x every decoder x {no drafter, a drafter}, and
every ordered pair of stacked pruners, on tiny random LLaVA, LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL,
Qwen2.5-VL and Qwen3-VL models (the Qwen ones with mixed image sizes: dynamic resolution).

Each combination either generates (batch 2, so branch batching and per-sample decisions are
exercised) or is refused before any compute with a reason that names the method: by
``load_recipe`` (the methods' capabilities) or by ``apply`` (the loaded model's family or tower).
Nothing else may ever be raised.
"""

from __future__ import annotations

import pytest

import mmfast
from mmfast.config import load_recipe
from mmfast.errors import IncompatibleRecipeError
from mmfast.pipeline import Session
from mmfast.registry import DECODERS, DRAFTERS, PRUNERS

# small searches keep the matrix inside the CI budget; every other parameter is the method's default
DECODER_PARAMS = {
    "beam": {"num_beams": 2},
    "opera": {"num_beams": 2, "num_attn_candidates": 2},
}
DRAFTER = "prompt_lookup"  # needs no trained weights


@pytest.fixture(scope="module")
def families(tiny_mm, tmp_path_factory):
    from mmfast.models.factory import random_llava_next, random_llava_onevision, random_qwen_vl, save_model

    model, processor = random_llava_next("tiny")
    path = save_model(model, processor, tmp_path_factory.mktemp("next_matrix"))
    model, processor = random_llava_onevision("tiny")
    ov_path = save_model(model, processor, tmp_path_factory.mktemp("onevision_matrix"))
    out = {
        "llava": tiny_mm,
        "llava_next": mmfast.load(path, device="cpu"),
        "llava_onevision": mmfast.load(ov_path, device="cpu"),
    }
    for family in QWEN:
        model, processor = random_qwen_vl(family)
        out[family] = mmfast.load(save_model(model, processor, tmp_path_factory.mktemp(family)), device="cpu")
    return out


QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
FAMILIES = ("llava", "llava_next", "llava_onevision", *QWEN)


@pytest.fixture(scope="module")
def mixed_images(images):
    """The shared images, every other one resized: dynamic-resolution families get two grids."""
    return [im if i % 2 == 0 else im.resize((32, 64)) for i, im in enumerate(images)]


def _stage(name: str, mm) -> dict:
    return {"method": name, "params": PRUNERS.get(name).cls.test_params(mm.adapter)}


def _outcome(mm, recipe_data: dict, images, prompts) -> tuple[str, list]:
    """('ran', the results), or ('refused: <reason>', []); anything else raised propagates (a failure)."""
    try:
        recipe = load_recipe(recipe_data)
    except IncompatibleRecipeError as exc:
        return f"refused: {exc}", []
    try:
        session = Session(mm, recipe)
    except IncompatibleRecipeError as exc:
        return f"refused: {exc}", []
    with session:
        try:
            out = session.generate(images[:2], prompts[:2], max_new_tokens=3)
        except IncompatibleRecipeError as exc:  # a video-only method on images: refused before compute
            if "needs a video" not in str(exc):
                raise
            return f"refused: {exc}", []
    assert len(out) == 2
    return "ran", out


def _footprint(results) -> list[tuple]:
    """What a pruner can change, per sample: the LLM's input, its cache, its compute, the answer."""
    return [
        (r.n_vision_tokens, r.kv_bytes_prefill, r.kv_bytes_end, round(r.flops_prefill), tuple(r.token_ids))
        for r in results
    ]


_BASELINES: dict[str, list[tuple]] = {}


def _baseline(family: str, mm, images, prompts) -> list[tuple]:
    if family not in _BASELINES:
        result, out = _outcome(mm, {"decoding": {"method": "greedy"}}, images, prompts)
        assert result == "ran"
        _BASELINES[family] = _footprint(out)
    return _BASELINES[family]


def _names_a_method(reason: str, recipe_data: dict) -> bool:
    names = [s["method"] for s in recipe_data.get("pruning", [])]
    names.append(recipe_data["decoding"]["method"])
    if "speculative" in recipe_data:
        names.append(recipe_data["speculative"]["method"])
    return any(n in reason for n in names)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pruner", PRUNERS.names())
def test_pruner_x_decoder_x_drafter(family, pruner, families, images, mixed_images, prompts):
    mm, images = families[family], mixed_images if family in QWEN else images
    problems, ran = [], 0
    for decoder in DECODERS.names():
        for drafter in (None, DRAFTER):
            data = {
                "pruning": [_stage(pruner, mm)],
                "decoding": {"method": decoder, "params": DECODER_PARAMS.get(decoder, {})},
            }
            if drafter:
                data["speculative"] = {"method": drafter}
            try:
                result, out = _outcome(mm, data, images, prompts)
            except Exception as exc:  # noqa: BLE001 - the point: report every combination that crashes
                problems.append(f"{pruner} x {decoder} x {drafter}: {type(exc).__name__}: {exc}")
                continue
            if result == "ran":
                ran += 1
                if decoder == "greedy" and drafter is None:  # a pruner that "ran" must have changed something
                    changed = _footprint(out)
                    assert changed != _baseline(family, mm, images, prompts), (
                        f"{pruner} ran on {family} but changed nothing"
                    )
            elif not _names_a_method(result, data):
                problems.append(f"{pruner} x {decoder} x {drafter}: refusal names no method: {result}")
    assert not problems, "\n".join(problems)
    from mmfast.capabilities import caps_of, supported_families, videos_only_on

    caps = caps_of(PRUNERS.get(pruner).cls, None)
    images_run = not videos_only_on(caps, mm.adapter.features)  # the matrix feeds images
    if (family == "llava" or family in supported_families(caps)) and images_run:
        assert ran > 0  # every pruner runs with some decoder on the anchor family and on those it declares


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("first", PRUNERS.names())
def test_stacked_pruners(family, first, families, images, mixed_images, prompts):
    mm, images = families[family], mixed_images if family in QWEN else images
    problems = []
    for second in PRUNERS.names():
        data = {"pruning": [_stage(first, mm), _stage(second, mm)], "decoding": {"method": "greedy"}}
        try:
            result, _ = _outcome(mm, data, images, prompts)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{first} + {second}: {type(exc).__name__}: {exc}")
            continue
        if result != "ran" and not _names_a_method(result, data):
            problems.append(f"{first} + {second}: refusal names no method: {result}")
    assert not problems, "\n".join(problems)


DRAFT_ARCH = {"flash": {"sar_k": 3, "n_latents": 4}}
DRAFT_PARAMS = {
    "msd": {"depth": 3, "top_k": 4, "total_tokens": 16},
    "flash": {"top_k": 4, "total_tokens": 12, "rounds": 2},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_drafter_on_every_family(family, families, images, mixed_images, prompts, tmp_path):
    """All four drafters (trained ones on random draft weights) on every family: each runs losslessly
    (greedy's tokens exactly) or is refused naming itself."""
    from mmfast.speculative._eagle_model import write_random_draft

    mm, images = families[family], mixed_images if family in QWEN else images
    result, out = _outcome(mm, {"decoding": {"method": "greedy"}}, images, prompts)
    assert result == "ran"
    greedy = [r.token_ids for r in out]
    ran = []
    for drafter in DRAFTERS.names():
        params = dict(DRAFT_PARAMS.get(drafter, {}))
        if drafter in ("msd", "flash"):
            params["weights"] = str(write_random_draft(mm, drafter, tmp_path / drafter, **DRAFT_ARCH.get(drafter, {})))
        data = {"decoding": {"method": "greedy"}, "speculative": {"method": drafter, "params": params}}
        result, out = _outcome(mm, data, images, prompts)
        if result == "ran":
            assert [r.token_ids for r in out] == greedy, f"{drafter} on {family} is not lossless"
            ran.append(drafter)
        else:
            assert drafter in result, result
    assert "prompt_lookup" in ran  # training-free: runs on every family
    assert family != "llava" or sorted(ran) == sorted(DRAFTERS.names())  # all four on the anchor family


SINGLE_PASS_PEERS = ("pai", "only", "clearsight")  # attention-editing decoders (one attention override each)


@pytest.mark.parametrize("family", ["llava", "llava_next"])
@pytest.mark.parametrize("decoder", SINGLE_PASS_PEERS)
def test_single_pass_peers_x_stacked_pruners(family, decoder, families, images, prompts):
    """Each single-pass peer (paper defaults) with every pruner alone and stacked in front of an in-LLM
    pruner: it generates, or is refused naming a method. ZipVL also overrides the LLM's attention, so
    it must be refused by the capabilities (never by a crash)."""
    mm = families[family]
    problems, ran = [], 0
    for pruner in PRUNERS.names():
        for stack in ([pruner], [pruner, "fastv"]):
            data = {"pruning": [_stage(p, mm) for p in stack], "decoding": {"method": decoder}}
            try:
                result, _ = _outcome(mm, data, images, prompts)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{stack} x {decoder}: {type(exc).__name__}: {exc}")
                continue
            if result == "ran":
                ran += 1
            elif not _names_a_method(result, data):
                problems.append(f"{stack} x {decoder}: refusal names no method: {result}")
            elif "zipvl" in stack and "attention" not in result:
                problems.append(
                    f"{stack} x {decoder}: refused for another reason than the attention override: {result}"
                )
        if pruner == "zipvl":
            with pytest.raises(IncompatibleRecipeError, match="attention"):
                load_recipe({"pruning": [_stage("zipvl", mm)], "decoding": {"method": decoder}})
    assert not problems, "\n".join(problems)
    assert ran > 0


def test_every_method_declares_capabilities():
    from mmfast.capabilities import Capabilities, caps_of

    for registry in (PRUNERS, DECODERS, DRAFTERS):
        for entry in registry.entries():
            assert isinstance(caps_of(entry.cls, None), Capabilities), entry.name


# what each diversity-based peer must do on each family (the matrix above accepts any named refusal)
DIVERSITY_PEERS = {"divprune": ("ran", "ran"), "dart": ("ran", "ran"), "cdpruner": ("ran", "ran")}


@pytest.mark.parametrize("pruner", sorted(DIVERSITY_PEERS))
def test_diversity_peers_families(pruner, families, images, prompts):
    for family, want in zip(("llava", "llava_next"), DIVERSITY_PEERS[pruner]):
        mm = families[family]
        got, _ = _outcome(mm, {"pruning": [_stage(pruner, mm)], "decoding": {"method": "greedy"}}, images, prompts)
        assert got.split(":")[0] == want, f"{pruner} on {family}: {got}"
