"""The shared single-branch decode loop and token selection helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .base import DecodeOutput, now, state_accounting

if TYPE_CHECKING:
    from ..models.base import LMInputs
    from ..pipeline import Session
    from ..runtime import LMState, StepOutput

# (logits [B, V] fp32, step, state) -> next tokens [B]
ChooseFn = Callable[[torch.Tensor, int, "LMState"], torch.Tensor]


def warpers(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> LogitsProcessorList:
    """transformers' sampling warpers, in generate()'s order (temperature, top-k, top-p)."""
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs


def sample_from(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Multinomial sample from softmax(logits) ([B, V] -> [B])."""
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def strip(tokens: list[int], stop_ids: list[int]) -> list[int]:
    """Generated ids up to (excluding) the first stop token."""
    out = []
    for t in tokens:
        if t in stop_ids:
            break
        out.append(t)
    return out


def autoregressive(
    session: Session,
    inputs: LMInputs,
    choose: ChooseFn,
    max_new_tokens: int,
    *,
    on_prefill: Callable[[LMState, StepOutput], None] | None = None,
) -> DecodeOutput:
    """Prefill, then one token per step chosen by ``choose`` until EOS or ``max_new_tokens``."""
    runner, mm = session.runner, session.mm
    device = mm.device
    stop = torch.tensor(mm.eos_token_ids, device=device)
    t0 = now(device)
    state, out = runner.prefill(inputs)
    if on_prefill is not None:
        on_prefill(state, out)
    t1 = now(device)
    acc = state_accounting(state)
    bsz = state.batch_size  # on_prefill may drop rows (VHR's text-only stream)
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)
    generated: list[torch.Tensor] = []
    n_forwards = 0
    for step in range(max_new_tokens):
        nxt = choose(out.logits[:, -1], step, state)  # [B]
        nxt = torch.where(finished, torch.full_like(nxt, mm.pad_token_id), nxt)
        generated.append(nxt)
        finished |= torch.isin(nxt, stop)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        if runner.use_cache:
            out = runner.step(state, nxt[:, None])
        else:  # recompute the whole sequence (Dynamic-LLaVA's decode-without-cache rule)
            inputs = state.inputs.append(nxt[:, None], session.adapter.embed_tokens(nxt[:, None]))
            state, out = runner.prefill(inputs)
        n_forwards += 1
    t2 = now(device)
    ids = torch.stack(generated, 1).tolist() if generated else [[] for _ in range(bsz)]
    result = DecodeOutput(
        tokens=[strip(row, mm.eos_token_ids) for row in ids],
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        n_forwards=n_forwards,
        kv_bytes_end=state.kv_bytes_per_sample(),
    )
    result.set_prefill_accounting(acc)
    return result
