"""The EAGLE-style draft's inference weights and its one-layer KV cache (MSD, FLASH; :mod:`._eagle`).

A preallocated one-layer KV cache (:class:`DraftCache`) holds the accepted prefix only: tree expansions
append uncommitted rows, which are dropped (a pointer reset) after every proposal; ``accept`` appends the
newly accepted rows (with the target's hidden states) and commits them. Only rows whose output is needed
are used as queries (one decoder layer: the prompt and accepted rows need keys/values, not outputs), so
the prompt costs one K/V projection pass. The ``*_static`` appends are the same layer in fixed shapes with
their slots and counts on the device, for the drafters' captured steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._eagle_model import DraftModel, _rotate_half


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
        self.w_o, self.b_o = (
            at.o_proj.weight.detach(),
            (at.o_proj.bias.detach() if at.o_proj.bias is not None else None),
        )
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
        max_pos: int | None = None,
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
        cos, sin = m.rope(pos, max_pos)  # [n, hd]
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
            q[None],
            self.k[None, :, :end],
            self.v[None, :, :end],
            attn_mask=None if mask is None else mask[None, None],
            enable_gqa=a.num_kv_heads != a.num_heads,
        )
        return self._finish(xq, out[0])

    def _finish(self, xq: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer after attention: rows xq [nq, d] and their attention output [H, nq, hd] -> [nq, d]."""
        f = self.f
        nq = xq.shape[0]
        h = xq + F.linear(attn.transpose(0, 1).reshape(nq, f.nq), f.w_o, f.b_o)
        y = F.rms_norm(h, (h.shape[-1],), f.ln_w, f.eps)
        if f.silu:
            g, u = F.linear(y, f.w_gu, f.b_gu).split(f.inter, -1)
            return h + F.linear(F.silu(g) * u, f.w_down, f.b_down)
        return h + self.model.layer.mlp(y)

    def append_rows_static(
        self, x: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, committed: torch.Tensor, vis: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`append` with ``vis`` in fixed shapes and without a host read (a captured tree level): rows
        ``x`` [Q, d] at positions ``pos`` [Q], written at slots ``start`` ([1], on the device) + 0..Q-1, the
        uncommitted rows being the A slots from ``committed`` ([1]) on, of which each row sees those ``vis``
        ([Q, A] bool) marks and every committed slot. Returns every row's output [Q, d]."""
        m, f = self.model, self.f
        a = m.arch
        n, n_app = x.shape[0], vis.shape[1]
        cos_t, sin_t = m.rope_table(0)  # covers pos: the captured step ensured it
        cos, sin = cos_t.index_select(0, pos), sin_t.index_select(0, pos)  # [Q, hd]
        qkv = F.linear(x, f.w_qkv, f.b_qkv)
        q, kv = qkv[:, : f.nq], qkv[:, f.nq :]
        k = kv[:, : f.nkv].view(n, a.num_kv_heads, a.head_dim).transpose(0, 1)  # [Hkv, Q, hd]
        slots = start + torch.arange(n, device=x.device)  # [Q]
        self.k.index_copy_(1, slots, k * cos + _rotate_half(k) * sin)
        self.v.index_copy_(1, slots, kv[:, f.nkv :].view(n, a.num_kv_heads, a.head_dim).transpose(0, 1))
        q = q.reshape(n, a.num_heads, a.head_dim).transpose(0, 1)  # [H, Q, hd]
        q = q * cos + _rotate_half(q) * sin
        slot = torch.arange(self.k.shape[1], device=x.device)  # [C]
        mask = (slot < committed).expand(n, -1).clone()  # [Q, C]: the committed prefix
        mask.index_copy_(1, committed + torch.arange(n_app, device=x.device), vis)  # the uncommitted rows
        out = F.scaled_dot_product_attention(
            q[None], self.k[None], self.v[None], attn_mask=mask[None, None], enable_gqa=a.num_kv_heads != a.num_heads
        )
        return self._finish(x, out[0])

    def append_last_static(
        self, x: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, n: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`append` of rows whose last real one is the query, in fixed shapes and without a host read
        (what a captured accept runs): ``x`` [P, d] rows at positions ``pos`` [P], of which the first ``n``
        ([1] long, on the device) are real, written at slots ``start`` ([1]) + 0..P-1; the output [1, d] of
        row n - 1, which sees the slots before ``start + n``. The pad rows' keys and values land beyond them
        (overwritten by the next append). The rope table must cover ``pos`` and the buffers ``start + P``."""
        m, f = self.model, self.f
        a = m.arch
        rows = x.shape[0]
        cos_t, sin_t = m.rope_table(0)  # covers pos: the captured step ensured it
        cos, sin = cos_t.index_select(0, pos), sin_t.index_select(0, pos)  # [P, hd]
        kv = F.linear(x, f.w_qkv[f.nq :], None if f.b_qkv is None else f.b_qkv[f.nq :])  # [P, 2 nkv]
        k = kv[:, : f.nkv].view(rows, a.num_kv_heads, a.head_dim).transpose(0, 1)  # [Hkv, P, hd]
        slots = start + torch.arange(rows, device=x.device)  # [P]
        self.k.index_copy_(1, slots, k * cos + _rotate_half(k) * sin)
        self.v.index_copy_(1, slots, kv[:, f.nkv :].view(rows, a.num_kv_heads, a.head_dim).transpose(0, 1))
        last = n - 1  # [1]
        xq = x.index_select(0, last)  # [1, d]
        q = F.linear(xq, f.w_qkv[: f.nq], None if f.b_qkv is None else f.b_qkv[: f.nq])
        q = q.reshape(1, a.num_heads, a.head_dim).transpose(0, 1)  # [H, 1, hd]
        q = q * cos.index_select(0, last) + _rotate_half(q) * sin.index_select(0, last)
        held = torch.arange(self.k.shape[1], device=x.device) < start + n  # [C]
        out = F.scaled_dot_product_attention(
            q[None],
            self.k[None],
            self.v[None],
            attn_mask=held[None, None, None],
            enable_gqa=a.num_kv_heads != a.num_heads,
        )
        return self._finish(xq, out[0])
