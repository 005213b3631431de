"""lmms-eval plugin: run any mmfast recipe on lmms-eval tasks.

    pip install lmms-eval          # optional; mmfast registers itself through its entry point
    python -m lmms_eval --model mmfast --model_args recipe=examples/fastv_192 --tasks pope --batch_size 4
    python -m lmms_eval --model mmfast \\
        --model_args pretrained=llava-hf/llava-1.5-7b-hf,recipe=examples/fastv_192,pruning.0.budget.tokens=160 ...
    accelerate launch --num_processes 8 -m lmms_eval --model mmfast --model_args recipe=... --tasks pope   # 8 GPUs
    torchrun --nproc_per_node 2 -m lmms_eval --model mmfast --model_args recipe=... --tasks pope         # 2 CPU processes

Offline, on the embedded world (``mmfast lmms-task`` writes the recipe's POPE questions as a local task):

    mmfast lmms-task world_eval
    python -m lmms_eval --model mmfast --model_args recipe=world_eval \
        --include_path ~/.cache/mmfast/lmms_tasks/mmfast_world_pope --tasks mmfast_world_pope --limit 8

Model arguments (``--model_args``, comma separated):

- ``recipe``: a recipe file or a shipped recipe name (``mmfast list recipes``); default: no methods.
- ``pretrained``: the checkpoint (lmms-eval's convention); sets the recipe's ``model.name``.
- any dotted recipe key: an override applied before validation, exactly like ``mmfast eval --set``
  (``pruning.0.budget.tokens=160`` or ``pruning[0].budget.tokens=160``, ``model.dtype=bfloat16``,
  ``decoding.method=vcd``); an unknown key fails with the recipe validator's did-you-mean.
- ``batch_size`` (``--batch_size``): requests answered per forward batch; ``device`` (``--device``).
- video frame sampling, with the names of lmms-eval's own Qwen-VL models (``qwen2_5_vl``, ``qwen3_vl``):
  ``max_num_frames`` (default 32): at most this many frames per video, uniformly (a shorter video keeps
  every frame; Qwen-VL, which samples frame pairs, keeps the largest even count within it); ``fps``: frames per second of the source instead, capped at ``max_num_frames``;
  ``video_fps``: the frame rate of frame directories (video files carry their own). A task that gives
  its own sampling (``mmfast lmms-task`` for ``video_pope``) keeps it.

Visuals (``doc_to_visual``): PIL images and image paths are images; a video file path (``.mp4``,
``.mkv``, ...; lmms-eval's video tasks such as Video-MME and MVBench return these; decoded with PyAV,
``pip install 'mmfast[video]'``), a directory of frame images, or a ``{"type": "video", "path": ...}``
dict is the request's video, given to the model's video input (``generate(videos=...)``), on the
families that have one (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision). A request takes one video,
listed before its images; see :mod:`mmfast.eval._lmms_visuals`. A video task on a family without
video input is refused before any request is answered.

Data parallel: under ``accelerate launch`` or ``torchrun`` (``WORLD_SIZE > 1``) the model takes the
process group's rank and size (accelerate's when no group is up) and accelerate's device
(``cuda:<LOCAL_RANK>``, or the CPU with gloo) as ``rank`` / ``world_size`` / ``device`` and exposes the
``accelerator``, as lmms-eval's own models do. On a machine without CUDA use ``torchrun`` (or
``accelerate launch --multi_gpu``): ``accelerate launch --num_processes 2 --cpu`` starts a single
process unless given an mpirun hostfile;
lmms-eval then hands each process its shard of the requests (every ``world_size``-th document, padded
to equal length) and gathers the results. mmfast's answers do not depend on batch composition, so the
gathered answers equal a single-process run's.

Generation settings: each request's ``gen_kwargs`` (the task's ``generation_kwargs``) are honoured:
``max_new_tokens``, ``until`` (answers are cut at the first stop string), and ``do_sample`` /
``temperature`` / ``top_k`` / ``top_p`` / ``num_beams`` choose greedy, sample or beam with transformers'
semantics when the recipe keeps the default greedy decoder. A recipe that names its own decoder (VCD,
OPERA, sample, ...) keeps it, and a warning says which task settings it overrides. Keys mmfast does not
implement are reported in a warning once. Requests with equal settings are batched (longest prompt
first); answers come back in request order. Progress goes to a bar on rank 0's terminal and to periodic
log lines; a summary of generated and vision token counts is logged after each call and kept in
``token_counts``; each answer is returned as lmms-eval's ``GenerationResult`` with ``output_tokens``
(lmms-eval >= 0.7 writes it into the samples file). mmfast's log lines go through lmms-eval's loguru
output when the application configured no ``logging`` (:func:`route_logs_to_lmms_eval`).

mmfast declares the entry point group ``lmms_eval.models`` (lmms-eval >= 0.7's plugin mechanism,
``ModelManifest``); the model loads the recipe's checkpoint, installs its methods once and answers
requests through the same session as ``mmfast eval``. ``loglikelihood`` scores a continuation by teacher
forcing through the session's runner (pruning stages apply). Errors are raised, never turned into empty
answers (lmms-eval's own ``llava_hf`` returns "" on failure).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError
from ..inputs import VideoClip
from ..progress import Progress
from ._lmms_visuals import FrameSampling, open_request_video, sort_visuals
from .lmms_logs import route_logs_to_lmms_eval

try:  # optional dependency: importing this module without lmms-eval is allowed, using the class is not
    from lmms_eval.api.model import lmms as _LMMBase
except ImportError:  # pragma: no cover - exercised when lmms-eval is absent
    _LMMBase = object
try:  # lmms-eval >= 0.7: per-answer token counts travel with the text into its samples file
    from lmms_eval.api.instance import GenerationResult as _LMMResult
    from lmms_eval.api.instance import TokenCounts as _LMMTokenCounts
except ImportError:  # older lmms-eval or its stand-in: plain strings
    _LMMResult = _LMMTokenCounts = None

logger = logging.getLogger(__name__)


def manifest():
    """The ``lmms_eval.models`` entry point payload."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id="mmfast", simple_class_path="mmfast.eval.lmms_plugin.MMFast")


