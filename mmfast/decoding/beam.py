"""Beam search, with transformers' semantics (the OPERA-style papers' ``beam=5`` baseline).

The search keeps ``num_beams`` running hypotheses per sample, expands each by every token, keeps the
best ``2 * num_beams`` continuations, moves those ending in EOS (or hitting the length limit) to a
finished pool scored ``sum_logprobs / generated_len ** length_penalty``, and stops when no running
beam can beat the worst finished one (transformers' ``early_stopping=False`` heuristic). Tested to
return the same tokens as ``model.generate(num_beams=...)``.

Presets: ``exact`` (default) is the above, transformers 5's scorer. ``release`` reproduces the beam
scorer of transformers 4.29.2, which OPERA's release (shikiw/OPERA) ships and runs for OPERA and for its
beam-5 baseline: a hypothesis is scored ``sum_logprobs / len(input_ids) ** length_penalty`` with
``input_ids`` the *prompt plus* the generated tokens (LLaVA's release prompt holds one placeholder id
per image, not the expanded image tokens; here the prompt's ``token_ids`` likewise), a hypothesis
ending in EOS is stored without its EOS (length prompt + generated - 1), beams still running at the
length limit are added by ``finalize`` with length prompt + generated, and the early stop
(``BeamHypotheses.is_done`` with ``cur_len = input_ids.shape[-1] + 1``, the length the step's scores
are computed on) compares the worst finished score with the best of the step's 2K candidates over
(prompt + generated) ** length_penalty.

:class:`BeamSearch` is the bookkeeping alone, so OPERA can reuse it with its own scores.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, Literal

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..models.captured_tower import eager_call
from ..registry import DECODERS
from .base import DecodeOutput, Decoder, DecodeRequest, now, state_accounting
from .loop import finish, rows_at_stop


def release_prompt_len(req: DecodeRequest) -> torch.Tensor:
    """[B] prompt length as transformers 4.29.2 saw it in the release: the prompt's ids with one
    placeholder id per image (``PreparedBatch.token_ids``), BOS included."""
    return torch.tensor([len(ids) for ids in req.batch.token_ids], dtype=torch.long)


class BeamSearch:
    """Vectorised beam bookkeeping for ``batch`` samples x ``num_beams`` beams, in fixed shapes: the tokens are
    ``[batch, num_beams, max_new]`` buffers and the step's length a device index, so a step is one pure function of
    tensors (:func:`beam_step`), run through ``run`` (``MethodContext.captured``: one captured graph a shape where
    the session captures, where it was ~90 kernels launched one by one; eager otherwise) with one read a step.

    After construction its tensors are replaced, never written in place, so a shallow copy is a snapshot of the
    search (OPERA keeps one a step for its rollback)."""

    def __init__(
        self,
        batch: int,
        num_beams: int,
        max_new: int,
        length_penalty: float,
        device: torch.device,
        prompt_len: torch.Tensor | None = None,
        run: Callable[..., Any] = eager_call,
    ) -> None:
        """``prompt_len`` ([batch] prompt ids per sample) selects the ``release`` scorer (4.29.2)."""
        self.b, self.k, self.max_new, self.lp, self.run = batch, num_beams, max_new, length_penalty, run
        self.release = prompt_len is not None
        # [B, 1] (a placeholder under ``exact``: the step's inputs are the same tensors either way)
        self.prompt_len = (
            torch.zeros(batch, 1) if prompt_len is None else prompt_len.to(dtype=torch.float32)[:, None]
        ).to(device)
        self._lengths = torch.arange(max_new, device=device)  # [max_new]: the step's length, a view of it
        running_scores = torch.zeros(batch, num_beams, device=device)
        running_scores[:, 1:] = -1e9  # all beams start identical: expand the first only
        self.state = BeamState(
            running_scores,
            torch.zeros(batch, num_beams, max_new, dtype=torch.long, device=device),
            torch.full((batch, num_beams), -1e9, device=device),
            torch.zeros(batch, num_beams, max_new, dtype=torch.long, device=device),
            torch.zeros(batch, num_beams, dtype=torch.long, device=device),
            torch.zeros(batch, num_beams, dtype=torch.bool, device=device),
            torch.ones(batch, 1, dtype=torch.bool, device=device),
        )
        self.cur_len = 0  # tokens generated so far
        self.done = False
        #: per sample, whether its own search has ended (no running beam can beat its finished pool); the batch's
        #: search runs on while another sample's has not, feeding the ended sample's rows
        self.ended = [False] * batch

    @property
    def running_tokens(self) -> torch.Tensor:
        """[B, K, t] the running beams' tokens."""
        return self.state.running_tokens[:, :, : self.cur_len]

    def step(self, log_probs: torch.Tensor, stop_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance with ``log_probs`` ([B*K, V], already processed). Returns (beam_idx [B*K], tokens [B*K])."""
        last = self.cur_len + 1 >= self.max_new
        key = ("beam", self.k, self.lp, self.release, last)
        fn = partial(beam_step, k=self.k, lp=self.lp, release=self.release, last=last)
        t = self._lengths[self.cur_len : self.cur_len + 1]  # [1]
        out = self.run(key, fn, log_probs, stop_ids, t, self.prompt_len, *self.state.tensors())
        self.state = BeamState(*out[:7])
        beam_idx, tokens, flags = out[7:]
        self.cur_len += 1
        host = flags.tolist()  # the step's one read: [1 + B] whether the search stops, each sample's improvable
        self.done = last or host[0]
        self.ended = [self.done or not improvable for improvable in host[1:]]
        return beam_idx, tokens

    def best(self) -> list[list[int]]:
        """The best finished hypothesis of each sample."""
        s = self.state
        j = s.finished_scores.argmax(1)  # [B]
        lens = s.finished_len.gather(1, j[:, None])[:, 0].tolist()
        tokens = s.finished_tokens[torch.arange(self.b, device=j.device), j].tolist()  # [B, max_new]
        return [row[:n] for row, n in zip(tokens, lens)]


@dataclass(frozen=True)
class BeamState:
    """The search's tensors (:func:`beam_step` returns new ones)."""

    running_scores: torch.Tensor  # [B, K] float
    running_tokens: torch.Tensor  # [B, K, N] long, N = max_new: zeros past the generated length
    finished_scores: torch.Tensor  # [B, K] float, -1e9 = none
    finished_tokens: torch.Tensor  # [B, K, N] long
    finished_len: torch.Tensor  # [B, K] long
    is_finished: torch.Tensor  # [B, K] bool
    improvable: torch.Tensor  # [B, 1] bool

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


def beam_step(
    log_probs: torch.Tensor,
    stop_ids: torch.Tensor,
    t: torch.Tensor,
    prompt_len: torch.Tensor,
    *state: torch.Tensor,
    k: int,
    lp: float,
    release: bool,
    last: bool,
) -> tuple[torch.Tensor, ...]:
    """One step in fixed shapes: ``log_probs`` [B*K, V], ``stop_ids`` [S], ``t`` [1] the tokens generated before
    it, ``prompt_len`` [B, 1] (``release``), ``state`` a :class:`BeamState`'s tensors; ``last``: the step reaches
    the length limit. Returns the new state's tensors, the running beams' flat source beam [B*K] and last token
    [B*K], and [1 + B] bool: whether the search stops, then whether each sample's search may still improve."""
    s = BeamState(*state)
    top_scores, src_beam, tok, seqs = _candidates(s, log_probs, stop_ids, t, k)
    if release:
        return _step_release(s, top_scores, src_beam, tok, seqs, stop_ids, t, prompt_len, k, lp, last)
    b = s.running_scores.shape[0]
    gen_len = t + 1  # [1]
    norm = (gen_len.double() ** lp).float()  # [1] the length penalty's divisor
    hits = torch.isin(tok, stop_ids) | last  # [B, M]
    s, beam_src = _keep_running(s, top_scores, src_beam, seqs, hits, k)  # the best K that did not stop
    # finished pool: stopped continuations among the top K, if they beat the pool
    just = hits & (torch.arange(tok.shape[1], device=tok.device)[None, :] < k)
    fin_scores = top_scores / norm
    fin_scores = fin_scores + (~s.improvable).float() * -1e9 + (~just).float() * -1e9
    s = _merge(s, fin_scores, seqs, gen_len.expand_as(tok), just, k)
    # early-stop heuristic (transformers' early_stopping=False)
    best_running = s.running_scores[:, :1] / norm
    worst_fin = torch.where(
        s.is_finished, s.finished_scores.min(1, keepdim=True).values, torch.full_like(best_running, -1e9)
    )
    s = replace(s, improvable=s.improvable & (best_running > worst_fin).any(-1, keepdim=True))
    stopped = ~s.improvable.any() | hits.all()
    return (*s.tensors(), *_chosen(beam_src, s, t, b, k), torch.cat([stopped.view(1), s.improvable.view(-1)]))


def _candidates(
    s: BeamState, log_probs: torch.Tensor, stop_ids: torch.Tensor, t: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best ``M = max(2, 1 + #stop ids) * K`` continuations of each sample's running beams
    (``log_probs`` [B*K, V]): (scores [B, M], source beam [B, M], token [B, M], tokens so far [B, M, N])."""
    b, n = s.running_scores.shape[0], s.running_tokens.shape[2]
    vocab = log_probs.shape[-1]
    scores = (log_probs.view(b, k, vocab) + s.running_scores[:, :, None]).view(b, k * vocab)
    keep = max(2, 1 + int(stop_ids.numel())) * k
    top_scores, top_idx = scores.topk(keep, dim=1)  # [B, M]
    src_beam, tok = top_idx // vocab, top_idx % vocab
    seqs = s.running_tokens.gather(1, src_beam[:, :, None].expand(-1, -1, n))  # [B, M, N]
    seqs = seqs.scatter(2, t.view(1, 1, 1).expand(b, keep, 1), tok[:, :, None])  # the new token at t
    return top_scores, src_beam, tok, seqs


def _keep_running(
    s: BeamState, top_scores: torch.Tensor, src_beam: torch.Tensor, seqs: torch.Tensor, stopped: torch.Tensor, k: int
) -> tuple[BeamState, torch.Tensor]:
    """The running beams become the best K candidates not ``stopped`` ([B, M]); returns them and their source
    beams [B, K]."""
    run_scores = top_scores + stopped.float() * -1e9
    nxt = run_scores.topk(k, dim=1).indices  # [B, K]
    s = replace(
        s,
        running_scores=run_scores.gather(1, nxt),
        running_tokens=seqs.gather(1, nxt[:, :, None].expand(-1, -1, seqs.shape[2])),
    )
    return s, src_beam.gather(1, nxt)


def _chosen(beam_src: torch.Tensor, s: BeamState, t: torch.Tensor, b: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat source beam [B*K], last token [B*K]) of the running beams, from their source beams [B, K]."""
    flat_src = (beam_src + torch.arange(b, device=beam_src.device)[:, None] * k).view(-1)
    return flat_src, s.running_tokens.index_select(2, t).reshape(-1)


def _merge(
    s: BeamState, fin_scores: torch.Tensor, seqs: torch.Tensor, lens: torch.Tensor, fin: torch.Tensor, k: int
) -> BeamState:
    """Keep the best K of the finished pool and new hypotheses (``fin_scores`` [B, M], -1e9 = none;
    ``seqs`` [B, M, N] tokens, ``lens`` [B, M], ``fin`` [B, M] real hypotheses)."""
    merged_scores = torch.cat([s.finished_scores, fin_scores], 1)
    merged_tokens = torch.cat([s.finished_tokens, seqs], 1)
    best = merged_scores.topk(k, dim=1).indices
    return replace(
        s,
        finished_scores=merged_scores.gather(1, best),
        finished_tokens=merged_tokens.gather(1, best[:, :, None].expand(-1, -1, seqs.shape[2])),
        finished_len=torch.cat([s.finished_len, lens], 1).gather(1, best),
        is_finished=torch.cat([s.is_finished, fin], 1).gather(1, best),
    )


def _step_release(
    s: BeamState,
    top_scores: torch.Tensor,
    src_beam: torch.Tensor,
    tok: torch.Tensor,
    seqs: torch.Tensor,
    stop_ids: torch.Tensor,
    t: torch.Tensor,
    prompt_len: torch.Tensor,
    k: int,
    lp: float,
    last: bool,
) -> tuple[torch.Tensor, ...]:
    """One step of transformers 4.29.2's ``BeamSearchScorer.process`` (+ ``finalize`` at the limit)."""
    b = s.running_scores.shape[0]
    gen_len = t + 1  # [1]
    eos = torch.isin(tok, stop_ids)  # [B, M]
    s, beam_src = _keep_running(s, top_scores, src_beam, seqs, eos, k)  # the best K that do not end in EOS
    # EOS among the top K ranks: stored without the EOS, so len(input_ids) = prompt + gen_len - 1
    just = eos & (torch.arange(tok.shape[1], device=tok.device)[None, :] < k) & s.improvable
    fin_scores = torch.where(just, top_scores / (prompt_len + gen_len - 1) ** lp, torch.full_like(top_scores, -1e9))
    s = _merge(s, fin_scores, seqs, gen_len.expand_as(tok), just, k)
    # is_done(best of the step's 2K scores, cur_len = input_ids.shape[-1] + 1 = prompt + gen_len)
    n_fin = s.is_finished.sum(1, keepdim=True)
    worst = s.finished_scores.min(1, keepdim=True).values
    done_now = (n_fin >= k) & (worst >= top_scores[:, :1] / (prompt_len + gen_len) ** lp)
    s = replace(s, improvable=s.improvable & ~done_now)
    if last:  # finalize: every running beam of an unfinished sample, length prompt + gen_len
        fin = s.improvable.expand(-1, k) & (s.running_scores > -1e8)
        fin_run = torch.where(
            fin, s.running_scores / (prompt_len + gen_len) ** lp, torch.full_like(s.running_scores, -1e9)
        )
        s = _merge(s, fin_run, s.running_tokens, gen_len.expand_as(beam_src), fin, k)
    stopped = ~s.improvable.any() | eos.all()
    return (*s.tensors(), *_chosen(beam_src, s, t, b, k), torch.cat([stopped.view(1), s.improvable.view(-1)]))


@DECODERS.register("beam", description="beam search (transformers semantics); the OPERA-paper baseline")
class Beam(Decoder):
    """Beam search."""

    caps = Capabilities(search="beam")

    @dataclass(frozen=True)
    class Config:
        num_beams: int = opt(5, lo=1, hi=64, doc="beams per sample")
        length_penalty: float = opt(1.0, lo=-10.0, hi=10.0, doc="exponent on the generated length")
        preset: Literal["exact", "release"] = opt(
            "exact",
            doc="exact: transformers 5's scorer; release: transformers 4.29.2's (OPERA's baseline), "
            "finished beams normalised by prompt + generated length",
        )

    def decode(self, req: DecodeRequest) -> DecodeOutput:
        inputs, max_new_tokens = req.inputs, req.max_new_tokens
        runner = self.ctx.runner
        device = self.ctx.device
        k = self.config.num_beams
        stop = torch.tensor(self.ctx.special.eos, device=device)
        t0 = now(device)
        state, out = runner.prefill(inputs)
        t1 = now(device)
        acc = state_accounting(state)
        state.repeat_interleave(k)
        logits = out.logits[:, -1].repeat_interleave(k, 0)  # [B*K, V]
        search = BeamSearch(
            inputs.batch_size,
            k,
            max_new_tokens,
            self.config.length_penalty,
            device,
            prompt_len=release_prompt_len(req) if self.config.preset == "release" else None,
            run=self.ctx.captured,
        )
        n_forwards = 0
        kv_at_end: dict[int, int] = {}  # a sample's K rows' bytes when its own search ended (later steps are not its)
        stats_at_end: dict[int, dict[str, dict[str, Any]]] = {}  # likewise its method statistics (rows_at_stop)
        while True:
            beam_idx, tokens = search.step(torch.log_softmax(logits, -1), stop)
            if search.done:
                break
            ended = [i for i, e in enumerate(search.ended) if e and i not in kv_at_end]
            if ended:
                kv_now = state.kv_bytes_per_sample()
                kv_at_end.update({i: sum(kv_now[i * k : (i + 1) * k]) for i in ended})
                stats_now = copy.deepcopy(state.stats_rows(inputs.batch_size))
                stats_at_end.update({i: stats_now for i in ended})
            runner.reorder(state, beam_idx)  # one captured graph under captured steps
            logits = runner.step(state, tokens[:, None]).logits[:, -1]
            n_forwards += 1
        t2 = now(device)
        kv_end = state.kv_bytes_per_sample()
        return finish(
            self.ctx,
            search.best(),
            times=(t0, t1, t2),
            acc=acc,
            n_forwards=n_forwards,
            method_stats=rows_at_stop(state.stats_rows(inputs.batch_size), stats_at_end),
            kv_end=[kv_at_end.get(i, sum(kv_end[i * k : (i + 1) * k])) for i in range(inputs.batch_size)],
        )
