"""Training the embedded world model (``mmfast/tiny-world``) on a 2-core CPU.

Stages (each resumable from ``work_dir``):

0. **Vision pre-training**, HF ``CLIPModel`` (CLIP vision tower at the LLaVA-1.5 token geometry,
   24 x 24 patches + CLS, and a small text tower): CLIP's contrastive loss on image/caption pairs,
   plus a dense per-patch label loss on the feature layer (``hidden_states[-2]``, what the projector
   reads) and a multi-label loss on the pooled CLS. The dense loss is what makes patch tokens
   carry object identity (and makes token pruning measurable); without it nothing downstream learns.
1. **Feature cache**: the frozen tower's feature-layer patch tokens for every training image.
2. **LLaVA training** (projector + Llama LM from scratch; vision frozen): multi-turn conversations
   mixing detailed descriptions, captions, balanced yes/no object questions and short QA. A tiny LM
   reading 576 image tokens learns captions from language priors long before it learns to *look*:
   every yes/no question then gets the same answer (a long plateau) and captions hallucinate from the
   scene prior. Training-only signals fix it: linear probes on the layer-2 hidden state at yes/no
   decision positions (queried object; image object set), a 5x weight on the yes/no decision tokens,
   and a grounding loss on the attention that, in the middle layers, the positions predicting "Yes"
   (object present) or an object word in a caption pay to that object's patches (known from the
   label map).
   Both are discarded after training: the shipped model is a stock ``LlavaForConditionalGeneration``.
3. **Refine rounds** (``refine_*``, ``refine2_*``, ...): stage 0 continued with foreground patches
   weighted up in the dense loss (~90% of patches are background; round 1 left foreground patch
   accuracy at 0.25 and small objects invisible), features re-cached, and stage 2 continued on the new
   features (a round with 0 stage-2 epochs only sharpens the tower, one with 0 stage-0 epochs only
   continues the LLaVA on the last tower). Round 1 alone was v1 of the shipped model, one refine round
   v2, two v3, ten v4, eleven v5; the twelve rounds of the defaults are v6. The rounds are kept
   separate so that earlier checkpoints resume.

Every phase runs on ``device`` (CPU by default, where the defaults take 17-18 hours on 2 cores;
``--device cuda`` runs the same steps on a GPU, about 35 minutes on one H100; rounding differs, the
algorithm does not).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ..models.factory import (
    SHAPES,
    LlavaShape,
    build_processor,
    clip_tower_kwargs,
    llava_config,
    save_model,
    train_bpe_tokenizer,
)
from ..world import CATEGORIES, NUM_LABELS
from ..world.text import captions, text_rng, world_corpus
from .common import cosine_lr, describe_device, load_checkpoint, save_checkpoint, seed_everything
from .world_data import (
    N_CATS,
    EncodedConversation,
    WorldImages,
    conversation,
    conversation_rng,
    encode_conversation,
    render_split,
    to_pixel_values,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Phase:
    """One resumable training phase: its work-dir name, length and what differs between rounds."""

    name: str  # checkpoint prefix in the work dir ("stage0", "refine_stage0", ...)
    epochs: float
    round: int = 0  # offsets the data sampling so that round 2 draws fresh batches and conversations
    fg_weight: float = 1.0  # stage 0 only: weight of foreground patches in the dense loss


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    n_train: int = 10000
    shape: str = "world"
    vocab_size: int = 1024
    clip_text_hidden: int = 128
    clip_text_layers: int = 3
    clip_proj: int = 128
    stage0_epochs: float = 2.5
    stage0_batch: int = 32
    stage0_lr: float = 1e-3
    # weight of foreground patches in the dense loss of the first stage-0 phase (the refine rounds use
    # refine_fg_weight); 1.0 in the shipped recipe, whose first round weighted every patch alike
    stage0_fg_weight: float = 1.0
    stage2_epochs: float = 2.0
    stage2_batch: int = 16
    stage2_lr: float = 1e-3
    probe_weight: float = 0.5
    grounding_weight: float = 1.0
    yes_no_weight: float = 5.0
    grounding_layers: tuple[int, ...] = (1, 2)
    bf16: bool = True
    workers: int = 2
    checkpoint_every: int = 100
    # refine rounds, one entry per round: stage 0 continued with foreground patches weighted up in
    # the dense loss, features re-cached, stage 2 continued on them; 0 epochs skips a phase (rounds
    # 5-6 and 8-9 only sharpen the tower: the LLaVA is fitted to the tower of rounds 7 and 10; round
    # 11 only continues the LLaVA on round 10's tower; round 12 sharpens the tower once more and
    # continues the LLaVA on it)
    refine_stage0_epochs: tuple[float, ...] = (4.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 0.0, 6.0)
    refine_fg_weight: float = 5.0
    refine_stage2_epochs: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 2.0, 2.0, 2.0)

    def __post_init__(self) -> None:
        if len(self.refine_stage0_epochs) != len(self.refine_stage2_epochs):
            raise ValueError(
                f"refine_stage0_epochs {self.refine_stage0_epochs} and refine_stage2_epochs {self.refine_stage2_epochs}"
                " need one entry per refine round each; give 0 to skip a phase of a round"
            )

    def phases(self) -> list[tuple[Phase, Phase]]:
        """Every (stage 0, stage 2) pair in training order: the first round, then the refine rounds."""
        first = (
            Phase("stage0", self.stage0_epochs, fg_weight=self.stage0_fg_weight),
            Phase("stage2", self.stage2_epochs),
        )
        return [first] + self.refine_rounds()

    def refine_rounds(self) -> list[tuple[Phase, Phase]]:
        """(stage 0, stage 2) phases of every refine round, named ``refine_*``, ``refine2_*``, ..."""
        rounds = []
        for i, (e0, e2) in enumerate(zip(self.refine_stage0_epochs, self.refine_stage2_epochs), start=1):
            prefix = "refine" if i == 1 else f"refine{i}"
            rounds.append(
                (
                    Phase(f"{prefix}_stage0", e0, round=i, fg_weight=self.refine_fg_weight),
                    Phase(f"{prefix}_stage2", e2, round=i),
                )
            )
        return rounds


# ------------------------------------------------------------------------------------ tokenizer


def build_tokenizer(images: WorldImages, cfg: TrainConfig):
    corpus = list(world_corpus([a for a in images.annotations[:2000]], seed=cfg.seed, split="train"))
    corpus += ["USER: <image>\nhello ASSISTANT: hi", "USER: ASSISTANT:"] * 20
    return train_bpe_tokenizer(corpus, cfg.vocab_size)


# ------------------------------------------------------------------------------------ stage 0


class Stage0(nn.Module):
    """CLIP + the two training-only heads of stage 0."""

    def __init__(self, clip, vision_hidden: int) -> None:
        super().__init__()
        self.clip = clip
        self.dense = nn.Sequential(nn.LayerNorm(vision_hidden), nn.Linear(vision_hidden, NUM_LABELS))
        self.multilabel = nn.Linear(vision_hidden, N_CATS)


def clip_config(shape: LlavaShape, tokenizer, cfg: TrainConfig):
    from transformers import CLIPConfig

    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.clip_text_hidden,
        intermediate_size=cfg.clip_text_hidden * 4,
        num_hidden_layers=cfg.clip_text_layers,
        num_attention_heads=4,
        max_position_embeddings=64,
        # mmfast pools text at the appended </s> itself (see text_features), not through HF's pooler
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=1,
        pad_token_id=0,
    )
    # the tower is LLaVA's: its weights are loaded into the LLaVA model after training
    return CLIPConfig(text_config=text, vision_config=clip_tower_kwargs(shape), projection_dim=cfg.clip_proj)


def clip_text_ids(tokenizer, texts: list[str], max_len: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """Caption token ids for the CLIP text tower, ending with the pooling token, right-padded."""
    eot = tokenizer.eos_token_id
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"][: max_len - 1] + [eot] for t in texts]
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def text_features(clip, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pooled, projected text embeddings (pooled at the last real token, the appended </s>)."""
    out = clip.text_model(input_ids=ids, attention_mask=mask)
    last = mask.sum(1) - 1
    pooled = out.last_hidden_state[torch.arange(ids.shape[0]), last]
    return clip.text_projection(pooled)