def data_parallel_state() -> Any | None:
    """accelerate's ``Accelerator`` under ``accelerate launch`` / ``torchrun`` (``WORLD_SIZE > 1``), else None.

    On a machine without CUDA it is asked for the CPU explicitly, so the process group uses gloo.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import Accelerator

    return Accelerator(cpu=not torch.cuda.is_available())


def rank_and_size(accelerator: Any) -> tuple[int, int]:
    """This process's rank and the process count: torch.distributed's group when it is up, else accelerate's.

    lmms-eval's command line builds its own ``Accelerator()`` before the model; accelerate's state is
    shared, and on a machine without CUDA that first one records a single process although ``torchrun``
    started several (the group itself is up), so ``process_index`` / ``num_processes`` said 0 / 1 on
    every rank.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return int(accelerator.process_index), int(accelerator.num_processes)


def recipe_overrides(args: dict[str, Any]) -> list[str]:
    """``--model_args`` recipe keys as ``load_recipe`` overrides, keys as given: a number between dots
    indexes a list (``pruning.0.params.keep``) and is a key in a mapping (``model.max_memory.0``), as
    with ``mmfast eval --set``. lmms-eval has already turned numbers and true/false into Python values;
    strings stay YAML."""
    out = []
    for key, value in args.items():
        if "." not in key and "[" not in key:
            hint = (
                " (mmfast spells it max_num_frames, as lmms-eval's Qwen-VL models)" if key == "max_frames_num" else ""
            )
            raise InputError(
                f"--model_args {key}={value!r}: unknown argument{hint}; mmfast takes recipe=, pretrained=, batch_size=, "
                "device=, max_num_frames=, fps=, video_fps= and dotted recipe keys (model.dtype=bfloat16, "
                "pruning.0.budget.tokens=160, decoding.method=vcd)"
            )
        text = value if isinstance(value, str) else json.dumps(value)
        out.append(f"{key}={text}")
    return out


@dataclass
class TokenCounts:
    """What the plugin generated so far (all ``generate_until`` calls of this process)."""

    requests: int = 0
    new_tokens: int = 0
    vision_tokens: int = 0  # at the LLM input, after pruning
    seconds: float = 0.0
    per_task: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, task: str, new_tokens: int, vision_tokens: int) -> None:
        self.requests += 1
        self.new_tokens += new_tokens
        self.vision_tokens += vision_tokens
        t = self.per_task.setdefault(task, {"requests": 0, "new_tokens": 0, "vision_tokens": 0})
        t["requests"] += 1
        t["new_tokens"] += new_tokens
        t["vision_tokens"] += vision_tokens


