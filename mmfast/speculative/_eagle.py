"""The EAGLE-style draft trunk shared by MSD and FLASH, its KV cache, EAGLE-2 dynamic trees, weights I/O.

Architecture (EAGLE, Li et al. 2024; the ``cnets.py`` of EAGLE / MSD / FlashSD): the draft reads, at
row ``j``, the pair (target final hidden state ``h_j``, embedding of the *next* token ``x_{j+1}``)
through ``fc = Linear(2d -> d, bias)`` and **one** Llama decoder layer (the target's width, heads and
FFN; no input RMSNorm, as EAGLE's layer 0), and regresses ``h_{j+1}``; the target's **frozen**
embeddings and LM head are reused (referenced, never copied into the draft's checkpoint). Row ``j``
has position ``j`` of the draft's own sequence, so the output of the row whose next token is the root
(the last committed token) is the draft's guess of the root's hidden state, whose LM-head
distribution proposes the root's children.

Multimodal variants change only how rows are built (:meth:`DraftModel.rows`): MSD feeds the projected
visual embedding itself at rows whose next token is an image token (no ``fc``, the target hidden state
discarded); FLASH replaces each image's rows by ``C`` latent rows pooled with learnable queries. FLASH
adds a semi-autoregressive head: the layer output is mapped to ``K`` future features per row.

Inference keeps a preallocated one-layer KV cache (:class:`DraftCache`) that holds the accepted
prefix only: tree expansions append uncommitted rows, which are dropped (a pointer reset) after every
proposal; ``accept`` appends the newly accepted rows (with the target's hidden states) and commits
them. Only rows whose output is needed are used as queries (one decoder layer: the prompt and
accepted rows need keys/values, not outputs), so the prompt costs one K/V projection pass.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from .base import Drafter
from .tree import DraftTree

if TYPE_CHECKING:
    from .engine import SpecContext

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
    compress_source: str = "hidden"  # FLASH: pool the target's hidden states ("hidden") or the projected features ("embeds")

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
    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ([*pos.shape, head_dim]) from a cached table (grown on demand)."""
        need = int(pos.max()) + 1 if pos.numel() else 1
        table = self._rope_table
        w = self.fc.weight
        if table is None or table[0].shape[0] < need or table[0].device != w.device or table[0].dtype != w.dtype:
            n = max(need, 2 * (table[0].shape[0] if table is not None else 0), 1024)
            self._rotary.to(w.device)
            cos, sin = self._rotary(w, torch.arange(n, device=w.device)[None])
            table = (cos[0].to(w.dtype), sin[0].to(w.dtype))
            self.__dict__["_rope_table"] = table
        return table[0][pos], table[1][pos]

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

    def finish(self, x_q: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
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
    def rows(self, next_emb: torch.Tensor, hid: torch.Tensor, row_image: torch.Tensor, vis_src: torch.Tensor | None = None):
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
        mask = kv_valid[:, None, None, :] & (torch.arange(t, device=dev)[None, None, None, :] <= q_pad[:, None, :, None])
        out = self.finish(x_q, q, k, v, mask)
        return self.slots(out), q_valid


# ------------------------------------------------------------------------------------ inference cache


class Fused:
    """The draft's inference weights, fused and detached (q/k/v and gate/up in one matmul each).

    Inference runs plain ``F.linear`` calls on these instead of the modules: a one-layer draft step is
    ~20 small ops, so per-call overhead matters as much as FLOPs on a CPU.
    """

    def __init__(self, m: DraftModel) -> None:
        a = m.arch
        at, mlp = m.layer.self_attn, m.layer.mlp

        def cat(*mods, bias: bool):
            w = torch.cat([x.weight for x in mods]).detach()
            b = torch.cat([x.bias for x in mods]).detach() if bias else None
            return w, b

        self.w_qkv, self.b_qkv = cat(at.q_proj, at.k_proj, at.v_proj, bias=at.q_proj.bias is not None)
        self.w_o, self.b_o = at.o_proj.weight.detach(), (at.o_proj.bias.detach() if at.o_proj.bias is not None else None)
        self.w_gu, self.b_gu = cat(mlp.gate_proj, mlp.up_proj, bias=mlp.gate_proj.bias is not None)
        self.w_down = mlp.down_proj.weight.detach()
        self.b_down = mlp.down_proj.bias.detach() if mlp.down_proj.bias is not None else None
        ln = m.layer.post_attention_layernorm
        self.ln_w, self.eps = ln.weight.detach(), float(getattr(ln, "variance_epsilon", a.rms_norm_eps))
        self.w_fc, self.b_fc = m.fc.weight.detach(), m.fc.bias.detach()
        head = m._head
        self.w_head = head.weight.detach()
        self.b_head = head.bias.detach() if getattr(head, "bias", None) is not None else None
        self.w_emb = m._embed.weight.detach()
        self.silu = a.hidden_act == "silu"
        self.nq, self.nkv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.inter = a.intermediate_size

    def fc(self, emb: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.cat([emb, hid], -1), self.w_fc, self.b_fc)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w_emb)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        return F.linear(feats, self.w_head, self.b_head).float()


