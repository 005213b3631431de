"""MustDrop's stage 1 inside the vision tower (``mustdrop.py`` holds the stage): the window merge on the output of
CLIP layer 0 and what the tower's later layers need of it.

Eagerly the merge drops the merged windows' extra tokens (:func:`~._mustdrop_ops.spatial_merge`), so each image
has its own length and the tower runs one image at a time. Where the session captures the tower, the merge keeps
the token count (:func:`~._mustdrop_ops.padded_spatial_merge`, its threshold read from device memory) and the later
layers mask the padded keys through the encoder's attention mask (a pre-hook): fixed shapes with no host read, so
the tower is one captured graph that runs a batch's images at once, and :meth:`TowerMerge.take` cuts the padding
off after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import compat
from ..hooks.attention import Carried, replayable
from ._mustdrop_ops import padded_spatial_merge, spatial_merge


@dataclass
class _Merged:
    """The window merge of a tower call's images (one, or the batch with a padded merge)."""

    ids: torch.Tensor  # [n, N'] raster patch id of each patch token (-1: a merged window); padded: [n, N], -1 after
    valid: torch.Tensor | None  # padded merge: [n, 1 + N] bool, the valid slots (CLS, then N'_i tokens); else None


class TowerMerge:
    """The window merge of ``window`` x ``window`` windows at ``threshold``, installed on ``adapter``'s tower through
    ``hooks`` (restored with the session)."""

    def __init__(self, hooks, adapter, window: int, threshold: float, device) -> None:
        self.adapter, self.window = adapter, window
        self._threshold = torch.tensor(threshold, dtype=torch.float32, device=device)  # what a captured graph reads
        self.threshold = threshold
        self._pending: _Merged | None = None  # set by the merge, read by take
        self._masks: dict[tuple, torch.Tensor] = {}  # [B, 1, 1, T] additive key masks of the padded merge
        layer0 = adapter.vision_layers[0]
        original = layer0.forward

        def merged_forward(hidden, attention_mask=None, *args, **kwargs):
            # layer 0 attends over every patch (the encoder's padding mask is for the layers after the merge)
            out = original(hidden, None, *args, **kwargs)
            if isinstance(out, tuple):
                return (self._merge(out[0]), *out[1:])
            return self._merge(out)

        carried = Carried(lambda: self._pending, self._put_pending)
        hooks.set_attr(layer0, "forward", replayable(merged_forward, carried))
        encoder = compat.vision_encoder(adapter.vision_tower)
        hooks.pre_hook(encoder, replayable(self._padding_mask, carried), with_kwargs=True)

    @property
    def threshold(self) -> float:
        return self._value

    @threshold.setter
    def threshold(self, value: float) -> None:
        self._value = float(value)
        self._threshold.fill_(float(value))  # what a captured tower graph compares with

    def padded(self) -> bool:
        """Whether the tower runs as a captured graph in this call (the merge then keeps the token count)."""
        graphs = getattr(self.adapter, "tower_graphs", None)
        return graphs is not None and graphs.factory() is not None

    def _mask(self, hidden: torch.Tensor) -> torch.Tensor:
        """The [B, 1, 1, T] additive key mask of a padded merge of ``hidden`` [B, T, D] (fixed memory per shape)."""
        key = (*hidden.shape[:2], hidden.dtype, hidden.device)
        if key not in self._masks:
            self._masks[key] = hidden.new_zeros(hidden.shape[0], 1, 1, hidden.shape[1])
        return self._masks[key]

    def _padding_mask(self, module, args, kwargs):
        """Encoder pre-hook: in a padded merge, every layer's attention mask is the merge's key mask ([B, 1, T, T];
        layer 0 ignores it), written by the merge inside the same call."""
        if not self.padded():
            return None
        hidden = kwargs["inputs_embeds"] if "inputs_embeds" in kwargs else args[0]
        bsz, t = hidden.shape[:2]
        return args, {**kwargs, "attention_mask": self._mask(hidden).expand(bsz, 1, t, t)}

    def _merge(self, hidden: torch.Tensor) -> torch.Tensor:
        grid = self.adapter.grid
        if not self.padded():
            if hidden.shape[0] != 1:
                raise RuntimeError("MustDrop: the vision tower must run one image at a time (the session does this)")
            out, _, ids = spatial_merge(hidden, grid, self.window, self.threshold)
            self._pending = _Merged(ids, None)
            return out
        out, valid, ids = padded_spatial_merge(hidden, grid, self.window, self._threshold)
        mask = self._mask(hidden)  # [B, 1, 1, T]
        mask.copy_(torch.zeros_like(mask).masked_fill(~valid[:, None, None, :], torch.finfo(mask.dtype).min))
        self._pending = _Merged(ids, valid)
        return out

    def _put_pending(self, merged: _Merged) -> None:
        """After a replay of the tower's graph: what its merge wrote (copies: the next replay overwrites it)."""
        self._pending = _Merged(merged.ids.clone(), None if merged.valid is None else merged.valid.clone())

    def take(self, vision, cls_probs: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Right after a tower call: each image's (windows merged, patch ids [N'], CLS -> patch attention [N']) from
        the key layer's CLS row ``cls_probs`` ([n, 1, 1 + N']; padded: [n, 1, 1 + N]); a padded merge's features and
        patch ids in ``vision`` cut to their valid tokens."""
        if self._pending is None:
            raise RuntimeError("MustDrop: the vision tower did not run with MustDrop's hooks")
        merged, self._pending = self._pending, None
        width = merged.ids.shape[1]
        if cls_probs.shape[-1] != 1 + width:
            raise RuntimeError("MustDrop: the key-set layer must run after the merge (key_layer >= 1)")
        n_valid = torch.full_like(merged.ids[:, 0], width) if merged.valid is None else merged.valid.sum(1) - 1  # [n]
        in_valid = torch.arange(width, device=n_valid.device)[None, :] < n_valid[:, None]  # [n, N]
        # [2][n] each image's tokens after the merge and windows merged (-1 ids before the padding): one read
        n_post, windows = torch.stack([n_valid, ((merged.ids == -1) & in_valid).sum(1)]).tolist()
        out = []
        for i, (n, r) in enumerate(zip(n_post, windows)):  # the padding goes: every valid slot is before it
            ids, cls_attn = merged.ids[i, :n], cls_probs[i, 0, 1 : 1 + n].clone()
            feats = vision.features[i]
            vision.features[i] = feats[: feats.shape[0] - width + n]  # (CLS kept or not) + N'
            vision.patch_ids[i] = vision.patch_ids[i][: vision.features[i].shape[0]]
            out.append((r, ids, cls_attn))
        return out
