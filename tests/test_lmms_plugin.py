"""The lmms-eval plugin against lmms-eval's model API contract.

These tests run without lmms-eval: when it is not installed, a minimal stand-in for
``lmms_eval.api.model.lmms`` (the base class's constructor, ``rank`` / ``world_size``,
``create_from_arg_string`` with lmms-eval's ``key=value`` parsing, the cache hook) is put in
``sys.modules`` and the plugin module is reloaded against it. Requests are objects whose ``args`` are
``(context, gen_kwargs, doc_to_visual, doc_id, task, split)`` and documents come from ``task_dict``,
as lmms-eval's evaluator provides them. With lmms-eval installed the real base class is used.
"""

from __future__ import annotations

import abc
import importlib
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

import mmfast
from mmfast.errors import ConfigError, InputError

TASK, SPLIT = "pope", "test"


def _handle_arg_string(arg: str):  # lmms_eval.utils.handle_arg_string
    if arg.lower() == "true":
        return True
    if arg.lower() == "false":
        return False
    if arg.isnumeric():
        return int(arg)
    try:
        return float(arg)
    except ValueError:
        return arg


def _standin_modules() -> dict[str, types.ModuleType]:
    class CacheHook:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def add_partial(self, attr, req, res) -> None:
            self.calls.append((attr, req, res))

    class lmms(abc.ABC):  # noqa: N801, B024 - lmms-eval's name and shape
        is_simple = True

        def __init__(self) -> None:
            self._rank = 0
            self._world_size = 1
            self.cache_hook = CacheHook()
            self.task_dict: dict = {}

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
            args = {k: _handle_arg_string(v) for k, v in (a.split("=") for a in arg_string.strip().split(",") if a)}
            extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
            return cls(**args, **extra)

        @property
        def rank(self) -> int:
            return self._rank

        @property
        def world_size(self) -> int:
            return self._world_size

    root, api, model = (types.ModuleType(n) for n in ("lmms_eval", "lmms_eval.api", "lmms_eval.api.model"))
    model.lmms = lmms
    model.CacheHook = CacheHook
    root.api, api.model = api, model
    return {"lmms_eval": root, "lmms_eval.api": api, "lmms_eval.api.model": model}


@pytest.fixture
def plugin(monkeypatch):
    try:
        import lmms_eval.api.model  # noqa: F401

        real = True
    except ImportError:
        real = False
        for name, mod in _standin_modules().items():
            monkeypatch.setitem(sys.modules, name, mod)
    import mmfast.eval.lmms_plugin as module

    module = importlib.reload(module)
    yield module
    if not real:
        monkeypatch.undo()
        importlib.reload(module)


class _Req:
    def __init__(self, args):
        self.args = args


def _visual(doc):
    return [doc["image"]]


QUESTIONS = [
    "Is there a cat in the image?",
    "Describe the image.",
    "What color is the car? Tell me now please.",
    "How many dogs are there?",
    "Is there a dog?",
]


def _requests(gen_kwargs: dict, doc_ids=range(5)) -> list[_Req]:
    return [_Req((f"<image>\n{QUESTIONS[d]}", dict(gen_kwargs), _visual, d, TASK, SPLIT)) for d in doc_ids]


@pytest.fixture(scope="module")
def task_dict(images):
    return {TASK: {SPLIT: {d: {"image": images[d % len(images)]} for d in range(5)}}}


def _model(plugin, args: str, task_dict, **extra):
    m = plugin.MMFast.create_from_arg_string(args, {"batch_size": 1, "device": "cpu", **extra})
    m.task_dict = task_dict
    return m


def _generate(model, reqs) -> list[str]:
    """``generate_until``'s answers as text. With lmms-eval >= 0.7 installed each answer is its
    ``GenerationResult`` whose ``output_tokens`` is the answer's generated token count."""
    before = model.token_counts.new_tokens
    out = model.generate_until(reqs)
    assert len(out) == len(reqs)
    result_cls = sys.modules[type(model).__module__]._LMMResult
    if result_cls is None:
        assert all(isinstance(o, str) for o in out)
        return out
    assert all(isinstance(o, result_cls) for o in out)
    assert sum(o.token_counts.output_tokens for o in out) == model.token_counts.new_tokens - before
    return [o.text for o in out]