def new_stage0(shape: LlavaShape, tokenizer, cfg: TrainConfig) -> Stage0:
    from transformers import CLIPModel

    return Stage0(CLIPModel(clip_config(shape, tokenizer, cfg)), shape.vision_hidden)


def train_stage0(
    model: Stage0, images: WorldImages, tokenizer, cfg: TrainConfig, work: Path, phase: Phase, device: str = "cpu"
) -> Stage0:
    """Train (or load, when ``<phase>_final`` exists) ``model`` in place (moved to ``device``) for one stage-0 phase."""
    done = work / f"{phase.name}_final"
    model.to(device)
    if done.exists():
        load_checkpoint(done, {"m": model})
        return model
    n = len(images)
    steps = int(phase.epochs * n / cfg.stage0_batch)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.stage0_lr, weight_decay=0.05)
    ckpt = work / f"{phase.name}_ckpt"
    step = 0
    if ckpt.exists():
        step = load_checkpoint(ckpt, {"m": model}, opt)["step"]
        logger.info("%s: resuming at step %d/%d", phase.name, step, steps)
    caps = [captions(a, text_rng(images.seed, "train", a.image_id, "captions")) for a in images.annotations]
    model.train()
    bar = tqdm(range(step, steps), initial=step, total=steps, desc=f"{phase.name} (vision)")
    for step in bar:
        draw = step + 1_000_000 * phase.round
        g = torch.Generator().manual_seed(cfg.seed * 100003 + draw)
        idx = torch.randint(0, n, (cfg.stage0_batch,), generator=g).numpy()
        rng = random.Random(draw)
        pv = to_pixel_values(images.pixels[idx]).to(device)
        hist = torch.from_numpy(images.patch_hist[idx]).float().to(device)  # [B, P, L]
        target = hist / hist.sum(-1, keepdim=True).clamp(min=1)
        # a patch is foreground when objects cover >= 1/4 of it; ~90% of patches are background
        fg = target[..., 0] <= 0.75  # [B, P]
        patch_w = torch.where(fg, phase.fg_weight, 1.0)  # [B, P]
        ids, mask = (t.to(device) for t in clip_text_ids(tokenizer, [rng.choice(caps[i]) for i in idx]))
        present = torch.from_numpy(images.present[idx]).float().to(device)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, cfg.stage0_lr)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.bf16):
            vout = model.clip.vision_model(pixel_values=pv, output_hidden_states=True)
            feats = vout.hidden_states[-2][:, 1:]  # [B, P, Dv] what LLaVA's projector reads
            dense_logits = model.dense(feats).float()
            pooled = vout.pooler_output  # post-layernorm CLS of the last layer
            img_emb = model.clip.visual_projection(pooled).float()
            txt_emb = text_features(model.clip, ids, mask).float()
            ml_logits = model.multilabel(pooled).float()
        img_emb = F.normalize(img_emb, dim=-1)
        txt_emb = F.normalize(txt_emb, dim=-1)
        logits = model.clip.logit_scale.exp().clamp(max=100) * img_emb @ txt_emb.T
        labels = torch.arange(len(idx), device=device)
        # identical captions in a batch are rare but possible; CLIP ignores it too
        l_con = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        l_dense = (-(target * F.log_softmax(dense_logits, -1)).sum(-1) * patch_w).sum() / patch_w.sum()
        l_ml = F.binary_cross_entropy_with_logits(ml_logits, present)
        loss = l_con + l_dense + l_ml
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            hit = dense_logits.argmax(-1) == target.argmax(-1)  # [B, P]
            acc, fg_acc = hit.float().mean().item(), hit[fg].float().mean().item()
        bar.set_postfix(
            con=f"{l_con.item():.2f}",
            dense=f"{l_dense.item():.2f}",
            ml=f"{l_ml.item():.3f}",
            patch_acc=f"{acc:.3f}",
            fg_acc=f"{fg_acc:.3f}",
        )
        if (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(ckpt, {"m": model}, opt, {"step": step + 1})
    save_checkpoint(done, {"m": model}, None, {"step": steps, "device": describe_device(device)})
    return model


def cache_features(
    clip_vision, images: WorldImages, work: Path, tag: str = "", batch: int = 64, device: str = "cpu"
) -> np.ndarray:
    """Feature-layer patch tokens ([N, P, Dv], fp16) of the frozen tower, cached on disk."""
    path = work / f"features{tag}_{len(images)}.npy"
    if path.exists():
        return np.load(path, mmap_mode="r")
    # moved outside inference mode: buffers moved inside it become inference tensors, and a later
    # stage-0 round on the same tower could no longer train
    clip_vision.eval().to(device)
    chunks = []
    with torch.inference_mode():
        for i in tqdm(range(0, len(images), batch), desc="cache features"):
            pv = to_pixel_values(images.pixels[i : i + batch]).to(device)
            hs = clip_vision(pixel_values=pv, output_hidden_states=True).hidden_states[-2][:, 1:]  # [b, P, Dv]
            chunks.append(hs.to(torch.float16).cpu().numpy())
    feats = np.concatenate(chunks)
    np.save(path.with_suffix(".tmp.npy"), feats)
    path.with_suffix(".tmp.npy").rename(path)
    return feats


# ------------------------------------------------------------------------------------ stage 2


def _collate(batch: list[EncodedConversation], n_patches: int, image_id: int, pad_id: int):
    """Expand the single image token to ``n_patches`` slots and right-pad."""
    rows = []
    for enc in batch:
        j = enc.ids.index(image_id)
        ids = enc.ids[:j] + [image_id] * n_patches + enc.ids[j + 1 :]
        labels = enc.labels[:j] + [-100] * n_patches + enc.labels[j + 1 :]
        shift = n_patches - 1
        rows.append(
            (
                ids,
                labels,
                [p + shift for p in enc.probe_pos],
                enc.probe_cat,
                enc.probe_yes,
                j,
                [p + shift for p in enc.mention_pos],
                enc.mention_cat,
            )
        )
    length = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    probe_b, probe_p, probe_c, probe_y = [], [], [], []
    ment_b, ment_p, ment_c = [], [], []
    image_start = torch.tensor([r[5] for r in rows], dtype=torch.long)
    for b, (i, lab, pp, pc, py, _, mp, mc) in enumerate(rows):
        ids[b, : len(i)] = torch.tensor(i)
        labels[b, : len(lab)] = torch.tensor(lab)
        mask[b, : len(i)] = 1
        probe_b += [b] * len(pp)
        probe_p += pp
        probe_c += pc
        probe_y += py
        ment_b += [b] * len(mp)
        ment_p += mp
        ment_c += mc
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    mentions = (as_long(ment_b), as_long(ment_p), as_long(ment_c))
    return (
        ids,
        labels,
        mask,
        as_long(probe_b),
        as_long(probe_p),
        as_long(probe_c),
        torch.tensor(probe_y, dtype=torch.bool),
        image_start,
        mentions,
    )


def _to(batch, device: str):
    """``batch`` (tensors and tuples of tensors, as :func:`_collate` returns it) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return type(batch)(_to(x, device) for x in batch)


class Stage2Heads(nn.Module):
    """Training-only probes on the layer-2 hidden state (discarded after training)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.queried = nn.Linear(hidden, N_CATS)
        self.present = nn.Linear(hidden, N_CATS)


def llava_forward(
    llava,
    feats: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    image_id: int,
    probe_layer: int = 2,
    all_hidden: bool = False,
):
    """Projector + LM on cached features; returns (logits [B, L, V], hidden entering layer ``probe_layer``
    or, with ``all_hidden``, every layer's input hidden states)."""
    base = llava.model
    img = base.multi_modal_projector(feats)  # [B, P, d]
    emb = base.language_model.embed_tokens(ids)  # [B, L, d]
    img_mask = (ids == image_id).unsqueeze(-1)
    emb = emb.masked_scatter(img_mask, img.to(emb.dtype))
    out = base.language_model(inputs_embeds=emb, attention_mask=mask, output_hidden_states=True)
    return llava.lm_head(out.last_hidden_state), (out.hidden_states if all_hidden else out.hidden_states[probe_layer])


def grounding_loss(
    lm,
    hidden_states,
    rows_b: torch.Tensor,
    rows_p: torch.Tensor,
    image_start: torch.Tensor,
    target: torch.Tensor,
    layers,
) -> torch.Tensor:
    """-log(attention mass on the queried object's patches), head mean, averaged over ``layers``.

    ``hidden_states[l]`` is the input of layer ``l`` ([B, L, d]); ``rows_*`` pick the answer positions
    ([n]); ``target`` ([n, P] bool) marks the patches holding the queried object. The attention rows
    are recomputed from q/k of those positions only (causal; right padding lies after them).
    """
    n, n_patches = target.shape
    total = torch.zeros((), device=target.device)
    for layer_idx in layers:
        layer = lm.layers[layer_idx]
        attn = layer.self_attn
        x = layer.input_layernorm(hidden_states[layer_idx])  # [B, L, d]
        bsz, length, _ = x.shape
        pos = torch.arange(length, device=x.device).expand(bsz, length)
        cos, sin = lm.rotary_emb(x, pos)  # [B, L, D]
        d_head = attn.head_dim
        k = attn.k_proj(x).view(bsz, length, -1, d_head)  # [B, L, Hkv, D]
        k = k * cos[:, :, None] + _rotate_half(k) * sin[:, :, None]
        q = attn.q_proj(x[rows_b, rows_p]).view(n, -1, d_head)  # [n, H, D]
        q = q * cos[rows_b, rows_p][:, None] + _rotate_half(q) * sin[rows_b, rows_p][:, None]
        kk = k[rows_b].repeat_interleave(q.shape[1] // k.shape[2], dim=2)  # [n, L, H, D]
        scores = torch.einsum("nhd,nlhd->nhl", q.float(), kk.float()) * d_head**-0.5  # [n, H, L]
        causal = torch.arange(length, device=x.device)[None, :] <= rows_p[:, None]  # [n, L]
        probs = torch.softmax(scores.masked_fill(~causal[:, None], float("-inf")), -1).mean(1)  # [n, L]
        idx = image_start[rows_b][:, None] + torch.arange(n_patches, device=x.device)[None]  # [n, P]
        mass = (probs.gather(1, idx) * target).sum(-1)
        total = total - torch.log(mass + 1e-4).mean()
    return total / len(layers)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def train_stage2(
    llava,
    heads: Stage2Heads,
    feats: np.ndarray,
    images: WorldImages,
    tokenizer,
    cfg: TrainConfig,
    work: Path,
    phase: Phase,
    device: str = "cpu",
) -> None:
    """Train (or load, when ``<phase>_final`` exists) projector + LM in place (moved to ``device``) for one stage-2 phase."""
    done = work / f"{phase.name}_final"
    modules = {
        "projector": llava.model.multi_modal_projector,
        "lm": llava.model.language_model,
        "head": llava.lm_head,
        "probes": heads,
    }
    llava.to(device)
    heads.to(device)
    if done.exists():
        load_checkpoint(done, modules)
        return
    image_id = llava.config.image_token_id
    n_patches = feats.shape[1]
    n = len(images)
    steps_per_epoch = n // cfg.stage2_batch
    steps = int(phase.epochs * steps_per_epoch)
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.stage2_lr, weight_decay=0.01, betas=(0.9, 0.98))
    ckpt = work / f"{phase.name}_ckpt"
    step = 0
    if ckpt.exists():
        step = load_checkpoint(ckpt, modules, opt)["step"]
        logger.info("%s: resuming at step %d/%d", phase.name, step, steps)
    for m in modules.values():
        m.train()
    bar = tqdm(range(step, steps), initial=step, total=steps, desc=f"{phase.name} (llava)")
    for step in bar:
        epoch, k = divmod(step, steps_per_epoch)
        draw = epoch + 1000 * phase.round  # fresh orders and conversations in round 2
        order = np.random.default_rng(cfg.seed + 7919 * draw).permutation(n)
        idx = order[k * cfg.stage2_batch : (k + 1) * cfg.stage2_batch]
        convs = [
            encode_conversation(
                tokenizer,
                conversation(images.annotations[i], conversation_rng(cfg.seed, draw, images.annotations[i].image_id)),
            )
            for i in idx
        ]
        batch = _collate(convs, n_patches, image_id, tokenizer.pad_token_id)
        ids, labels, mask, pb, pp, pc, py, img_start, (mb, mp, mc) = _to(batch, device)
        f = torch.from_numpy(np.asarray(feats[idx])).float().to(device)
        present = torch.from_numpy(images.present[idx]).float().to(device)
        hist = torch.from_numpy(images.patch_hist[idx]).to(device)  # [b, P, labels] pixel counts
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, cfg.stage2_lr, warmup=100)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.bf16):
            logits, hs = llava_forward(llava, f, ids, mask, image_id, all_hidden=True)
            probe_h = hs[2][pb, pp]  # [n_probe, d] hidden entering layer 2
            q_logits = heads.queried(probe_h).float()
            p_logits = heads.present(probe_h).float()
            ground = torch.zeros((), device=device)
            # rows to ground: yes/no decisions about a present object, and caption positions that
            # predict an object word; target = that object's patches (label = category index + 1)
            yes = py.nonzero().squeeze(1)
            gb, gp, gc = torch.cat([pb[yes], mb]), torch.cat([pp[yes], mp]), torch.cat([pc[yes], mc])
            if cfg.grounding_weight > 0 and len(gb):
                target = hist[gb].gather(2, (gc + 1)[:, None, None].expand(-1, n_patches, 1)).squeeze(2) > 0
                ok = target.any(1)
                if ok.any():
                    ground = grounding_loss(
                        llava.model.language_model, hs, gb[ok], gp[ok], img_start, target[ok], cfg.grounding_layers
                    )
        # yes/no decisions are a few % of the answer tokens: weight them up so the decision is not
        # drowned by the long descriptions
        tok_loss = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="none",
        ).view(labels.shape[0], -1)  # [B, L-1]
        weight = (labels[:, 1:] != -100).float()
        weight[pb, pp] *= cfg.yes_no_weight  # pp predicts the "Yes"/"No" token
        lm_loss = (tok_loss * weight).sum() / weight.sum()
        probe_loss = torch.zeros((), device=device)
        if len(pb):
            probe_loss = F.cross_entropy(q_logits, pc) + F.binary_cross_entropy_with_logits(p_logits, present[pb])
        loss = lm_loss + cfg.probe_weight * probe_loss + cfg.grounding_weight * ground.float()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(
            lm=f"{lm_loss.item():.3f}", probe=f"{probe_loss.item():.3f}", ground=f"{ground.item():.3f}", ep=epoch
        )
        if (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(ckpt, modules, opt, {"step": step + 1})
    save_checkpoint(done, modules, None, {"step": steps, "device": describe_device(device)})


# ------------------------------------------------------------------------------------ driver


def train_embedded(
    out_dir: str | Path, work_dir: str | Path, cfg: TrainConfig = TrainConfig(), device: str = "cpu"
) -> Path:
    """Run every stage and write the model (``save_pretrained``) plus its CLIP towers to ``out_dir``.

    ``device`` only decides where the steps run (the recipe is the same; a GPU gives different
    rounding, not a different algorithm). Finished phases found in ``work_dir`` are loaded, not rerun.
    """
    from transformers import LlavaForConditionalGeneration

    t0 = time.time()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    seed_everything(cfg.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    shape = SHAPES[cfg.shape]
    images = render_split(cfg.seed, "train", cfg.n_train, shape.patch_size, workers=cfg.workers)
    tokenizer = build_tokenizer(images, cfg)
    logger.info("tokenizer: %d tokens", len(tokenizer))
    stage0 = new_stage0(shape, tokenizer, cfg)
    seed_everything(cfg.seed + 1)
    llava = LlavaForConditionalGeneration(llava_config(shape, vocab_size=len(tokenizer)))
    heads = Stage2Heads(llava.config.text_config.hidden_size)
    phases = cfg.phases()
    feats, tag = None, ""
    for vision_phase, llava_phase in phases:
        # (a sharper) tower, then the LLaVA (re-)fitted to its features; features are only computed
        # for a LLaVA phase that still has to run, and are named after the tower phase that made them
        if vision_phase.epochs > 0:
            train_stage0(stage0, images, tokenizer, cfg, work, vision_phase, device)
            feats, tag = None, ("_" + vision_phase.name.removesuffix("_stage0") if vision_phase.round else "")
        if llava_phase.epochs > 0:
            if feats is None and not (work / f"{llava_phase.name}_final").exists():
                feats = cache_features(stage0.clip.vision_model, images, work, tag=tag, device=device)
            train_stage2(llava, heads, feats, images, tokenizer, cfg, work, llava_phase, device)
    stage0.cpu()
    llava.cpu()
    clip = stage0.clip
    llava.model.vision_tower.load_state_dict(clip.vision_model.state_dict())
    llava.generation_config.eos_token_id = tokenizer.eos_token_id
    llava.generation_config.pad_token_id = tokenizer.pad_token_id
    llava.generation_config.bos_token_id = tokenizer.bos_token_id
    llava.eval()
    out = save_model(llava, build_processor(tokenizer, shape.image_size, shape.patch_size), out_dir)
    clip.save_pretrained(out / "clip", safe_serialization=True)  # text tower for instruction-guided methods
    ran = {
        p.name: json.loads((work / f"{p.name}_final" / "meta.json").read_text())
        for pair in phases
        for p in pair
        if (work / f"{p.name}_final" / "meta.json").exists()
    }
    meta = {
        "train_config": asdict(cfg),
        "train_seconds": round(time.time() - t0),
        "phases": ran,
        "categories": [c.name for c in CATEGORIES],
    }
    (out / "training.json").write_text(json.dumps(meta, indent=1))
    logger.info("wrote %s in %.0f s", out, time.time() - t0)
    return out
