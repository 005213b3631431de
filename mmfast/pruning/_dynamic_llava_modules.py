"""Dynamic-LLaVA's learned predictors, their sizes, and loading (ours or a released checkpoint).

Architectures (checked in Osilly/dynamic_llava, ``llava/model/language_model/dynamic_modeling_llama.py``
classes ``VisionPredictor`` / ``TextPredictor`` and ``custom_transformer_layer.SelfTransformerEncoderBlock``):

- **image predictor**: LayerNorm(d) -> Linear(d, c) -> GELU -> ``num_layers`` pre-norm transformer
  encoder blocks (width c, ``nhead`` heads, qkv without bias, MLP c -> ``dim_feedforward`` -> c, GELU)
  -> channel split: the first c/2 channels stay per token ("local"), the last c/2 are averaged over the
  sample's image tokens (masked mean, "global") and broadcast -> MLP c -> c/2 -> c/4 -> 2 (GELU between).
- **output-text predictor**: a per-token MLP, LayerNorm(d) -> d -> c -> c/2 -> c/4 -> 2 (GELU between).

Logit 0 means "keep". The released LLaVA-1.5 checkpoints use c = 512, 8 heads, MLP 2048, 2 blocks for
both d = 4096 (7B) and d = 5120 (13B). mmfast's own predictors scale c with the LLM width:
c = max(32, d / 8) (512 on a 4096-wide LLM), ``nhead`` = max(1, c / 64) (head width 64, as 512 / 8),
``dim_feedforward`` = 4 c, 2 blocks (:meth:`PredictorSpec.scaled`).

On disk, mmfast's predictors are a directory with ``predictors.safetensors`` and ``config.json``
(``{"format": "mmfast.dynamic_llava", "hidden_size": d, "num_hidden_layers": L, "sparse_config": {...}}``,
the ``sparse_config`` keys named as in the released checkpoints). A released checkpoint directory
(``config.json`` with ``sparse_config`` + ``model*.safetensors`` / ``pytorch_model*.bin``) is read too:
only the predictor tensors are loaded, renamed by :func:`released_to_ours`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError, load_tensors_into

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "predictors.safetensors"
CONFIG_NAME = "config.json"
FORMAT = "mmfast.dynamic_llava"
TRAIN_COMMAND = "python scripts/train_dynamic_llava.py"

#: Released Dynamic-LLaVA prefixes (``DynamicLlavaLlamaForCausalLM.model.<name>``) -> ours.
RELEASED_PREFIXES = {
    "model.image_score_predictor.": "image.",
    "model.output_text_score_predictor.": "text.",
}


# ------------------------------------------------------------------------------------ sizes


@dataclass(frozen=True)
class PredictorSpec:
    """Sizes of one predictor pair (the released ``sparse_config`` keys, plus the LLM width)."""

    hidden_size: int  # d, the LLM width
    d_model: int  # c
    nhead: int
    dim_feedforward: int
    num_layers: int = 2
    text_predictor: bool = True

    @classmethod
    def scaled(
        cls, hidden_size: int, *, d_model: int = 0, nhead: int = 0, dim_feedforward: int = 0, num_layers: int = 2
    ) -> PredictorSpec:
        """mmfast's size rule (0 = derive): c = max(32, d/8), heads = max(1, c/64), MLP = 4c."""
        c = d_model or max(32, hidden_size // 8)
        heads = nhead or max(1, c // 64)
        if c % heads or c % 4:
            raise ValueError(f"d_model {c} must be divisible by 4 and by nhead {heads}")
        return cls(hidden_size, c, heads, dim_feedforward or 4 * c, num_layers)

    def sparse_config(self) -> dict[str, Any]:
        return {
            "d_model": self.d_model,
            "nhead": self.nhead,
            "dim_feedforward": self.dim_feedforward,
            "num_layers": self.num_layers,
            "use_vision_predictor": True,
            "use_text_predictor": self.text_predictor,
            "use_output_text_predictor": self.text_predictor,
            "use_instruct_predictor": False,
        }


# ------------------------------------------------------------------------------------ modules


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block (ViT style); keys outside ``valid`` are masked."""

    def __init__(self, dim: int, nhead: int, ff: int) -> None:
        super().__init__()
        self.nhead = nhead
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ff)
        self.fc2 = nn.Linear(ff, dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.nhead, c // self.nhead).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [B, H, N, c/H]
        x = x + self.out(a.transpose(1, 2).reshape(b, n, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ImagePredictor(nn.Module):
    """Per image token keep/drop logits from the hidden states entering the sparse layer."""

    def __init__(self, spec: PredictorSpec) -> None:
        super().__init__()
        d, c = spec.hidden_size, spec.d_model
        self.down_norm = nn.LayerNorm(d)
        self.down = nn.Linear(d, c)
        self.blocks = nn.ModuleList(EncoderBlock(c, spec.nhead, spec.dim_feedforward) for _ in range(spec.num_layers))
        self.head1 = nn.Linear(c, c // 2)
        self.head2 = nn.Linear(c // 2, c // 4)
        self.head3 = nn.Linear(c // 4, 2)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None, dense: bool | None = None) -> torch.Tensor:
        """x [B, N, d] (image tokens of each sample, padded), valid [B, N] bool -> logits [B, N, 2]. ``dense``:
        whether every entry of ``valid`` is True, when the caller knows it (None: read from ``valid``; a captured
        call must not read)."""
        b, n, _ = x.shape
        if valid is None:
            valid = torch.ones(b, n, dtype=torch.bool, device=x.device)
        h = F.gelu(self.down(self.down_norm(x))) * valid[..., None]
        # every query sees the valid keys and itself (padded rows stay finite and are never used)
        eye = torch.eye(n, dtype=torch.bool, device=x.device)
        dense = bool(valid.all()) if dense is None else dense
        mask = None if dense else (valid[:, None, None, :] | eye)
        for blk in self.blocks:
            h = blk(h, mask)
        half = h.shape[-1] // 2
        w = valid[..., None].to(h.dtype)
        glob = (h[..., half:] * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp(min=1)
        h = torch.cat([h[..., :half], glob.expand(b, n, half)], dim=-1)
        return self.head3(F.gelu(self.head2(F.gelu(self.head1(h)))))


class TextPredictor(nn.Module):
    """Per-token keep/drop logits for generated (output) text tokens; no context."""

    def __init__(self, spec: PredictorSpec) -> None:
        super().__init__()
        d, c = spec.hidden_size, spec.d_model
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, c)
        self.fc2 = nn.Linear(c, c // 2)
        self.fc3 = nn.Linear(c // 2, c // 4)
        self.fc4 = nn.Linear(c // 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.norm(x)))
        return self.fc4(F.gelu(self.fc3(F.gelu(self.fc2(h)))))


class Predictors(nn.Module):
    """The image predictor and (optionally) the output-text predictor of one model."""

    def __init__(self, spec: PredictorSpec) -> None:
        super().__init__()
        self.spec = spec
        self.image = ImagePredictor(spec)
        self.text = TextPredictor(spec) if spec.text_predictor else None

    def init_weights(self, std: float = 0.02) -> Predictors:
        """The released training init: Linear ~ N(0, std), zero bias (LayerNorm 1, 0)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        return self


# ------------------------------------------------------------------------------------ key mapping

# released suffix (inside image_score_predictor / output_text_score_predictor) -> ours
_IMAGE_RULES = [
    (r"down_mlp\.0\.", "down_norm."),
    (r"down_mlp\.1\.", "down."),
    (r"transformer\.(\d+)\.norm1\.", r"blocks.\1.norm1."),
    (r"transformer\.(\d+)\.attn\.qkv\.", r"blocks.\1.qkv."),
    (r"transformer\.(\d+)\.attn\.proj\.", r"blocks.\1.out."),
    (r"transformer\.(\d+)\.norm2\.", r"blocks.\1.norm2."),
    (r"transformer\.(\d+)\.mlp\.fc1\.", r"blocks.\1.fc1."),
    (r"transformer\.(\d+)\.mlp\.fc2\.", r"blocks.\1.fc2."),
    (r"output_mlp\.0\.", "head1."),
    (r"output_mlp\.2\.", "head2."),
    (r"output_mlp\.4\.", "head3."),
]
_TEXT_RULES = [
    (r"output_mlp\.0\.", "norm."),
    (r"output_mlp\.1\.", "fc1."),
    (r"output_mlp\.3\.", "fc2."),
    (r"output_mlp\.5\.", "fc3."),
    (r"output_mlp\.7\.", "fc4."),
]


def released_to_ours(key: str) -> str | None:
    """Our state-dict key for a released checkpoint key, or None for a non-predictor key.

    ``model.image_score_predictor.transformer.0.attn.qkv.weight`` -> ``image.blocks.0.qkv.weight``;
    ``model.output_text_score_predictor.output_mlp.7.bias`` -> ``text.fc4.bias``. A predictor key that
    no rule covers raises (a checkpoint layout this code does not know).
    """
    for prefix, ours in RELEASED_PREFIXES.items():
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            for pat, rep in _IMAGE_RULES if ours == "image." else _TEXT_RULES:
                m = re.match(pat, rest)
                if m:
                    return ours + m.expand(rep) + rest[m.end() :]
            raise ModelLoadError(f"unknown Dynamic-LLaVA predictor tensor {key!r}")
    return None


# ------------------------------------------------------------------------------------ io


def save_predictors(
    predictors: Predictors, out_dir: str | Path, sparse: dict[str, Any], extra: dict[str, Any] | None = None
) -> Path:
    """Write ``predictors.safetensors`` + ``config.json`` (``sparse``: sparse_layer, keep rates, ...)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in predictors.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": FORMAT})
    spec = predictors.spec
    cfg = {
        "format": FORMAT,
        "hidden_size": spec.hidden_size,
        "sparse_config": {**spec.sparse_config(), **sparse},
        **(extra or {}),
    }
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=1))
    return out


def _released_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Predictor tensors of a released checkpoint directory, renamed to our keys."""
    from safetensors import safe_open

    wanted = tuple(RELEASED_PREFIXES)
    out: dict[str, torch.Tensor] = {}
    index = next(
        (path / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json") if (path / n).is_file()),
        None,
    )
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for k, f in weight_map.items() if k.startswith(wanted)})
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))] or [
            p.name for p in sorted(path.glob("pytorch_model*.bin"))
        ]
    for name in files:
        f = path / name
        if not f.is_file():
            raise ModelLoadError(f"{f} (listed in {index}) is missing; download the complete checkpoint")
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    ours = released_to_ours(k)
                    if ours is not None:
                        out[ours] = sf.get_tensor(k)
        else:
            for k, v in torch.load(f, map_location="cpu", weights_only=True).items():
                ours = released_to_ours(k)
                if ours is not None:
                    out[ours] = v
    return out