class _RecordingHook:
    """Records ``add_partial`` calls (lmms-eval's own ``CacheHook`` keeps nothing without a cache)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add_partial(self, attr, req, res) -> None:
        self.calls.append((attr, req, res))


def _expected(tiny_mm, recipe, doc_ids, max_new, **kw) -> list[str]:
    with mmfast.apply(tiny_mm, recipe) as s:
        out = []
        for d in doc_ids:
            meta = [{"doc_id": f"{TASK}/{SPLIT}/{d}"}]
            im = s.mm.prepare([[tiny_mm_images[d % 4]]], [QUESTIONS[d]], meta=meta)
            out.append(s.run(im, max_new_tokens=max_new, decoder=s.decoder_for(None, kw.get("keywords")))[0].text)
        return out


tiny_mm_images: list = []


@pytest.fixture(autouse=True)
def _images(images):
    tiny_mm_images[:] = images


def test_entry_point_declared():
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["lmms_eval.models"] == {"mmfast": "mmfast.eval.lmms_plugin:manifest"}


def test_lmms_installs_pin_filelock_below_4():
    # filelock 4 has no filelock._api, which lmms-eval 0.7.3 imports: it then dies and exits 0
    import tomllib

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert "filelock<4" in project["project"]["optional-dependencies"]["lmms"]
    setup = (root / "Makefile").read_text().split("$(LMMS_VENV)/.installed:", 1)[1].split("\n\n", 1)[0]
    assert '"filelock<4"' in setup and ".[test,lmms]" in setup


def test_plugin_runs_a_recipe(plugin, tiny_dir, task_dict, tiny_mm, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name: {tiny_dir}, device: cpu}}\npruning: [{{method: fastv, params: {{keep: 5}}}}]\n")
    model = _model(plugin, f"recipe={recipe}", task_dict)
    assert (model.rank, model.world_size, model.device, model.batch_size) == (0, 1, torch.device("cpu"), 1)
    assert not hasattr(model, "accelerator")
    model.cache_hook = _RecordingHook()
    out = _generate(model, _requests({"max_new_tokens": 4, "until": ["\n"]}, [0, 1]))
    assert out == _expected(tiny_mm, str(recipe), [0, 1], 4)
    assert [c[0] for c in model.cache_hook.calls] == ["generate_until"] * 2
    assert model.token_counts.requests == 2 and 0 < model.token_counts.new_tokens <= 8
    assert model.token_counts.vision_tokens == 2 * 16 and model.token_counts.per_task[TASK]["requests"] == 2
    ((lp, greedy),) = model.loglikelihood([_Req(("Is there a cat?", " Yes", _visual, 0, TASK, SPLIT))])
    assert lp < 0 and isinstance(greedy, bool)


def test_pretrained_and_overrides(plugin, tiny_dir, task_dict, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name: no/such-model}\npruning: [{method: fastv, params: {keep: 5}}]\n")
    for key in ("pruning.0.params.keep", "pruning[0].params.keep"):
        m = _model(plugin, f"pretrained={tiny_dir},recipe={recipe},{key}=3,decoding.max_new_tokens=7", task_dict)
        assert m.recipe.model.name == str(tiny_dir) == m.pretrained
        assert m.recipe.pruning[0].params.keep == 3 and m.recipe.decoding.max_new_tokens == 7
    m = _model(plugin, f"pretrained={tiny_dir}", task_dict)  # no recipe: no methods
    assert m.recipe.pruning == () and m.recipe.decoding.method == "greedy"
    with pytest.raises(ConfigError, match="keep"):
        _model(plugin, f"pretrained={tiny_dir},recipe={recipe},pruning.0.params.kepp=3", task_dict)
    with pytest.raises(InputError, match="pruning.*has 1 entries"):
        _model(plugin, f"pretrained={tiny_dir},recipe={recipe},pruning.4.params.keep=3", task_dict)
    with pytest.raises(InputError, match="dtyp=.*unknown argument.*pretrained="):
        _model(plugin, f"pretrained={tiny_dir},dtyp=float16", task_dict)
    with pytest.raises(InputError, match="batch_size='auto'"):
        _model(plugin, f"pretrained={tiny_dir}", task_dict, batch_size="auto")


def test_batching_keeps_answers_and_order(plugin, tiny_dir, task_dict, monkeypatch):
    reqs = _requests({"max_new_tokens": 5})
    one = _generate(_model(plugin, f"pretrained={tiny_dir}", task_dict), reqs)
    model = _model(plugin, f"pretrained={tiny_dir}", task_dict, batch_size=3)
    sizes: list[int] = []
    run = model.session.run

    def spy(batch, **kw):
        sizes.append(batch.batch_size)
        return run(batch, **kw)

    monkeypatch.setattr(model.session, "run", spy)
    assert _generate(model, reqs) == one
    assert sizes == [3, 2]
    # requests with other settings are never batched with these
    mixed = reqs[:2] + _requests({"max_new_tokens": 2}, [2])
    sizes.clear()
    out = _generate(model, mixed)
    assert sizes == [2, 1] and out[:2] == one[:2] and len(out[2]) <= len(one[2])


def test_gen_kwargs_honoured(plugin, tiny_dir, task_dict, tiny_mm):
    model = _model(plugin, f"pretrained={tiny_dir}", task_dict)
    pope = {"max_new_tokens": 6, "temperature": 0, "top_p": 1.0, "num_beams": 1, "do_sample": False}
    greedy = _generate(model, _requests(pope, [0, 1]))
    assert greedy == _expected(tiny_mm, None, [0, 1], 6)
    sampled = _generate(model, _requests({"max_new_tokens": 6, "do_sample": True, "temperature": 0.7}, [0, 1]))
    want = _expected(
        tiny_mm, None, [0, 1], 6, keywords={"method": "sample", "params": {"temperature": 0.7, "top_k": 50}}
    )
    assert sampled == want and sampled != greedy
    beams = _generate(model, _requests({"max_new_tokens": 6, "num_beams": 2}, [0]))
    assert beams == _expected(tiny_mm, None, [0], 6, keywords={"method": "beam", "params": {"num_beams": 2}})
    # until cuts the answer at the first stop string
    stop = greedy[0].split()[1]
    assert _generate(model, _requests({**pope, "until": [stop]}, [0])) == [greedy[0].split(stop)[0]]
    before = model.token_counts.new_tokens
    _generate(model, _requests({"max_new_tokens": 2}, [0, 1]))
    assert model.token_counts.new_tokens - before <= 4


def test_recipe_decoder_kept_with_a_warning(plugin, tiny_dir, task_dict, tiny_mm, caplog):
    model = _model(plugin, f"pretrained={tiny_dir},decoding.method=vcd", task_dict)
    pope = {"max_new_tokens": 4, "do_sample": False, "temperature": 0, "image_aspect_ratio": "pad"}
    with caplog.at_level(logging.WARNING, logger="mmfast.eval.lmms_plugin"):
        out = _generate(model, _requests(pope, [0, 1]))
        _generate(model, _requests(pope, [2]))
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("recipe's decoder 'vcd' is kept" in m for m in msgs) == 1
    assert sum("image_aspect_ratio='pad'" in m and "ignored" in m for m in msgs) == 1
    assert out == _expected(tiny_mm, {"decoding": "vcd"}, [0, 1], 4)


def test_two_ranks_shard_like_lmms_eval(plugin, tiny_dir, task_dict, monkeypatch):
    gk = {"max_new_tokens": 5, "until": ["\n"]}
    single = _generate(_model(plugin, f"pretrained={tiny_dir}", task_dict, batch_size=2), _requests(gk))

    class FakeAccelerator:  # what accelerate gives process `rank` of 2 (no process group needed here)
        def __init__(self, rank: int) -> None:
            self.process_index, self.num_processes, self.device = rank, 2, torch.device("cpu")

    merged: dict[int, str] = {}
    for rank in (0, 1):
        monkeypatch.setattr(plugin, "data_parallel_state", lambda rank=rank: FakeAccelerator(rank))
        model = _model(plugin, f"pretrained={tiny_dir}", task_dict, batch_size=2)
        assert (model.rank, model.world_size, model.device) == (rank, 2, torch.device("cpu"))
        assert model.accelerator.process_index == rank
        # lmms-eval's evaluator: build_all_requests(rank=..., world_size=...) takes every world_size-th doc,
        # then pads the shorter shard by repeating its last request
        docs = list(range(5))[rank::2]
        reqs = _requests(gk, docs)
        reqs += [reqs[-1]] * (3 - len(reqs))
        out = _generate(model, reqs)
        assert len(out) == 3
        merged.update(zip(docs, out))
    assert [merged[d] for d in range(5)] == single
    with pytest.raises(InputError, match="device_map.*data parallel"):
        _model(plugin, f"pretrained={tiny_dir},model.device_map=auto", task_dict)


def test_data_parallel_state_outside_a_launch(plugin, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert plugin.data_parallel_state() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert plugin.data_parallel_state() is None


def test_recipe_overrides_translation(plugin):
    # keys as given: load_recipe reads a number between dots as a list index or a mapping key
    assert plugin.recipe_overrides({"pruning.0.params.keep": 32, "decoding.method": "vcd", "model.x.1": True}) == [
        "pruning.0.params.keep=32",
        "decoding.method=vcd",
        "model.x.1=true",
    ]


def test_model_args_set_numbered_mapping_keys_and_list_items(plugin):
    """``model.max_memory.0=20GiB`` (a per-GPU cap) was rewritten to ``model.max_memory[0]``, a list index,
    and refused; ``pruning.0...`` still indexes the list."""
    from mmfast.config import load_recipe

    edits = plugin.recipe_overrides({"model.max_memory.0": "1GiB", "pruning.0.budget.tokens": 160})
    r = load_recipe("examples/fastv_192", edits)
    assert r.model.max_memory == {"0": "1GiB"} and r.pruning[0].budget.tokens == 160


def test_without_lmms_eval_the_class_refuses(monkeypatch):
    try:
        import lmms_eval.api.model  # noqa: F401

        pytest.skip("lmms-eval is installed: the real base class is used")
    except ImportError:
        pass
    import mmfast.eval.lmms_plugin as module

    module = importlib.reload(module)
    with pytest.raises(ImportError, match="pip install lmms-eval"):
        module.MMFast()


def test_plugin_runs_a_onevision_recipe(plugin, task_dict, tmp_path):
    """The plugin works unchanged on LLaVA-OneVision (anyres-max tiles, ChatML template)."""
    from mmfast.models.factory import random_llava_onevision, save_model

    path = save_model(*random_llava_onevision("tiny"), tmp_path / "onevision")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name: {path}, device: cpu}}\npruning: [{{method: fastv, params: {{keep: 5}}}}]\n")
    model = _model(plugin, f"recipe={recipe}", task_dict)
    out = _generate(model, _requests({"max_new_tokens": 4, "until": ["\n"]}, [0, 1]))
    assert out == _expected(mmfast.load(path, device="cpu"), str(recipe), [0, 1], 4)


def test_rank_and_size_prefer_the_process_group(plugin, monkeypatch):
    """lmms-eval's CLI makes its own Accelerator() first; on a machine without CUDA accelerate's shared
    state then says one process although torchrun started two (the gloo group is up)."""
    import torch.distributed as dist

    class OneProcess:  # what that shared state reports on every rank
        process_index, num_processes = 0, 1

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert plugin.rank_and_size(OneProcess()) == (0, 1)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert plugin.rank_and_size(OneProcess()) == (1, 2)


# -- videos ---------------------------------------------------------------------------------------------
VTASK = "vtask"


@pytest.fixture(scope="module")
def qwen_video(tmp_path_factory):
    """A tiny random Qwen2.5-VL saved to a directory, and a clip of 6 frames (PNG files, 32 x 32)."""
    import numpy as np
    from PIL import Image

    from mmfast.models.factory import random_qwen_vl, save_model

    root = tmp_path_factory.mktemp("lmms_video")
    qdir = save_model(*random_qwen_vl("qwen2_5_vl", seed=1), root / "qwen")
    clip = root / "clip"
    clip.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(clip / f"{i:03d}.png")
    return qdir, clip, mmfast.load(qdir, device="cpu")


def _video_requests(docs: dict, max_new: int = 4) -> tuple[dict, list[_Req]]:
    task_dict = {VTASK: {SPLIT: {d: {"visuals": v} for d, v in docs.items()}}}
    reqs = [_Req((f"What happens in clip {d}?", {"max_new_tokens": max_new}, _visuals, d, VTASK, SPLIT)) for d in docs]
    return task_dict, reqs


def _visuals(doc):
    return doc["visuals"]


def _direct(mm, video, images=(), max_new: int = 4, doc: int = 0, **sampling) -> tuple[str, int]:
    """(answer, vision tokens) of mmfast's own session for the same prompt, video and images."""
    with mmfast.apply(mm, None) as s:
        batch = mm.prepare([list(images)], [f"What happens in clip {doc}?"], videos=[video], **sampling)
        (r,) = s.run(batch, max_new_tokens=max_new)
    return r.text, r.n_vision_tokens


