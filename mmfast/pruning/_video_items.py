"""A video as one vision item for the feature stage, on models whose frame groups are separate items.

Qwen3-VL writes every frame group (temporal patch group) of a video as its own vision item, in its own
timestamped span, so its :class:`~mmfast.models.base.VisionBatch` holds F items of grid (1, h, w) per
video. Methods that compress across a video's frames (``Capabilities.video_join``: DyCoke's TTM,
FastVID, ToMe's temporal merge) read one item of grid (F, h, w), as Qwen2-VL / Qwen2.5-VL and OneVision
give them. The session (``Session.encode``) wraps such a stage's ``prune_vision``:

1. :func:`join_videos`: each video's items (``PreparedBatch.items``: same sample and ``video``, ordered
   by ``first_frame``) become one temporary item: rows concatenated frame-major ([sum N_k, ...]: features,
   projected, every tag, per-row extras), patch ids re-indexed onto the joined grid (item k's cell p ->
   offset_k + p, offset_k = the earlier items' t h w), ``grid_thw`` (sum t, h, w), pixel rows and the
   batch's ``items`` / ``image_owner`` / ``image_sizes`` of the joined view. Images stay as they are.
   A temporary tag ``ORIGIN`` holds every row's original item.
2. the stage runs on the joined view (budgets, ``config_for`` and ``per_sample_*`` stats see the video's
   token count);
3. :func:`split_videos`: every row goes back to the item of its ``ORIGIN`` tag (a merged token keeps its
   representative's row, hence its item), in the stage's output order, with its own patch id
   (joined id - offset_k). So each kept token sits in its own frame group's span with its own (t, h, w)
   M-RoPE ids and deepstack rows; a frame group whose tokens were all dropped or merged away keeps its
   timestamp text and an empty span (``build_lm_inputs`` splices zero rows; the positions after it are
   those of the unpruned prompt).

Per-item extras (lists of one entry per item) join by :data:`_JOIN` (``grid_thw``, ``n_patches``,
``time_interval``) or, for tensors, by rows (``fastvid.attention`` [1, n] per frame group -> [F, n]);
after the stage an extra it left untouched gets its original list back, one it set is split by rows
(a tensor of the joined item's rows) or, where None, is None for every part. Anything else is refused
loudly (naming the extra): a stage whose per-item data cannot be split cannot be served by the join.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..inputs import PreparedBatch, VisionItem
from ..models.base import VisionBatch

ORIGIN = "video_items.origin"  # temporary VisionBatch tag: every row's original item index (long)


def _grid_join(parts: list) -> tuple:
    t = sum(int(g[0]) for g in parts)
    if any(tuple(g[1:]) != tuple(parts[0][1:]) for g in parts):
        raise RuntimeError(f"a video's frame groups have different grids {parts}; they cannot form one item")
    return (t, *parts[0][1:])


def _same(parts: list) -> Any:
    if any(p != parts[0] for p in parts):
        raise RuntimeError(f"a video's frame groups differ in {parts}; they cannot form one item")
    return parts[0]


#: how per-item extras that are no tensors join (the group's values, frame order -> the joined item's)
_JOIN: dict[str, Callable[[list], Any]] = {
    "grid_thw": _grid_join,  # merged-token grid (t, h, w)
    "n_patches": sum,  # real pixel rows
    "time_interval": _same,  # the video's temporal M-RoPE spacing
}


@dataclass
class Joined:
    """A joined view and how to split its output back (:func:`split_videos`)."""

    vision: VisionBatch  # the joined view the stage runs on
    batch: PreparedBatch  # the batch as the joined view's items
    original: VisionBatch
    groups: list[list[int]]  # per joined item: its original items (one for an image)
    offsets: list[list[int]]  # per joined item: each original item's first joined patch id
    sizes: list[list[int]]  # per joined item: each original item's grid cells (t h w)
    #: the joined extras as handed to the stage, with a list's entries (to tell what it changed in place)
    extras: dict[str, tuple[Any, list | None]]


def video_groups(batch: PreparedBatch) -> list[list[int]]:
    """The items of ``batch`` as joined items: each video's items (one sample, one ``video``) in frame
    order at the place of its first item; every image alone."""
    groups: list[list[int]] = []
    where: dict[tuple[int, int], int] = {}
    for i, owner in enumerate(batch.image_owner):
        it = batch.item(i)
        if not it.is_video:
            groups.append([i])
            continue
        key = (owner, it.video)
        if key not in where:
            where[key] = len(groups)
            groups.append([])
        groups[where[key]].append(i)
    for g in groups:
        g.sort(key=lambda i: batch.item(i).first_frame)
    return groups


def budget_items(counts: list[int], batch: PreparedBatch | None, joined: bool) -> list[tuple[int, str]]:
    """(vision tokens, what it is) of every item a stage's budget applies to, from per-item ``counts``: each
    video as one item where the stage joins them (``joined``), else each item as it is (a video that is one
    item, or a frame group of a video written as several)."""
    if batch is None or not batch.has_video:
        return [(n, "image") for n in counts]
    out: list[tuple[int, str]] = []
    for g in video_groups(batch):
        if not batch.item(g[0]).is_video:
            out.append((counts[g[0]], "image"))
        elif joined or len(g) == 1:
            out.append((sum(counts[i] for i in g), "video"))
        else:
            out += [(counts[i], "frame group") for i in g]
    return out


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts])


def _join_extra(key: str, values: list) -> Any:
    if key in _JOIN:
        return _JOIN[key](values)
    if all(v is None for v in values):
        return None
    if all(isinstance(v, torch.Tensor) for v in values):
        return _cat(values)  # per row (or per frame group) values, frame-major
    raise RuntimeError(
        f"the per-item extra {key!r} ({type(values[0]).__name__}) cannot be joined across a video's frame groups"
    )


def _pixel_rows(vision: VisionBatch, groups: list[list[int]]) -> torch.Tensor:
    """[n_joined, max P, D]: each joined item's real patch rows (``extras["n_patches"]``), padded."""
    px = vision.pixel_values
    n_rows = vision.extras.get("n_patches")
    if n_rows is None or px.dim() != 3:
        raise RuntimeError("joining a video's frame groups needs patch-row pixels ([n, max P, D] and n_patches)")
    rows = [torch.cat([px[k, : int(n_rows[k])] for k in g]) for g in groups]
    out = px.new_zeros(len(rows), max(r.shape[0] for r in rows), px.shape[-1])
    for j, r in enumerate(rows):
        out[j, : r.shape[0]] = r
    return out


