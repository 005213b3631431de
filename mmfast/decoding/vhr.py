"""VHR: Vision-aware Head Reinforcement (He et al., ACL 2025, "Cracking the Code of Hallucination in
LVLMs with Vision-aware Head Divergence").

Algorithm (Alg. 1), at the first generated token only: the prompt with the image and the same prompt
without it run side by side (one batch, left-padded). Layer by layer over L_r = {1} U {last 14 of 32},
at the last position, VHD_{l,i} = ||A_{l,i}(image) - A_{l,i}(text only)||_2 with A_{l,i} head i's
attention output before W_O (the ``o_proj`` input slice); heads with VHD > mean + std *and* text-only
energy ||A_{l,i}(text)||^2 > mean + std are zeroed (negatively vision-sensitive outliers); heads with
VHD above the layer's median are scaled by alpha (2) -- in that same forward, so later layers are
measured on the reinforced stream. The head set is then frozen for every later step (cache-consistent).
Hook points: forward pre-hooks on each chosen layer's ``self_attn.o_proj``: one chooses and scales at the joint
prefill; one scales in decode steps from the frozen scales held in fixed memory (refilled after each prefill),
tensor work only, so a static decode step is one captured graph (``model.compile``). Cost: one extra text-only
prefill at t = 0, nothing after. Whether the text-only stream is reinforced too is unstated in the paper: ``reinforce_text_stream`` (default false). Limits: greedy or sampling (no beam here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..hooks.attention import Carried, replayable, staged_copy
from ..models.base import LMInputs
from ..registry import DECODERS
from .base import DecodeOutput, Decoder, DecodeRequest, existing_layers
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

    @classmethod
    def capabilities(cls, params) -> Capabilities:
        return Capabilities()  # its o_proj pre-hooks replay in a captured step (the scales: a static input)

    @dataclass(frozen=True)
    class Config:
        alpha: float = opt(2.0, lo=0.0, hi=10.0, doc="scale of the selected heads (1 = off)")
        layers: tuple[int, ...] | None = opt(None, doc="0-based layers L_r; default {1} U last 14/32 of the LLM")
        reinforce_text_stream: bool = opt(False, doc="also scale heads in the text-only stream at t = 0")
        sample: bool = opt(False, doc="sample instead of greedy")
        temperature: float = opt(1.0, lo=1e-4, hi=100.0)
        top_p: float = opt(1.0, lo=0.0, hi=1.0)
        top_k: int = opt(0, lo=0)

    @classmethod
    def check_facts(cls, config, facts) -> list[int]:
        """The reinforced layers exist in this LLM (from the config before weights load, or the model); each is
        reinforced once, however often ``layers`` names it."""
        n = facts.llm_layers
        return sorted(set(existing_layers(config.layers if config.layers is not None else paper_layers(n), n)))

    def install(self) -> None:
        from ..capabilities import ModelFacts

        adapter = self.ctx.adapter
        self.layers = self.check_facts(self.config, ModelFacts.of_adapter(adapter))
        self.heads = adapter.text_config.num_attention_heads
        # the frozen heads' scales of the running decode, per layer: the memory a captured step reads (filled
        # from the state's chosen heads after each prefill, :meth:`_after_prefill`), one per batch size and dtype
        self._scales: dict[tuple, torch.Tensor] = {}
        if self.config.alpha != 1.0:
            for layer in self.layers:
                o_proj = adapter.layers[layer].self_attn.o_proj
                # the joint prefill chooses the heads (Python with side effects: never inside a captured graph) ...
                self.ctx.hooks.pre_hook(o_proj, self._select_hook(layer), prefill_only=True)
                # ... and every decode step scales them, reading fixed memory: replayable, nothing to carry
                self.ctx.hooks.pre_hook(
                    o_proj, replayable(self._scale_hook(layer), Carried(lambda: None, lambda _: None))
                )
            # the scale hook acts on VHR's image stream only (phase "apply"): a captured graph records whether it did
            self.ctx.runner.graph_variants.append(
                lambda state: ("vhr", getattr(state.extras.get(self.name), "phase", None))
            )

    def _select_hook(self, layer: int):
        def pre_hook(module, args):
            data = _heads_of(self.ctx.runner.active, self.name)
            if data is None or data.phase != "select":
                return None  # a forward that is not VHR's joint prefill (no text stream among its inputs)
            x = args[0]  # [rows, T, H*D] per-head outputs, concatenated
            rows, t, hd = x.shape
            heads = x.view(rows, t, self.heads, hd // self.heads)  # [rows, T, H, D]
            b = data.n_image_rows
            img, txt = heads[:b, -1].float(), heads[b:, -1].float()  # [B, H, D] at the last position
            vhd = (img - txt).norm(dim=-1)  # [B, H]
            data.selected[layer] = mask = select_heads(vhd, txt.pow(2).sum(-1))  # scaled in this same forward
            mask = torch.cat([mask, mask if self.config.reinforce_text_stream else torch.zeros_like(mask)])
            scale = 1 + (self.config.alpha - 1) * mask.to(x.dtype)  # [rows, H]
            return ((heads * scale[:, None, :, None]).view(rows, t, hd),)

        return pre_hook

    def _scale_hook(self, layer: int):
        def pre_hook(module, args):
            data = _heads_of(self.ctx.runner.active, self.name)
            if data is None or data.phase != "apply":
                return None  # not a decode step of VHR's image stream
            x = args[0]  # [rows, T, H*D]
            rows, t, hd = x.shape
            scale = self._scales[(layer, rows, x.dtype, x.device)]  # [rows, H] the frozen heads' scales
            return ((x.view(rows, t, self.heads, hd // self.heads) * scale[:, None, :, None]).view(rows, t, hd),)

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
        # the text stream's rows are marked on the inputs: the hooks find them on the running state
        joint.tags[TEXT_STREAM] = (
            torch.arange(joint.batch_size, device=joint.input_ids.device)[:, None].expand_as(joint.input_ids) >= bsz
        )
        out = autoregressive(
            self.ctx, joint, choose, req.max_new_tokens, on_prefill=self._after_prefill, batch_size=bsz
        )
        out.tokens = out.tokens[:bsz]
        return out

    def _after_prefill(self, state, step_out) -> None:
        """Freeze the heads and drop the text-only rows: decoding continues on the image stream."""
        data = _heads_of(state, self.name)
        n = data.n_image_rows
        state.keep_rows(n)  # on a static cache in place: the next call's joint prefill takes the same buffers
        step_out.logits = step_out.logits[:n]
        step_out.hidden = step_out.hidden[:n]
        data.phase = "apply"
        for layer, mask in data.selected.items():  # [B, H] bool each
            dtype = self.ctx.adapter.layers[layer].self_attn.o_proj.weight.dtype  # what its inputs are
            scale = 1 + (self.config.alpha - 1) * mask.to(dtype)  # [B, H]
            staged_copy(self._scales, (layer, scale.shape[0], dtype, scale.device), scale, scale.device)
        state.stats[self.name] = {
            "per_sample_reinforced_heads": [
                {str(layer): int(m[b].sum()) for layer, m in data.selected.items()} for b in range(data.n_image_rows)
            ],
            "per_sample_selected_heads": [
                {str(layer): m[b].tolist() for layer, m in data.selected.items()} for b in range(data.n_image_rows)
            ],
        }


TEXT_STREAM = "vhr.text_stream"  # LMInputs tag: rows of the text-only stream at t = 0 (bool)


@dataclass
class _Heads:
    """VHR's per-state data: the phase, the image rows at t = 0, and the heads chosen per layer."""

    phase: Literal["select", "apply"]
    n_image_rows: int
    selected: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, H] bool


def _heads_of(state, name: str) -> _Heads | None:
    """The running state's VHR data; created at the joint prefill (its inputs carry the text stream)."""
    if state is None:
        return None
    data = state.extras.get(name)
    if data is None:
        stream = state.inputs.tags.get(TEXT_STREAM)
        if stream is None:
            return None
        # no text-stream row: a recompute of the image stream after the joint prefill (decode without a KV cache,
        # Dynamic-LLaVA's use_cache: false), which applies the heads frozen there at every position
        phase = "select" if bool(stream[:, -1].any()) else "apply"
        data = state.extras[name] = _Heads(phase, int((~stream[:, -1]).sum()))
    return data


def _left_pad_cat(a: LMInputs, b: LMInputs, pad_id: int, adapter) -> LMInputs:
    """Stack two input batches of different lengths with joint left padding (tags carried)."""
    length = max(a.length, b.length)
    pad_embed = adapter.embed_tokens(torch.tensor([pad_id], device=a.input_ids.device))[0]  # [d]
    return LMInputs.cat([x.pad_left(length - x.length, pad_id, pad_embed) for x in (a, b)])