class DraftCache:
    """A preallocated single-layer KV cache: ``committed`` rows (the accepted prefix) plus ``n_app``
    uncommitted rows appended during a tree expansion (dropped by :meth:`rollback`)."""

    def __init__(self, model: DraftModel, capacity: int = 1024) -> None:
        a = model.arch
        w = model.fc.weight
        self.model = model
        self.f = Fused(model)
        self.k = torch.zeros(a.num_kv_heads, capacity, a.head_dim, dtype=w.dtype, device=w.device)
        self.v = torch.zeros_like(self.k)
        self.committed = 0
        self.n_app = 0

    def reset(self) -> None:
        self.committed = self.n_app = 0

    def _ensure(self, n: int) -> None:
        cap = self.k.shape[1]
        if n <= cap:
            return
        new = max(n, 2 * cap)
        k = self.k.new_zeros(self.k.shape[0], new, self.k.shape[-1])
        v = torch.zeros_like(k)
        k[:, :cap] = self.k
        v[:, :cap] = self.v
        self.k, self.v = k, v

    def rollback(self) -> None:
        self.n_app = 0

    def commit(self) -> None:
        self.committed += self.n_app
        self.n_app = 0

    def append(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        *,
        vis: torch.Tensor | None = None,
        query: torch.Tensor | slice | None = None,
    ) -> torch.Tensor:
        """Append rows x [Q, d] at positions pos [Q] (uncommitted); return outputs [nq, d] of ``query`` rows.

        ``vis`` ([Q, n_app + Q] bool) says which uncommitted rows (earlier appended ones and the new
        ones) each new row sees; the committed prefix is always visible. Default: causal among the new
        rows (and all earlier uncommitted rows visible). Same math as :meth:`DraftModel.train_forward`.
        """
        m, f = self.model, self.f
        a = m.arch
        n = x.shape[0]
        start = self.committed + self.n_app
        end = start + n
        self._ensure(end)
        cos, sin = m.rope(pos)  # [n, hd]
        if query is None:
            qkv = F.linear(x, f.w_qkv, f.b_qkv)
            q, kv, xq = qkv[:, : f.nq], qkv[:, f.nq :], x
        else:  # keys/values for every new row, a query only where an output is wanted
            kv = F.linear(x, f.w_qkv[f.nq :], None if f.b_qkv is None else f.b_qkv[f.nq :])
            xq = x[query]
            q = F.linear(xq, f.w_qkv[: f.nq], None if f.b_qkv is None else f.b_qkv[: f.nq])
        k = kv[:, : f.nkv].view(n, a.num_kv_heads, a.head_dim).transpose(0, 1)
        self.k[:, start:end] = k * cos + _rotate_half(k) * sin
        self.v[:, start:end] = kv[:, f.nkv :].view(n, a.num_kv_heads, a.head_dim).transpose(0, 1)
        self.n_app += n
        if query is not None:
            cos, sin = cos[query], sin[query]
        nq = xq.shape[0]
        q = q.reshape(nq, a.num_heads, a.head_dim).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        if vis is None:
            if query is None and n > 1:
                new = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
                mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=x.device), new], 1)
            elif query is None or (isinstance(query, slice) and query.stop in (None, n) and nq == 1):
                mask = None  # a single last row sees everything
            else:
                idx = torch.arange(n, device=x.device)
                new = idx[query].reshape(-1, 1) >= idx[None, :]
                mask = torch.cat([torch.ones(nq, start, dtype=torch.bool, device=x.device), new], 1)
        else:
            vq = vis if query is None else vis[query]
            mask = torch.cat([torch.ones(vq.shape[0], self.committed, dtype=torch.bool, device=x.device), vq], 1)
        out = F.scaled_dot_product_attention(
            q[None], self.k[None, :, :end], self.v[None, :, :end],
            attn_mask=None if mask is None else mask[None, None], enable_gqa=a.num_kv_heads != a.num_heads,
        )
        h = xq + F.linear(out[0].transpose(0, 1).reshape(nq, f.nq), f.w_o, f.b_o)
        y = F.rms_norm(h, (h.shape[-1],), f.ln_w, f.eps)
        if f.silu:
            g, u = F.linear(y, f.w_gu, f.b_gu).split(f.inter, -1)
            return h + F.linear(F.silu(g) * u, f.w_down, f.b_down)
        return h + m.layer.mlp(y)


