"""``apply(model, recipe)``: a session that runs a recipe's methods on a model and restores it on exit.

The session instantiates the recipe's pruning stages, drafter and decoder, lets each install its hooks
through one :class:`~mmfast.hooks.HookSession`, and runs the pipeline

    images -> vision tower (+ tower hooks) -> feature stages -> projector -> spliced LLM inputs
           -> decoder loop (prefill with in-LLM pruning, decode with KV policies / drafts / branches)

Everything it changed is removed by ``close()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .capabilities import (
    Capabilities,
    ModelFacts,
    caps_of,
    check_model,
    check_recipe,
    image_refusal,
    joins_videos,
    static_cache_blocker,
)
from .config import Recipe, from_dict, load_recipe, to_dict
from .context import MethodContext
from .decoding.base import DecodeOutput, Decoder, DecodeRequest, now
from .decoding.loop import Streamer, streaming
from .errors import ConfigError, IncompatibleRecipeError, InputError
from .flops import LMShape
from .generation import BOTH_DECODING_AND_KEYWORDS, KEYWORD_DECODERS, decoding_config, parse_generation_args
from .hooks import AttentionProbe, HookSession
from .inputs import PreparedBatch, VisionItem
from .models.base import LMInputs, VisionBatch
from .models.captured_tower import SELECTION_GRAPHS, CapturedCalls, CapturedTower
from .models.fused_norms import install_fused_norms
from .models.qwen_tower import install_fused_tower
from .pruning._budget import ImageBudget, calibrate_once, calibration_key
from .pruning._video_items import budget_items, join_videos, split_videos
from .registry import DECODERS, DRAFTERS, PRUNERS
from .runtime import CudaGraph, LMRunner
from .speculative.engine import speculative_decode

if TYPE_CHECKING:
    from .model import MMModel

logger = logging.getLogger(__name__)

COMPILE_MODES = ("off", "static", "auto")  # model.compile


@dataclass
class Timings:
    vision_s: float
    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.vision_s + self.prefill_s + self.decode_s


@dataclass
class GenerationResult:
    """One answer with its token accounting and timings (timings are per batch)."""

    text: str
    token_ids: list[int]
    n_vision_tokens: int  # vision tokens at the LLM input
    vision_tokens_layer_avg: float  # layer-averaged vision tokens held in the KV cache after prefill
    kv_bytes_prefill: int
    kv_bytes_end: int
    timings: Timings
    flops_prefill: float = 0.0  # papers' convention, model at hand
    flops_prefill_7b: float = 0.0  # the same token schedule on the LLaVA-1.5-7B shape
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "n_new_tokens": len(self.token_ids),
            "n_vision_tokens": self.n_vision_tokens,
            "vision_tokens_layer_avg": round(self.vision_tokens_layer_avg, 3),
            "kv_bytes_prefill": self.kv_bytes_prefill,
            "kv_bytes_end": self.kv_bytes_end,
            "flops_prefill": self.flops_prefill,
            "flops_prefill_7b": self.flops_prefill_7b,
            "vision_s": round(self.timings.vision_s, 6),
            "prefill_s": round(self.timings.prefill_s, 6),
            "decode_s": round(self.timings.decode_s, 6),
            **({"stats": self.stats} if self.stats else {}),
        }


class Session:
    """A recipe installed on a model. Use as a context manager; see :func:`apply`."""

    def __init__(self, mm: MMModel, recipe: Recipe, *, calibration: Any = None, compile: str | None = None) -> None:
        self.mm = mm
        if compile is not None:  # the Python API's override of model.compile
            if compile not in COMPILE_MODES:
                raise InputError(f"compile={compile!r} is not one of {', '.join(COMPILE_MODES)}")
            recipe = recipe.replace(model=dataclasses.replace(recipe.model, compile=compile))
        self.recipe = recipe
        self._static_refusals: set[str] = set()  # fall-back reasons already logged
        self.adapter = mm.adapter
        self.closed = False  # close() restored the model: the methods no longer run, so nothing may generate
        self.hooks = HookSession(mm.model)
        self.probe = AttentionProbe(self.hooks)
        self.runner = LMRunner(self.adapter, self.hooks)
        self.runner.pad_token_id = int(mm.pad_token_id if mm.pad_token_id is not None else 0)
        self.ctx = MethodContext.of(mm, self.runner, self.probe, self.hooks, self.encode)
        self.ctx.calibration_set = calibration  # what token budgets are calibrated on (None: the default set)
        self.scoring_s = 0.0
        self._call_decoders: dict[str, Decoder] = {}  # per-call decoders (generate(decoding=...)), by spec
        self._decoder: Decoder | None = None  # the decoder of the batch being run
        try:
            problem = check_model(recipe, self.adapter)
            if problem:
                raise IncompatibleRecipeError(f"{problem} (model {mm.name})")
            if recipe.model.fused_vision_attention:
                install_fused_tower(self.adapter, self.hooks)
            if recipe.model.fuse_norms:
                install_fused_norms(self.adapter.language_model, self.hooks)
            # the methods' pure functions of tensors (pruners' selections, beam steps, attention editors' slot
            # classes) are captured graphs where the session captures
            self.ctx.captured = CapturedCalls(
                self.runner,
                self._tower_capture_factory,
                "the methods' selections, beam steps and slot classes run",
                max_graphs=SELECTION_GRAPHS,
            )
            # and the layouts of the layer groups that in-LLM pruning makes (between captured prefill segments)
            self.runner.calls = CapturedCalls(
                self.runner, self._tower_capture_factory, "layer groups are laid out", max_graphs=SELECTION_GRAPHS
            )
            if hasattr(self.adapter, "tower_layers"):  # a fixed-size pixel tower: captured where the session captures
                tower = CapturedTower(self.adapter.vision_tower, self.runner, self._tower_capture_factory)
                self.hooks.set_attr(self.adapter, "tower_graphs", tower)
            self.pruners = [self._make_pruner(i, spec) for i, spec in enumerate(recipe.pruning)]
            self._tower_per_image = [p for p in self.pruners if caps_of(type(p), p.config).tower_per_image]
            # stages that see each video as one item on a model whose frame groups are items (pruning._video_items)
            self._joins = [joins_videos(caps_of(type(p), p.config), self.adapter.features) for p in self.pruners]
            self.decoder = DECODERS.get(recipe.decoding.method).cls(recipe.decoding.params, self.ctx)
            self.drafter = None
            if recipe.speculative is not None:
                self.drafter = DRAFTERS.get(recipe.speculative.method).cls(recipe.speculative.params, self.ctx)
            for i, pruner in enumerate(self.pruners):
                with _recipe_path(f"pruning[{i}].params"):
                    pruner.install()
            stages = [st._to_recipe() for st in recipe.pruning]
            for i, pruner in enumerate(self.pruners):
                if pruner.calibrated and pruner.budget_tokens is not None:
                    calibrate_once(pruner, pruner.budget_tokens, calibration_key(mm.model, stages, i, calibration))
            with _recipe_path("decoding.params"):
                self.decoder.install()
            if self.drafter is not None:
                with _recipe_path("speculative.params"):
                    self.drafter.install()
            self._guard_hf_generate()
        except BaseException:
            self.hooks.close()
            raise

    def _guard_hf_generate(self) -> None:
        """transformers' own ``model.generate`` does not go through the session's pipeline: inside a
        session whose recipe changes anything, calling it warns (once) and runs the unmodified model.
        The wrapper is an instance attribute set through the hook session, so ``close()`` removes it."""
        recipe = self.recipe
        if not recipe.pruning and recipe.speculative is None and recipe.decoding.method == "greedy":
            return
        model = self.mm.model
        original = model.generate
        warned = False
        methods = [st.method for st in recipe.pruning] + [recipe.decoding.method]
        methods += [recipe.speculative.method] if recipe.speculative is not None else []

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            nonlocal warned
            if not warned:
                warned = True
                logger.warning(
                    "model.generate() inside an mmfast session runs the unmodified model: the recipe's methods (%s) "
                    "do not apply to transformers' own generate; call session.generate(images, prompts, ...) (or "
                    "MMModel.generate) to run them",
                    ", ".join(methods),
                )
            return original(*args, **kwargs)

        self.hooks.set_attr(model, "generate", generate)

    def _make_pruner(self, i: int, spec):
        """Instantiate stage ``i`` with its ``budget`` (if any) as a rule per image (``pruning._budget``):
        mapped onto the method's knobs here where every image the stage sees has the same vision-token
        count (the first stage on a model with one count; an infeasible budget is refused now), else per
        image count as the images arrive (a later stage sees what the earlier ones left)."""
        cls = PRUNERS.get(spec.method).cls
        params, tokens, rule, per_image = spec.params, None, None, False
        if spec.budget is not None:
            path = f"pruning[{i}].budget"
            if spec.budget.flops is not None and cls.flops_refused:
                raise ConfigError(f"{path}.flops", f"{spec.method}: {cls.flops_refused}; give budget: {{tokens: N}}")
            rule = ImageBudget(spec.budget, LMShape.of(self.adapter.text_config), path)
            n = self.adapter.n_image_tokens
            if n is not None and i > 0:
                rule.target(n)  # more than the model's images have is refused now; the rest as they arrive
                n = None
            per_image = n is None and cls.budget_per_image and not cls.calibrated
            if not per_image and n is None:  # one tokens budget for images of different counts: no fraction
                rule = dataclasses.replace(rule, fractions=False)
            mapped = None
            if not per_image:
                what = f"{spec.method} on {self.adapter.family}"
                if n is not None:
                    tokens = rule.target(n)
                elif i > 0:
                    tokens = rule.same_for_every_image(what, "images reach this stage with what earlier stages left")
                else:
                    tokens = rule.same_for_every_image(what, "this model's images have different vision-token counts")
                if not cls.calibrated:
                    mapped = rule.knobs(cls, tokens, n, self.adapter, params)
                    params = from_dict(cls.Config, {**to_dict(params), **mapped}, f"pruning[{i}].params")
            logger.info(
                "pruning[%d] %s: budget %s -> %s%s",
                i,
                spec.method,
                spec.budget._to_recipe(),
                f"{tokens} tokens per image" if tokens is not None else "mapped per image on its own vision tokens",
                f" -> {mapped}" if mapped else "",
            )
        pruner = cls(params, self.ctx)
        pruner.budget_tokens = tokens
        pruner.budget_rule = rule
        pruner.maps_per_image = per_image
        pruner.budget_path = f"pruning[{i}].budget"
        return pruner

    def check_budgets(
        self, counts: list[int], batch: PreparedBatch | None = None, *, before_tower: bool = False
    ) -> None:
        """Refuse, before any pruning or LLM compute, a budget that an image of the batch cannot meet:
        every budgeted stage's target against each image's vision tokens (``counts``, out of the tower;
        a stage that sees each video as one item: the video's tokens, from ``batch``'s items), and the first
        stage's per-image mapping (later stages see the tokens earlier ones left, and are checked when
        they run). Models whose images all have one count were checked at installation.

        ``before_tower``: ``counts`` are the adapter's, read from the batch before the tower runs
        (``counts_before_tower``); only ``tokens`` budgets above an item's count are refused from them (what
        the tower's output would refuse too), the rest waits for the tower's counts."""
        if self.adapter.n_image_tokens is not None:
            return
        for i, pruner in enumerate(self.pruners):
            if pruner.budget_rule is None:
                continue
            # what a refusal names fits the whole batch: the most tokens the smallest item has, then (the largest item
            # first) an in-LLM method's smallest feasible budget, which grows with the count
            items = sorted(set(budget_items(counts, batch, self._joins[i])))
            for n, item in items:
                pruner.budget_rule.budget.check_fits(n, pruner.budget_rule.path, item, pruner.budget_rule.fractions)
            if before_tower:
                continue
            for n, item in reversed(items):
                pruner.budget_rule.target(n, item)
                if i == 0:
                    pruner.config_for(n)

    # -- pipeline stages -----------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, batch: PreparedBatch) -> VisionBatch:
        """Vision tower + feature-stage pruners (pre-projection). The tower's untouched output is kept
        in ``vision.raw`` (DAMRO's outlier branch reads it)."""
        self.probe.clear()
        before = self.adapter.counts_before_tower(batch)
        if before is not None:  # a budget no item can meet is refused before the tower runs
            self.check_budgets(before, batch, before_tower=True)
        items = batch.items or None
        if batch.pixel_values.shape[0] > 1 and any(p.tower_per_image() for p in self._tower_per_image):
            sizes = batch.image_sizes
            vision = VisionBatch.concat(
                [
                    self._tower(
                        batch.pixel_values[i : i + 1],
                        None if sizes is None else sizes[i : i + 1],
                        None if items is None else items[i : i + 1],
                    )
                    for i in range(batch.pixel_values.shape[0])
                ]
            )
        else:
            vision = self._tower(batch.pixel_values, batch.image_sizes, items)
        self.check_budgets(vision.counts(), batch)
        raw = dataclasses.replace(
            vision, features=list(vision.features), patch_ids=list(vision.patch_ids), tags={}, stats={}
        )
        for pruner, joins in zip(self.pruners, self._joins):
            t0 = time.perf_counter()
            if joins and batch.has_video:  # each video's frame-group items as one item for this stage
                joined = join_videos(vision, batch, self.adapter.project)
                vision = split_videos(joined, pruner.prune_vision(joined.vision, joined.batch))
            else:
                vision = pruner.prune_vision(vision, batch)
            self.scoring_s += time.perf_counter() - t0
        vision.raw = raw
        return vision

    def _tower(
        self, pixel_values: torch.Tensor, image_sizes: torch.Tensor | None, items: list[VisionItem] | None = None
    ) -> VisionBatch:
        if items:  # a batch with a video: the adapter's video path
            vision = self.adapter.encode_images(pixel_values, image_sizes=image_sizes, items=items)
        else:
            vision = self.adapter.encode_images(pixel_values, image_sizes=image_sizes)
        for method in (*self.pruners, self._decoder or self.decoder):
            method.observe_tower(vision)
        return vision

    def build_inputs(
        self, batch: PreparedBatch, vision: VisionBatch, token_ids: list[list[int]] | None = None
    ) -> LMInputs:
        """Project the (pruned) features and splice them into the prompts."""
        return self.ctx.build_inputs(batch, vision, token_ids)

    def text_only_inputs(self, batch: PreparedBatch) -> LMInputs:
        return self.ctx.text_only_inputs(batch)

    def reprompt(self, batch: PreparedBatch, prompts: list[str]) -> PreparedBatch:
        return self.ctx.reprompt(batch, prompts)

    @property
    def context_length(self) -> int | None:
        """The LLM's context (``text_config.max_position_embeddings``), or None when it declares none."""
        n = getattr(self.adapter.text_config, "max_position_embeddings", None)
        return int(n) if n else None

    def check_context(self, batch: PreparedBatch, max_new: int, inputs: LMInputs | None = None) -> None:
        """Refuse samples whose prompt (text + vision tokens) plus ``max_new`` new tokens exceed the
        LLM's context, saying by how much. Without ``inputs`` only the text tokens are counted (a
        check before the vision tower runs); with them, the spliced inputs as the LLM will see them."""
        limit = self.context_length
        if limit is None:
            return
        problems = []
        if inputs is not None:  # [2][B] vision and real tokens of each sample: one read
            used = inputs.attention_mask.bool()
            counts = torch.stack([(inputs.image_mask.bool() & used).sum(1), used.sum(1)]).tolist()
        for b in range(batch.batch_size):
            n_images = sum(1 for owner in batch.image_owner if owner == b)
            if inputs is None:
                text, vision = len(batch.token_ids[b]) - n_images, 0
            else:
                vision, text = counts[0][b], counts[1][b] - counts[0][b]
            total = text + vision + max_new
            if total > limit:
                problems.append(
                    f"sample {b}: {text} text + {vision} vision tokens ({_what(batch, b)}) + {max_new} new tokens = "
                    f"{total}, {total - limit} over"
                )
        if problems:
            raise InputError(
                f"input longer than the context of {self.mm.name} ({limit} tokens): {'; '.join(problems)}; "
                "shorten the prompt, pass fewer images (or frames: num_frames=), lower max_new_tokens, or prune "
                "vision tokens"
            )

    # -- generation ------------------------------------------------------------------------------
    def generate(
        self,
        images: Sequence[Any] | Any,
        prompts: Sequence[str] | str,
        *,
        max_new_tokens: int | None = None,
        seed: int | None = None,
        meta: Sequence[dict] | None = None,
        decoding: str | dict[str, Any] | None = None,
        generation_config: Any = None,
        streamer: Streamer | None = None,
        videos: Sequence[Any] | Any = None,
        num_frames: int | None = None,
        fps: float | None = None,
        video_fps: float | None = None,
        **generation_kwargs: Any,
    ) -> list[GenerationResult]:
        """Answer ``prompts`` about ``images`` (and ``videos``) with the recipe's methods.

        Args:
            images: one image (PIL image or path) per prompt, or a list of images per prompt (None:
                no image, with ``videos``).
            prompts: one string or a list (one per sample); the chat template is applied.
            max_new_tokens: tokens to generate (default: the recipe's ``decoding.max_new_tokens``).
            seed: sampling seed, a whole number >= 0 (default: the recipe's ``decoding.seed``); the same seed
                gives the same answers. With neither, each call draws its seed from torch's global generator, as
                transformers' ``generate`` samples from it: calls differ, and ``torch.manual_seed(n)``
                before them repeats them (greedy and beam calls without pruning or a drafter draw nothing from it,
                as transformers' greedy search). (Evaluations and benches use ``decoding.seed``, 0 when unset.)
                Each sample draws from its own stream, seeded by the seed and the sample itself (its
                ``doc_id``, else its prompt and image), so its answer does not depend on the batch: the same
                prompt and image twice in one batch give the same sample twice. To draw n samples of one
                input, call with n seeds.
            meta: per-sample dicts; ``meta[b]["doc_id"]`` fixes the sample's random stream.
            decoding: a decoder for this call instead of the recipe's: a name (``"beam"``) or
                ``{"method": "vcd", "params": {...}}``. Decoders that install hooks (OPERA, VHR, DAMRO)
                must be in the recipe (or use :meth:`mmfast.MMModel.generate`, which opens a session per call).
            generation_config: a ``transformers.GenerationConfig`` (see below).
            streamer: an object with ``put`` / ``end`` (e.g. ``transformers.TextStreamer(tokenizer,
                skip_prompt=True)``): gets the prompt ids ``[B, L]`` first, then each step's tokens ``[B]``,
                then ``end()``, as in transformers. Not with beam searches or a drafter.
            videos: one video per prompt (None for none): a list of frames (PIL images or paths), a uint8
                array [T, H, W, 3] or a directory of frames; with a single prompt string, that prompt's
                video. Qwen2-VL, Qwen2.5-VL, Qwen3-VL and LLaVA-OneVision only (:mod:`mmfast.video`).
            num_frames, fps: sample that many frames, or that many per second of ``video_fps``, as
                transformers' video processors do (default: every frame).
            video_fps: frames per second of the given frames (the processors assume 24 without it).
            **generation_kwargs: transformers' ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
                ``num_beams``, ``length_penalty``: they choose greedy, sample or beam with transformers'
                semantics (:mod:`mmfast.generation`; values they leave unset come from the model's
                ``generation_config``, as in transformers); refused when the recipe's decoder has its own
                token rule (VCD, ...) -- pass ``decoding=`` to replace it. Without them (and without
                ``generation_config=``) the recipe's decoder runs, whatever the model's ``generation_config``
                says (mmfast's default recipe decodes greedily).

        Returns:
            One :class:`GenerationResult` per prompt.
        """
        self._check_open()
        _check_seed(seed)
        args = parse_generation_args(
            generation_kwargs, generation_config, model_generation_config=self.mm.model.generation_config
        )
        decoder = self.decoder_for(decoding, args.decoding)
        if max_new_tokens is None:
            max_new_tokens = args.max_new_tokens
        batch = self.mm.prepare(
            images, prompts, meta=meta, videos=videos, num_frames=num_frames, fps=fps, video_fps=video_fps
        )
        # follow torch's global RNG (torch.manual_seed); a call that draws nothing (greedy or beam, no pruning, no
        # drafter) leaves it alone, as transformers' greedy generate does
        draws = self.pruners or self.drafter is not None or decoder.name not in ("greedy", "beam")
        if seed is None and self.recipe.decoding.seed is None and draws:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        return self.run(batch, max_new_tokens=max_new_tokens, seed=seed, decoder=decoder, streamer=streamer)

    def decoder_for(self, decoding: str | dict[str, Any] | None, keywords: dict[str, Any] | None = None) -> Decoder:
        """The decoder a call asks for: the recipe's, ``decoding=`` (a name or ``{method, params}``), or
        greedy / sample / beam from generation keywords (``keywords``, from
        :func:`~mmfast.generation.parse_generation_args`). Checked against the recipe's other methods and
        the model like a recipe; built once per distinct setting."""
        recipe_dec = self.recipe.decoding
        if decoding is not None and keywords is not None:
            raise InputError(BOTH_DECODING_AND_KEYWORDS)
        if decoding is None and keywords is None:
            return self.decoder
        if decoding is None and recipe_dec.method not in KEYWORD_DECODERS:
            raise InputError(
                f"the recipe decodes with {recipe_dec.method!r}, which has its own token rule; generation keywords "
                f"choose among {', '.join(sorted(KEYWORD_DECODERS))}: set the decoder's parameters in the recipe "
                f"(decoding.params), or pass decoding= to replace it for this call"
            )
        cfg = decoding_config(
            decoding if decoding is not None else keywords,
            max_new_tokens=recipe_dec.max_new_tokens,
            seed=recipe_dec.seed,
        )
        if cfg == recipe_dec:
            return self.decoder
        key = repr((cfg.method, cfg.params))
        if key in self._call_decoders:
            return self._call_decoders[key]
        cls = DECODERS.get(cfg.method).cls
        if cls.install is not Decoder.install:
            raise IncompatibleRecipeError(
                f"decoder {cfg.method!r} installs hooks on the model, which a session does when it opens; put it in "
                f"the recipe (decoding: {cfg.method}) or call MMModel.generate(..., decoding=...), which opens a "
                "session per call"
            )
        trial = self.recipe.replace(decoding=cfg)
        problem = check_recipe(trial) or check_model(trial, self.adapter)
        if problem:
            raise IncompatibleRecipeError(f"decoding={cfg.method!r} for this call: {problem} (model {self.mm.name})")
        decoder = cls(cfg.params, self.ctx)
        self._call_decoders[key] = decoder
        return decoder

    def run(
        self,
        batch: PreparedBatch,
        *,
        max_new_tokens: int | None = None,
        seed: int | None = None,
        decoder: Decoder | None = None,
        streamer: Streamer | None = None,
    ) -> list[GenerationResult]:
        """Run one prepared batch end to end (see :meth:`generate` for the arguments); ``decoder``
        replaces the recipe's for this batch (build it with :meth:`decoder_for`)."""
        self._check_open()
        _check_seed(seed)
        decoder = decoder or self.decoder
        max_new = self.recipe.decoding.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new!r}")
        if seed is None:
            seed = self.recipe.decoding.seed or 0
        device = self.mm.device
        self.scoring_s = self.runner.scoring_s = self.probe.time_s = self.runner.capture_s = 0.0
        if batch.has_video:
            for where, caps in self._method_caps(decoder):
                if caps.images_only:
                    raise IncompatibleRecipeError(
                        f"{where} takes images only ({caps.images_only}); pass the video without it, or its frames "
                        "as images"
                    )
        else:
            for where, caps in self._method_caps(decoder):
                if caps.videos_only:
                    raise IncompatibleRecipeError(
                        f"{where} needs a video ({caps.videos_only}); pass videos=..., or use an image pruner "
                        "(e.g. divprune, fastv) for images"
                    )
        if any(not batch.item(i).is_video for i in range(len(batch.image_owner))):
            facts = ModelFacts.of_adapter(self.adapter)
            for where, caps in self._method_caps(decoder):
                problem = image_refusal(where, caps, facts)
                if problem:
                    raise IncompatibleRecipeError(problem)
        self.check_context(batch, max_new)  # the text alone, before the vision tower runs
        t0 = now(device)
        self._decoder = decoder  # observes the tower (DAMRO) for this batch
        try:
            vision = self.encode(batch)
        finally:
            self._decoder = None
        inputs = self.build_inputs(batch, vision)
        self.check_context(batch, max_new, inputs)  # text + vision tokens, before the LLM runs
        t1 = now(device)
        req = DecodeRequest(batch, vision, inputs, max_new, seed, vision.raw)
        if streamer is not None:
            self._check_streamable(decoder, streamer)
            streamer.put(_padded(batch.token_ids, self.mm.pad_token_id))  # the prompt first, as transformers does
            with streaming(streamer) as streamed:
                out = self._decode(req, decoder)
            if streamed[0] == 0:
                raise IncompatibleRecipeError(
                    f"decoder {decoder.name!r} did not run the decode driver, so nothing was streamed; call without "
                    "streamer= (mmfast bug: its capabilities should say it cannot stream)"
                )
            streamer.end()
        else:
            out = self._decode(req, decoder)
        timings = Timings(t1 - t0, out.prefill_s, out.decode_s)
        stats = dict(out.stats)
        if self.pruners:
            # time spent deciding what to drop (probe rows + selection), per batch
            stats["scoring_s"] = round(self.scoring_s + self.runner.scoring_s + self.probe.time_s, 6)
        if self.runner.capture_s:  # inside decode_s: capturing this batch's step graphs (model.compile: auto)
            stats["capture_s"] = round(self.runner.capture_s, 6)
        for name in dict.fromkeys([*vision.stats, *out.method_stats]):
            stats[name] = {**vision.stats.get(name, {}), **out.method_stats.get(name, {})}
        for pruner in self.pruners:  # calibrated thresholds and the tokens they kept on the calibration set
            if pruner.calibration is not None:
                stats[pruner.name] = {**stats.get(pruner.name, {}), "calibration": pruner.calibration.as_stats()}
        n_vis = inputs.n_vision_tokens()
        results = []
        for b, toks in enumerate(out.tokens):
            text = self.mm.tokenizer.decode(toks, skip_special_tokens=True).strip()
            results.append(
                GenerationResult(
                    text=text,
                    token_ids=toks,
                    n_vision_tokens=int(n_vis[b]),
                    vision_tokens_layer_avg=float(out.vision_tokens_layer_avg[b])
                    if out.vision_tokens_layer_avg
                    else float(n_vis[b]),
                    kv_bytes_prefill=int(out.kv_bytes_prefill[b]) if out.kv_bytes_prefill else 0,
                    kv_bytes_end=int(out.kv_bytes_end[b]) if out.kv_bytes_end else 0,
                    timings=timings,
                    flops_prefill=float(out.flops_prefill[b]) if out.flops_prefill else 0.0,
                    flops_prefill_7b=float(out.flops_prefill_7b[b]) if out.flops_prefill_7b else 0.0,
                    stats=_sample_stats(stats, b),
                )
            )
        return results

    def _decode(self, req: DecodeRequest, decoder: Decoder) -> DecodeOutput:
        reserve = self._static_reserve(req, decoder)
        factory = self._capture_factory() if reserve is not None else None
        self.ctx.decoding = decoder  # a recipe decoder's forward edits step aside for another call's (PAI)
        try:
            with self.runner.static_cache(reserve, factory, decodes=req.max_new_tokens > 1):
                if self.drafter is not None:  # lossless draft-and-verify in the decoder's own token choice
                    return speculative_decode(self.ctx, self.drafter, req, decoder.sampling())
                return decoder.decode(req)
        finally:
            self.ctx.decoding = None

    def _captures(self) -> bool:
        """``model.compile: auto`` on CUDA: static steps are captured graphs."""
        return self.recipe.model.compile == "auto" and self.ctx.device.type == "cuda"

    def _capture_factory(self):
        """The step-graph factory of ``model.compile: auto`` on CUDA (None: eager static steps)."""
        return CudaGraph if self._captures() else None

    def _tower_capture_factory(self):
        """The graph factory of this call outside the LLM's steps (the vision tower, the methods' selections):
        the steps', unless ``model.compile`` is off."""
        return None if self.recipe.model.compile == "off" else self._capture_factory()

    def _method_caps(self, decoder: Decoder) -> list[tuple[str, Capabilities]]:
        """(where, capabilities) of the recipe's stages, ``decoder`` and the drafter."""
        methods = [
            (f"pruning[{i}] ({st.method})", caps_of(type(p), p.config))
            for i, (st, p) in enumerate(zip(self.recipe.pruning, self.pruners))
        ]
        methods.append((f"decoding ({decoder.name})", caps_of(type(decoder), decoder.config)))
        if self.drafter is not None:
            methods.append((f"speculative ({self.drafter.name})", caps_of(type(self.drafter), self.drafter.config)))
        return methods

    def _static_reserve(self, req: DecodeRequest, decoder: Decoder) -> int | None:
        """Free slots per layer of a static KV cache for this call (``model.compile``), or None for the
        dynamic cache; a method that needs the dynamic step makes it fall back, logged once per reason."""
        mode = self.recipe.model.compile
        if mode == "off" or (mode == "auto" and not self._captures()):
            return None
        methods = self._method_caps(decoder)
        reason = static_cache_blocker(methods)
        if reason is None and mode == "auto":  # eager static steps gain nothing over the dynamic cache
            blocker = self.runner.capture_blocker()
            if blocker is not None and req.max_new_tokens == 1 and self.runner.prefill_graph_blocker() is None:
                blocker = None  # no decode step: the one-token call gains the captured prefill (TTFT) and loses nothing
            if blocker is not None:  # the method that declared it, and why (Capabilities.eager_decode)
                declared = next((f"; {where}: {c.eager_decode}" for where, c in methods if c.eager_decode), "")
                reason = f"no captured graph: {blocker}{declared}"
        if reason is not None:
            if reason not in self._static_refusals:
                self._static_refusals.add(reason)
                logger.info("model.compile: %s: decoding on the dynamic KV cache (%s)", mode, reason)
            return None
        # every generated token, plus the most a verify step (its tree and root) or a decoder's look-ahead appends
        # before its rollback
        step = decoder.max_step_tokens() if self.drafter is None else self.drafter.max_step_tokens()
        return req.max_new_tokens + (step or 1)

    def _check_streamable(self, decoder: Decoder, streamer: Any) -> None:
        if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
            raise InputError(
                f"streamer is a {type(streamer).__name__} without put() and end(); pass e.g. "
                "transformers.TextStreamer(mm.tokenizer, skip_prompt=True)"
            )
        if self.drafter is not None:
            raise IncompatibleRecipeError(
                f"speculative decoding ({self.recipe.speculative.method}) commits several tokens per verification "
                "and does not stream; remove the speculative section to stream"
            )
        search = caps_of(type(decoder), decoder.config).search
        if search not in ("single", "branches"):
            raise IncompatibleRecipeError(
                f"decoder {decoder.name!r} searches with '{search}': its tokens are final only when the search "
                "ends, so it cannot stream; use greedy, sample or a contrastive decoder to stream"
            )

    # -- lifetime --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise InputError(
                f"this session of recipe {self.recipe.name!r} is closed (its methods were removed from the model); "
                "generate inside its `with` block, or open a new one with mmfast.apply(mm, recipe)"
            )

    def close(self) -> None:
        self.closed = True
        self.runner.release()
        if isinstance(self.ctx.captured, CapturedCalls):
            self.ctx.captured.graphs.clear()  # their memory goes with the session, as the runner's
        self.hooks.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_seed(seed: Any) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise InputError(f"seed must be a whole number >= 0 (or None), got {seed!r}")


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    """Left-padded ``[B, L]`` token ids."""
    width = max(len(r) for r in rows)
    return torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)