def join_videos(
    vision: VisionBatch, batch: PreparedBatch, project: Callable[[VisionBatch], list[torch.Tensor]]
) -> Joined:
    """Each video's frame-group items of ``vision`` as one item (module docstring); ``project`` is the
    adapter's projector (an item left unprojected beside a projected one of its video is projected)."""
    groups = video_groups(batch)
    n = vision.n_images
    grids = vision.extras.get("grid_thw")
    if grids is None:
        raise RuntimeError("joining a video's frame groups needs each item's grid (extras['grid_thw'])")
    projected = list(vision.projected)
    if any(p is None for p in projected) and any(p is not None for p in projected):
        projected = project(vision)
    feats, pids, projs, offsets, sizes = [], [], [], [], []
    tags: dict[str, list[torch.Tensor]] = {k: [] for k in vision.tags}
    tags[ORIGIN] = []
    for g in groups:
        off, cells = [], []
        for k in g:
            t, h, w = (int(x) for x in grids[k][:3])
            off.append(sum(cells))
            cells.append(t * h * w)
        offsets.append(off)
        sizes.append(cells)
        feats.append(_cat([vision.features[k] for k in g]))  # [sum N_k, Dv]
        pid = [vision.patch_ids[k].long() for k in g]
        pids.append(_cat([torch.where(p >= 0, p + o, p) for p, o in zip(pid, off)]))  # [sum N_k] joined grid
        projs.append(None if projected[g[0]] is None else _cat([projected[k] for k in g]))  # [sum N_k, d]
        for key, per in vision.tags.items():
            tags[key].append(_cat([per[k] for k in g]))
        dev = vision.patch_ids[g[0]].device
        tags[ORIGIN].append(_cat([torch.full((vision.patch_ids[k].shape[0],), k, device=dev) for k in g]))
    extras = {}
    for key, value in vision.extras.items():
        if isinstance(value, list) and len(value) == n:
            extras[key] = [value[g[0]] if len(g) == 1 else _join_extra(key, [value[k] for k in g]) for g in groups]
        else:
            extras[key] = value
    joined = VisionBatch(
        features=feats,
        patch_ids=pids,
        cls=None if vision.cls is None else vision.cls[[g[0] for g in groups]],
        grid=vision.grid,
        pixel_values=_pixel_rows(vision, groups),
        projected=projs,
        extras=extras,
        tags=tags,
        stats=vision.stats,
    )
    items = [
        VisionItem(
            video=batch.item(g[0]).video,
            first_frame=batch.item(g[0]).first_frame,
            time_interval=batch.item(g[0]).time_interval,
            n_frames=sum(batch.item(k).n_frames for k in g),
        )
        for g in groups
    ]
    sizes_rows = batch.image_sizes
    if sizes_rows is not None:  # Qwen-VL: grid_thw rows in patches; a video's t adds up
        sizes_rows = torch.stack([torch.tensor(_grid_join(sizes_rows[g].tolist())) for g in groups]).to(sizes_rows)
    view = dataclasses.replace(
        batch,
        pixel_values=joined.pixel_values,
        image_sizes=sizes_rows,
        image_owner=[batch.image_owner[g[0]] for g in groups],
        items=items,
    )
    handed = {k: (v, list(v) if isinstance(v, list) else None) for k, v in extras.items()}
    return Joined(joined, view, vision, groups, offsets, sizes, handed)