# ------------------------------------------------------------------------------------ trees


def select_tree(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, total: int) -> DraftTree:
    """EAGLE-2's rerank: keep the ``total`` best candidates by cumulative log-prob.

    Candidates are in level order (parents before children, ``parents`` = candidate index or -1 for
    the root). A stable descending sort keeps ancestors first among ties, and a child's cumulative
    score never exceeds its parent's, so the kept set is closed under ancestors.
    """
    n = int(scores.numel())
    total = min(total, n)
    order = torch.sort(scores, descending=True, stable=True).indices[:total]
    keep = torch.sort(order).values  # back to level order: parents before children
    new_id = torch.zeros(n, dtype=torch.long, device=scores.device)
    new_id[keep] = torch.arange(1, total + 1, device=scores.device)
    par = parents[keep]
    tree_par = torch.where(par < 0, torch.zeros_like(par), new_id[par.clamp(min=0)])
    if bool(((par >= 0) & (tree_par == 0)).any()):  # an ancestor fell out (ties at -inf): drop such nodes
        ok = ~((par >= 0) & (tree_par == 0))
        return select_tree(tokens[keep][ok], scores[keep][ok], _reindex(par, ok), int(ok.sum()))
    return DraftTree(tokens[keep].clone(), tree_par)


def _reindex(par: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    new = torch.cumsum(ok.long(), 0) - 1
    out = torch.where(par >= 0, new[par.clamp(min=0)], par)
    return out[ok]


class EagleDrafter(Drafter):
    """An EAGLE-style drafter over :class:`DraftModel`; subclasses build the tree in :meth:`propose`."""

    needs_hidden: ClassVar[bool] = True
    kind: ClassVar[str] = ""

    def install(self) -> None:
        mm = self.session.mm
        path = resolve_weights(getattr(self.config, "weights", None), mm, self.kind)
        self.model = load_draft(path, mm, self.kind)
        self.cache = DraftCache(self.model)
        self.root_slots: torch.Tensor | None = None  # [K, d] the draft's features at the root row
        self.pos = 0  # draft position of the next committed row

    # -- sequence start -----------------------------------------------------------------------------
    def _prompt_hidden(self, ctx: SpecContext) -> torch.Tensor:
        """[L, d] target final hidden states of the prompt (pruned slots of an in-LLM pruner: zeros)."""
        hidden = ctx.prefill.hidden[0]
        length = ctx.inputs.length
        if hidden.shape[0] == length:
            return hidden
        full = hidden.new_zeros(length, hidden.shape[-1])
        src = ctx.state.groups[-1].source[0]
        if src.numel() == hidden.shape[0]:
            ok = src >= 0
            full[src[ok]] = hidden[ok]
        else:  # the layout changed after prefill (a KV policy): align on the last (text) positions
            n = min(length, hidden.shape[0])
            full[-n:] = hidden[-n:]
        return full

    @torch.inference_mode()
    def begin(self, ctx: SpecContext) -> None:
        if ctx.prefill is None or ctx.prefill.hidden.shape[1] < 2 and ctx.inputs.length > 1:
            raise RuntimeError(f"{self.kind}: the engine must pass the prompt's hidden states (needs_hidden)")
        m = self.model
        inp = ctx.inputs
        hid = self._prompt_hidden(ctx).to(m.fc.weight.dtype)  # [L, d]
        root = torch.tensor([ctx.committed[-1]], device=inp.input_ids.device)
        emb = inp.embeds[0].to(hid.dtype)
        next_emb = torch.cat([emb[1:], m.embed(root).to(hid.dtype)])  # [L, d] embedding of token j+1
        img = torch.where(inp.image_mask[0], inp.image_index[0], torch.full_like(inp.image_index[0], -1))
        row_image = torch.cat([img[1:], img.new_full((1,), -1)])
        vis_src = None
        if m.arch.n_latents and m.arch.compress_source == "hidden":
            vis_src = torch.cat([hid[1:], hid[-1:]])  # hidden state of token j+1 at visual rows
        x, _ = m.rows(next_emb, hid, row_image, vis_src)
        self.cache.reset()
        n = x.shape[0]
        pos = torch.arange(n, device=x.device)
        out = self.cache.append(x, pos, query=slice(n - 1, n))  # K/V for every row, output of the last
        self.cache.commit()
        self.pos = n
        self.root_slots = m.slots(out[-1])
        self._count(ctx, forwards=1)

    @torch.inference_mode()
    def accept(self, ctx: SpecContext, tree: DraftTree, path: list[int], hidden: torch.Tensor, bonus: int) -> None:
        m = self.model
        self.cache.rollback()
        toks = [int(tree.tokens[i - 1]) for i in path] + [int(bonus)]
        ids = torch.tensor(toks, device=hidden.device)
        h = hidden.to(m.fc.weight.dtype)
        f = self.cache.f
        x = f.fc(f.embed(ids).to(h.dtype), h)  # generated tokens are text rows
        n = x.shape[0]
        pos = torch.arange(self.pos, self.pos + n, device=x.device)
        out = self.cache.append(x, pos, query=slice(n - 1, n))
        self.cache.commit()
        self.pos += n
        self.root_slots = m.slots(out[-1])
        self._count(ctx, forwards=1)

    # -- helpers --------------------------------------------------------------------------------------
    @staticmethod
    def _count(ctx: SpecContext, forwards: int = 0, tokens: int = 0) -> None:
        if forwards:
            ctx.extras["draft_forwards"] = ctx.extras.get("draft_forwards", 0) + forwards
        if tokens:
            ctx.extras["draft_tokens"] = ctx.extras.get("draft_tokens", 0) + tokens

    def _logp(self, feats: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.cache.f.logits(feats), dim=-1)

    @torch.inference_mode()
    def eagle2_tree(self, depth: int, top_k: int, total: int, early_stop: bool = True) -> tuple[DraftTree, int]:
        """EAGLE-2 dynamic tree (``cnets1.topK_genrate``) from the root row's feature.

        Level 1: the top-k tokens of the root's draft distribution. Then ``depth`` times: the k
        frontier nodes go through the draft in **one** forward (same position for the whole level, tree
        mask over their ancestors), each proposes its top-k children, cumulative log-probs score the
        k^2 candidates and the k best become the next frontier. Finally all candidates (k + depth k^2)
        are reranked and the ``total`` best kept. Returns the tree and the number of draft forwards.

        Expansion stops early once the best frontier score is no better than the ``total - 1``-th best
        candidate so far: cumulative log-probs never increase along a path, so no deeper candidate could
        enter the kept set and the tree is exactly the one the full expansion would keep.
        """
        m, cache = self.model, self.cache
        f = cache.f
        dev = m.fc.weight.device
        k = max(1, min(top_k, m.arch.vocab_size))
        logp = self._logp(self.root_slots[0])
        score, tok = logp.topk(k)
        toks, scores, parents = [tok], [score], [torch.full((k,), -1, dtype=torch.long, device=dev)]
        front_ids = torch.arange(k, device=dev)  # candidate index of each frontier node
        front_feat = self.root_slots[0].expand(k, -1)
        n_cand = k
        vis = torch.zeros(depth * k, depth * k, dtype=torch.bool, device=dev)
        parent_rows = None
        eye = torch.eye(k, dtype=torch.bool, device=dev)
        n_keep = max(1, total - 1)
        forwards = 0
        for i in range(depth):
            if early_stop and n_cand >= n_keep and float(score[0]) <= float(torch.cat(scores).topk(n_keep).values[-1]):
                break  # score is sorted (topk): score[0] is the best frontier node
            r0 = i * k
            if parent_rows is not None:
                vis[r0 : r0 + k, :r0] = vis[parent_rows, :r0]
            vis[r0 : r0 + k, r0 : r0 + k] = eye
            x = f.fc(f.embed(tok).to(front_feat.dtype), front_feat)
            pos = torch.full((k,), self.pos + i, device=dev, dtype=torch.long)
            out = cache.append(x, pos, vis=vis[r0 : r0 + k, : r0 + k])
            logp = self._logp(out)  # [k, V]
            s2, t2 = logp.topk(k, dim=-1)  # [k, k]
            cu = (s2 + score[:, None]).reshape(-1)
            toks.append(t2.reshape(-1))
            scores.append(cu)
            parents.append(front_ids.repeat_interleave(k))
            score, sel = cu.topk(k)
            tok = t2.reshape(-1)[sel]
            front_ids = n_cand + sel
            front_feat = out[sel // k]
            parent_rows = r0 + sel // k
            n_cand += k * k
            forwards += 1
        cache.rollback()
        tree = select_tree(torch.cat(toks), torch.cat(scores), torch.cat(parents), n_keep)
        return tree, forwards


# ------------------------------------------------------------------------------------ weights I/O


def _model_dir(mm) -> Path | None:
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
    want = DraftArch.for_target(tc, kind, sar_k=arch.sar_k, n_latents=arch.n_latents, compress_source=arch.compress_source)
    if want != arch:
        raise ModelLoadError(f"the {kind} draft in {path} was trained for another target ({arch} vs {want}); retrain with `{cmd}`")
    model = DraftModel(arch, getattr(tc, "rope_parameters", None), getattr(tc, "max_position_embeddings", 4096))
    model.load_state_dict(load_file(str(wfile)), strict=True)
    model.to(device=mm.device, dtype=mm.dtype).eval().requires_grad_(False)
    return model.attach(mm.adapter.language_model.embed_tokens, mm.adapter.lm_head)


def write_random_draft(mm, kind: str, path: str | Path, seed: int = 0, **arch_kw: Any) -> Path:
    """Untrained (random) draft weights for ``mm`` in ``path`` (tests, smoke runs)."""
    torch.manual_seed(seed)
    return save_draft(build_draft(mm, kind, **arch_kw), path, {"trained": False})
