"""Training Dynamic-LLaVA's predictors on a LLaVA model (CPU-sized; the embedded world model by default).

What the released code does (Osilly/dynamic_llava: ``dynamic_modeling_llama.py``, ``train_sparse.py``,
``dynamic_llava_trainer.py``, ``run/train_dynamic_llava_7b.sh``), and what this module does the same way:

- at the input of layer K the image predictor scores the sample's image tokens and the output-text
  predictor scores every answer token; a **hard Gumbel-softmax with straight-through gradients**
  (``F.gumbel_softmax(log_softmax(logits), tau, hard=True)[..., 0]``) turns them into 0/1 keep masks;
  tau decays exponentially from 1.0 to 0.1 over the run (``tau_at``);
- in every layer >= K, attention uses a **masked softmax**: key j is weighted by its mask, except that
  every query always sees itself (the self-attention diagonal); the mask multiplies exp(scores), so
  the LM loss reaches the predictors through the straight-through masks (an additive -inf mask would not);
- loss = LM cross-entropy + ``mask_loss_weight`` (100) * [mean over samples (r_vision - mean(image mask))^2
  + mean over answers (r_text - mean(answer mask))^2], r_vision = 0.2, r_text = 0.5; an answer shorter
  than ``output_text_len_for_training`` (50) tokens is never dropped and adds no ratio loss;
- predictors get lr 2e-4 (AdamW, no weight decay), cosine schedule with 3% warmup, gradient clipping 1.0.

Deviations: the LLM is frozen by default (the paper fine-tunes it at 5e-6 for one epoch on 665k
samples; ``llm_lr > 0`` tunes it here too and then writes the tuned model as well); every answer of a
multi-turn conversation is an "answer" for the output-text predictor (the released code uses only the
last one; in the world conversations the last answers are 2-5 tokens, so the predictor would never train);
the masked softmax takes its max over the attended keys and so needs no epsilon smoothing (the code adds
eps / N to every weight, also to causally masked ones).

The attention override is installed through a :class:`~mmfast.hooks.HookSession` (``hooks.attach``) on a
stock ``LlavaForConditionalGeneration``; closing the session restores the model exactly.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..checkpoint import source_dir
from ..errors import InputError
from ..hooks import HookSession, attach
from ..pruning._dynamic_llava_modules import Predictors, PredictorSpec, gather_rows, save_predictors, tau_at
from .common import (
    bind_work_data,
    bind_work_dir,
    check_resume_config,
    cosine_lr,
    load_checkpoint,
    require_positive,
    save_checkpoint,
    seed_everything,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DynamicTrainConfig:
    seed: int = 0
    n_train: int = 4000  # training images (world train split, the embedded model's own training images)
    epochs: float = 1.0
    batch: int = 8
    lr: float = 2e-4  # predictors (paper)
    llm_lr: float = 0.0  # 0: LLM frozen; > 0: tune the language model too (paper: 5e-6)
    warmup_ratio: float = 0.03
    tau_start: float = 1.0
    tau_end: float = 0.1
    mask_loss_weight: float = 100.0
    vision_keep_rate: float = 0.2
    output_text_keep_rate: float = 0.5
    output_text_len_for_training: int = 50
    sparse_layer: int = 2
    d_model: int = 0  # 0: scaled from the LLM width (PredictorSpec.scaled)
    nhead: int = 0
    dim_feedforward: int = 0
    num_layers: int = 2
    bf16: bool = True
    workers: int = 2
    checkpoint_every: int = 50

    def __post_init__(self) -> None:
        require_positive(
            self,
            "n_train",
            "epochs",
            "batch",
            "lr",
            "tau_start",
            "tau_end",
            "num_layers",
            "workers",
            "checkpoint_every",
        )


# ------------------------------------------------------------------------------------ the forward


def answer_spans(labels: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of each run of supervised (label != -100) input positions."""
    spans = []
    sup = (labels != -100).tolist()
    for b, row in enumerate(sup):
        start = None
        for i, s in enumerate(row + [False]):
            if s and start is None:
                start = i
            elif not s and start is not None:
                spans.append((b, start, i))
                start = None
    return spans


