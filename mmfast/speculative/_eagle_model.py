"""The EAGLE-style draft model shared by MSD and FLASH: architecture, rows, training forward, weights I/O.

See :mod:`mmfast.speculative._eagle` for the inference side (KV cache, EAGLE-2 trees, the drafter).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError, load_tensors_into

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TRAIN_COMMAND = "python scripts/train_drafts.py --draft {kind} --model {model}"


# ------------------------------------------------------------------------------------ architecture


@dataclass(frozen=True)
class DraftArch:
    """Sizes of a draft (saved as ``config.json`` next to the weights)."""

    kind: str  # "msd" | "flash"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sar_k: int = 1  # FLASH: future features predicted per row (1 = plain EAGLE head)
    n_latents: int = 0  # FLASH: latent queries per image (0 = no compression)
    compress_source: str = (
        "hidden"  # FLASH: pool the target's hidden states ("hidden") or the projected features ("embeds")
    )

    @staticmethod
    def for_target(text_config, kind: str, **kw: Any) -> DraftArch:
        tc = text_config
        heads = tc.num_attention_heads
        return DraftArch(
            kind=kind,
            hidden_size=tc.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            intermediate_size=tc.intermediate_size,
            rms_norm_eps=tc.rms_norm_eps,
            vocab_size=tc.vocab_size,
            attention_bias=bool(getattr(tc, "attention_bias", False)),
            mlp_bias=bool(getattr(tc, "mlp_bias", False)),
            hidden_act=getattr(tc, "hidden_act", "silu"),
            **kw,
        )


def _llama_config(arch: DraftArch, rope_parameters: dict | None, max_positions: int):
    from transformers import LlamaConfig

    kw = {}
    if rope_parameters is not None:
        kw["rope_parameters"] = dict(rope_parameters)
    return LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        attention_bias=arch.attention_bias,
        mlp_bias=arch.mlp_bias,
        hidden_act=arch.hidden_act,
        max_position_embeddings=max_positions,
        **kw,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DraftModel(nn.Module):
    """fc + one Llama decoder layer (+ FLASH's latent queries and semi-AR head) over a frozen target's
    embeddings and LM head (attached with :meth:`attach`, not part of ``state_dict``)."""

    def __init__(self, arch: DraftArch, rope_parameters: dict | None = None, max_positions: int = 4096) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        self.arch = arch
        d = arch.hidden_size
        cfg = _llama_config(arch, rope_parameters, max_positions)
        self.fc = nn.Linear(2 * d, d, bias=True)
        layer = LlamaDecoderLayer(cfg, layer_idx=0)
        del layer.input_layernorm  # EAGLE's draft layer (index 0) has no input norm: fc output goes straight in
        self.layer = layer
        if arch.sar_k > 1:
            # FLASH's semi-AR projection (FlashSD llama_sar.py ``ar_proj``): d -> 4d -> K*d
            self.sar = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, arch.sar_k * d))
        if arch.n_latents > 0:
            self.latents = nn.Parameter(torch.randn(arch.n_latents, d) * 0.02)  # FLASH's query matrix C (C x d)
        self.__dict__["_rotary"] = LlamaRotaryEmbedding(cfg)  # no parameters; kept out of state_dict
        self.__dict__["_rope_table"] = None
        self.__dict__["_embed"] = None
        self.__dict__["_head"] = None

    # -- frozen target parts ------------------------------------------------------------------------
    def attach(self, embed: nn.Module, head: nn.Module) -> DraftModel:
        """Reference the target's token embeddings and LM head (frozen; never saved with the draft)."""
        self.__dict__["_embed"] = embed
        self.__dict__["_head"] = head
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed(ids)

    def head(self, feats: torch.Tensor) -> torch.Tensor:
        return self._head(feats)

    @property
    def n_slots(self) -> int:
        return self.arch.sar_k

    # -- the decoder layer --------------------------------------------------------------------------
    def rope(self, pos: torch.Tensor, max_pos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ([*pos.shape, head_dim]) from a cached table (grown on demand). ``max_pos``: a bound
        on ``pos`` the caller knows on the host (saves reading the largest position from the device)."""
        table = self.rope_table((int(pos.max()) if max_pos is None else max_pos) if pos.numel() else 0)
        return table[0][pos], table[1][pos]

    def rope_table(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached cos, sin tables ([n, hd] each), grown (doubled, at least 1024 rows) to cover ``max_pos``;
        a captured draft step reads them at fixed addresses (its key names the table)."""
        table = self._rope_table
        w = self.fc.weight
        if table is None or table[0].shape[0] <= max_pos or table[0].device != w.device or table[0].dtype != w.dtype:
            n = max(max_pos + 1, 2 * (table[0].shape[0] if table is not None else 0), 1024)
            self._rotary.to(w.device)
            cos, sin = self._rotary(w, torch.arange(n, device=w.device)[None])
            table = (cos[0].to(w.dtype), sin[0].to(w.dtype))
            self.__dict__["_rope_table"] = table
        return table

    def qkv(self, x: torch.Tensor, pos: torch.Tensor, *, q: bool = True, kv: bool = True):
        """Rotated q [B, H, T, hd] and k, v [B, Hkv, T, hd] of rows x [B, T, d] at positions pos [B, T]."""
        a = self.arch
        attn = self.layer.self_attn
        b, t, _ = x.shape
        cos, sin = self.rope(pos)
        cos, sin = cos[:, None], sin[:, None]
        out_q = out_k = out_v = None
        if q:
            out_q = attn.q_proj(x).view(b, t, a.num_heads, a.head_dim).transpose(1, 2)
            out_q = out_q * cos + _rotate_half(out_q) * sin
        if kv:
            out_k = attn.k_proj(x).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
            out_k = out_k * cos + _rotate_half(out_k) * sin
            out_v = attn.v_proj(x).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        return out_q, out_k, out_v

    def finish(
        self, x_q: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of queries q over k/v (bool mask [B|1, 1, Q, T], True = attend), o_proj, MLP."""
        a = self.arch
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=a.num_kv_heads != a.num_heads)
        b, _, nq, _ = out.shape
        h = x_q + self.layer.self_attn.o_proj(out.transpose(1, 2).reshape(b, nq, a.num_heads * a.head_dim))
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def slots(self, o: torch.Tensor) -> torch.Tensor:
        """[..., d] layer outputs -> [..., K, d] predicted features of the next K positions (K = 1: EAGLE)."""
        if self.arch.sar_k == 1:
            return o.unsqueeze(-2)
        d = self.arch.hidden_size
        return o.unsqueeze(-2) + self.sar(o).view(*o.shape[:-1], self.arch.sar_k, d)

    # -- rows ---------------------------------------------------------------------------------------
    def rows(
        self, next_emb: torch.Tensor, hid: torch.Tensor, row_image: torch.Tensor, vis_src: torch.Tensor | None = None
    ):
        """Draft input rows of one sequence.

        Args:
            next_emb: [R, d] target input embedding of token j+1 (the projected feature for an image token).
            hid: [R, d] target final hidden state at j.
            row_image: [R] long, image index of token j+1 (-1: a text token).
            vis_src: [R, d] FLASH's pooling source at visual rows (the target hidden state of the image
                token, or its projected feature); defaults to ``next_emb``.

        Returns:
            x: [R', d] rows, and src: [R'] long, the source row j of each (-1 for a latent row).
        """
        text = row_image < 0
        r = next_emb.shape[0]
        dev = next_emb.device
        hid = hid.to(next_emb.dtype)
        if bool(text.all()):
            return self.fc(torch.cat([next_emb, hid], -1)), torch.arange(r, device=dev)
        tidx = text.nonzero().squeeze(1)
        # fc at text rows only; MSD: visual rows take the projected visual embedding itself
        fc = next_emb.index_copy(0, tidx, self.fc(torch.cat([next_emb[tidx], hid[tidx]], -1)))
        if self.arch.n_latents == 0:
            return fc, torch.arange(r, device=dev)
        # FLASH: each image's rows are replaced by C latent rows pooled from its features
        src_feats = next_emb if vis_src is None else vis_src
        parts, srcs = [], []
        start = 0
        img = row_image.tolist()
        j = 0
        while j < r:
            if img[j] < 0:
                j += 1
                continue
            if j > start:
                parts.append(fc[start:j])
                srcs.append(torch.arange(start, j, device=dev))
            k = j
            while k < r and img[k] == img[j]:
                k += 1
            feats = src_feats[j:k].to(fc.dtype)  # [N, d]
            attn = torch.softmax(self.latents.to(fc.dtype) @ feats.T, dim=-1)  # [C, N]
            parts.append(attn @ feats)  # [C, d]
            srcs.append(torch.full((self.arch.n_latents,), -1, device=dev, dtype=torch.long))
            start = j = k
        if start < r:
            parts.append(fc[start:])
            srcs.append(torch.arange(start, r, device=dev))
        return torch.cat(parts), torch.cat(srcs)

    # -- training forward ---------------------------------------------------------------------------
    def train_forward(self, samples: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted features at the query rows of a batch of sequences.

        Each sample: ``next_emb``, ``hid`` (noised input hidden states), ``row_image``, optional
        ``vis_src`` (see :meth:`rows`) and ``query`` ([Q_i] long, source rows j whose output is trained;
        text rows). Returns predictions [B, Qmax, K, d] and a validity mask [B, Qmax].
        """
        xs, qidx = [], []
        for s in samples:
            x, src = self.rows(s["next_emb"], s["hid"], s["row_image"], s.get("vis_src"))
            inv = torch.full((s["next_emb"].shape[0],), -1, dtype=torch.long, device=x.device)
            keep = src >= 0
            inv[src[keep]] = torch.arange(x.shape[0], device=x.device)[keep]
            q = inv[s["query"]]
            if bool((q < 0).any()):
                raise ValueError("query rows must be text rows")
            xs.append(x)
            qidx.append(q)
        b = len(xs)
        t = max(x.shape[0] for x in xs)
        nq = max(max(q.numel() for q in qidx), 1)
        d = self.arch.hidden_size
        dev = xs[0].device
        x_pad = xs[0].new_zeros(b, t, d)
        kv_valid = torch.zeros(b, t, dtype=torch.bool, device=dev)
        q_pad = torch.zeros(b, nq, dtype=torch.long, device=dev)
        q_valid = torch.zeros(b, nq, dtype=torch.bool, device=dev)
        for i, (x, q) in enumerate(zip(xs, qidx)):
            x_pad[i, : x.shape[0]] = x
            kv_valid[i, : x.shape[0]] = True
            q_pad[i, : q.numel()] = q
            q_valid[i, : q.numel()] = True
        pos = torch.arange(t, device=dev).expand(b, t)
        _, k, v = self.qkv(x_pad, pos, q=False)
        x_q = x_pad.gather(1, q_pad[:, :, None].expand(-1, -1, d))
        q, _, _ = self.qkv(x_q, q_pad, kv=False)
        mask = kv_valid[:, None, None, :] & (
            torch.arange(t, device=dev)[None, None, None, :] <= q_pad[:, None, :, None]
        )
        out = self.finish(x_q, q, k, v, mask)
        return self.slots(out), q_valid


# ------------------------------------------------------------------------------------ weights I/O


def _model_dir(mm) -> Path | None:
    if hasattr(mm, "model_path"):  # a MethodContext
        p = mm.model_path
    else:
        p = getattr(mm.model, "name_or_path", None) or getattr(mm.model.config, "_name_or_path", None)
    return Path(p) if p and Path(p).is_dir() else None


def resolve_weights(weights: str | None, mm, kind: str) -> Path:
    """The draft directory: ``weights``, else ``<model dir>/<kind>``."""
    if weights:
        return Path(weights).expanduser()
    d = _model_dir(mm)
    if d is None:
        raise ModelLoadError(
            f"{kind}: the model {mm.name!r} has no local directory to look for <model dir>/{kind}/; set "
            f"params.weights to a draft trained with `{TRAIN_COMMAND.format(kind=kind, model=mm.name)}`"
        )
    return d / kind


def save_draft(model: DraftModel, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` (draft parameters only) and ``config.json`` into directory ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
    tmp = path / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp))
    tmp.rename(path / WEIGHTS)
    (path / CONFIG).write_text(json.dumps({"arch": asdict(model.arch), **(meta or {})}, indent=1))
    return path


def build_draft(mm, kind: str, **arch_kw: Any) -> DraftModel:
    """An untrained draft for ``mm`` (attached to its embeddings and LM head), on the model's device/dtype."""
    tc = mm.adapter.text_config
    arch = DraftArch.for_target(tc, kind, **arch_kw)
    model = DraftModel(arch, getattr(tc, "rope_parameters", None), getattr(tc, "max_position_embeddings", 4096))
    model.to(device=mm.device, dtype=mm.dtype)
    return model.attach(mm.adapter.language_model.embed_tokens, mm.adapter.lm_head)


def load_draft(path: str | Path, mm, kind: str) -> DraftModel:
    """Load a trained draft for ``mm``; clear errors for a missing directory or a mismatched target."""
    from safetensors.torch import load_file

    path = Path(path)
    wfile, cfile = path / WEIGHTS, path / CONFIG
    cmd = TRAIN_COMMAND.format(kind=kind, model=mm.name)
    if not wfile.is_file() or not cfile.is_file():
        raise ModelLoadError(
            f"{kind} draft weights not found in {path} (need {WEIGHTS} and {CONFIG}). Train them with "
            f"`{cmd}` (writes <model dir>/{kind}/), or set params.weights to a trained draft directory"
        )
    meta = json.loads(cfile.read_text())
    arch = DraftArch(**meta["arch"])
    if arch.kind != kind:
        raise ModelLoadError(f"{path} holds a {arch.kind!r} draft, not {kind!r}")
    tc = mm.adapter.text_config
    want = DraftArch.for_target(
        tc, kind, sar_k=arch.sar_k, n_latents=arch.n_latents, compress_source=arch.compress_source
    )
    if want != arch:
        raise ModelLoadError(
            f"the {kind} draft in {path} was trained for another target ({arch} vs {want}); retrain with `{cmd}`"
        )
    model = DraftModel(arch, getattr(tc, "rope_parameters", None), getattr(tc, "max_position_embeddings", 4096))
    load_tensors_into(model, load_file(str(wfile)), wfile, f"retrain with `{cmd}`")
    model.to(device=mm.device, dtype=mm.dtype).eval().requires_grad_(False)
    return model.attach(mm.adapter.language_model.embed_tokens, mm.adapter.lm_head)


def write_random_draft(mm, kind: str, path: str | Path, seed: int = 0, **arch_kw: Any) -> Path:
    """Untrained (random) draft weights for ``mm`` in ``path`` (tests, smoke runs)."""
    torch.manual_seed(seed)
    return save_draft(build_draft(mm, kind, **arch_kw), path, {"trained": False})
