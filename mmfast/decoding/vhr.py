"""VHR: Vision-aware Head Reinforcement (He et al., ACL 2025, "Cracking the Code of Hallucination in
LVLMs with Vision-aware Head Divergence").

Algorithm (Alg. 1), at the first generated token only: the prompt with the image and the same prompt
without it run side by side (one batch, left-padded). Layer by layer over L_r = {1} U {last 14 of 32},
at the last position, VHD_{l,i} = ||A_{l,i}(image) - A_{l,i}(text only)||_2 with A_{l,i} head i's
attention output before W_O (the ``o_proj`` input slice); heads with VHD > mean + std *and* text-only
energy ||A_{l,i}(text)||^2 > mean + std are zeroed (negatively vision-sensitive outliers); heads with
VHD above the layer's median are scaled by alpha (2) -- in that same forward, so later layers are
measured on the reinforced stream. The head set is then frozen for every later step (cache-consistent).
Hook points: a forward pre-hook on each chosen layer's ``self_attn.o_proj``. Cost: one extra
text-only prefill at t = 0, nothing after. Whether the text-only stream is reinforced too is unstated
in the paper: ``reinforce_text_stream`` (default false). Limits: greedy or sampling (no beam here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import opt
from ..models.base import LMInputs
from ..registry import DECODERS
from .base import Decoder, DecodeOutput, DecodeRequest
from .loop import autoregressive, sample_from, warpers


def paper_layers(n_layers: int) -> list[int]:
    """{1} U {the last 14/32 of the layers}: 0-based {1, 18..31} for a 32-layer LLM."""
    n_last = max(1, round(14 * n_layers / 32))
    return sorted({min(1, n_layers - 1)} | set(range(n_layers - n_last, n_layers)))


def select_heads(vhd: torch.Tensor, text_energy: torch.Tensor) -> torch.Tensor:
    """Heads to reinforce ([B, H] bool) from VHD and text-only energy ([B, H]), per VHR's Alg. 1."""
    def outlier(x: torch.Tensor) -> torch.Tensor:
        return x > x.mean(-1, keepdim=True) + x.std(-1, keepdim=True)

    filtered = vhd.masked_fill(outlier(vhd) & outlier(text_energy), 0.0)
    return filtered > filtered.median(dim=-1, keepdim=True).values


