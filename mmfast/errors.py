"""Error types. User errors (bad recipe, missing file, unknown method) exit the CLI with code 2."""

from __future__ import annotations


class MMFastError(Exception):
    """Base class for errors caused by the user's input; the message names the thing and the fix."""


class ConfigError(MMFastError):
    """A recipe key is unknown, mistyped or out of range. `path` is the dotted key."""

    def __init__(self, path: str, detail: str, source: str | None = None) -> None:
        self.path = path
        self.detail = detail
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path}: {detail}" if path else f"{where}{detail}")


class UnknownMethodError(MMFastError):
    """A method name is not in its registry."""


class IncompatibleRecipeError(MMFastError):
    """Two parts of a recipe cannot run together; raised before any compute."""


class InputError(MMFastError):
    """A missing or corrupt input file, or an argument that cannot be used."""


class ModelLoadError(MMFastError):
    """A checkpoint cannot be found or loaded (offline hub, wrong path, unsupported family)."""


EXIT_SAMPLES_FAILED = 3
"""``mmfast eval``'s exit status when samples failed: more than ``eval.max_failures`` allow (the run
aborted), or any at all in a finished run (unless ``--allow-failures``)."""


class SamplesFailedError(MMFastError):
    """Samples of the evaluation failed; ``mmfast eval`` exits :data:`EXIT_SAMPLES_FAILED`."""

    exit_code = EXIT_SAMPLES_FAILED


class RunAbortedError(SamplesFailedError):
    """More samples failed than ``eval.max_failures`` allows."""


def load_tensors_into(module, tensors: dict, path, fix: str) -> None:
    """``module.load_state_dict(tensors)`` (strict), raising :class:`ModelLoadError` that names ``path`` and
    ``fix`` when keys are missing or unexpected or a shape differs (torch's own error names neither)."""
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    shapes = sorted(
        f"{k} {tuple(tensors[k].shape)} != {tuple(v.shape)}"
        for k, v in own.items()
        if k in tensors and tuple(tensors[k].shape) != tuple(v.shape)
    )
    if missing or unexpected or shapes:
        parts = [
            f"{what} {items[:5]}{' ...' if len(items) > 5 else ''}"
            for what, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
            if items
        ]
        raise ModelLoadError(f"the weights in {path} do not fit this model ({'; '.join(parts)}); {fix}")
    module.load_state_dict(tensors, strict=True)
