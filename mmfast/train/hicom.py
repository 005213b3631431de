"""Training HICom's global branch on a LLaVA model (the embedded world model by default), on CPU.

Everything but the global branch is frozen: vision tower, projector, LLM and the CLIP guide. Data is
the world's instruction data of stage 2 (``mmfast.train.embedded``): each step samples images of the
train split and one conversation per image, cut after a random turn as HICom's guided format does
(``hicom/train.py``: every prefix ending at an answer is a sample, the guide is that turn's question
and only its answer is supervised). The visual input is HICom's token layout at inference:
[projector(training-free local tokens), global tokens]; the loss is the LM cross-entropy.

Resumable (``mmfast.train.common`` checkpoints in ``work_dir``); writes the weights with
:func:`mmfast.pruning._hicom_modules.save_global` (``hicom_global.safetensors`` + ``.json``).
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
from tqdm import tqdm

from ..checkpoint import source_dir
from ..errors import InputError
from ..pruning._hicom_guide import ClipGuide, guide_text, load_clip_guide
from ..pruning._hicom_modules import (
    GLOBAL_WEIGHTS,
    GlobalCompressor,
    local_compress,
    local_grid,
    save_global,
)
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
from .embedded import _collate
from .world_data import conversation, conversation_rng, encode_conversation, render_split, to_pixel_values

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HIComTrainConfig:
    seed: int = 0
    n_train: int = 4000
    steps: int = 1500  # ~2 s/step at batch 16 on the shared 2-core CPU (about 50 min)
    batch: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    n_queries: int = 32
    global_mode: str = "coarse"  # coarse: the paper's FiLM queries; direct: the release's (queries = instruction)
    spatial_kernel: int = 3  # the local tokens the global branch is trained next to (inference default)
    alpha: float = 0.5
    scale: float = 20.0
    bf16: bool = True
    workers: int = 2
    checkpoint_every: int = 100

    def __post_init__(self) -> None:
        require_positive(
            self, "n_train", "steps", "batch", "lr", "n_queries", "spatial_kernel", "workers", "checkpoint_every"
        )


# ------------------------------------------------------------------------------------ data


@torch.inference_mode()
def cache_features(
    mm, clip: ClipGuide, pixels: np.ndarray, work: Path, batch: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """Feature-layer patch tokens [N, P, Dv] and CLIP-aligned last-layer patch embeddings [N, P, Pk]
    (fp16, cached in ``work``) of the frozen tower."""
    n = len(pixels)
    fpath, kpath = work / f"features_{n}.npy", work / f"keys_{n}.npy"
    if fpath.exists() and kpath.exists():
        return np.load(fpath, mmap_mode="r"), np.load(kpath, mmap_mode="r")
    tower = mm.adapter.vision_tower
    size = mm.adapter.vision_config.image_size
    layer = mm.adapter.vision_feature_layer_index() + 1  # index into hidden_states
    feats, keys = [], []
    for i in tqdm(range(0, n, batch), desc="cache features"):
        pv = to_pixel_values(pixels[i : i + batch])
        if pv.shape[-1] != size:
            pv = F.interpolate(pv, size=(size, size), mode="bicubic", align_corners=False)
        hs = tower(pv.to(tower.device, tower.dtype), output_hidden_states=True).hidden_states
        feats.append(hs[layer][:, 1:].float().cpu().to(torch.float16).numpy())
        keys.append(clip.patch_embeds(hs[-1][:, 1:]).cpu().to(torch.float16).numpy())
    for path, arr in ((fpath, np.concatenate(feats)), (kpath, np.concatenate(keys))):
        np.save(path.with_suffix(".tmp.npy"), arr)
        path.with_suffix(".tmp.npy").rename(path)
    return np.load(fpath, mmap_mode="r"), np.load(kpath, mmap_mode="r")


def guided_sample(tokenizer, ann, rng: random.Random, conv_rng: random.Random):
    """One conversation cut after a random turn: (encoded, guide text); only the last answer is a label."""
    turns = conversation(ann, conv_rng)
    k = rng.randrange(len(turns))
    enc = encode_conversation(tokenizer, turns[: k + 1])
    if k > 0:
        n_prev = len(encode_conversation(tokenizer, turns[:k]).ids)
        enc.labels[:n_prev] = [-100] * n_prev
    return enc, guide_text(turns[k].question)


# ------------------------------------------------------------------------------------ step


def local_tokens(
    feats: torch.Tensor, keys: torch.Tensor, guides: torch.Tensor, grid: tuple[int, int], cfg: HIComTrainConfig
) -> torch.Tensor:
    """[B, G, Dv] training-free local tokens of single images (feats [B, P, Dv], keys [B, P, Pk])."""
    rows, cols = grid
    out = local_grid(1, rows, cols, 1, cfg.spatial_kernel, None)
    toks = [
        local_compress(f.view(1, rows, cols, -1), k.view(1, rows, cols, -1), g, out, cfg.alpha, cfg.scale)[0]
        for f, k, g in zip(feats, keys, guides)
    ]
    return torch.stack(toks)


def hicom_loss(
    llava, glob: GlobalCompressor, feats, local, guides, ids, labels, mask, image_id: int, grid: tuple[int, int]
) -> torch.Tensor:
    """LM cross-entropy with [projector(local), global(feats, guide)] at the image slots.

    feats [B, P, Dv] (global input), local [B, G, Dv], guides [B, Pk]; ids/labels/mask [B, L] with
    G + n_queries image slots per row.
    """
    base = llava.model
    rows, cols = grid
    with torch.no_grad():
        local_proj = base.multi_modal_projector(local)  # [B, G, d]
    _, glob_tok = glob(feats.view(feats.shape[0], 1, rows, cols, -1), guides)  # [B, n, d]
    img = torch.cat([local_proj.to(glob_tok.dtype), glob_tok], dim=1)
    emb = base.language_model.embed_tokens(ids)
    emb = emb.masked_scatter((ids == image_id).unsqueeze(-1), img.to(emb.dtype))
    out = base.language_model(inputs_embeds=emb, attention_mask=mask)
    logits = llava.lm_head(out.last_hidden_state)
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


# ------------------------------------------------------------------------------------ driver


def train_hicom_global(
    model: str | Path,
    out: str | Path | None,
    work_dir: str | Path,
    cfg: HIComTrainConfig = HIComTrainConfig(),
    clip_model: str | None = None,
) -> Path:
    """Train the global branch for ``model`` and write ``out`` (default ``<model>/hicom_global.safetensors``)."""
    import mmfast

    t0 = time.time()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    mm = mmfast.load(model, device="cpu", dtype="float32")
    bind_work_dir(work, mm.model)
    # the feature and CLIP-key caches' images and guide
    bind_work_data(work, {"seed": cfg.seed, "n_train": cfg.n_train, "clip_model": clip_model}, "hicom_data.json")
    if out is None:
        d = source_dir(model)
        if d is None:
            raise InputError(f"{model} is not a local directory; pass --out")
        out = d / GLOBAL_WEIGHTS
    out = Path(out)
    llava = mm.model.requires_grad_(False)
    tokenizer = mm.tokenizer
    clip = load_clip_guide(clip_model, llava, tokenizer)
    grid = mm.adapter.grid
    patch = mm.adapter.vision_config.patch_size
    images = render_split(cfg.seed, "train", cfg.n_train, patch, workers=cfg.workers)
    feats, keys = cache_features(mm, clip, images.pixels, work)
    glob = GlobalCompressor(
        mm.adapter.vision_config.hidden_size,
        mm.adapter.text_config.hidden_size,
        clip.dim,
        cfg.n_queries,
        cfg.global_mode,
    )
    opt = torch.optim.AdamW(glob.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt = work / "hicom_ckpt"
    step = 0
    if ckpt.exists():
        meta = load_checkpoint(ckpt, {"global": glob}, opt)
        check_resume_config(ckpt, meta, asdict(cfg))
        step = meta["step"]
        logger.info("resuming at step %d/%d", step, cfg.steps)
    n_img = local_grid(1, *grid, 1, cfg.spatial_kernel, None)
    n_tokens = n_img[1] * n_img[2] + cfg.n_queries
    image_id = mm.adapter.image_token_id
    llava.eval()
    glob.train()
    ema = None
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc="hicom global")
    for step in bar:
        g = torch.Generator().manual_seed(cfg.seed * 100003 + step)
        idx = torch.randint(0, len(images), (cfg.batch,), generator=g).numpy()
        rng = random.Random(cfg.seed * 7919 + step)
        samples = [
            guided_sample(
                tokenizer, images.annotations[i], rng, conversation_rng(cfg.seed, step, images.annotations[i].image_id)
            )
            for i in idx
        ]
        ids, labels, mask, *_ = _collate([s[0] for s in samples], n_tokens, image_id, tokenizer.pad_token_id)
        f = torch.from_numpy(np.asarray(feats[idx])).float()
        k = torch.from_numpy(np.asarray(keys[idx])).float()
        guides = clip.text_embeds([s[1] for s in samples])
        local = local_tokens(f, k, guides, grid, cfg)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg.steps, cfg.lr, warmup=min(50, cfg.steps // 10 + 1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = hicom_loss(llava, glob, f, local, guides, ids, labels, mask, image_id, grid)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(glob.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{loss.item():.3f}", ema=f"{ema:.3f}")
        if (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(ckpt, {"global": glob}, opt, {"step": step + 1, "config": asdict(cfg)})
    save_checkpoint(ckpt, {"global": glob}, opt, {"step": cfg.steps, "config": asdict(cfg)})
    meta = {
        "train_config": asdict(cfg),
        "clip_model": clip_model or "<model dir>/clip",
        "local": {"spatial_kernel": cfg.spatial_kernel, "alpha": cfg.alpha, "scale": cfg.scale},
        "final_loss_ema": ema,
        "train_seconds": round(time.time() - t0),
    }
    save_global(glob.eval(), out, meta)
    logger.info("wrote %s (%s) in %.0f s", out, json.dumps({"loss_ema": ema}), time.time() - t0)
    return out
