"""Training MSD / FLASH drafts by self-distillation from a LLaVA target, on CPU.

Stage 1 (**data**, shared by both drafts, resumable per shard): the target answers the world's prompts
(detailed descriptions, captions, short questions; ``mmfast.world.text``) about **train** images with
greedy decoding (<= ``max_new_tokens``), batched through mmfast's own pipeline; one teacher-forced
forward over prompt + answer then gives the target's final hidden state at every position. Shards
hold the token ids, the projected visual features, the hidden states (fp16) and the target's top-8
log-probs at the answer positions. The loss uses the full target distribution, ``lm_head(hidden)``
through the frozen head, recomputed from the cached hidden states as EAGLE's trainer does. MSD's
text-only data are the target's answers to the same prompts without the image.

Stage 2 (**train**): EAGLE's objective on the draft's rows (:meth:`DraftModel.rows`), at rows whose
next token is an answer token: SmoothL1(pred, h_{t+1}) + ``ce_weight`` x soft cross-entropy against
softmax(lm_head(h_{t+1})) through the frozen head, with uniform noise U(-noise/2, noise/2) on the
input hidden states; FLASH's K slots regress h_{t+1..t+K} (the loss replicated over the offsets).
AdamW (betas 0.9/0.95), linear warmup + cosine decay, gradient clip 0.5. MSD's curriculum: the first
``text_stage`` of the steps text-only, then each sample is visual with probability rising linearly to
1, and the last ``visual_stage`` all visual. Resumable checkpoints (``mmfast.train.common``) in the
work directory; the result is written with :func:`mmfast.speculative._eagle_model.save_draft`.

Deviations from the papers (reasons: CPU budget, a 256-wide target): learning rate 1e-3 with a short
warmup instead of 3e-5 / 5e-5 with 2k warmup steps (5e-5 reaches tau 1.8 where 1e-3 reaches 4.2 after
400 steps on a stand-in target); 2k steps (~16 epochs of the visual data) instead of 20-40 epochs;
EAGLE's uniform noise is also scaled by 512 / sequence length, dropped here; the curriculum is over
steps rather than epochs (``--text-stage 0 --visual-stage 1`` trains on visual data only).
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from tqdm import tqdm

from ..errors import InputError
from ..speculative._eagle_model import DraftModel, build_draft, save_draft
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
class DraftTrainConfig:
    seed: int = 0
    # data
    n_images: int = 2000  # train images, one prompt each (visual samples)
    n_text: int = 800  # text-only samples (MSD's first curriculum stage)
    max_new_tokens: int = 96
    gen_batch: int = 32
    detail_frac: float = 0.45  # prompt mix: detailed descriptions / captions / short questions
    caption_frac: float = 0.4
    # optimisation
    steps: int = 2000
    batch: int = 16
    lr: float = 1e-3
    warmup: int = 60
    weight_decay: float = 0.0
    clip: float = 0.5
    noise: float = 0.2
    ce_weight: float = 0.1
    # MSD curriculum (fractions of the steps)
    text_stage: float = 0.5
    visual_stage: float = 0.025
    # FLASH
    sar_k: int = 5
    n_latents: int = 64
    compress_source: str = "hidden"
    checkpoint_every: int = 100
    threads: int = 0  # torch threads (0: leave as is)

    def __post_init__(self) -> None:
        require_positive(
            self, "n_images", "max_new_tokens", "gen_batch", "steps", "batch", "lr", "checkpoint_every", "sar_k"
        )


# ------------------------------------------------------------------------------------ data


def _prompt_for(ann, rng: random.Random, cfg: DraftTrainConfig) -> str:
    from ..world.text import (
        CAPTION_PROMPTS,
        DETAIL_PROMPTS,
        SHORT_ANSWER_SUFFIX,
        short_qa,
        yes_no_questions,
    )

    u = rng.random()
    if u < cfg.detail_frac:
        return rng.choice(DETAIL_PROMPTS)
    if u < cfg.detail_frac + cfg.caption_frac:
        return rng.choice(CAPTION_PROMPTS)
    if rng.random() < 0.5:
        q = rng.choice(yes_no_questions(ann, rng)).question
        return q if rng.random() < 0.5 else f"{q}\n{SHORT_ANSWER_SUFFIX}"
    return rng.choice(short_qa(ann, rng)).question


TOPK = 8


@torch.inference_mode()
def _generate_shard(session, images, prompts: list[str], with_image: bool, max_new: int) -> dict[str, torch.Tensor]:
    from ..decoding.loop import autoregressive

    mm = session.mm
    batch = mm.prepare(images, prompts)
    if with_image:
        inputs = session.build_inputs(batch, session.encode(batch))
    else:
        inputs = session.text_only_inputs(batch)
    out = autoregressive(session.ctx, inputs, lambda logits, step, state: logits.argmax(-1), max_new)
    lm = mm.adapter.language_model
    eos = mm.eos_token_ids[0]
    ids_l, hid_l, vis_l, off, voff, plen, has_eos, top_i, top_v = [], [], [], [0], [0], [], [], [], []
    for b, toks in enumerate(out.tokens):
        row = inputs.select(torch.tensor([b]))
        pad = int((row.attention_mask[0] == 0).sum())
        ids = row.input_ids[0, pad:]
        emb = row.embeds[0, pad:]
        img = row.image_mask[0, pad:]
        ended = len(toks) < max_new
        ans = torch.tensor(toks + ([eos] if ended else []), dtype=torch.long)
        full_ids = torch.cat([ids.cpu(), ans])
        full_emb = torch.cat([emb, mm.adapter.embed_tokens(ans.to(emb.device)[None])[0].to(emb.dtype)])
        pos = torch.arange(full_emb.shape[0], device=emb.device)[None]
        hid = lm(inputs_embeds=full_emb[None], position_ids=pos, use_cache=False).last_hidden_state[0]
        top = torch.log_softmax(mm.adapter.lm_head(hid[ids.numel() - 1 :]).float(), -1).topk(TOPK)  # answer positions
        top_i.append(top.indices.to(torch.int32).cpu())
        top_v.append(top.values.to(torch.float16).cpu())
        ids_l.append(full_ids.to(torch.int32))
        hid_l.append(hid.float().cpu().to(torch.float16))
        vis_l.append(emb[img].float().cpu().to(torch.float16))
        off.append(off[-1] + full_ids.numel())
        voff.append(voff[-1] + int(img.sum()))
        plen.append(ids.numel())
        has_eos.append(int(ended))
    d = hid_l[0].shape[-1]
    return {
        "ids": torch.cat(ids_l),
        "hid": torch.cat(hid_l),
        "vis": torch.cat(vis_l) if voff[-1] else torch.zeros(0, d, dtype=torch.float16),
        "off": torch.tensor(off, dtype=torch.long),
        "voff": torch.tensor(voff, dtype=torch.long),
        "plen": torch.tensor(plen, dtype=torch.long),
        "eos": torch.tensor(has_eos, dtype=torch.long),
        # the target's top-k log-probs at the answer positions (rows plen-1 .. T-1), a record of the
        # distributions the loss recomputes exactly from ``hid`` through the frozen LM head
        "topk_ids": torch.cat(top_i),
        "topk_logp": torch.cat(top_v),
    }


def generate_data(mm, cfg: DraftTrainConfig, work: Path, kind: str, n: int) -> Path:
    """Self-distilled samples ``kind`` ("visual" | "text") in ``work/data/<kind>/shard_*.safetensors``."""
    from safetensors.torch import save_file

    from ..config import load_recipe
    from ..pipeline import Session
    from ..world import WorldConfig, render_image

    out = work / "data" / kind
    out.mkdir(parents=True, exist_ok=True)
    n_shards = math.ceil(n / cfg.gen_batch)
    # a shard is done when it holds all its samples: the last one of a smaller earlier run is redone
    todo = [
        s
        for s in range(n_shards)
        if _shard_size(out / f"shard_{s:05d}.safetensors") != min(n, (s + 1) * cfg.gen_batch) - s * cfg.gen_batch
    ]
    if not todo:
        return out
    wc = WorldConfig()
    offset = 0 if kind == "visual" else 1_000_000  # text prompts come from other train images
    bar = tqdm(todo, desc=f"target answers ({kind})", unit="shard")
    t0 = time.time()
    with Session(mm, load_recipe({"decoding": {"method": "greedy"}})) as session:
        for i, s in enumerate(bar):
            ids = range(1 + offset + s * cfg.gen_batch, 1 + offset + min(n, (s + 1) * cfg.gen_batch))
            images, prompts = [], []
            for image_id in ids:
                r = render_image(cfg.seed, "train", image_id, wc)
                rng = random.Random(f"{cfg.seed}-{kind}-{image_id}")
                images.append(r.image)
                prompts.append(_prompt_for(r.annotation, rng, cfg))
            shard = _generate_shard(session, images, prompts, kind == "visual", cfg.max_new_tokens)
            tmp = out / f"shard_{s:05d}.tmp"
            save_file(shard, str(tmp))
            tmp.rename(out / f"shard_{s:05d}.safetensors")
            if i == 0:
                per = (time.time() - t0) / len(ids)
                logger.info("%s data: %.2f s per sample -> about %.1f min for %d samples", kind, per, per * n / 60, n)
    return out


@dataclass
class Sample:
    ids: torch.Tensor  # [T] long
    hid: torch.Tensor  # [T, d] fp16
    vis: torch.Tensor  # [N, d] fp16 projected features of the image tokens
    plen: int
    eos: bool


def _shard_size(path: Path) -> int:
    """Samples in a shard file (-1 when it does not exist)."""
    if not path.exists():
        return -1
    with safe_open(str(path), framework="pt") as f:
        return f.get_slice("off").get_shape()[0] - 1


def load_samples(path: Path, n: int | None = None) -> list[Sample]:
    """The first ``n`` samples (all if None) of the shards in ``path``, in image-id order."""
    from safetensors.torch import load_file

    out: list[Sample] = []
    for f in sorted(path.glob("shard_*.safetensors")):
        if n is not None and len(out) >= n:
            break
        t = load_file(str(f))
        off, voff = t["off"].tolist(), t["voff"].tolist()
        for b in range(len(off) - 1):
            out.append(
                Sample(
                    t["ids"][off[b] : off[b + 1]].long(),
                    t["hid"][off[b] : off[b + 1]],
                    t["vis"][voff[b] : voff[b + 1]],
                    int(t["plen"][b]),
                    bool(t["eos"][b]),
                )
            )
    return out if n is None else out[:n]


# ------------------------------------------------------------------------------------ loss


def _prepare(model: DraftModel, s: Sample, image_id: int, noise: float, gen: torch.Generator | None):
    """Row inputs, query rows and regression targets of one sample (see the module docstring)."""
    dtype = model.fc.weight.dtype
    dev = model.fc.weight.device
    ids = s.ids.to(dev)
    hid = s.hid.to(dev, dtype)
    with torch.no_grad():
        emb = model.embed(ids).to(dtype)
    t = ids.numel()
    # image slots are prompt positions only: a target answer may itself contain the image token's id
    img = (ids == image_id) & (torch.arange(t, device=dev) < s.plen)  # [T]
    if bool(img.any()):
        emb = emb.clone()
        emb[img] = s.vis.to(dev, dtype)
    image_index = torch.where(img, torch.zeros_like(ids), torch.full_like(ids, -1))  # one image per sample
    hid_in = hid[:-1]
    if noise > 0:
        hid_in = hid_in + (torch.rand(hid_in.shape, generator=gen, dtype=torch.float32).to(dev, dtype) - 0.5) * noise
    last = t - 2 - int(s.eos)  # last row whose target is worth predicting
    query = torch.arange(s.plen - 1, last + 1, device=dev)
    vis_src = hid[1:] if model.arch.compress_source == "hidden" else None
    row = {"next_emb": emb[1:], "hid": hid_in, "row_image": image_index[1:], "vis_src": vis_src, "query": query}
    return row, hid, last


def draft_loss(
    model: DraftModel, samples: list[Sample], image_id: int, cfg: DraftTrainConfig, gen: torch.Generator | None = None
):
    """(loss, stats) of one batch: SmoothL1 + ce_weight x soft CE over valid (row, slot) pairs."""
    rows, targets = [], []
    for s in samples:
        row, hid, last = _prepare(model, s, image_id, cfg.noise, gen)
        rows.append(row)
        targets.append((hid, last, row["query"]))
    pred, q_valid = model.train_forward(rows)  # [B, Q, K, d]
    b, nq, k, d = pred.shape
    tgt = pred.new_zeros(b, nq, k, d)
    valid = torch.zeros(b, nq, k, dtype=torch.bool, device=pred.device)
    for i, (hid, last, query) in enumerate(targets):
        for slot in range(k):
            ok = query + slot <= last
            n = int(ok.sum())
            if n:
                tgt[i, :n, slot] = hid[query[:n] + 1 + slot]
                valid[i, :n, slot] = True
    valid &= q_valid[:, :, None]
    if not bool(valid.any()):  # e.g. a batch of empty answers: nothing to learn, no NaN
        return pred.sum() * 0.0, {"vloss": float("nan"), "ploss": float("nan"), "acc": [float("nan")] * k, "n": 0}
    p, t = pred[valid], tgt[valid]  # [M, d]
    vloss = F.smooth_l1_loss(p.float(), t.float(), reduction="none").mean(-1)
    logp = torch.log_softmax(model.head(p).float(), -1)
    with torch.no_grad():
        tlogits = model.head(t).float()
        tp = torch.softmax(tlogits, -1)
    ploss = -(tp * logp).sum(-1)
    loss = vloss.mean() + cfg.ce_weight * ploss.mean()
    with torch.no_grad():
        hit = logp.argmax(-1) == tlogits.argmax(-1)
        slot_of = torch.arange(k, device=pred.device).expand(b, nq, k)[valid]
        acc = [
            float(hit[slot_of == j].float().mean()) if bool((slot_of == j).any()) else float("nan") for j in range(k)
        ]
    return loss, {
        "vloss": float(vloss.detach().mean()),
        "ploss": float(ploss.detach().mean()),
        "acc": acc,
        "n": int(valid.sum()),
    }


def visual_probability(step: int, steps: int, cfg: DraftTrainConfig, kind: str) -> float:
    """MSD's curriculum: text-only, then linearly rising visual probability, then all visual."""
    if kind != "msd":
        return 1.0
    u = step / max(1, steps)
    if u < cfg.text_stage:
        return 0.0
    end = 1.0 - cfg.visual_stage
    if u >= end:
        return 1.0
    return (u - cfg.text_stage) / max(1e-9, end - cfg.text_stage)