def _split_extra(key: str, value: Any, joined: Joined, rows: list[list[torch.Tensor]]) -> list:
    """A per-joined-item extra the stage set, as per original item."""
    out: list = [None] * joined.original.n_images
    for j, g in enumerate(joined.groups):
        v = value[j]
        if len(g) == 1:  # an image (or a one-group video): as the stage left it
            out[g[0]] = v
            continue
        n_rows = sum(int(r.numel()) for r in rows[j])
        if v is not None and not (isinstance(v, torch.Tensor) and v.shape[0] == n_rows):
            raise RuntimeError(
                f"the per-item extra {key!r} of a joined video cannot be split back onto its frame groups"
            )
        for k, r in zip(g, rows[j]):
            out[k] = None if v is None else v[r.to(v.device)]
    return out


def split_videos(joined: Joined, out: VisionBatch) -> VisionBatch:
    """The stage's output ``out`` (on the joined view) as the original items (module docstring)."""
    orig = joined.original
    n = orig.n_images
    feats: list[Any] = [None] * n
    pids: list[Any] = [None] * n
    projs: list[Any] = [None] * n
    tags: dict[str, list[Any]] = {k: [None] * n for k in out.tags if k != ORIGIN}
    rows: list[list[torch.Tensor]] = []
    if ORIGIN not in out.tags:
        raise RuntimeError(
            "a stage dropped the per-token tags of a joined video (the origin tag): keep VisionBatch.tags"
        )
    for j, g in enumerate(joined.groups):
        origin = out.tags[ORIGIN][j]
        pid = out.patch_ids[j].long()
        n_rows = int(pid.shape[0])
        if out.projected[j] is not None and out.projected[j].shape[0] != n_rows:
            raise RuntimeError("a stage left a joined video with projected rows that its patch ids do not match")
        aligned = out.features[j].shape[0] == n_rows
        if len(g) > 1 and not aligned:
            raise RuntimeError("a stage left a joined video with features not row-aligned with its tokens")
        part = [(origin == k).nonzero().squeeze(1) for k in g]  # [n_k] rows of item k, in output order
        if sum(int(r.numel()) for r in part) != n_rows:
            raise RuntimeError("a stage left joined-video rows without their original item (the origin tag)")
        rows.append(part)
        for k, r, off, cells in zip(g, part, joined.offsets[j], joined.sizes[j]):
            p = pid[r.to(pid.device)]
            local = torch.where(p >= 0, p - off, p)  # [n_k] item k's own grid
            if len(g) > 1 and bool(((p >= 0) & ((local < 0) | (local >= cells))).any()):
                raise RuntimeError(f"a stage moved a token of frame group {k} onto another frame group's cells")
            pids[k] = local
            feats[k] = out.features[j][r.to(out.features[j].device)] if aligned else out.features[j]
            projs[k] = None if out.projected[j] is None else out.projected[j][r.to(out.projected[j].device)]
            for key in tags:
                tags[key][k] = out.tags[key][j][r.to(out.tags[key][j].device)]
    extras = dict(orig.extras)
    for key in set(joined.extras) - set(out.extras):  # popped by the stage
        extras.pop(key, None)
    for key, value in out.extras.items():
        before, entries = joined.extras.get(key, (_MISSING, None))
        untouched = value is before and (
            entries is None or (len(value) == len(entries) and all(a is b for a, b in zip(value, entries)))
        )
        if untouched:
            continue  # the original (per-item) value stays
        if isinstance(value, list) and len(value) == len(joined.groups):
            extras[key] = _split_extra(key, value, joined, rows)
        else:
            extras[key] = value
    return VisionBatch(
        features=feats,
        patch_ids=pids,
        cls=orig.cls,
        grid=out.grid,
        pixel_values=orig.pixel_values,
        projected=projs,
        extras=extras,
        tags=tags,
        stats=out.stats,
        raw=out.raw,
    )


_MISSING = object()
