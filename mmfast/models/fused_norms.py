"""The language model's RMSNorm modules as one fused kernel each (``model.fuse_norms``).

transformers' RMSNorm (Llama, Qwen2, Qwen2.5-VL / Qwen3-VL text, Vicuna in LLaVA) runs eagerly as about eight
kernels: upcast, square, mean, add epsilon, reciprocal square root, multiply, downcast, weight multiply. A 7B
decode step runs 65 of them (two per layer and the final norm), ~500 tiny launches of its ~1,500: inside a
captured CUDA graph the launches cost no host time, but each kernel still costs the GPU a few microseconds,
which is a large part of what separates mmfast's captured step from transformers' ``torch.compile``-d
static-cache ``generate`` (issue 27).

With ``model.fuse_norms: true`` the session replaces each such module's ``forward`` (an instance attribute,
restored on close, as the fused Qwen tower does) with one ``torch.compile``-d function (Inductor): the module's
own forward, traced, so the arithmetic is transformers' (fp32 statistics, the cast before the weight); only
the kernel boundaries change. One compiled function serves every norm (their weights are inputs), on the
input's rows ([..., d] -> [N, d]); a new shape compiles once (a second one makes the row count dynamic). A
compile that fails (no Triton, no C compiler) is caught when the session opens on a probe input: the norms stay
as transformers ships them, with one warning.

Equality: the fused reduction sums in another order, so outputs equal the eager ones within float tolerance
(fp32: ~1e-6 relative), not bitwise; ``compile: static`` and ``auto`` fuse alike, so a captured step still
equals its eager twin. Off by default: the GPU bench measures it (``mmfast unpruned (fused norms)``) before a
default changes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _is_rms_norm(m: nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.Tensor)


def _norm_forward(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return type(module).forward(module, hidden)


_compiled: Any = None


def _fused() -> Any:
    """The one compiled function every fused norm calls (compiled lazily, on the first call)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(
            _norm_forward
        )  # not fullgraph: where dynamo cannot run (a dispatch mode) it runs eagerly
    return _compiled


def install_fused_norms(language_model: nn.Module, hooks: Any) -> int:
    """Replace the forward of every RMSNorm module of ``language_model`` through ``hooks`` (restored on its
    close). Returns the number replaced; 0, with a warning, when compiling fails on this machine or a
    module's forward is already wrapped (e.g. accelerate's offload hooks, whose device moves must run)."""
    mods = [m for m in language_model.modules() if _is_rms_norm(m)]
    if not mods:
        return 0
    if all(getattr(m.__dict__.get("forward"), "mmfast_fused_norm", False) for m in mods):  # mods is not empty
        logger.debug("model.fuse_norms: already installed by an open session on this model")
        return 0
    wrapped = [m for m in mods if "forward" in m.__dict__]
    if wrapped:
        logger.warning(
            "model.fuse_norms: %d of the language model's RMSNorm modules already have a wrapped forward; "
            "the norms run as transformers ships them",
            len(wrapped),
        )
        return 0
    fused = _fused()
    probe = mods[0]
    x = torch.zeros(1, probe.weight.shape[-1], dtype=probe.weight.dtype, device=probe.weight.device)
    try:
        with torch.inference_mode():  # as the runner calls it (a no_grad probe compiled a variant never used)
            fused(probe, x)  # [1, d]: compiles here, so a machine that cannot compile is told now
    except Exception as exc:  # noqa: BLE001  any compile failure leaves the eager norms
        logger.warning(
            "model.fuse_norms: torch.compile failed on this machine (%s: %s); the norms run as transformers ships them",
            type(exc).__name__,
            str(exc).splitlines()[0][:200] if str(exc) else "",
        )
        return 0
    for m in mods:
        hooks.set_attr(m, "forward", _bound(fused, m))
    logger.info("model.fuse_norms: %d RMSNorm modules run as one compiled kernel each", len(mods))
    return len(mods)


def _bound(fused: Any, module: nn.Module) -> Any:
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        # [..., d] -> [N, d]: the norm is per row, and one rank keeps the compiled variants few (batch and
        # length 1 or not, per width); Qwen3-VL's per-head norms ([B, T, H, Dh]) beside the [B, T, d] ones
        # otherwise spent torch's recompile limit (8) within two calls, and later shapes ran eagerly
        return fused(module, hidden.reshape(-1, hidden.shape[-1])).reshape(hidden.shape)

    forward.mmfast_fused_norm = True  # type: ignore[attr-defined]
    forward.mmfast_graph_safe = True  # type: ignore[attr-defined]  (a captured graph may run it)
    return forward