# ------------------------------------------------------------------------------------ driver


def train_draft(
    model_name: str, kind: str, out: str | Path | None, work_dir: str | Path, cfg: DraftTrainConfig = DraftTrainConfig()
) -> Path:
    """Generate (or reuse) the self-distilled data and train a ``kind`` draft; returns the output directory."""
    import mmfast

    from ..checkpoint import source_dir

    if kind not in ("msd", "flash"):
        raise InputError(f"unknown draft {kind!r} (msd | flash)")
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    mm = mmfast.load(model_name, device="cpu", dtype="float32")
    mm.model.requires_grad_(False)
    bind_work_dir(work, mm.model)
    # the shards' images, prompts and answers (shared by msd and flash; the counts may grow)
    data_keys = ("seed", "max_new_tokens", "gen_batch", "detail_frac", "caption_frac")
    bind_work_data(work, {k: getattr(cfg, k) for k in data_keys}, "drafts_data.json")
    if out is None:
        d = source_dir(model_name)
        if d is None:
            raise InputError(f"{model_name} is not a local directory; pass --out")
        out = d / kind
    out = Path(out)
    vis_dir = generate_data(mm, cfg, work, "visual", cfg.n_images)
    visual = load_samples(vis_dir, cfg.n_images)
    text: list[Sample] = []
    if kind == "msd" and cfg.text_stage > 0 and cfg.n_text > 0:
        text = load_samples(generate_data(mm, cfg, work, "text", cfg.n_text), cfg.n_text)
    t_data = time.time() - t_start
    logger.info("data: %d visual, %d text-only samples (%.0f s)", len(visual), len(text), t_data)

    seed_everything(cfg.seed + 1)
    arch_kw = (
        {"sar_k": cfg.sar_k, "n_latents": cfg.n_latents, "compress_source": cfg.compress_source}
        if kind == "flash"
        else {}
    )
    model = build_draft(mm, kind, **arch_kw)
    if kind == "flash":
        torch.nn.init.zeros_(model.sar[-1].weight)  # slots start as the EAGLE next-feature guess
        torch.nn.init.zeros_(model.sar[-1].bias)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt = work / f"{kind}_ckpt"
    step = 0
    if ckpt.exists():
        meta = load_checkpoint(ckpt, {"draft": model}, opt)
        check_resume_config(ckpt, meta, asdict(cfg))
        step = meta["step"]
        logger.info("%s: resuming at step %d/%d", kind, step, cfg.steps)
    image_id = mm.adapter.image_token_id
    gen = torch.Generator().manual_seed(cfg.seed)
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc=f"train {kind}")
    first = step
    ema, st = None, {"acc": None}
    t0 = time.time()
    for step in bar:
        rng = random.Random(cfg.seed * 100003 + step)
        gen.manual_seed(cfg.seed * 7919 + step)
        pv = visual_probability(step, cfg.steps, cfg, kind)
        batch = [rng.choice(visual) if (not text or rng.random() < pv) else rng.choice(text) for _ in range(cfg.batch)]
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg.steps, cfg.lr, warmup=cfg.warmup)
        loss, st = draft_loss(model, batch, image_id, cfg, gen)
        if st["n"]:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            ema = loss.item() if ema is None else 0.97 * ema + 0.03 * loss.item()
        bar.set_postfix(
            loss=f"{ema if ema is not None else float('nan'):.3f}", acc=f"{st['acc'][0]:.2f}", p_vis=f"{pv:.2f}"
        )
        if step + 1 == first + 10:
            per = (time.time() - t0) / 10
            logger.info(
                "%s: %.2f s per step -> about %.1f min for the remaining %d steps",
                kind,
                per,
                per * (cfg.steps - step - 1) / 60,
                cfg.steps - step - 1,
            )
        if (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(ckpt, {"draft": model}, opt, {"step": step + 1, "config": asdict(cfg)})
    if first < cfg.steps:
        save_checkpoint(ckpt, {"draft": model}, opt, {"step": cfg.steps, "config": asdict(cfg)})
    model.eval()
    meta = {
        "trained": True,
        "train_config": asdict(cfg),
        "target": str(model_name),
        "n_visual": len(visual),
        "n_text": len(text),
        "final_loss_ema": ema,
        "final_acc_by_slot": st["acc"],
        "train_seconds": round(time.time() - t_start),
    }
    save_draft(model, out, meta)
    logger.info("wrote %s draft to %s in %.0f s", kind, out, time.time() - t_start)
    return out
