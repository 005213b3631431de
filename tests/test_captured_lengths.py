"""Captured graphs across calls of different prompt lengths in one session (issue 27): a later call whose cache takes
an earlier call's KV buffers replays that call's graphs (decode steps, the methods' keyed calls, the drafts'), so
whatever a graph reads besides its buffers must be laid out on what its key holds (batch, capacities), not on the
first call's prompt. Every method that runs inside captured steps, with CUDA-graph semantics emulated on the CPU:
short, long, short prompts in one session give the tokens of ``compile: off``, and the calls share buffers (else
the check would be empty). DyCoke's videos: tests/test_dycoke.py."""

from __future__ import annotations

import pytest
from conftest import random_video, video_models

import mmfast
from mmfast import compat
from mmfast._graph_emulator import ReplayEmulator
from mmfast.config import load_recipe
from mmfast.pipeline import Session
from mmfast.registry import PRUNERS
from mmfast.runtime import LMRunner

_video_mm = video_models()
SHORT, LONG = "Describe the image.", "Describe the image in words."

DECODERS = {
    "greedy": {},
    "sample": {"decoding": {"method": "sample", "params": {"top_k": 20}, "seed": 5}},
    "beam": {"decoding": {"method": "beam", "params": {"num_beams": 2}}},
    "opera": {"decoding": {"method": "opera", "params": {"num_beams": 2, "num_attn_candidates": 2}}},
    "vcd": {"decoding": {"method": "vcd", "params": {"sample": False}}},
    "m3id": {"decoding": {"method": "m3id"}},
    "vhr": {"decoding": {"method": "vhr"}},
    "pai": {"decoding": {"method": "pai", "params": {"alpha": 3.0, "gamma": 1.5}}},
    "clearsight": {"decoding": {"method": "clearsight", "params": {"enhance": 3.0, "suppress": 0.2}}},
    "only": {"decoding": {"method": "only", "params": {"sample": False, "gamma": 0.5}}},
    "prompt_lookup": {"speculative": {"method": "prompt_lookup"}},
    "layer_skip": {"speculative": {"method": "layer_skip", "params": {"skip": [2], "gamma": 3}}},
}
DRAFTS = {  # random draft weights: their captured proposals and accepts, not their acceptance
    "msd": {"depth": 3, "top_k": 4, "total_tokens": 16},
    "flash": {"top_k": 4, "total_tokens": 12, "rounds": 2},
}
PRUNERS_CAPTURED = ["fastv", "dart", "pyramiddrop", "sparsevlm", "mustdrop", "dynamic_llava", "zipvl", "divprune"]


def _recipe(name: str, mm) -> dict:
    if name in DECODERS:
        return DECODERS[name]
    if name in DRAFTS:
        from mmfast.speculative._eagle_model import _model_dir, write_random_draft

        d = _model_dir(mm)
        if not (d / name).exists():
            write_random_draft(mm, name, d / name, **({"sar_k": 3, "n_latents": 4} if name == "flash" else {}))
        return {"speculative": {"method": name, "params": DRAFTS[name]}}
    return {"pruning": [{"method": name, "params": PRUNERS.get(name).cls.test_params(mm.adapter)}]}


def _runs(mm, recipe: dict, media: dict, monkeypatch) -> tuple[list, list, list, list]:
    """Tokens of short, long, short prompts in one session with ``compile: off``, then with emulated graphs; each
    static call's prompt length (its first prefill: a branch decoder's other prompts have their own), and for each
    graph the call that captured it and the calls that replayed it."""
    lengths: dict[int, int] = {}
    call = [0]
    graphs: list[Graph] = []
    prefill = LMRunner.prefill

    class Graph(ReplayEmulator):
        def __init__(self) -> None:
            super().__init__()
            self.made_in, self.replayed_in = call[0], set()
            graphs.append(self)

        def replay(self):
            self.replayed_in.add(call[0])
            return super().replay()

    def spy(self, inputs, **kw):
        state, out = prefill(self, inputs, **kw)
        if compat.is_static(state.cache):
            lengths.setdefault(call[0], inputs.input_ids.shape[1])
        return state, out

    def run(mode: str) -> list:
        out = []
        with mmfast.apply(mm, load_recipe(recipe), compile=mode) as s:
            for call[0], prompt in enumerate((SHORT, LONG, SHORT)):
                out.append(s.generate(prompts=[prompt], max_new_tokens=8, seed=0, **media)[0].token_ids)
        return out

    off = run("off")
    with monkeypatch.context() as m:
        m.setattr(LMRunner, "prefill", spy)
        m.setattr(Session, "_capture_factory", lambda self: Graph)
        captured = run("static")
    return off, captured, [lengths[i] for i in range(3)], graphs


@pytest.mark.parametrize("name", [*DECODERS, *DRAFTS, *PRUNERS_CAPTURED])
def test_graphs_replayed_for_another_prompt_length_give_its_tokens(name, tiny_mm, images, monkeypatch):
    _check(*_runs(tiny_mm, _recipe(name, tiny_mm), {"images": [images[0]]}, monkeypatch))


@pytest.mark.parametrize("media", ["image", "video"])
@pytest.mark.parametrize("name", ["greedy", "pai", "fastv", "dart"])
def test_qwen_graphs_replayed_for_another_prompt_length_give_its_tokens(name, media, images, monkeypatch):
    """The same on Qwen2.5-VL (M-RoPE positions, a windowed tower) with an image or a video."""
    mm = _video_mm("qwen2_5_vl")
    given = {"images": [images[0]]} if media == "image" else {"images": None, "videos": [random_video(6, 1)]}
    _check(*_runs(mm, _recipe(name, mm), given, monkeypatch))


def _check(off: list, captured: list, lengths: list, graphs: list) -> None:
    assert captured == off
    assert lengths[0] == lengths[2] < lengths[1], lengths
    # what the check is for: graphs captured on one prompt replayed for the other (the calls share their buffers)
    assert any(g.made_in == 0 and 1 in g.replayed_in for g in graphs), "no graph replayed across prompt lengths"
    assert any(g.made_in <= 1 and 2 in g.replayed_in for g in graphs)