def random_predictors(hidden_size: int, seed: int = 0) -> Predictors:
    """Untrained, deterministic predictors (tests and plumbing checks only).

    Linear weights ~ N(0, 4 / fan_in) and zero biases from ``seed`` (well separated logits, so a batch and
    its samples run alone decide alike); the text predictor's drop bias is then set so that half of a
    fixed set of random inputs is dropped (after its LayerNorm any token looks like such an input).
    """
    gen = torch.Generator().manual_seed(seed)
    predictors = Predictors(PredictorSpec.scaled(hidden_size))
    with torch.no_grad():
        for m in predictors.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * 2 / math.sqrt(m.in_features))
                if m.bias is not None:
                    m.bias.zero_()
        ref = predictors.text(torch.randn(512, hidden_size, generator=gen))
        predictors.text.fc4.bias[1] = (ref[:, 0] - ref[:, 1]).median()
    return predictors


def load_predictors(
    path: str | Path, hidden_size: int, model_dir: str | Path | None = None
) -> tuple[Predictors, dict[str, Any]]:
    """(predictors, sparse_config) from one of our directories or a released checkpoint directory.

    ``model_dir`` (the model the predictors are for) only completes the missing-weights message.
    """
    path = Path(path).expanduser()
    cfg_file = path / CONFIG_NAME
    ours = path / WEIGHTS_NAME
    if not cfg_file.is_file():
        raise _missing(path, model_dir)
    cfg = json.loads(cfg_file.read_text())
    sparse = cfg.get("sparse_config")
    if not isinstance(sparse, dict):
        raise ModelLoadError(
            f"{cfg_file} has no sparse_config: not Dynamic-LLaVA predictors nor a released Dynamic-LLaVA checkpoint"
        )
    d = int(cfg.get("hidden_size") or cfg.get("text_config", {}).get("hidden_size") or 0)
    if d != hidden_size:
        raise ModelLoadError(
            f"the predictors in {path} read hidden states of width {d}, but this model's LLM is {hidden_size} wide; "
            "use predictors trained for this model"
        )
    has_text = bool(sparse.get("use_text_predictor", True)) and bool(sparse.get("use_output_text_predictor", True))
    spec = PredictorSpec(
        d,
        int(sparse["d_model"]),
        int(sparse["nhead"]),
        int(sparse["dim_feedforward"]),
        int(sparse.get("num_layers", 2)),
        has_text,
    )
    if cfg.get("format") == FORMAT:
        if not ours.is_file():
            raise _missing(path, model_dir)
        from safetensors.torch import load_file

        tensors = load_file(str(ours))
    else:
        tensors = _released_tensors(path)
        if not tensors:
            raise ModelLoadError(f"no Dynamic-LLaVA predictor tensors (model.image_score_predictor.*) found in {path}")
    predictors = Predictors(spec)
    load_tensors_into(
        predictors,
        tensors,
        path,
        f"they do not match the sparse_config of {cfg_file}; retrain with `{TRAIN_COMMAND} --out {path}`",
    )
    return predictors.float().eval(), sparse


