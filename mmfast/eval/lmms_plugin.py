"""lmms-eval plugin: run any mmfast recipe on lmms-eval tasks.

    pip install lmms-eval          # optional; mmfast registers itself through its entry point
    python -m lmms_eval --model mmfast --model_args recipe=configs/examples/fastv_64.yaml --tasks pope --batch_size 1

mmfast declares the entry point group ``lmms_eval.models`` (lmms-eval >= 0.7's plugin mechanism,
``ModelManifest``); the model loads the recipe's checkpoint, installs its methods once and answers
``generate_until`` requests through the same session as ``mmfast eval``. ``loglikelihood`` scores a
continuation by teacher forcing through the session's runner (pruning stages apply). Errors are
raised, never turned into empty answers (lmms-eval's own ``llava_hf`` returns "" on failure).
"""

from __future__ import annotations

import logging
import torch

try:  # optional dependency: importing this module without lmms-eval is allowed, using the class is not
    from lmms_eval.api.model import lmms as _LMMBase
except ImportError:  # pragma: no cover - exercised when lmms-eval is absent
    _LMMBase = object

logger = logging.getLogger(__name__)


def manifest():
    """The ``lmms_eval.models`` entry point payload."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id="mmfast", simple_class_path="mmfast.eval.lmms_plugin.MMFast")


class MMFast(_LMMBase):
    """An mmfast recipe as an lmms-eval model (``--model mmfast --model_args recipe=PATH``)."""

    is_simple = True

    def __init__(self, recipe: str = "mmfast/tiny-world", batch_size: int | str = 1, device: str | None = None, max_batch_size: int | None = None) -> None:
        if _LMMBase is object:
            raise ImportError("lmms-eval is not installed: pip install lmms-eval")
        super().__init__()
        from ..config import load_recipe
        from ..model import load_model
        from ..pipeline import apply

        self.recipe = load_recipe(recipe if recipe.endswith((".yaml", ".yml")) else {"model": {"name": recipe}})
        self.mm = load_model(self.recipe.model, device=device)
        self.session = apply(self.mm, self.recipe)
        self.batch_size = int(batch_size)

    def _visuals(self, request) -> list:
        args = request.args
        doc_to_visual, doc_id, task, split = args[2], args[3], args[4], args[5]
        visuals = doc_to_visual(self.task_dict[task][split][doc_id]) if doc_to_visual is not None else []
        return [v.convert("RGB") for v in (visuals or [])]

    def generate_until(self, requests) -> list[str]:
        out: list[str] = []
        for req in requests:
            context, gen_kwargs = req.args[0], dict(req.args[1] or {})
            images = self._visuals(req)
            until = gen_kwargs.pop("until", None) or []
            max_new = int(gen_kwargs.pop("max_new_tokens", self.recipe.decoding.max_new_tokens))
            prompt = context.replace("<image>", "").strip()
            batch = self.mm.prepare([images], [prompt]) if images else None
            if batch is None:
                raise ValueError(f"mmfast needs at least one image per request (doc {req.args[3]} of {req.args[4]})")
            text = self.session.run(batch, max_new_tokens=max_new)[0].text
            for stop in [until] if isinstance(until, str) else until:
                if stop and stop in text:
                    text = text.split(stop)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
        return out

    @torch.inference_mode()
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            images = self._visuals(req)
            batch = self.mm.prepare([images], [context.replace("<image>", "").strip()])
            cont = self.mm.tokenizer(continuation, add_special_tokens=False)["input_ids"]
            inputs = self.session.build_inputs(batch, self.session.encode(batch))
            ids = torch.tensor([cont], device=inputs.input_ids.device)
            full = inputs.append(ids, self.mm.adapter.embed_tokens(ids))
            _, step = self.session.runner.prefill(full, all_hidden=True)
            logits = self.mm.adapter.lm_head(step.hidden[:, -len(cont) - 1 : -1]).float()  # [1, C, V]
            logp = torch.log_softmax(logits, -1)[0, torch.arange(len(cont)), ids[0]]
            greedy = bool((logits[0].argmax(-1) == ids[0]).all())
            out.append((float(logp.sum()), greedy))
        return out

    def generate_until_multi_round(self, requests) -> list[str]:
        raise NotImplementedError("mmfast answers single-round requests; multi-round lmms-eval tasks are not supported")
