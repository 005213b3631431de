"""HICom on video through a SigLIP tower (see :mod:`mmfast.pruning.hicom`): the SigLIP guide (text
tower + the vision layers the model's tower was cut from + post-layernorm + head), the release's
frame grouping (``balance_divide_feature``) and its local weighting.

The release (lntzm/HICom ``hicom/model/encoder.py`` ``SiglipVisionTower``, ``projector.py``
``LocalCompressor``) runs the full SigLIP-so400m-384: values = ``hidden_states[-2]``, keys =
``last_hidden_state + head.mlp(head.layernorm(last_hidden_state))`` (``last_hidden_state`` is after
SigLIP's ``post_layernorm``), guide = ``SiglipTextModel(...).pooler_output`` of the instruction padded
to ``max_length``. A tower cut to fewer layers (LLaVA-OneVision keeps 26 of 27) is completed here by the
checkpoint's remaining layers before the post-layernorm and the head.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer, SiglipConfig, SiglipModel, SiglipTextModel
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer, SiglipMLP

from ..errors import ConfigError, ModelLoadError
from ..models.base import FRAME, VisionBatch
from ._grid import adaptive_bins, group_index_bins
from ._hicom_guide import tiny_tower_configs

SIGLIP_HUB = "google/siglip-so400m-patch14-384"
GUIDE_DIR = "siglip"  # default: <model dir>/siglip
DOWNLOAD = f"`huggingface-cli download {SIGLIP_HUB} --local-dir DIR`"


# ------------------------------------------------------------------------------------ grouping
def release_bins(n: int, k: int) -> list[tuple[int, int]]:
    """[start, end) of the groups of ``n`` cells with kernel ``k`` along one axis, as the release's
    ``LocalCompressor.divide_feature``: n / k blocks when k divides n; otherwise
    ``balance_divide_feature``: ceil(n / k) groups of k cells, the first ``n % groups`` disjoint, each
    later one starting a cell before the previous one ends. Where that split has groups of different
    sizes (the release's ``torch.stack`` fails, e.g. n = 6, k = 4), adaptive bins of the same count."""
    if n % k == 0:
        return [(i * k, (i + 1) * k) for i in range(n // k)]
    split = math.ceil(n / k)
    full = n % split or split
    bins, start = [], 0
    for i in range(split):
        length = k if i < full else k - 1
        end = start + length
        bins.append((start - (length < k), min(end, n)))
        start = end
    if len({e - s for s, e in bins}) > 1:
        return adaptive_bins(n, split)
    return bins


def local_weights(keys: torch.Tensor, guide: torch.Tensor, index: torch.Tensor, clip_scale=None) -> torch.Tensor:
    """[G, S] the release's local attention with the instruction as every group's query (``use_guide
    direct``): softmax over the group of g . k / sqrt(D), or, with ``clip_scale`` = (logit_scale,
    logit_bias) (``use_clip_scale local``), of cos(g, k) * exp(logit_scale) + logit_bias.
    keys [T * H * W, D] fp32, guide [D], index [G, S] (-1 padding)."""
    valid = index >= 0
    k = keys[index.clamp(min=0)]  # [G, S, D]
    g = guide.to(k)
    if clip_scale is not None:
        k, g = k / k.norm(dim=-1, keepdim=True), g / g.norm()
        logits = (k @ g) * clip_scale[0].exp() + clip_scale[1]
    else:
        logits = (k @ g) / math.sqrt(k.shape[-1])
    return torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)


# ------------------------------------------------------------------------------------ SigLIP guide
class SiglipGuide(nn.Module):
    """SigLIP's text tower (the guide) and the vision parts after the model's tower (keys)."""

    def __init__(self, text_model: nn.Module, layers: nn.ModuleList, post_layernorm, head_norm, head_mlp, tokenizer):
        super().__init__()
        self.text_model, self.layers, self.post_layernorm = text_model, layers, post_layernorm
        self.head_norm, self.head_mlp, self.tokenizer = head_norm, head_mlp, tokenizer
        self.max_len = int(text_model.config.max_position_embeddings)
        self.register_buffer("logit_scale", torch.zeros(1), persistent=False)
        self.register_buffer("logit_bias", torch.zeros(1), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.post_layernorm.weight.device

    @property
    def dim(self) -> int:
        """Width of the keys (the tower's)."""
        return int(self.head_mlp.fc2.out_features)

    @property
    def text_dim(self) -> int:
        """Width of the guide (the text head's output)."""
        return int(self.text_model.head.out_features)

    @torch.no_grad()
    def text_embeds(self, texts: list[str]) -> torch.Tensor:
        """[B, D] fp32: ``pooler_output`` of the instruction padded to ``max_length`` (the release's
        ``guide_tokenizer(..., padding="max_length", truncation=True)``)."""
        enc = self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_len, return_tensors="pt")
        enc = {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        return self.text_model(**enc).pooler_output.float()

    @torch.no_grad()
    def keys(self, last: torch.Tensor) -> torch.Tensor:
        """[F, N, D] fp32 keys from the model tower's last-layer output ``last`` [F, N, D]: the remaining
        SigLIP layers, post-layernorm, then x + head.mlp(head.layernorm(x))."""
        x = last.to(self.device, self.post_layernorm.weight.dtype)
        for layer in self.layers:
            x = layer(x, None)
            x = x[0] if isinstance(x, tuple) else x
        x = self.post_layernorm(x)
        return (x + self.head_mlp(self.head_norm(x))).float()


def _siglip_parts(model, tokenizer, tower_layers: int) -> SiglipGuide:
    vm = model.vision_model
    n = len(vm.encoder.layers)
    if n < tower_layers:
        raise ConfigError(
            "guide_model", f"the SigLIP guide has {n} vision layers but the model's tower has {tower_layers}"
        )
    guide = SiglipGuide(
        model.text_model,
        nn.ModuleList(list(vm.encoder.layers)[tower_layers:]),
        vm.post_layernorm,
        vm.head.layernorm,
        vm.head.mlp,
        tokenizer,
    )
    guide.logit_scale, guide.logit_bias = model.logit_scale.detach().clone(), model.logit_bias.detach().clone()
    return guide


def random_siglip(
    vision_config, tokenizer, tower_layers: int, seed: int = 0, text_width: int = 32, text_positions: int = 32
):
    """A tiny randomly initialised ``SiglipModel`` for tests and timings: a 2-layer text tower on the
    model's tokenizer projecting to the tower's width, the vision tower's sizes with one more layer."""
    text, vision = tiny_tower_configs(
        vision_config,
        tokenizer,
        vision_layers=tower_layers + 1,
        text_width=text_width,
        text_positions=text_positions,
        projection_size=vision_config.hidden_size,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SiglipModel(SiglipConfig(text_config=text, vision_config=vision)).eval()


_CACHE: dict[tuple[str, int, str], SiglipGuide] = {}


def _missing(what: str) -> ConfigError:
    return ConfigError(
        "guide_model",
        f"{what}. HICom on video needs the SigLIP text tower and vision head that this model's tower was cut "
        f"from, which the model checkpoint does not include: download {SIGLIP_HUB} ({DOWNLOAD}) and set "
        f"guide_model: DIR (or put it in <model dir>/{GUIDE_DIR})",
    )


def load_siglip_guide(spec: str | None, model_dir: Path | None, vision_config, tower_layers: int, tokenizer, device):
    """The SigLIP guide for a tower of ``tower_layers`` layers: ``spec`` (a ``SiglipModel`` directory, read
    with safetensors, offline), else ``<model dir>/siglip``; ``"random"``: :func:`random_siglip`."""
    if spec == "random":
        model = random_siglip(vision_config, tokenizer, tower_layers)
        return _siglip_parts(model, tokenizer, tower_layers).to(device).requires_grad_(False)
    if spec is None:
        if model_dir is None or not (model_dir / GUIDE_DIR / "config.json").is_file():
            where = model_dir / GUIDE_DIR if model_dir is not None else f"<model dir>/{GUIDE_DIR}"
            raise _missing(f"no SigLIP guide given (guide_model) and none at {where}")
        spec = str(model_dir / GUIDE_DIR)
    key = (spec, tower_layers, str(device))
    if key in _CACHE:
        return _CACHE[key]
    path = Path(spec)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not (path / "config.json").is_file() or not files:
        raise _missing(f"guide_model {spec!r} is not a SiglipModel directory (config.json and *.safetensors)")

    config = SiglipConfig.from_dict(json.loads((path / "config.json").read_text()))
    vc = config.vision_config
    if int(vc.hidden_size) != int(vision_config.hidden_size) or int(vc.num_hidden_layers) < tower_layers:
        raise ConfigError(
            "guide_model",
            f"{spec} is a SigLIP of width {vc.hidden_size} with {vc.num_hidden_layers} layers, but this model's "
            f"tower is {vision_config.hidden_size} wide with {tower_layers} layers; give the SigLIP the tower was "
            f"cut from ({SIGLIP_HUB})",
        )
    wanted = ("text_model.", "vision_model.post_layernorm.", "vision_model.head.", "logit_")
    wanted += tuple(f"vision_model.encoder.layers.{i}." for i in range(tower_layers, vc.num_hidden_layers))
    state: dict[str, torch.Tensor] = {}
    for f in files:  # only the tensors the guide uses (the tower's own layers stay on disk)
        with safe_open(str(f), framework="pt") as handle:
            for k in handle.keys():
                if k.removeprefix("model.").startswith(wanted):
                    state[k.removeprefix("model.")] = handle.get_tensor(k)
    # only what the guide uses: the text tower, the layers after the model's tower, post-layernorm, head
    text = SiglipTextModel(config.text_config)
    rest = nn.ModuleList(SiglipEncoderLayer(vc) for _ in range(tower_layers, vc.num_hidden_layers))
    post, head_norm = (
        nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps),
        nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps),
    )
    head_mlp = SiglipMLP(vc)
    parts = {
        "text_model.": text,
        "vision_model.post_layernorm.": post,
        "vision_model.head.layernorm.": head_norm,
        "vision_model.head.mlp.": head_mlp,
        **{f"vision_model.encoder.layers.{tower_layers + i}.": layer for i, layer in enumerate(rest)},
    }
    for prefix, module in parts.items():
        want = module.state_dict()
        got = {k: state.get(prefix + k) for k in want}
        lacking = [prefix + k for k, v in got.items() if v is None]
        if lacking:
            raise ModelLoadError(f"the HICom guide {spec} (guide_model) lacks weights, e.g. {lacking[:3]}")
        module.load_state_dict({k: v.float() for k, v in got.items()})
    try:
        tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(
            f"cannot load the tokenizer of the HICom guide {spec} (guide_model): {exc}; SigLIP's tokenizer needs "
            "the sentencepiece package (pip install sentencepiece)"
        ) from None
    guide = SiglipGuide(text.eval(), rest.eval(), post, head_norm, head_mlp, tok)
    for name in ("logit_scale", "logit_bias"):
        if name in state:
            setattr(guide, name, state[name].float().reshape(1))
    guide = guide.to(device).requires_grad_(False)
    _CACHE[key] = guide
    return guide


# ------------------------------------------------------------------------------------ one video
def video_bins(
    t: int, h: int, w: int, temporal: int, spatial: int, cells: int | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """Per-axis groups of a (t, h, w) video: the release's bins with kernels (temporal, spatial, spatial),
    or, with ``cells`` (local tokens per frame group: ``local_tokens`` or a budget), adaptive bins of
    the largest grid with at most ``cells`` cells (ties: the aspect nearest the frame's)."""
    bt = release_bins(t, temporal)
    if cells is None:
        return bt, release_bins(h, spatial), release_bins(w, spatial)
    grids = [(oh, min(w, cells // oh)) for oh in range(1, min(h, cells) + 1)]
    oh, ow = max(grids, key=lambda g: (g[0] * g[1], -abs(math.log(g[0] * w / (g[1] * h)))))
    return bt, adaptive_bins(h, oh), adaptive_bins(w, ow)


def video_local(
    values: torch.Tensor, keys: torch.Tensor | None, guide: torch.Tensor | None, bins, clip_scale=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The release's local compressor up to its readout on one video: values [T, H, W, Dv], keys
    [T, H, W, D] (None: average pooling), guide [D]. Returns tokens [G, Dv] fp32 (groups in (t, h, w)
    raster order), weights [G, S] and the member index [G, S] (-1 padding)."""
    t, h, w, dv = values.shape
    index = group_index_bins((t, h, w), bins, device=values.device)  # [G, S]
    valid = index >= 0
    if keys is None or guide is None:
        weights = valid.float() / valid.sum(1, keepdim=True)
    else:
        weights = local_weights(keys.reshape(t * h * w, -1).float().to(values.device), guide, index, clip_scale)
    v = values.reshape(-1, dv).float()[index.clamp(min=0)]  # [G, S, Dv]
    return (weights.unsqueeze(-1) * v).sum(1), weights, index


def budget_cells(target: int, t: int, temporal: int, fixed: int, path: str) -> int:
    """Local cells per frame group for ``target`` tokens on a video of ``t`` frames: (target - fixed) //
    frame groups, where ``fixed`` = global tokens + the model's non-frame tokens (the closing newline)."""
    groups = len(release_bins(t, temporal))
    cells = (target - fixed) // groups
    if cells < 1:
        raise ConfigError(
            f"{path}.tokens",
            f"{target} tokens for a video of {t} frames leave no local token per frame group ({groups} groups of "
            f"{temporal} frames beside {fixed} global and closing tokens); the smallest feasible budget is "
            f"{groups + fixed}",
        )
    return cells


def splice_video(
    vision: VisionBatch, i: int, features: torch.Tensor, projected: torch.Tensor, grid: tuple[int, int, int]
) -> None:
    """Item ``i`` becomes the compressed video: ``projected`` [n, d] (local groups in (t, h, w) raster order,
    then the rest), ``features`` (pre-projection rows), patch ids -1 (merged tokens). Its ``FRAME`` tag is
    each local token's frame group (the rest: the last group), other tags keep the item's first value."""
    n, dev = projected.shape[0], vision.patch_ids[i].device
    vision.features[i], vision.projected[i] = features, projected
    vision.patch_ids[i] = torch.full((n,), -1, dtype=torch.long, device=dev)
    frame = torch.arange(grid[0], device=dev).repeat_interleave(grid[1] * grid[2])  # [G]
    frame = torch.cat([frame, frame.new_full((n - frame.shape[0],), max(grid[0] - 1, 0))])  # [n]
    for name, tags in vision.tags.items():
        old = tags[i]
        tags[i] = (frame + old.min()).to(old) if name == FRAME else old[:1].expand(n, *old.shape[1:]).clone()