def _missing(path: Path, model_dir: str | Path | None = None) -> ModelLoadError:
    return ModelLoadError(
        f"Dynamic-LLaVA predictor weights not found: {path / WEIGHTS_NAME} (with {path / CONFIG_NAME}). Train them "
        f"with `{TRAIN_COMMAND} --model {model_dir or '<model dir>'} --out {path}`, or set the pruning param `predictors:` to a "
        "trained directory or to a released Dynamic-LLaVA checkpoint directory (Osilly/Dynamic-LLaVA-7B)"
    )


# ------------------------------------------------------------------------------------ helpers


def gather_rows(hidden: torch.Tensor, select: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-aligned per-row gather of the ``select`` ([B, T] bool) slots of ``hidden`` ([B, T, d]).

    Returns (x [B, N, d], valid [B, N] bool, index [B, N] long into T; padding points at slot 0),
    keeping each row's slot order. N = the largest row count (at least 1).
    """
    bsz, t = select.shape
    counts = select.sum(1)
    n = max(1, int(counts.max()))
    # stable sort puts selected slots first, in order
    order = torch.sort((~select).to(torch.int8), dim=1, stable=True).indices[:, :n]  # [B, N]
    valid = torch.arange(n, device=select.device)[None, :] < counts[:, None]
    index = order.masked_fill(~valid, 0)
    x = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
    return x, valid, index


def keep_topk(score: torch.Tensor, valid: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: the ``k[b]`` best valid entries of each row (ties toward lower index)."""
    s = score.float().masked_fill(~valid, float("-inf"))
    order = s.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(s.shape[1], device=s.device).expand_as(order))
    return (ranks < k[:, None]) & valid


def tau_at(step: int, total: int, start: float = 1.0, end: float = 0.1) -> float:
    """Gumbel temperature annealed exponentially from ``start`` to ``end`` over ``total`` steps."""
    return start * math.pow(end / start, step / max(1, total))
