"""``mmfast.load`` and ``MMModel``: a LLaVA checkpoint plus its processor, ready for recipes.

``load`` accepts an embedded model name (``mmfast/tiny-world``, shipped inside the package), a local
directory written by ``save_pretrained``, or a hub id. It never hangs on an unreachable hub: cached
files are used first, and otherwise a short connectivity check turns a network problem into a clear
error that says what to do.
"""

from __future__ import annotations

import json
import logging
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from jinja2 import TemplateError
from safetensors import SafetensorError

from .checkpoint import ASSETS, DEFAULT_MODEL, EMBEDDED, _resolve  # noqa: F401 (re-exported)
from .config import DEVICE_MAP_STRATEGIES, ModelConfig, Recipe, load_recipe
from .errors import InputError, ModelLoadError
from .generation import BOTH_DECODING_AND_KEYWORDS, GENERATION_KEYS, decoding_config, parse_generation_args
from .inputs import PreparedBatch, VideoClip, open_image  # noqa: F401 (re-exported)
from .models import adapter_for
from .models._video import VideoSettings, video_settings
from .models.base import VideoItems
from .pipeline import GenerationResult, apply
from .video import VideoSampling, open_video, with_videos

logger = logging.getLogger(__name__)

ImageLike = "Image.Image | str | os.PathLike"


def _check_prompt_text(prompt: Any, b: int) -> None:
    """A prompt must be a string that is valid Unicode (no lone surrogates from undecodable bytes)."""
    if not isinstance(prompt, str):
        raise InputError(f"prompt {b} is a {type(prompt).__name__}, not a string")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"prompt {b} is not valid UTF-8 text (undecodable byte at character {exc.start}); pass the prompt as "
            "UTF-8 (check the terminal or file encoding)"
        ) from None