def test_video_visuals_go_to_the_video_input(plugin, qwen_video, images):
    """A frame directory, a video dict with the task's own sampling, and a video followed by an image
    are answered through ``generate(videos=...)``'s path, batched, as mmfast's own session answers them;
    ``max_num_frames`` caps the frames a video gives (6 frames: 3 groups of 2 x 16 tokens on Qwen2.5-VL)."""
    qdir, clip, mm = qwen_video
    docs = {
        0: [str(clip)],  # 6 frames, under the default max_num_frames=32: every frame
        1: [{"type": "video", "path": str(clip), "sampling": {"num_frames": 2, "fps": None, "video_fps": None}}],
        2: [clip, images[0]],  # the video first, then an image
    }
    task_dict, reqs = _video_requests(docs)
    model = _model(plugin, f"pretrained={qdir}", task_dict, batch_size=2)
    want = [
        _direct(mm, clip, doc=0),
        _direct(mm, clip, doc=1, num_frames=2),
        _direct(mm, clip, [images[0]], doc=2),
    ]
    assert [w[1] for w in want[:2]] == [48, 16] and want[2][1] > 48  # the video's frames reach the model
    assert _generate(model, reqs) == [w[0] for w in want]
    assert model.token_counts.vision_tokens == sum(w[1] for w in want)

    capped = _model(plugin, f"pretrained={qdir},max_num_frames=4", task_dict)
    assert _generate(capped, reqs[:2]) == [_direct(mm, clip, doc=0, num_frames=4)[0], want[1][0]]  # doc 1 keeps its own
    assert capped.token_counts.vision_tokens == 32 + 16

    # loglikelihood takes the video too: the same frames score the same, other frames differently
    def ll(m, doc):
        return m.loglikelihood([_Req((f"What happens in clip {doc}?", " Yes", _visuals, doc, VTASK, SPLIT))])[0][0]

    assert ll(capped, 0) == pytest.approx(ll(_model(plugin, f"pretrained={qdir},max_num_frames=5", task_dict), 0))
    assert ll(capped, 0) != pytest.approx(ll(model, 0))


