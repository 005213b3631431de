"""HICom building blocks (see :mod:`mmfast.pruning.hicom`): grouped local pooling, the global
compressor and its weight files (the CLIP guide is in ``_hicom_guide.py``). Shared by the pruner and
``scripts/train_hicom.py``."""

from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ModelLoadError, load_tensors_into
from ._grid import group_index

logger = logging.getLogger(__name__)

GLOBAL_WEIGHTS = "hicom_global.safetensors"
TRAIN_COMMAND = "python scripts/train_hicom.py --model {model}"


# ------------------------------------------------------------------------------------ local


def local_compress(
    values: torch.Tensor,
    keys: torch.Tensor | None,
    guide: torch.Tensor | None,
    out: tuple[int, int, int],
    alpha: float,
    scale: float,
    rule: str = "blend",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Instruction-weighted pooling of (t, h, w) groups.

    ``rule``: ``blend`` (mmfast's training-free rule below) or ``release`` (HICom's local attention
    with the instruction as the query, as its release runs it on CLIP without a logit scale:
    w = softmax(g . k / sqrt(P)) over the group, raw (unnormalised) g and k; alpha and scale unused).

    Args:
        values: [T, H, W, Dv] features that are pooled (pre-projection). keys: [T, H, W, P]
            text-aligned patch embeddings (or None). guide: [P] text embedding (or None).
        out: groups along (t, h, w) (adaptive bins). alpha, scale: w = alpha * softmax(scale * cos)
            + (1 - alpha) / |G| (uniform = average pooling when alpha = 0 or no guide).

    Returns:
        tokens [G, Dv] fp32 in (t, h, w) raster order, weights [G, S] and member index [G, S] (-1 pad).
    """
    t, h, w, dv = values.shape
    index = group_index((t, h, w), out, device=values.device)  # [G, S]
    valid = index >= 0
    safe = index.clamp(min=0)
    v = values.reshape(-1, dv).float()[safe]  # [G, S, Dv]
    uniform = valid.float() / valid.sum(1, keepdim=True)
    if rule == "release" and keys is not None and guide is not None:
        k = keys.reshape(t * h * w, -1).float()[safe]  # [G, S, P]
        logits = (k @ guide.float().to(k.device)) / math.sqrt(k.shape[-1])
        weights = torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
    elif keys is None or guide is None or alpha == 0:
        weights = uniform
    else:
        k = F.normalize(keys.reshape(t * h * w, -1).float(), dim=-1)[safe]  # [G, S, P]
        g = F.normalize(guide.float().to(k.device), dim=-1)
        logits = (k @ g * scale).masked_fill(~valid, float("-inf"))  # [G, S]
        weights = alpha * torch.softmax(logits, dim=-1) + (1 - alpha) * uniform
    return (weights.unsqueeze(-1) * v).sum(1), weights, index


def local_grid(t: int, h: int, w: int, temporal: int, spatial: int, tokens: int | None) -> tuple[int, int, int]:
    """Groups along (t, h, w): ceil(T / temporal) x ceil(H / g) x ceil(W / g), or a near-square
    grid with about ``tokens`` cells per frame group."""
    from ._grid import near_square_grid

    ot = math.ceil(t / temporal)
    if tokens is not None:
        return (ot, *near_square_grid(tokens, h, w))
    return ot, math.ceil(h / spatial), math.ceil(w / spatial)


# ------------------------------------------------------------------------------------ global


def sincos_3d(t: int, h: int, w: int, dim: int, device=None) -> torch.Tensor:
    """[t, h, w, dim]: sum of 1-D sinusoidal encodings of the t, h and w indices (each full width;
    even channels sin, odd channels cos, frequency 10000^(-2(i//2)/dim)), as HICom's global branch. A fresh
    tensor on ``device``, computed once per shape (on the host: ~50 small ops every call otherwise)."""
    pe = _sincos_3d(t, h, w, dim)
    return pe.clone() if device is None else pe.to(device, copy=True)


@functools.lru_cache(maxsize=16)
def _sincos_3d(t: int, h: int, w: int, dim: int) -> torch.Tensor:
    i = torch.arange(dim, dtype=torch.float64)
    inv = 1.0 / torch.pow(10000.0, 2 * torch.div(i, 2, rounding_mode="floor") / dim)

    def enc(n: int) -> torch.Tensor:
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
        return torch.where(i.long() % 2 == 0, torch.sin(ang), torch.cos(ang))  # [n, dim]

    pe = enc(t)[:, None, None] + enc(h)[None, :, None] + enc(w)[None, None, :]
    return pe.float()


def _mlp(depth: int, d_in: int, d_out: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(d_in, d_out)]
    for _ in range(1, depth):
        layers += [nn.GELU(), nn.Linear(d_out, d_out)]
    return nn.Sequential(*layers)


GLOBAL_MODES = ("coarse", "direct")


class GlobalCompressor(nn.Module):
    """HICom's global branch: ``n`` queries, one multi-head cross-attention over all frame features
    (+ 3-D sinusoidal positions), and a 2-layer GELU readout of ``query + attention`` to the LLM width.

    ``mode`` (HICom's ``use_guide`` for the global branch):
    - ``coarse`` (the paper): learnable queries FiLM-modulated by the instruction,
      ``LN(q (1 + scale) + shift)`` with (scale, shift) = MLP(MLP(g)).
    - ``direct`` (the release: ``scripts/qwen2.5_7B/release/directg_local43_global32.sh`` passes
      ``--use_guide direct``): every query *is* the projected instruction MLP(g), so the learned query
      parameters are unused and the n queries, their attention and their n output tokens are identical.
    """

    def __init__(
        self, vision_hidden: int, llm_hidden: int, text_dim: int, n_queries: int = 32, mode: str = "coarse"
    ) -> None:
        super().__init__()
        if mode not in GLOBAL_MODES:
            raise ValueError(f"global mode {mode!r}: one of {GLOBAL_MODES}")
        d = vision_hidden
        self.mode = mode
        self.dims = {
            "vision_hidden": vision_hidden,
            "llm_hidden": llm_hidden,
            "text_dim": text_dim,
            "n_queries": n_queries,
        }
        self.heads = max(1, d // 128)  # HICom: embed_dim // 128 heads
        if d % self.heads:
            self.heads = 1
        self.query = nn.Parameter(torch.zeros(n_queries, d))
        self.text2q = _mlp(2, text_dim, d) if text_dim != d else nn.Identity()
        if mode == "coarse":
            self.coarse_proj = _mlp(2, d, 2 * d)
            self.coarse_norm = nn.LayerNorm(d, eps=1e-6)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))
        self.readout = _mlp(2, d, llm_hidden)
        self.apply(self._init)
        nn.init.trunc_normal_(self.query, std=0.02)  # HICom: zeros (see the pruner's deviations)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def inject(self, guide: torch.Tensor) -> torch.Tensor:
        """[B, text_dim] -> queries [B, n, Dv]: FiLM-modulated (coarse) or the projected guide (direct)."""
        g = self.text2q(guide)  # [B, Dv]
        if self.mode == "direct":
            return g[:, None].expand(-1, self.query.shape[0], -1)
        scale, shift = self.coarse_proj(g).chunk(2, dim=-1)
        return self.coarse_norm(self.query[None] * (1 + scale[:, None]) + shift[:, None])

    def forward(self, frames: torch.Tensor, guide: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """frames [B, T, H, W, Dv], guide [B, text_dim] -> (query + attention [B, n, Dv], tokens [B, n, d])."""
        bsz, t, h, w, d = frames.shape
        kv = (frames + sincos_3d(t, h, w, d, frames.device).to(frames.dtype)).reshape(bsz, t * h * w, d)
        q = self.inject(guide.to(frames.dtype))

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(bsz, x.shape[1], self.heads, d // self.heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(heads(self.q_proj(q)), heads(self.k_proj(kv)), heads(self.v_proj(kv)))
        x = self.out_proj(att.transpose(1, 2).reshape(bsz, -1, d))
        pre = q + x
        return pre, self.readout(pre)


def save_global(module: GlobalCompressor, path: str | Path, meta: dict[str, Any]) -> Path:
    """Write the weights (safetensors) and ``<name>.json`` (sizes + ``meta``)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}, str(tmp))
    tmp.rename(path)
    path.with_suffix(".json").write_text(json.dumps({**module.dims, "mode": module.mode, **meta}, indent=1))
    return path


def load_global(
    path: str | Path, *, model_hint: str, expect: dict[str, int]
) -> tuple[GlobalCompressor, dict[str, Any]]:
    """Load trained global-branch weights; clear errors for a missing file or mismatched sizes.

    ``path == "random"``: a seeded, untrained branch of the expected sizes (timings on random-weight
    model shapes, where no trained file can exist, and tests)."""
    from safetensors.torch import load_file

    if str(path) == "random":
        logger.warning(
            "hicom: an untrained random global branch (global_weights: random) decides nothing meaningful: "
            "for tests and timings on random-weight shapes only"
        )
        dims = {k: int(expect[k]) for k in ("vision_hidden", "llm_hidden", "text_dim", "n_queries")}
        meta = {**dims, "mode": expect.get("mode", "coarse"), "trained": False}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = GlobalCompressor(**dims, mode=meta["mode"])
        return module.eval().requires_grad_(False), meta
    path = Path(path)
    meta_path = path.with_suffix(".json")
    if not path.is_file() or not meta_path.is_file():
        raise ModelLoadError(
            f"HICom global-branch weights not found: {path} (with {meta_path.name}). Train them with "
            f"`{TRAIN_COMMAND.format(model=model_hint)} --out {path}`, point global_weights at a trained "
            "file, or set global_queries: 0 for the training-free local-only variant"
        )
    meta = json.loads(meta_path.read_text())
    meta.setdefault("mode", "coarse")  # files written before the modes existed are coarse
    want_mode = expect.get("mode")
    if want_mode is not None and meta["mode"] != want_mode:
        raise ConfigError(
            "global_mode",
            f"{path} holds a {meta['mode']!r} global branch but global_mode is {want_mode!r}; "
            f"train one with `{TRAIN_COMMAND.format(model=model_hint)} --global-mode {want_mode}` or set global_mode: {meta['mode']}",
        )
    for k, v in expect.items():
        if k == "mode":
            continue
        if int(meta.get(k, -1)) != int(v):
            raise ConfigError(
                "global_weights",
                f"{path} was trained with {k}={meta.get(k)} but this model/recipe needs {k}={v}; retrain it",
            )
    module = GlobalCompressor(
        meta["vision_hidden"], meta["llm_hidden"], meta["text_dim"], meta["n_queries"], meta["mode"]
    )
    load_tensors_into(
        module, load_file(str(path)), path, f"retrain with `{TRAIN_COMMAND.format(model=model_hint)} --out {path}`"
    )
    return module.eval().requires_grad_(False), meta