class MMModel:
    """A LLaVA-family model, its processor and its adapter."""

    def __init__(self, model, processor, name: str) -> None:
        self.model = model.eval()
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.adapter = adapter_for(model)
        self.name = name
        self._video_settings: VideoSettings | None = None
        gen = model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_token_ids: list[int] = list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = int(pad if pad is not None else self.eos_token_ids[0])

    @property
    def device(self) -> torch.device:
        return self.adapter.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.lm_head.weight.dtype

    # -- inputs --------------------------------------------------------------------------------
    def chat_text(self, prompt: str, n_images: int = 1, n_videos: int = 0) -> str:
        """The chat-templated text for one user turn with ``n_videos`` videos and ``n_images`` images first."""
        content = [{"type": "video"} for _ in range(n_videos)] + [{"type": "image"} for _ in range(n_images)]
        conv = [{"role": "user", "content": [*content, {"type": "text", "text": prompt}]}]
        return self.processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)

    @property
    def video_settings(self) -> VideoSettings:
        """How this checkpoint's video processor treats frames (:func:`mmfast.models._video.video_settings`)."""
        if self._video_settings is None:
            self._video_settings = video_settings(self.processor, self.name)
            logger.info("video frames: settings from the %s", self._video_settings.source)
        return self._video_settings

    def prepare(
        self,
        images: Sequence[Any] | Any,
        prompts: Sequence[str] | str,
        *,
        texts: Sequence[str] | None = None,
        meta: Sequence[dict] | None = None,
        videos: Sequence[Any] | Any = None,
        num_frames: int | None = None,
        fps: float | None = None,
        video_fps: float | None = None,
    ) -> PreparedBatch:
        """Open images (and videos), apply the chat template, tokenise, and run the image processor.

        ``images[b]`` is one image or a list of images (several frames) for prompt ``b`` (None: no
        image). ``videos[b]`` is prompt ``b``'s video or None (see :meth:`Session.generate
        <mmfast.pipeline.Session.generate>`); ``num_frames`` / ``fps`` / ``video_fps`` sample it.
        ``texts`` bypasses the chat template (already templated strings with image tokens; images only).
        """
        single = isinstance(prompts, str)
        if single:
            prompts = [prompts]
        elif not hasattr(prompts, "__len__"):  # a PIL image (arguments swapped), a generator
            swapped = " (images and prompts swapped? the images come first)" if isinstance(images, str) else ""
            raise InputError(f"prompts is a string or a list of strings, got {type(prompts).__name__}{swapped}")
        if not prompts:
            raise InputError("no prompts: pass at least one prompt (and its image or video)")
        if images is None:
            images = [None] * len(prompts)
        if not isinstance(images, (list, tuple)):
            images = [images]
        if len(images) != len(prompts):
            raise InputError(
                f"got {len(images)} images for {len(prompts)} prompts; pass one image (or list) per prompt"
            )
        for b, prompt in enumerate(prompts):
            _check_prompt_text(prompt, b)
        if single and isinstance(meta, dict):
            meta = [meta]
        if meta is not None and (
            not isinstance(meta, (list, tuple))
            or len(meta) != len(prompts)
            or not all(isinstance(m, dict) for m in meta)
        ):
            raise InputError(
                f"meta is one dict per prompt ({len(prompts)} here, e.g. [{{'doc_id': ...}}]); got {meta!r:.120}"
            )
        per_sample = [
            [open_image(im) for im in (x if isinstance(x, (list, tuple)) else [x])] if x is not None else []
            for x in images
        ]
        clips = self._open_videos(videos, len(prompts), single, VideoSampling(num_frames, fps, video_fps))
        if clips is not None and texts is not None:
            raise InputError("texts= (pre-templated prompts) is for images only; pass videos with plain prompts")
        # every sample needs an image or a video (with videos=, a None video and no image is a text-only sample,
        # which the vision path cannot take either: refused here, not deep in the pixel packing)
        bare = [b for b, ims in enumerate(per_sample) if not ims and (clips is None or clips[b] is None)]
        if bare:
            raise InputError(f"prompt {bare[0]} has no image; pass an image (or a video, videos=) per prompt")
        vids = [None if c is None else self.adapter.video_items(c, 0, self.video_settings) for c in clips or []]
        if texts is not None:
            given = texts
            if isinstance(given, str):  # one prompt's text (with a single prompt), never its characters
                texts = [given] if single else []
            else:
                texts = list(given)
            if len(texts) != len(prompts) or not all(isinstance(t, str) for t in texts):
                raise InputError(
                    f"texts= is a list of templated strings, one per prompt ({len(prompts)} here); got {given!r:.120}"
                )
        elif clips is None:
            texts = [self.chat_text(p, len(ims)) for p, ims in zip(prompts, per_sample)]
        else:
            texts = [
                self._video_text(b, p, len(ims), v) for b, (p, ims, v) in enumerate(zip(prompts, per_sample, vids))
            ]
        token_ids = [self.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
        image_id = self.adapter.image_token_id
        video_id = self.adapter.video_token_id if self.adapter.supports_video else None
        for b, (ids, ims) in enumerate(zip(token_ids, per_sample)):
            n_slots = sum(1 for t in ids if t == image_id)
            if n_slots != len(ims):
                token = self.tokenizer.convert_ids_to_tokens(image_id)
                raise InputError(
                    f"prompt {b} has {n_slots} image placeholders {token!r} for {len(ims)} image(s): the prompt text "
                    f"must not contain {token!r} (images are passed separately and placed by the chat template); "
                    "remove it from the prompt"
                )
            n_video = 0 if clips is None or vids[b] is None else len(vids[b].items)
            if video_id is not None and sum(1 for t in ids if t == video_id) != n_video:
                token = self.tokenizer.convert_ids_to_tokens(video_id)
                raise InputError(
                    f"prompt {b} contains the video placeholder {token!r}; remove it (videos are passed with videos=)"
                )
        flat = [im for ims in per_sample for im in ims]
        pixel_values, image_sizes = (None, None)
        if flat:
            processed = self.image_processor(images=flat, return_tensors="pt")
            pixel_values, image_sizes = self.adapter.pack_pixels(processed)
        if clips is None:
            owner = [b for b, ims in enumerate(per_sample) for _ in ims]
            return PreparedBatch(
                per_sample, list(prompts), texts, token_ids, pixel_values, owner, list(meta or []), image_sizes
            )
        self._check_video_context(token_ids, vids)
        return with_videos(
            PreparedBatch(per_sample, list(prompts), texts, token_ids, pixel_values, [], list(meta or []), image_sizes),
            clips,
            vids,
            self.adapter,
        )

    def _video_text(self, b: int, prompt: str, n_images: int, video: VideoItems | None) -> str:
        """Sample ``b``'s templated text, its video placeholder replaced by the family's video text."""
        text = self.chat_text(prompt, n_images, 0 if video is None else 1)
        if video is None:
            return text
        placeholder = self.adapter.video_token
        if text.count(placeholder) != 1:
            raise InputError(
                f"the chat template of {self.name} renders no {placeholder!r} for a video (prompt {b}); use the "
                "checkpoint's own processor, whose template has video content"
            )
        return text.replace(placeholder, video.text)

    def _open_videos(
        self, videos: Any, n_prompts: int, single: bool, sampling: VideoSampling
    ) -> list[VideoClip | None] | None:
        """Per-sample clips, or None without videos; refuses video on a family without it."""
        if videos is None:
            if any(v is not None for v in (sampling.num_frames, sampling.fps, sampling.video_fps)):
                raise InputError("num_frames / fps / video_fps sample videos; pass videos= too (or drop them)")
            return None
        adapter = self.adapter
        if not adapter.supports_video:
            raise InputError(
                f"{self.name} is a {adapter.family} model, which has no video input; {adapter.video_alternative}"
            )
        per = [videos] if single else videos
        if not isinstance(per, (list, tuple)) or len(per) != n_prompts:
            raise InputError(
                f"videos= needs one video (or None) per prompt: {n_prompts} prompt(s), got "
                f"{len(per) if isinstance(per, (list, tuple)) else type(per).__name__}"
            )
        rule = adapter.frame_rule(self.video_settings)
        return [None if v is None else open_video(v, sampling, rule, f"video {b}") for b, v in enumerate(per)]

    def _check_video_context(self, token_ids: list[list[int]], vids: list[VideoItems | None]) -> None:
        """Refuse a video whose tokens (the processor's count) with the prompt exceed the LLM's context."""
        limit = getattr(self.adapter.text_config, "max_position_embeddings", None)
        if not limit:
            return
        for b, (ids, v) in enumerate(zip(token_ids, vids)):
            if v is None:
                continue
            total = len(ids) - len(v.items) + v.tokens
            if total > limit:
                raise InputError(
                    f"video {b}: {v.n_frames} frames make {v.tokens} vision tokens; with the prompt that is "
                    f"{total} tokens, over the context of {self.name} ({limit}); sample fewer frames (num_frames=) "
                    "or pass smaller frames"
                )

    # -- generation ----------------------------------------------------------------------------
    def generate(
        self,
        images: Sequence[Any] | Any,
        prompts: Sequence[str] | str,
        recipe: Recipe | str | dict | None = None,
        *,
        decoding: str | dict[str, Any] | None = None,
        compile: str | None = None,
        **generation_kwargs: Any,
    ) -> list[GenerationResult]:
        """Answer ``prompts`` about ``images`` with the recipe's methods (plain greedy without one).

        Opens a session for ``recipe`` (:func:`mmfast.apply`), generates, and restores the model.

        Args:
            images: one image (PIL image or path) per prompt, or a list of images per prompt.
            prompts: one string or a list of strings.
            recipe: a :class:`~mmfast.config.Recipe`, a recipe file or shipped recipe name, or a mapping.
            decoding: a decoder replacing the recipe's for this call: a name (``"opera"``) or
                ``{"method": "vcd", "params": {"alpha": 1.0}}``; any registered decoder, including those
                that install hooks.
            compile: ``off`` | ``static`` | ``auto``, replacing the recipe's ``model.compile`` for this
                call (the static KV cache and captured decode steps; docs/methods.md).
            **generation_kwargs: ``videos`` (one video per prompt: frames, a uint8 array or a directory;
                Qwen-VL families and LLaVA-OneVision) with ``num_frames`` / ``fps`` / ``video_fps``,
                ``max_new_tokens``, ``seed``, ``meta``, ``streamer``,
                ``generation_config`` and transformers' ``do_sample`` / ``temperature`` / ``top_k`` /
                ``top_p`` / ``num_beams`` / ``length_penalty``; see :meth:`mmfast.pipeline.Session.generate`.

        Returns:
            One :class:`~mmfast.pipeline.GenerationResult` per prompt.
        """
        if decoding is not None:  # folded into the recipe, so decoders that install hooks work too
            # the search keywords would pick greedy / sample / beam over the folded decoder: refused, as in a session
            search = {k: v for k, v in generation_kwargs.items() if k in GENERATION_KEYS}
            config = generation_kwargs.get("generation_config")
            if parse_generation_args(search, config, model_generation_config=self.model.generation_config).decoding:
                raise InputError(BOTH_DECODING_AND_KEYWORDS)
            resolved = recipe if isinstance(recipe, Recipe) else load_recipe(recipe if recipe is not None else {})
            base = resolved.decoding
            recipe = resolved.replace(
                decoding=decoding_config(decoding, max_new_tokens=base.max_new_tokens, seed=base.seed)
            )
        with apply(self, recipe, compile=compile) as session:
            return session.generate(images, prompts, **generation_kwargs)


def load_model(cfg, *, device: str | None = None) -> MMModel:
    """Load the model a recipe's ``model`` section describes (device placement and offload included)."""
    extra: dict[str, Any] = {}
    if cfg.offload_folder:
        extra["offload_folder"] = cfg.offload_folder
    if cfg.max_memory:
        extra["max_memory"] = {int(k) if str(k).isdigit() else k: v for k, v in cfg.max_memory.items()}
    return load(
        cfg.name,
        device=device or cfg.device,
        dtype=cfg.dtype,
        attn_implementation=cfg.attn_implementation,
        device_map=cfg.device_map,
        revision=cfg.revision,
        **extra,
    )


def _check_device(device: str | int, what: str = "model.device") -> None:
    """Refuse a device this machine does not have, before any weights load (``what``: the setting named)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise InputError(f"{what} {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(
                f"{what} {device!r}: CUDA is not available here (torch {torch.__version__}); "
                "use device: auto (cuda when present, else cpu) or device: cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(
                f"{what} {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise InputError(f"{what} {device!r}: MPS is not available here; use device: auto or cpu")
    elif dev.type == "meta":
        raise InputError(f"{what} {device!r}: the meta device holds no weights, so nothing can run; use cpu or cuda")
    elif dev.type not in ("cpu", "cuda", "mps"):  # xpu, xla, hpu, ...: the backend torch was built with
        backend = getattr(torch, dev.type, None)
        available = getattr(backend, "is_available", None)
        if available is None or not available():
            raise InputError(
                f"{what} {device!r}: this torch ({torch.__version__}) has no {dev.type} device; use auto, cpu, cuda or cuda:N"
            )


def _check_local_files(path: Path) -> None:
    """A local checkpoint directory must hold safetensors weights (the loader reads only those)."""
    if not any((path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise ModelLoadError(
            f"{path} has no model.safetensors (or model.safetensors.index.json); mmfast loads safetensors "
            "weights only: save the checkpoint with save_pretrained(safe_serialization=True)"
        )
    index = path / "model.safetensors.index.json"
    if not (path / "model.safetensors").is_file():  # sharded: transformers reads the index with no check
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelLoadError(
                f"{index} is not a shard index ({exc}); download or save the checkpoint again"
            ) from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(
                f"{index} has no weight_map (which tensor is in which shard); download or save the checkpoint again"
            )


def _hub_error(timeout: float = 3.0) -> str | None:
    """Why the hub (``HF_ENDPOINT``) does not answer an HTTP request, or None when it does.

    Asked through huggingface_hub's own session, the one downloads use: it honours ``HTTPS_PROXY`` /
    ``HTTP_PROXY`` / ``NO_PROXY`` and a client factory the user installed (``set_client_factory``), so a
    cluster that reaches the hub through a proxy is not told that the hub is unreachable. Any HTTP answer,
    even an error status, means the hub is reachable.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    url = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    try:
        _ = url.port  # parsing the port raises on a malformed one
    except ValueError:
        raise ModelLoadError(f"HF_ENDPOINT {endpoint!r} has an invalid port; use e.g. http://host:8080") from None
    if not url.hostname:
        raise ModelLoadError(f"HF_ENDPOINT {endpoint!r} names no host; use e.g. https://hf-mirror.example.org")
    try:
        get_session().head(url.geturl(), timeout=timeout)
    except Exception as exc:  # the session's transport errors (connection, proxy, timeout, TLS), named to the user
        return f"{url.geturl()}: {type(exc).__name__}: {exc}"
    return None


def _check_load_args(attn_implementation: Any, device_map: Any, kwargs: dict[str, Any]) -> None:
    """``load``'s arguments checked as a recipe's ``model`` section checks them, before anything loads."""
    allowed = typing.get_args(typing.get_type_hints(ModelConfig)["attn_implementation"])
    if attn_implementation not in allowed:
        raise InputError(
            f"attn_implementation {attn_implementation!r} is not one of {', '.join(allowed)} (mmfast reads attention "
            "scores through its own probe, on these kernels)"
        )
    if isinstance(device_map, str) and device_map not in DEVICE_MAP_STRATEGIES:
        try:
            torch.device(device_map)
        except (RuntimeError, ValueError):
            raise InputError(
                f"device_map {device_map!r} is neither a placement strategy ({', '.join(DEVICE_MAP_STRATEGIES)}) "
                "nor a device (cpu, cuda, cuda:N)"
            ) from None
    if "use_safetensors" in kwargs:
        raise InputError(
            "use_safetensors: mmfast loads safetensors weights only (it never unpickles a checkpoint); drop the argument"
        )


def _pick_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise InputError(f"dtype {dtype!r} is not one of auto, {', '.join(table)}")
    return table[dtype]


def load(
    name_or_path: str | os.PathLike | Any = DEFAULT_MODEL,
    processor: Any = None,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    device_map: str | dict | None = None,
    revision: str | None = None,
    **from_pretrained_kwargs: Any,
) -> MMModel:
    """Load a LLaVA checkpoint and its processor as an :class:`MMModel`, or wrap a loaded one.

    Args:
        name_or_path: embedded name (``mmfast/tiny-world``), local directory, hub id, or an already
            loaded transformers model (``LlavaForConditionalGeneration`` or a supported family), which
            is then used as it is (``processor=`` required).
        processor: the model's processor (``AutoProcessor.from_pretrained(...)``); required with a loaded
            model, optional otherwise (replaces the checkpoint's own).
        device: ``auto`` (the default: cuda if available), ``cpu``, ``cuda``, ``cuda:N``; ignored with
            ``device_map``. With a loaded model: moves it there; unset keeps it where it is.
        dtype: ``float32`` (the default), ``bfloat16``, ``float16`` or ``auto``. With a loaded model:
            casts it in place (``model.to``: the caller's model changes too, with a warning); unset keeps
            its dtype. A loaded model in training mode is put in eval mode (in place, with a warning).
        attn_implementation: ``sdpa`` (the default) or ``eager``; with a loaded model, set it when loading.
        device_map: passed to ``from_pretrained`` (e.g. ``"auto"`` to spread a 13B model over GPUs).
        revision: hub revision.
        **from_pretrained_kwargs: passed to ``from_pretrained``.

    Example::

        model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
        mm = mmfast.load(model, AutoProcessor.from_pretrained(path))
    """
    if isinstance(name_or_path, torch.nn.Module):
        given = {
            "attn_implementation": attn_implementation,
            "device_map": device_map,
            "revision": revision,
            **from_pretrained_kwargs,
        }
        unused = [k for k, v in given.items() if v is not None]
        if unused:
            raise InputError(
                f"{', '.join(unused)} only apply when mmfast loads the checkpoint; the model is already loaded: "
                "pass them to from_pretrained yourself, or give mmfast.load the checkpoint's name or directory"
            )
        return _wrap_loaded(name_or_path, processor, device=device, dtype=dtype)
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise InputError(
            f"mmfast.load got a {type(name_or_path).__name__}; pass a model name, a directory, or a loaded "
            "transformers model (with processor=)"
        )
    device = device or "auto"
    dtype = dtype or "float32"
    attn_implementation = attn_implementation or "sdpa"
    _check_load_args(attn_implementation, device_map, from_pretrained_kwargs)
    from transformers import AutoConfig

    path, local = _resolve(name_or_path)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device_map is None:
        _check_device(device)
    elif isinstance(device_map, str) and device_map not in DEVICE_MAP_STRATEGIES:
        _check_device(device_map, "device_map")
    elif isinstance(device_map, dict):  # module -> device, an accelerator index, or "disk"
        for placed in device_map.values():
            if placed != "disk":
                _check_device(f"cuda:{placed}" if isinstance(placed, int) else placed, "device_map")
    torch_dtype = _pick_dtype(dtype, device)
    kwargs: dict[str, Any] = dict(from_pretrained_kwargs)
    if revision:
        kwargs["revision"] = revision
    if not local:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        try:
            AutoConfig.from_pretrained(path, local_files_only=True, revision=revision)
            kwargs["local_files_only"] = True  # cached: never touch the network
        except OSError:
            if offline:
                raise ModelLoadError(
                    f"{path!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it "
                    f"on a machine with network access (hf download {path}{f' --revision {revision}' if revision else ''}) "
                    "or pass a local directory"
                ) from None
            why = _hub_error()
            if why is not None:
                raise ModelLoadError(
                    f"cannot reach the Hugging Face hub to download {path!r} ({why}); check the network, "
                    "HTTPS_PROXY or HF_ENDPOINT, or pass a local directory written by save_pretrained"
                ) from None
    try:
        config = AutoConfig.from_pretrained(
            path, **{k: v for k, v in kwargs.items() if k in ("revision", "local_files_only")}
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the config of {path!r}: {exc}") from None
    from .models import _REJECTED, MODEL_CLASSES

    if config.model_type not in MODEL_CLASSES:
        msg = _REJECTED.get(config.model_type, f"model_type {config.model_type!r} is not a supported LLaVA checkpoint")
        raise ModelLoadError(f"{path}: {msg}")
    if local:
        _check_local_files(Path(path))
    if processor is not None:
        _check_processor(processor)
        _check_chat_template(processor, "processor=", InputError)
    else:
        processor = _load_processor(
            path, kwargs, config.model_type
        )  # before the weights: a missing tokenizer fails early
        _check_chat_template(processor, f"the processor of {path!r}", ModelLoadError)
    try:
        model = MODEL_CLASSES[config.model_type]().from_pretrained(
            path,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
            device_map=device_map,
            use_safetensors=True,
            **kwargs,
        )
    except SafetensorError as exc:
        raise ModelLoadError(
            f"the weights of {path!r} are corrupt or truncated ({exc}); download or save the checkpoint again"
        ) from None
    except OSError as exc:
        raise ModelLoadError(f"cannot load {path!r}: {exc}") from None
    except ImportError as exc:  # a quantized checkpoint (config.json's quantization_config) without its backend
        quant = getattr(config, "quantization_config", None)
        if quant is None:
            raise
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        raise ModelLoadError(
            f"{path!r} is a quantized checkpoint ({method}) whose backend is not installed: {exc}; install it, "
            "or load the unquantized checkpoint"
        ) from None
    except RuntimeError as exc:
        if "mismatched_sizes" not in str(exc) and "size mismatch" not in str(exc):
            raise
        raise ModelLoadError(
            f"the weights of {path!r} do not fit its config.json (tensor shapes differ: the config was edited, or the "
            "weights belong to another model size); use the config.json saved with these weights"
        ) from None
    if device_map is None:
        model = model.to(device)
    logger.info("loaded %s (%s, %s, attention=%s)", name_or_path, model.device, torch_dtype, attn_implementation)
    return MMModel(model, processor, str(name_or_path))


def _load_processor(path: str, kwargs: dict[str, Any], model_type: str | None = None) -> Any:
    from transformers import AutoProcessor

    from .models import PROCESSOR_CLASSES

    kw = {k: v for k, v in kwargs.items() if k in ("revision", "local_files_only")}
    cls = PROCESSOR_CLASSES[model_type]() if model_type in PROCESSOR_CLASSES else AutoProcessor
    try:
        return cls.from_pretrained(path, **kw)
    except (AttributeError, ImportError, TypeError, ValueError) as exc:
        # Qwen-VL processors' video half needs torchvision; a checkpoint with a
        # video_preprocessor_config.json (the hub's Qwen-VL ones) raises a ValueError "requires
        # `torchvision`"; other ValueErrors are a broken processor
        if isinstance(exc, ValueError) and "torchvision" not in str(exc):
            raise ModelLoadError(_processor_problem(path, exc)) from None
        from .models.qwen_processor import load_qwen_processor

        logger.info("AutoProcessor unavailable for %s (%s); using its tokenizer and image processor", path, exc)
        try:
            return load_qwen_processor(path, **kw)
        except (OSError, ValueError) as exc2:
            raise ModelLoadError(f"cannot load the processor of {path!r}: {exc2}") from None
    except OSError as exc:
        raise ModelLoadError(_processor_problem(path, exc)) from None


def _processor_problem(path: str, exc: Exception) -> str:
    return (
        f"cannot load the processor (tokenizer, image processor) of {path!r}: {' '.join(str(exc).split())[:300]}; "
        "the directory needs the files save_pretrained writes for the processor (tokenizer.json, "
        "tokenizer_config.json, processor_config.json or preprocessor_config.json)"
    )


def _check_processor_geometry(model: Any, processor: Any) -> None:
    """A center-cropping processor (CLIP-style LLaVA) must crop to the tower's image size and count the tower's
    patch size, else the first image fails deep in transformers (a processor of another checkpoint)."""
    vision = getattr(model.config, "vision_config", None)
    side, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    image_processor = processor.image_processor
    crop = getattr(image_processor, "crop_size", None) if getattr(image_processor, "do_center_crop", False) else None
    # a SizeDict (transformers 5) or a plain dict
    crop_hw = tuple(crop.get(k) if isinstance(crop, Mapping) else getattr(crop, k, None) for k in ("height", "width"))
    problems = []
    if isinstance(side, int) and all(isinstance(x, int) for x in crop_hw) and crop_hw != (side, side):
        problems.append(f"crops images to {crop_hw[0]}x{crop_hw[1]}, the vision tower takes {side}x{side}")
    proc_patch = getattr(processor, "patch_size", None)
    if isinstance(patch, int) and isinstance(proc_patch, int) and proc_patch != patch:
        problems.append(f"counts {proc_patch}-pixel patches, the vision tower's are {patch}")
    if problems:
        raise InputError(
            f"processor= is not this model's: it {'; '.join(problems)}; pass the checkpoint's own processor "
            "(AutoProcessor.from_pretrained of the model's directory or hub id)"
        )


def _check_processor(processor: Any) -> None:
    """A multimodal processor: a tokenizer and an image processor (not a bare tokenizer)."""
    missing = [a for a in ("tokenizer", "image_processor", "apply_chat_template") if not hasattr(processor, a)]
    if missing:
        raise InputError(
            f"processor is a {type(processor).__name__} without {', '.join(missing)}; pass the model's multimodal "
            "processor (transformers.AutoProcessor.from_pretrained(<checkpoint>)), not its tokenizer or image processor"
        )


def _check_chat_template(processor: Any, what: str, error: type[Exception]) -> None:
    """The processor renders a user turn with an image (what :meth:`MMModel.chat_text` asks); a checkpoint
    saved without a chat template loaded, then failed at the first prompt with transformers' ValueError."""
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    try:
        processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    except (ValueError, TemplateError) as exc:
        raise error(
            f"{what} cannot apply a chat template ({' '.join(str(exc).split())[:200]}); mmfast writes each prompt "
            "with the checkpoint's template: save the processor with its chat_template.jinja, or set "
            "processor.chat_template to the model's template"
        ) from None


def _wrap_loaded(
    model: torch.nn.Module, processor: Any, *, device: str | None, dtype: str | torch.dtype | None
) -> MMModel:
    """An :class:`MMModel` around a model the caller loaded with transformers."""
    from transformers import PreTrainedModel

    from .models import _REJECTED, MODEL_CLASSES

    if not isinstance(model, PreTrainedModel):
        raise InputError(
            f"mmfast.load got a {type(model).__name__}, not a transformers model; pass e.g. "
            "LlavaForConditionalGeneration.from_pretrained(...)"
        )
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_CLASSES:
        msg = _REJECTED.get(model_type, f"model_type {model_type!r} is not a supported LLaVA checkpoint")
        raise ModelLoadError(f"{type(model).__name__}: {msg}")
    if not isinstance(model, MODEL_CLASSES[model_type]()):
        raise InputError(
            f"mmfast.load got a {type(model).__name__}; mmfast needs the generation class "
            f"{MODEL_CLASSES[model_type]().__name__} (with its lm_head) for model_type {model_type!r}"
        )
    if processor is None:
        source = getattr(model, "name_or_path", "") or "<checkpoint>"
        raise InputError(
            f"mmfast.load(model) needs the model's processor: mmfast.load(model, "
            f"processor=AutoProcessor.from_pretrained({source!r}))"
        )
    _check_processor(processor)
    _check_chat_template(processor, "processor=", InputError)
    _check_processor_geometry(model, processor)
    if device is not None:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if getattr(model, "hf_device_map", None):
            raise InputError(
                "the model is spread over devices (device_map); load it without device= to keep that placement"
            )
        _check_device(device)
        model = model.to(device)
    if dtype is not None:
        target = _pick_dtype(dtype, str(model.device))
        if target != model.dtype:
            logger.warning(
                "dtype=%s casts your %s in place, from %s: the model you passed is now %s too (a copy would double "
                "its memory); load it with from_pretrained(..., dtype=...) instead to keep the original",
                dtype,
                type(model).__name__,
                model.dtype,
                target,
            )
            model = model.to(target)
    if model.training:  # MMModel runs it in eval mode (no dropout): the caller's model changes, so say so
        logger.warning(
            "your %s is in training mode; mmfast puts it in eval mode (model.eval(), in place): call model.train() "
            "after mmfast to train it again",
            type(model).__name__,
        )
    name = getattr(model, "name_or_path", "") or type(model).__name__
    logger.info("using loaded %s (%s, %s)", name, model.device, model.dtype)
    return MMModel(model, processor, str(name))
