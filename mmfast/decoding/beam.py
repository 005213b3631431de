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

from dataclasses import dataclass
from typing import Literal

import torch

from ..capabilities import Capabilities
from ..config import opt
from ..registry import DECODERS
from .base import DecodeOutput, Decoder, DecodeRequest, now, state_accounting
from .loop import finish


def release_prompt_len(req: DecodeRequest) -> torch.Tensor:
    """[B] prompt length as transformers 4.29.2 saw it in the release: the prompt's ids with one
    placeholder id per image (``PreparedBatch.token_ids``), BOS included."""
    return torch.tensor([len(ids) for ids in req.batch.token_ids], dtype=torch.long)


class BeamSearch:
    """Vectorised beam bookkeeping for ``batch`` samples x ``num_beams`` beams.

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
    ) -> None:
        """``prompt_len`` ([batch] prompt ids per sample) selects the ``release`` scorer (4.29.2)."""
        self.b, self.k, self.max_new, self.lp = batch, num_beams, max_new, length_penalty
        self.prompt_len = (
            None if prompt_len is None else prompt_len.to(device=device, dtype=torch.float32)[:, None]
        )  # [B, 1]
        self.running_scores = torch.zeros(batch, num_beams, device=device)
        self.running_scores[:, 1:] = -1e9  # all beams start identical: expand the first only
        self.running_tokens = torch.zeros(batch, num_beams, 0, dtype=torch.long, device=device)
        self.finished_scores = torch.full((batch, num_beams), -1e9, device=device)
        self.finished_tokens = torch.zeros(batch, num_beams, max_new, dtype=torch.long, device=device)
        self.finished_len = torch.zeros(batch, num_beams, dtype=torch.long, device=device)
        self.is_finished = torch.zeros(batch, num_beams, dtype=torch.bool, device=device)
        self.improvable = torch.ones(batch, 1, dtype=torch.bool, device=device)
        self.done = False

    @property
    def cur_len(self) -> int:
        return int(self.running_tokens.shape[-1])

    def step(self, log_probs: torch.Tensor, stop_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance with ``log_probs`` ([B*K, V], already processed). Returns (beam_idx [B*K], tokens [B*K])."""
        if self.prompt_len is not None:
            return self._step_release(log_probs, stop_ids)
        k = self.k
        top_scores, src_beam, tok, seqs = self._candidates(log_probs, stop_ids)
        gen_len = seqs.shape[2]
        hits = torch.isin(tok, stop_ids) | (gen_len >= self.max_new)  # [B, 2K]
        beam_src = self._keep_running(top_scores, src_beam, seqs, hits)  # the best K that did not stop
        # finished pool: stopped continuations among the top K, if they beat the pool
        top_k_mask = torch.arange(tok.shape[1], device=tok.device)[None, :] < k
        just = hits & top_k_mask
        fin_scores = top_scores / (gen_len**self.lp)
        fin_scores = fin_scores + (~self.improvable).float() * -1e9 + (~just).float() * -1e9
        self._merge(fin_scores, seqs, torch.full_like(tok, gen_len), just)
        # early-stop heuristic (transformers' early_stopping=False)
        best_running = self.running_scores[:, :1] / (gen_len**self.lp)
        worst_fin = torch.where(
            self.is_finished, self.finished_scores.min(1, keepdim=True).values, torch.full_like(best_running, -1e9)
        )
        self.improvable = self.improvable & (best_running > worst_fin).any(-1, keepdim=True)
        self.done = (not bool(self.improvable.any())) or bool(hits.all()) or gen_len >= self.max_new
        return self._chosen(beam_src)

    def _candidates(
        self, log_probs: torch.Tensor, stop_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The best ``M = max(2, 1 + #stop ids) * K`` continuations of each sample's running beams
        (``log_probs`` [B*K, V]): (scores [B, M], source beam [B, M], token [B, M], tokens so far [B, M, t+1])."""
        b, k = self.b, self.k
        vocab = log_probs.shape[-1]
        scores = (log_probs.view(b, k, vocab) + self.running_scores[:, :, None]).view(b, k * vocab)
        keep = max(2, 1 + int(stop_ids.numel())) * k
        top_scores, top_idx = scores.topk(keep, dim=1)  # [B, M]
        src_beam, tok = top_idx // vocab, top_idx % vocab
        seqs = torch.cat(
            [self.running_tokens.gather(1, src_beam[:, :, None].expand(-1, -1, self.cur_len)), tok[:, :, None]], 2
        )
        return top_scores, src_beam, tok, seqs

    def _keep_running(
        self, top_scores: torch.Tensor, src_beam: torch.Tensor, seqs: torch.Tensor, stopped: torch.Tensor
    ) -> torch.Tensor:
        """The running beams become the best K candidates not ``stopped`` ([B, M]); returns their source
        beams [B, K]."""
        run_scores = top_scores + stopped.float() * -1e9
        nxt = run_scores.topk(self.k, dim=1).indices  # [B, K]
        self.running_scores = run_scores.gather(1, nxt)
        self.running_tokens = seqs.gather(1, nxt[:, :, None].expand(-1, -1, seqs.shape[2]))
        return src_beam.gather(1, nxt)

    def _chosen(self, beam_src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat source beam [B*K], last token [B*K]) of the running beams, from their source beams [B, K]."""
        flat_src = (beam_src + torch.arange(self.b, device=beam_src.device)[:, None] * self.k).view(-1)
        return flat_src, self.running_tokens[:, :, -1].reshape(-1)

    def _merge(self, fin_scores: torch.Tensor, seqs: torch.Tensor, lens: torch.Tensor, fin: torch.Tensor) -> None:
        """Keep the best K of the finished pool and new hypotheses (``fin_scores`` [B, M], -1e9 = none;
        ``seqs`` [B, M, t] tokens, ``lens`` [B, M], ``fin`` [B, M] real hypotheses)."""
        b, m, t = seqs.shape
        padded = torch.zeros(b, m, self.max_new, dtype=torch.long, device=seqs.device)
        padded[:, :, :t] = seqs
        merged_scores = torch.cat([self.finished_scores, fin_scores], 1)
        merged_tokens = torch.cat([self.finished_tokens, padded], 1)
        merged_len = torch.cat([self.finished_len, lens], 1)
        merged_fin = torch.cat([self.is_finished, fin], 1)
        best = merged_scores.topk(self.k, dim=1).indices
        self.finished_scores = merged_scores.gather(1, best)
        self.finished_tokens = merged_tokens.gather(1, best[:, :, None].expand(-1, -1, self.max_new))
        self.finished_len = merged_len.gather(1, best)
        self.is_finished = merged_fin.gather(1, best)

    def _step_release(self, log_probs: torch.Tensor, stop_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of transformers 4.29.2's ``BeamSearchScorer.process`` (+ ``finalize`` at the limit)."""
        k = self.k
        top_scores, src_beam, tok, seqs = self._candidates(log_probs, stop_ids)
        gen_len = seqs.shape[2]
        eos = torch.isin(tok, stop_ids)  # [B, 2K]
        beam_src = self._keep_running(top_scores, src_beam, seqs, eos)  # the best K that do not end in EOS
        # EOS among the top K ranks: stored without the EOS, so len(input_ids) = prompt + gen_len - 1
        just = eos & (torch.arange(tok.shape[1], device=tok.device)[None, :] < k) & self.improvable
        fin_scores = torch.where(
            just, top_scores / (self.prompt_len + gen_len - 1) ** self.lp, torch.full_like(top_scores, -1e9)
        )
        self._merge(fin_scores, seqs, torch.full_like(tok, gen_len), just)
        # is_done(best of the step's 2K scores, cur_len = input_ids.shape[-1] + 1 = prompt + gen_len)
        n_fin = self.is_finished.sum(1, keepdim=True)
        worst = self.finished_scores.min(1, keepdim=True).values
        done_now = (n_fin >= k) & (worst >= top_scores[:, :1] / (self.prompt_len + gen_len) ** self.lp)
        self.improvable = self.improvable & ~done_now
        last = gen_len >= self.max_new
        if last:  # finalize: every running beam of an unfinished sample, length prompt + gen_len
            fin = self.improvable.expand(-1, k) & (self.running_scores > -1e8)
            fin_run = torch.where(
                fin,
                self.running_scores / (self.prompt_len + gen_len) ** self.lp,
                torch.full_like(self.running_scores, -1e9),
            )
            self._merge(fin_run, self.running_tokens, torch.full_like(beam_src, gen_len), fin)
        self.done = (not bool(self.improvable.any())) or bool(eos.all()) or last
        return self._chosen(beam_src)

    def best(self) -> list[list[int]]:
        """The best finished hypothesis of each sample."""
        out = []
        for i in range(self.b):
            j = int(self.finished_scores[i].argmax())
            out.append(self.finished_tokens[i, j, : int(self.finished_len[i, j])].tolist())
        return out


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
        )
        n_forwards = 0
        while True:
            beam_idx, tokens = search.step(torch.log_softmax(logits, -1), stop)
            if search.done:
                break
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
            method_stats=state.stats_rows(inputs.batch_size),
            kv_end=[sum(kv_end[i * k : (i + 1) * k]) for i in range(inputs.batch_size)],
        )