@dataclass(frozen=True)
class _Plan:
    """How one set of ``gen_kwargs`` is answered."""

    decoder: Any
    max_new_tokens: int
    until: tuple[str, ...]


class MMFast(_LMMBase):
    """An mmfast recipe as an lmms-eval model (``--model mmfast --model_args recipe=...,pretrained=...``)."""

    is_simple = True

    def __init__(
        self,
        recipe: str | None = None,
        pretrained: str | None = None,
        batch_size: int | str = 1,
        device: str | None = None,
        max_batch_size: int | None = None,
        max_num_frames: int = 32,
        fps: float | None = None,
        video_fps: float | None = None,
        **overrides: Any,
    ) -> None:
        if _LMMBase is object:
            raise ImportError("lmms-eval is not installed: pip install lmms-eval (or pip install 'mmfast[lmms]')")
        super().__init__()
        route_logs_to_lmms_eval()
        from ..config import load_recipe
        from ..model import load_model
        from ..pipeline import apply

        self.batch_size_per_gpu = _batch_size(batch_size)
        self.frame_sampling = FrameSampling(max_num_frames, fps, video_fps)
        if max_batch_size is not None:
            logger.warning(
                "max_batch_size=%s is ignored: it applies to batch_size=auto, which mmfast does not "
                "implement; batch_size=%d is used",
                max_batch_size,
                self.batch_size_per_gpu,
            )
        edits = recipe_overrides(overrides)
        if pretrained is not None:
            edits.append(f"model.name={json.dumps(str(pretrained))}")
        self.recipe = load_recipe(recipe if recipe is not None else {}, edits)
        accelerator = data_parallel_state()
        if accelerator is not None:
            if self.recipe.model.device_map is not None:
                raise InputError(
                    f"model.device_map={self.recipe.model.device_map!r} spreads one model over devices, which data "
                    "parallelism (accelerate launch / torchrun) cannot combine with; launch one process, or drop "
                    "device_map"
                )
            device = str(accelerator.device)
            self.accelerator = accelerator
            self._rank, self._world_size = rank_and_size(accelerator)
        self.mm = load_model(self.recipe.model, device=device)
        self.session = apply(self.mm, self.recipe)
        self._device = self.mm.device
        self.pretrained = self.recipe.model.name
        self.token_counts = TokenCounts()
        self._warned: set[str] = set()
        if self._world_size > 1:
            logger.info("mmfast rank %d of %d on %s (data parallel)", self._rank, self._world_size, self._device)

    # -- the attributes lmms-eval's evaluator reads -------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    @property
    def model(self) -> torch.nn.Module:
        return self.mm.model

    @property
    def tokenizer(self) -> Any:
        return self.mm.tokenizer

    # -- requests ------------------------------------------------------------------------------------
    def _doc(self, task: str, split: str, doc_id: Any) -> Any:
        try:
            return self.task_dict[task][split][doc_id]
        except (KeyError, IndexError, TypeError):
            raise InputError(
                f"request for doc {doc_id!r} of {task}/{split}, which lmms-eval's task_dict does not hold"
            ) from None

    def _visuals(self, request) -> tuple[list, VideoClip | None]:
        """The request's images and its video (opened with the frame sampling), in the model's order."""
        _, _, doc_to_visual, doc_id, task, split = request.args[:6]
        visuals = doc_to_visual(self._doc(task, split, doc_id)) if doc_to_visual is not None else []
        what = f"doc {doc_id} of {task}/{split}"
        sorted_ = sort_visuals(visuals, what)
        images = list(sorted_.images)  # opened by MMModel.prepare (open_image: EXIF, alpha onto white, 16-bit)
        if sorted_.video is None:
            return images, None
        self._check_video_support(what)
        rule = self.mm.adapter.frame_rule(self.mm.video_settings)
        return images, open_request_video(sorted_.video, self.frame_sampling, rule, f"{what}, video")

    def _check_video_support(self, what: str) -> None:
        adapter = self.mm.adapter
        if not adapter.supports_video:
            raise InputError(
                f"{what} is a video, and {self.pretrained} is a {adapter.family} model, which has no video input; "
                f"{adapter.video_alternative}"
            )

    def _refuse_video_tasks(self, reqs: Sequence[Any]) -> None:
        """On a family without video input: a task whose first request has a video is refused before any
        request is answered (lmms-eval hands every task's requests in one call)."""
        if self.mm.adapter.supports_video:
            return
        first: dict[tuple[str, str], Any] = {}
        for req in reqs:
            first.setdefault((req.args[4], req.args[5]), req)
        for (task, split), req in first.items():
            _, _, doc_to_visual, doc_id = req.args[:4]
            if doc_to_visual is None:
                continue
            what = f"doc {doc_id} of {task}/{split}"
            if sort_visuals(doc_to_visual(self._doc(task, split, doc_id)), what).video is not None:
                self._check_video_support(f"{what} (task {task})")

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def _plan(self, task: str, gen_kwargs: dict[str, Any]) -> _Plan:
        from ..generation import GENERATION_KEYS, decoding_config, parse_generation_args

        gk = {k: v for k, v in dict(gen_kwargs or {}).items() if v is not None}
        until = gk.pop("until", None) or []
        if isinstance(until, str):
            until = [until]
        if not isinstance(until, (list, tuple)) or not all(isinstance(u, str) for u in until):
            raise InputError(f"task {task}: gen_kwargs until={until!r} must be a string or a list of strings")
        ignored = sorted(k for k in gk if k not in GENERATION_KEYS)
        if ignored:
            self._warn_once(
                f"ignored:{task}:{ignored}",
                "task %s: generation settings %s are not implemented by mmfast and are ignored",
                task,
                ", ".join(f"{k}={gk[k]!r}" for k in ignored),
            )
        args = parse_generation_args(
            {k: v for k, v in gk.items() if k in GENERATION_KEYS},
            strict=False,
            model_generation_config=self.mm.model.generation_config,
        )
        recipe_dec = self.recipe.decoding
        max_new = args.max_new_tokens or recipe_dec.max_new_tokens
        if args.decoding is None or recipe_dec.method == "greedy":
            decoder = self.session.decoder_for(None, args.decoding)
        else:  # the recipe names its own decoder: it is kept
            asked = decoding_config(args.decoding, max_new_tokens=recipe_dec.max_new_tokens, seed=recipe_dec.seed)
            if asked != recipe_dec:
                self._warn_once(
                    f"decoder:{task}:{asked.method}:{asked.params!r}",
                    "task %s asks for %s decoding (%s); the recipe's decoder %r is kept (it defines its own token "
                    "rule); use a recipe with the default greedy decoder to follow the task",
                    task,
                    asked.method,
                    ", ".join(f"{k}={v!r}" for k, v in gk.items() if k != "max_new_tokens"),
                    recipe_dec.method,
                )
            decoder = self.session.decoder
        return _Plan(decoder, int(max_new), tuple(until))

    def generate_until(self, requests) -> list[Any]:
        """Answer every request; batches of ``batch_size`` requests with equal task settings.

        With lmms-eval >= 0.7 each answer is its ``GenerationResult`` (text and ``output_tokens``, the
        generated token count, as lmms-eval's own ``llava_hf`` reports); otherwise the text.
        """
        reqs = list(requests)
        self._refuse_video_tasks(reqs)
        out: list[Any] = [None] * len(reqs)
        groups: dict[tuple[str, str, str], list[int]] = {}
        for i, req in enumerate(reqs):
            _, gen_kwargs, _, _, task, split = req.args[:6]
            key = (task, split, json.dumps(gen_kwargs or {}, sort_keys=True, default=repr))
            groups.setdefault(key, []).append(i)
        progress = Progress(len(reqs), f"rank {self.rank} generate_until", report=True, unit="requests")
        t0 = time.perf_counter()
        counts_before = (self.token_counts.requests, self.token_counts.new_tokens, self.token_counts.vision_tokens)
        try:
            for (task, _split, _), idx in groups.items():
                plan = self._plan(task, reqs[idx[0]].args[1])
                idx = sorted(idx, key=lambda i: -len(reqs[i].args[0]))  # longest first: OOMs show at once
                for start in range(0, len(idx), self.batch_size):
                    chunk = idx[start : start + self.batch_size]
                    for i, (text, n_new) in zip(chunk, self._answer([reqs[i] for i in chunk], plan)):
                        out[i] = text if _LMMResult is None else _LMMResult(text, _LMMTokenCounts(output_tokens=n_new))
                        self.cache_hook.add_partial("generate_until", (reqs[i].args[0], reqs[i].args[1]), text)
                    progress.update(len(chunk))
        finally:
            progress.close()
        self.token_counts.seconds += time.perf_counter() - t0
        n = self.token_counts.requests - counts_before[0]
        if n:
            new = self.token_counts.new_tokens - counts_before[1]
            vis = self.token_counts.vision_tokens - counts_before[2]
            logger.info(
                "rank %d generate_until: %d requests, %d new tokens (%.1f per answer), %.1f vision tokens per "
                "request at the LLM input, %.1fs",
                self.rank,
                n,
                new,
                new / n,
                vis / n,
                time.perf_counter() - t0,
            )
        return out

    def _answer(self, chunk: Sequence[Any], plan: _Plan) -> list[tuple[str, int]]:
        """(answer cut at the first stop string, generated token count) per request."""
        images, videos, prompts, meta = [], [], [], []
        for req in chunk:
            context, _, _, doc_id, task, split = req.args[:6]
            ims, video = self._visuals(req)
            if not ims and video is None:
                raise InputError(
                    f"mmfast needs an image or a video per request (doc {doc_id} of {task}/{split} has none)"
                )
            images.append(ims)
            videos.append(video)
            prompts.append(context.replace("<image>", "").strip())
            meta.append({"doc_id": f"{task}/{split}/{doc_id}"})
        has_video = any(v is not None for v in videos)
        batch = self.mm.prepare(images, prompts, meta=meta, videos=videos if has_video else None)
        results = self.session.run(batch, max_new_tokens=plan.max_new_tokens, decoder=plan.decoder)
        texts = []
        for req, res in zip(chunk, results):
            text = res.text
            for stop in plan.until:
                if stop and stop in text:
                    text = text.split(stop)[0]
            texts.append((text, len(res.token_ids)))
            self.token_counts.add(req.args[4], len(res.token_ids), res.n_vision_tokens)
        return texts

    @torch.inference_mode()
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        self._refuse_video_tasks(requests)
        progress = Progress(len(requests), f"rank {self.rank} loglikelihood", report=True, unit="requests")
        try:
            for req in requests:
                context, continuation, _, doc_id, task, split = req.args[:6]
                if callable(continuation):  # lmms-eval passes doc_to_target for some tasks
                    continuation = continuation(self._doc(task, split, doc_id))
                images, video = self._visuals(req)
                prompt = context.replace("<image>", "").strip()
                batch = self.mm.prepare([images], [prompt], videos=None if video is None else [video])
                what = f"loglikelihood request for doc {doc_id} of {task}/{split}"
                if not isinstance(continuation, str):
                    raise InputError(f"{what}: the continuation is a {type(continuation).__name__}, not text")
                cont = self.mm.tokenizer(continuation, add_special_tokens=False)["input_ids"]
                if not cont:  # no token to score: a score of 0 would beat every real option
                    raise InputError(f"{what}: the continuation {continuation!r} has no tokens to score")
                inputs = self.session.build_inputs(batch, self.session.encode(batch))
                ids = torch.tensor([cont], device=inputs.input_ids.device)
                full = inputs.append(ids, self.mm.adapter.embed_tokens(ids))
                _, step = self.session.runner.prefill(full, all_hidden=True)
                logits = self.mm.adapter.lm_head(step.hidden[:, -len(cont) - 1 : -1]).float()  # [1, C, V]
                logp = torch.log_softmax(logits, -1)[0, torch.arange(len(cont)), ids[0]]
                greedy = bool((logits[0].argmax(-1) == ids[0]).all())
                out.append((float(logp.sum()), greedy))
                progress.update(1)
        finally:
            progress.close()
        return out

    def generate_until_multi_round(self, requests) -> list[str]:
        raise NotImplementedError("mmfast answers single-round requests; multi-round lmms-eval tasks are not supported")


def _batch_size(value: int | str) -> int:
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise InputError(
            f"batch_size={value!r}: mmfast needs a positive integer (batch_size=auto is not implemented); answers "
            "do not depend on it, so pick what fits the GPU"
        )
    return int(text)