@contextlib.contextmanager
def _recipe_path(prefix: str) -> Iterator[None]:
    """Methods name the parameter a ConfigError is about; the session adds where it sits in the recipe (a path
    already in the recipe, such as a stage's ``Pruner.setting_path``, ``pruning[0].budget.tokens``, stays)."""
    try:
        yield
    except ConfigError as exc:
        if exc.path.startswith(prefix.split(".")[0] + "."):
            raise
        raise ConfigError(f"{prefix}.{exc.path}" if exc.path else prefix, exc.detail, exc.source) from None


def _sample_stats(stats: dict[str, Any], b: int) -> dict[str, Any]:
    """Per-sample view of batch stats: lists keyed ``per_sample`` are indexed, the rest shared."""
    out = {}
    for k, v in stats.items():
        if isinstance(v, dict):
            out[k] = _sample_stats(v, b)
        elif str(k).startswith("per_sample_") and isinstance(v, list):
            # a stage that ran on sub-batches (speculative decoding serves one sample at a time)
            # reports only its last one: other samples get no value rather than a wrong one
            out[str(k).removeprefix("per_sample_")] = v[b] if len(v) > b else None
        else:
            out[k] = v
    return out


def apply(
    mm: MMModel, recipe: Recipe | str | dict | None = None, *, calibration: Any = None, compile: str | None = None
) -> Session:
    """Install ``recipe`` on ``mm`` and return the session (a context manager that restores the model).

    ``calibration``: a ``pruning._budget.CalibrationSet`` that token budgets of threshold methods are
    calibrated on (an evaluation passes a spread of its own samples); None: the default world set.
    ``compile``: ``off`` | ``static`` | ``auto``, replacing the recipe's ``model.compile`` (None keeps it).
    The recipe's other ``model`` keys (name, dtype, device, ...) are not applied: the methods run on ``mm`` as it
    was loaded (``mmfast.load`` takes them; ``mmfast eval`` / ``run`` load the recipe's model)."""
    if not hasattr(mm, "adapter"):  # a transformers model (or anything else) rather than mmfast.load's MMModel
        raise InputError(
            f"mmfast.apply takes the MMModel mmfast.load returns, got a {type(mm).__name__}; wrap a loaded "
            "transformers model first: mm = mmfast.load(model, processor=processor), then mmfast.apply(mm, recipe)"
        )
    if recipe is None:
        recipe = Recipe()
    elif not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    return Session(mm, recipe, calibration=calibration, compile=compile)


def _what(batch: PreparedBatch, b: int) -> str:
    """``"2 image(s)"``, or ``"1 image(s), a video of 8 frames"`` for a sample with a video."""
    clip = batch.videos[b] if b < len(batch.videos) else None
    n = len(batch.images[b])
    return f"{n} image(s)" if clip is None else f"{n} image(s), a video of {len(clip.frames)} frames"