@DECODERS.register("vhr", description="VHR: reinforce vision-aware attention heads chosen at the first token")
class VHR(Decoder):
    """Vision-aware Head Reinforcement."""

    @dataclass(frozen=True)
    class Config:
        alpha: float = opt(2.0, lo=0.0, hi=10.0, doc="scale of the selected heads (1 = off)")
        layers: tuple[int, ...] | None = opt(None, doc="0-based layers L_r; default {1} U last 14/32 of the LLM")
        reinforce_text_stream: bool = opt(False, doc="also scale heads in the text-only stream at t = 0")
        sample: bool = opt(False, doc="sample instead of greedy")
        temperature: float = opt(1.0, lo=1e-4, hi=100.0)
        top_p: float = opt(1.0, lo=0.0, hi=1.0)
        top_k: int = opt(0, lo=0)

    def install(self) -> None:
        adapter = self.ctx.adapter
        n = len(adapter.layers)
        self.layers = list(self.config.layers) if self.config.layers is not None else paper_layers(n)
        bad = [layer for layer in self.layers if not 0 <= layer < n]
        if bad:
            raise ValueError(f"vhr layers {bad} do not exist in this {n}-layer LLM")
        self.heads = adapter.text_config.num_attention_heads
        self.phase = "off"  # "select" (t = 0 joint prefill) | "apply" (frozen heads) | "off"
        self.selected: dict[int, torch.Tensor] = {}
        self.n_image_rows = 0
        if self.config.alpha != 1.0:
            for layer in self.layers:
                self.ctx.hooks.pre_hook(adapter.layers[layer].self_attn.o_proj, self._hook(layer))

    def _hook(self, layer: int):
        def pre_hook(module, args):
            if self.phase == "off":
                return None
            x = args[0]  # [rows, T, H*D] per-head outputs, concatenated
            rows, t, hd = x.shape
            heads = x.view(rows, t, self.heads, hd // self.heads)  # [rows, T, H, D]
            if self.phase == "select":
                b = self.n_image_rows
                img, txt = heads[:b, -1].float(), heads[b:, -1].float()  # [B, H, D] at the last position
                vhd = (img - txt).norm(dim=-1)  # [B, H]
                self.selected[layer] = select_heads(vhd, txt.pow(2).sum(-1))
                mask = self.selected[layer]
                if self.config.reinforce_text_stream:
                    mask = torch.cat([mask, mask])
                else:
                    mask = torch.cat([mask, torch.zeros_like(mask)])
            else:
                mask = self.selected[layer]
            scale = 1 + (self.config.alpha - 1) * mask.to(x.dtype)  # [rows, H]
            return ((heads * scale[:, None, :, None]).view(rows, t, hd),)

        return pre_hook

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        cfg = self.config
        gens = req.generators(self.ctx.device)  # one per sample (the image rows)
        procs = warpers(cfg.temperature, cfg.top_k, cfg.top_p)

        def choose(logits, step, state):
            return sample_from(procs(None, logits), gens) if cfg.sample else logits.argmax(-1)

        if cfg.alpha == 1.0:
            return autoregressive(self.ctx, req.inputs, choose, req.max_new_tokens)
        bsz = req.inputs.batch_size
        text = self.ctx.text_only_inputs(req.batch)
        joint = _left_pad_cat(req.inputs, text, self.ctx.special.pad, self.ctx.adapter)
        self.n_image_rows = bsz
        self.phase = "select"
        try:
            out = autoregressive(self.ctx, joint, choose, req.max_new_tokens, on_prefill=self._after_prefill, batch_size=bsz)
        finally:
            self.phase = "off"
        out.tokens = out.tokens[:bsz]
        out.stats = {
            "per_sample_reinforced_heads": [
                {str(layer): int(m[b].sum()) for layer, m in self.selected.items()} for b in range(bsz)
            ]
        }
        return out

    def _after_prefill(self, state, step_out) -> None:
        """Freeze the heads and drop the text-only rows: decoding continues on the image stream."""
        keep = torch.arange(self.n_image_rows, device=step_out.logits.device)
        state.reorder(keep)
        step_out.logits = step_out.logits[keep]
        step_out.hidden = step_out.hidden[keep]
        self.phase = "apply"


def _left_pad_cat(a: LMInputs, b: LMInputs, pad_id: int, adapter) -> LMInputs:
    """Stack two input batches of different lengths with joint left padding."""
    length = max(a.length, b.length)

    def pad(x: LMInputs) -> LMInputs:
        n = length - x.length
        if n == 0:
            return x
        bsz = x.batch_size
        dev = x.input_ids.device
        pad_ids = torch.full((bsz, n), pad_id, dtype=torch.long, device=dev)
        pad_emb = adapter.embed_tokens(pad_ids).to(x.embeds.dtype)
        zeros = torch.zeros(bsz, n, dtype=x.attention_mask.dtype, device=dev)
        neg = torch.full((bsz, n), -1, dtype=torch.long, device=dev)
        return LMInputs(
            torch.cat([pad_emb, x.embeds], 1),
            torch.cat([pad_ids, x.input_ids], 1),
            torch.cat([zeros, x.attention_mask], 1),
            torch.cat([torch.ones_like(zeros), x.position_ids], 1),
            torch.cat([torch.zeros(bsz, n, dtype=torch.bool, device=dev), x.image_mask], 1),
            torch.cat([neg, x.patch_ids], 1),
            torch.cat([neg, x.image_index], 1),
        )

    return LMInputs.cat([pad(a), pad(b)])