class DynamicTraining:
    """Training-time Dynamic-LLaVA on a ``LlavaForConditionalGeneration``: masks at layer K, masked softmax in
    layers >= K. Call :meth:`begin` before each forward and :meth:`end` after it; :meth:`close` restores."""

    def __init__(self, llava, predictors: Predictors, layer: int, cfg: DynamicTrainConfig) -> None:
        lm = llava.model.language_model
        if not 0 < layer < len(lm.layers):
            raise InputError(f"sparse_layer {layer} must be in 1..{len(lm.layers) - 1}")
        self.predictors, self.layer, self.cfg = predictors, layer, cfg
        self.hooks = HookSession(llava)
        self.hooks.pre_hook(lm.layers[layer], self._at_layer, with_kwargs=True)
        for i in range(layer, len(lm.layers)):
            attach(self.hooks, lm.layers[i].self_attn).override = self._attention
        self._batch: dict[str, Any] | None = None
        self.policy: torch.Tensor | None = None
        self.out: dict[str, Any] = {}

    def close(self) -> None:
        self.hooks.close()

    def begin(self, image_mask: torch.Tensor, labels: torch.Tensor, tau: float) -> None:
        spans = answer_spans(labels)
        trainable = torch.zeros_like(image_mask)
        for b, s, e in spans:
            if e - s >= self.cfg.output_text_len_for_training:
                trainable[b, s:e] = True
        self._batch = {"image_mask": image_mask, "spans": spans, "trainable": trainable, "tau": tau}
        self.policy, self.out = None, {}

    def end(self) -> dict[str, Any]:
        self._batch, self.policy = None, None
        return self.out

    # -- layer K ---------------------------------------------------------------------------------------
    def _at_layer(self, module, args, kwargs):
        if self._batch is None:
            return None
        hidden = (args[0] if args else kwargs["hidden_states"]).float()
        b = self._batch
        tau = b["tau"]
        x, valid, index = gather_rows(hidden, b["image_mask"])
        img_logits = self.predictors.image(x, valid).float()
        img_keep = F.gumbel_softmax(F.log_softmax(img_logits, -1), tau=tau, hard=True)[..., 0] * valid
        txt_logits = self.predictors.text(hidden).float()
        txt_keep = F.gumbel_softmax(F.log_softmax(txt_logits, -1), tau=tau, hard=True)[..., 0]
        bsz, length = b["image_mask"].shape
        idx = index.masked_fill(~valid, length)
        img_full = torch.zeros(bsz, length + 1, dtype=hidden.dtype, device=hidden.device).scatter(1, idx, img_keep)[
            :, :length
        ]
        ones = torch.ones_like(txt_keep)
        text_policy = torch.where(b["trainable"], txt_keep, ones)
        self.policy = torch.where(b["image_mask"], img_full, text_policy)  # [B, L], 1 = kept
        with torch.no_grad():  # the predicted keep probabilities (what the hard masks sample)
            p_img = (img_logits.softmax(-1)[..., 0] * valid).sum() / valid.sum().clamp(min=1)
            p_txt = (
                txt_logits.softmax(-1)[..., 0][b["trainable"]].mean()
                if bool(b["trainable"].any())
                else torch.tensor(float("nan"))
            )
        self.out = {
            "image_keep": img_keep,
            "image_valid": valid,
            "text_keep": text_policy,
            "spans": b["spans"],
            "p_keep_v": float(p_img),
            "p_keep_t": float(p_txt),
        }
        return None

    # -- layers >= K: masked softmax keeping the diagonal ------------------------------------------------
    def _attention(self, module, query, key, value, attention_mask, scaling, base, dropout=0.0, **kwargs):
        if self.policy is None:
            out, _ = base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            return out
        with torch.autocast(query.device.type, enabled=False):
            bsz, heads, q_len, _ = query.shape
            k_len = key.shape[2]
            rep = heads // key.shape[1]
            k = key.float().repeat_interleave(rep, 1)
            v = value.float().repeat_interleave(rep, 1)
            scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scaling  # [B, H, Q, K]
            allowed = _allowed(attention_mask, q_len, k_len, query.device)  # [B|1, 1, Q, K]
            pos = torch.arange(k_len, device=query.device)
            diag = pos[None, :] == pos[k_len - q_len :, None]  # [Q, K]: each query's own key
            weight = torch.where(
                diag, torch.ones((), device=query.device), self.policy[:, None, None, :].float()
            )  # [B, 1, Q, K]
            ok = allowed & (weight > 0)
            top = scores.masked_fill(~ok, float("-inf")).amax(-1, keepdim=True).detach()
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            e = torch.exp(scores - top).masked_fill(~allowed, 0.0) * weight
            probs = e / e.sum(-1, keepdim=True).clamp(min=1e-30)
            out = torch.matmul(probs, v)  # [B, H, Q, D]
        return out.to(query.dtype).transpose(1, 2).contiguous()


def _allowed(mask: torch.Tensor | None, q_len: int, k_len: int, device) -> torch.Tensor:
    if mask is None:  # sdpa without padding: plain causal
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)[None, None]
    if mask.dtype == torch.bool:
        return mask[..., :k_len]
    return mask[..., :k_len] > torch.finfo(mask.dtype).min / 2