def test_video_files_with_max_num_frames_and_fps(plugin, qwen_video, tmp_path):
    av = pytest.importorskip("av")
    import numpy as np

    qdir, _, mm = qwen_video
    path = tmp_path / "clip.mp4"  # 12 frames at 6 per second
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=6)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for i in range(12):
            a = np.full((32, 32, 3), (20 * i, 255 - 20 * i, 40), np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")))
        container.mux(stream.encode())
    task_dict, reqs = _video_requests({0: [str(path)]})
    for args, sampling in [
        ("max_num_frames=4", {"num_frames": 4}),
        ("fps=1", {"fps": 1.0}),  # 12 frames at 6 fps: 2 frames, under the cap
        ("fps=6,max_num_frames=8", {"num_frames": 8}),  # 12 frames by rate: capped at 8
    ]:
        model = _model(plugin, f"pretrained={qdir},{args}", task_dict)
        assert _generate(model, reqs) == [_direct(mm, path, **sampling)[0]], args
    assert model.token_counts.vision_tokens == 4 * 16


def test_video_on_a_family_without_video_is_refused_before_compute(plugin, tiny_dir, task_dict, tmp_path, monkeypatch):
    clip = tmp_path / "clip"
    clip.mkdir()
    vdict, vreqs = _video_requests({0: [str(clip)]})
    model = _model(plugin, f"pretrained={tiny_dir}", {**task_dict, **vdict})
    monkeypatch.setattr(model.session, "run", lambda *a, **k: pytest.fail("a request was answered"))
    reqs = _requests({"max_new_tokens": 2}, [0]) + vreqs  # the image task comes first
    with pytest.raises(
        InputError, match=rf"doc 0 of {VTASK}/{SPLIT} \(task {VTASK}\) is a video, and .* is a llava model"
    ):
        model.generate_until(reqs)
    with pytest.raises(InputError, match="which has no video input; pass the frames as images"):
        model.loglikelihood([_Req(("Q", " Yes", _visuals, 0, VTASK, SPLIT))])


@pytest.mark.parametrize(
    ("visuals", "match"),
    [
        (["IMG", "DIR"], "visual 1 is a video listed after an image"),
        (["DIR", "DIR"], "visual 1 is a second video"),
        ([{"type": "video", "path": "DIR", "video_start": 1.0, "video_end": 2.0}], "time window"),
        ([{"type": "audio", "array": [0.0]}], "dict with type 'audio'"),
        (["https://example.com/v.mp4"], "is a URL; mmfast reads local files"),
        (["notes.txt"], "is neither an image file, a video file"),
        ([3], "visual 0 is a int"),
        ([{"type": "video", "path": "DIR", "sampling": {"frames": 2}}], "'sampling' must be a dict of num_frames"),
    ],
)
def test_visuals_that_cannot_be_given_are_refused(visuals, match, tmp_path):
    from PIL import Image

    from mmfast.eval._lmms_visuals import sort_visuals

    sub = {"IMG": Image.new("RGB", (8, 8)), "DIR": str(tmp_path)}
    visuals = [sub.get(v, v) if isinstance(v, str) else v for v in visuals]
    visuals = [{**v, "path": sub["DIR"]} if isinstance(v, dict) and v.get("path") == "DIR" else v for v in visuals]
    with pytest.raises(InputError, match=match):
        sort_visuals(visuals, "doc 0 of t/s")
    assert sort_visuals(str(tmp_path), "d").video.source == tmp_path  # one visual, not in a list


def test_frame_sampling_rule():
    from mmfast.eval._lmms_visuals import FrameSampling
    from mmfast.video import FrameRule, VideoSampling, sample_indices

    plain, qwen = FrameRule(), FrameRule(multiple=2, min_frames=4, max_frames=768)
    s = FrameSampling()
    assert s.for_source(10, None, plain, "v") == VideoSampling()  # at most 32: every frame
    assert s.for_source(100, 30.0, plain, "v") == VideoSampling(num_frames=32, video_fps=30.0)
    fps = FrameSampling(max_num_frames=8, fps=1.0)
    assert fps.for_source(120, 30.0, qwen, "v") == VideoSampling(fps=1.0, video_fps=30.0)  # 4 frames by rate
    assert fps.for_source(600, 30.0, qwen, "v") == VideoSampling(num_frames=8, video_fps=30.0)  # 20 by rate: capped
    with pytest.raises(InputError, match="needs the video's frame rate.*video_fps="):
        fps.for_source(120, None, plain, "v")
    # Qwen-VL samples frame pairs: "at most 7" is 6 frames (7 used to round up to 8), and at most 1 is no pair
    odd = FrameSampling(max_num_frames=7)
    assert odd.for_source(100, 30.0, qwen, "v") == VideoSampling(num_frames=6, video_fps=30.0)
    assert len(sample_indices(100, odd.for_source(100, 30.0, qwen, "v"), qwen)) == 6
    assert odd.for_source(100, 30.0, plain, "v") == VideoSampling(num_frames=7, video_fps=30.0)
    with pytest.raises(InputError, match="max_num_frames=1 is below this model's frame multiple.*max_num_frames=2"):
        FrameSampling(max_num_frames=1).for_source(100, 30.0, qwen, "v")
    for bad in ({"max_num_frames": 0}, {"max_num_frames": 2.5}, {"fps": -1.0}, {"video_fps": "x"}):
        with pytest.raises(InputError, match="--model_args"):
            FrameSampling(**bad)


def test_loglikelihood_refuses_a_continuation_it_cannot_score(plugin, tiny_dir, task_dict):
    """An empty continuation crashed inside the embedding (a float tensor of no ids), and a non-text one
    inside the tokenizer; both are InputErrors naming the request, never a score."""
    m = _model(plugin, f"pretrained={tiny_dir}", task_dict)
    with pytest.raises(InputError, match="doc 0 of pope/test: the continuation '' has no tokens"):
        m.loglikelihood([_Req(("Is there a cat?", "", _visual, 0, TASK, SPLIT))])
    with pytest.raises(InputError, match="the continuation is a int, not text"):
        m.loglikelihood([_Req(("Is there a cat?", 5, _visual, 0, TASK, SPLIT))])


def test_transparent_visuals_are_opened_as_mmfast_run_opens_them(plugin, tiny_dir, tiny_mm, tmp_path):
    """The plugin converted each PIL visual with convert("RGB") before MMModel.prepare, dropping its alpha (and
    clipping 16-bit pixels): an RGBA visual gave other pixels than the same image through `mmfast run`."""
    import numpy as np
    from PIL import Image

    rgba = np.random.default_rng(0).integers(0, 255, (40, 48, 4), dtype=np.uint8)
    rgba[:20, :, 3] = 0
    image = Image.fromarray(rgba, "RGBA")
    image.save(tmp_path / "x.png")
    model = _model(plugin, f"pretrained={tiny_dir}", {TASK: {SPLIT: {0: {"image": image}}}})
    images, _ = model._visuals(_Req(("<image>\nQ", {}, _visual, 0, TASK, SPLIT)))
    got = tiny_mm.prepare([images], ["Q"]).pixel_values
    assert torch.equal(got, tiny_mm.prepare([tmp_path / "x.png"], ["Q"]).pixel_values)