def dynamic_loss(
    logits: torch.Tensor, labels: torch.Tensor, out: dict[str, Any], cfg: DynamicTrainConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """LM cross-entropy + mask_loss_weight * (image ratio loss + output-text ratio loss)."""
    lm = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    valid = out["image_valid"].float()
    img_ratio = (out["image_keep"] * valid).sum(1) / valid.sum(1).clamp(min=1)
    loss_v = ((cfg.vision_keep_rate - img_ratio) ** 2).mean()
    ratios, targets = [], []
    for b, s, e in out["spans"]:
        r = out["text_keep"][b, s:e].mean()
        ratios.append(r)
        targets.append(cfg.output_text_keep_rate if e - s >= cfg.output_text_len_for_training else float(r.detach()))
    if ratios:
        r_t = torch.stack(ratios)
        loss_t = ((torch.tensor(targets, dtype=r_t.dtype, device=r_t.device) - r_t) ** 2).mean()
    else:
        loss_t = torch.zeros((), device=logits.device)
    total = lm + cfg.mask_loss_weight * (loss_v + loss_t)
    long = [
        float(r.detach()) for r, (b, s, e) in zip(ratios, out["spans"]) if e - s >= cfg.output_text_len_for_training
    ]
    parts = {
        "lm": float(lm.detach()),
        "ratio_v": float(loss_v.detach()),
        "ratio_t": float(loss_t.detach()),
        "keep_v": float(img_ratio.mean().detach()),
        "keep_t": float(np.mean(long)) if long else float("nan"),
        "p_keep_v": out["p_keep_v"],
        "p_keep_t": out["p_keep_t"],
    }
    return total, parts


def forward_loss(training: DynamicTraining, llava, feats, ids, labels, mask, image_id: int, tau: float):
    """One training forward on cached vision features; returns (loss, parts)."""
    from .embedded import llava_forward

    training.begin(ids == image_id, labels, tau)
    try:
        logits, _ = llava_forward(llava, feats, ids, mask, image_id)
    finally:
        out = training.end()
    return dynamic_loss(logits, labels, out, training.cfg)


# ------------------------------------------------------------------------------------ driver


def _resolve_model(model: str | Path) -> Path:
    from ..checkpoint import _resolve

    path, local = _resolve(str(model))
    if not local:
        raise InputError(f"{model!r} is not a local model directory; download it first")
    return Path(path)


def train_dynamic_llava(
    model: str | Path,
    out_dir: str | Path | None,
    work_dir: str | Path,
    cfg: DynamicTrainConfig = DynamicTrainConfig(),
    model_out: str | Path | None = None,
) -> Path:
    """Train the predictors of ``model`` (a local LLaVA directory or ``mmfast/tiny-world``); resumable.

    Writes ``predictors.safetensors`` + ``config.json`` to ``out_dir`` (default ``<model>/dynamic_llava``).
    With ``cfg.llm_lr > 0`` the tuned model is written to ``model_out`` (required) with its predictors in
    ``model_out/dynamic_llava``.
    """
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from ..pruning.dynamic_llava import PREDICTOR_DIR
    from .embedded import _collate, cache_features
    from .world_data import conversation, conversation_rng, encode_conversation, render_split

    t0 = time.time()
    model_dir = _resolve_model(model)
    if cfg.llm_lr > 0 and model_out is None:
        raise InputError("llm_lr > 0 tunes the LLM: pass model_out, the directory for the tuned model")
    out = (
        Path(out_dir) if out_dir else (Path(model_out) if model_out else source_dir(model) or model_dir) / PREDICTOR_DIR
    )
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps({**asdict(cfg), "model": str(model_dir)}, indent=1))
    seed_everything(cfg.seed)
    llava = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    bind_work_dir(work, llava)
    bind_work_data(work, {"seed": cfg.seed, "n_train": cfg.n_train}, "dynamic_llava_data.json")  # the cached features
    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    vcfg = llava.config
    if vcfg.vision_feature_layer != -2 or vcfg.vision_feature_select_strategy != "default":
        raise InputError("the feature cache assumes vision_feature_layer -2 and the 'default' (drop CLS) strategy")
    image_id = vcfg.image_token_id
    n_layers = vcfg.text_config.num_hidden_layers
    d = vcfg.text_config.hidden_size
    images = render_split(cfg.seed, "train", cfg.n_train, vcfg.vision_config.patch_size, workers=cfg.workers)
    llava.eval()
    llava.requires_grad_(False)
    feats = cache_features(llava.model.vision_tower, images, work)
    n_patches = feats.shape[1]

    spec = PredictorSpec.scaled(
        d, d_model=cfg.d_model, nhead=cfg.nhead, dim_feedforward=cfg.dim_feedforward, num_layers=cfg.num_layers
    )
    predictors = Predictors(spec).init_weights()
    groups = [{"params": list(predictors.parameters()), "lr": cfg.lr, "weight_decay": 0.0}]
    modules: dict[str, torch.nn.Module] = {"predictors": predictors}
    if cfg.llm_lr > 0:
        llava.model.language_model.requires_grad_(True)
        groups.append({"params": list(llava.model.language_model.parameters()), "lr": cfg.llm_lr, "weight_decay": 0.0})
        modules["lm"] = llava.model.language_model
    opt = torch.optim.AdamW(groups)
    base_lrs = [g["lr"] for g in groups]
    n = len(images)
    steps_per_epoch = max(1, n // cfg.batch)
    steps = max(1, int(cfg.epochs * steps_per_epoch))
    warmup = int(cfg.warmup_ratio * steps)
    ckpt = work / "ckpt"
    step = 0
    if ckpt.exists():
        meta = load_checkpoint(ckpt, modules, opt)
        check_resume_config(ckpt, meta, asdict(cfg))
        step = meta["step"]
        logger.info("dynamic-llava: resuming at step %d/%d", step, steps)
    training = DynamicTraining(llava, predictors, cfg.sparse_layer, cfg)
    predictors.train()
    bar = tqdm(range(step, steps), initial=step, total=steps, desc="dynamic-llava predictors")
    try:
        for step in bar:
            epoch, k = divmod(step, steps_per_epoch)
            order = np.random.default_rng(cfg.seed + 7919 * epoch).permutation(n)
            idx = order[k * cfg.batch : (k + 1) * cfg.batch]
            convs = [
                encode_conversation(
                    tokenizer,
                    conversation(
                        images.annotations[i], conversation_rng(cfg.seed, epoch, images.annotations[i].image_id)
                    ),
                )
                for i in idx
            ]
            ids, labels, mask, *_ = _collate(convs, n_patches, image_id, tokenizer.pad_token_id)
            f = torch.from_numpy(np.asarray(feats[idx])).float()
            for g, base in zip(opt.param_groups, base_lrs):
                g["lr"] = cosine_lr(step, steps, base, warmup=warmup, floor=0.0)
            tau = tau_at(step, steps, cfg.tau_start, cfg.tau_end)
            torch.manual_seed(cfg.seed * 100003 + step)  # Gumbel noise: identical after a resume
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, parts = forward_loss(training, llava, f, ids, labels, mask, image_id, tau)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
            opt.step()
            bar.set_postfix(
                lm=f"{parts['lm']:.3f}",
                keep_v=f"{parts['keep_v']:.2f}",
                keep_t=f"{parts['keep_t']:.2f}",
                p_v=f"{parts['p_keep_v']:.2f}",
                p_t=f"{parts['p_keep_t']:.2f}",
                rv=f"{parts['ratio_v']:.4f}",
                rt=f"{parts['ratio_t']:.4f}",
                tau=f"{tau:.2f}",
            )
            if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < steps:
                save_checkpoint(ckpt, modules, opt, {"step": step + 1, "config": asdict(cfg)})
    finally:
        training.close()
    predictors.eval()
    if cfg.llm_lr > 0:
        from ..models.factory import save_model

        llava.requires_grad_(False)
        save_model(llava, processor, model_out)
        for extra in ("clip", "training.json"):  # the embedded model's side files (CLIP text tower, provenance)
            src = model_dir / extra
            if src.is_dir():
                shutil.copytree(src, Path(model_out) / extra, dirs_exist_ok=True)
            elif src.is_file():
                shutil.copy2(src, Path(model_out) / extra)
    sparse = {
        "sparse_layer": cfg.sparse_layer,
        "vision_keep_rate": cfg.vision_keep_rate,
        "output_text_keep_rate": cfg.output_text_keep_rate,
        "output_text_len_for_training": cfg.output_text_len_for_training,
        "mask_loss_weight": cfg.mask_loss_weight,
    }
    meta = {
        "num_hidden_layers": n_layers,
        "model": str(model_out or model),
        "training": asdict(cfg),
        "train_seconds": round(time.time() - t0),
        "steps": steps,
    }
    save_predictors(predictors, out, sparse, meta)
    save_checkpoint(ckpt, modules, opt, {"step": steps, "config": asdict(cfg)})
    logger.info("wrote %s in %.0f s", out, time.time() - t0)
    return out
