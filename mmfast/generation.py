"""transformers-style generation arguments mapped onto mmfast decoders.

``generate(..., do_sample=True, temperature=0.7)`` or ``generate(..., generation_config=cfg)`` choose
among mmfast's ``greedy``, ``sample`` and ``beam`` decoders the way transformers' ``generate`` chooses
its own search: ``num_beams > 1`` is beam search, ``do_sample=True`` is multinomial sampling with the
temperature / top-k / top-p warpers, anything else is greedy. Values left unset come from the model's
``generation_config`` and then from transformers' defaults (``temperature=1.0``, ``top_k=50``,
``top_p=1.0``, ``num_beams=1``, ``length_penalty=1.0``), so a call means what it means in transformers.

Unknown keywords and settings mmfast's decoders do not implement are refused with the reason, never
ignored. ``decoding=`` (a decoder name or ``{method, params}``) picks any registered decoder instead.
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import DecodingConfig
from .errors import ConfigError, InputError

logger = logging.getLogger(__name__)

#: keywords that choose the decoder (greedy / sample / beam) and its parameters
SEARCH_KEYS: tuple[str, ...] = ("do_sample", "temperature", "top_k", "top_p", "num_beams", "length_penalty")
#: every transformers generation keyword mmfast maps
GENERATION_KEYS: tuple[str, ...] = (*SEARCH_KEYS, "max_new_tokens")
#: transformers' global defaults for values neither the call nor the model's generation_config set
HF_DEFAULTS: dict[str, Any] = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "num_beams": 1,
    "length_penalty": 1.0,
}
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_BOOKKEEPING_KEYS = ("transformers_version", "_from_model_config")
#: settings a model's own generation_config carries that mmfast's decoders already follow (they change no token):
#: a copy of ``model.generation_config`` passed back as ``generation_config=`` holds them
_FOLLOWED_SETTINGS: dict[str, Any] = {
    "use_cache": True,
    "output_attentions": False,
    "output_hidden_states": False,
    "output_scores": False,
    "output_logits": False,
    "return_dict_in_generate": False,
}
#: the refusal of a call that names a decoder and also search keywords (which would pick greedy / sample / beam)
BOTH_DECODING_AND_KEYWORDS = (
    "pass either decoding= or sampling keywords (do_sample, temperature, top_k, top_p, num_beams, length_penalty, "
    "or a generation_config setting them), not both; put the decoder's parameters in "
    "decoding={'method': ..., 'params': {...}}"
)
#: decoders whose token rule the generation keywords describe (any other decoder has its own)
KEYWORD_DECODERS: frozenset[str] = frozenset({"greedy", "sample", "beam"})


@dataclass(frozen=True)
class GenerationArgs:
    """What a set of generation arguments asks for.

    ``decoding``: ``{"method": ..., "params": {...}}`` for greedy / sample / beam, or None when no search
    keyword was given (the recipe's decoder stays). ``max_new_tokens``: None when not given.
    """

    decoding: dict[str, Any] | None
    max_new_tokens: int | None


def _did_you_mean(key: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


#: settings a model's own generation_config may carry that change tokens and that no mmfast decoder applies
_UNAPPLIED_MODEL_KEYS = (
    "repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_repetition_penalty",
    "typical_p",
    "min_p",
)
_UNAPPLIED_NEUTRAL = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0,
    "typical_p": 1.0,
}


def _warn_unapplied(model_generation_config: Any) -> None:
    """The model's own generation_config fills what transformers-style keywords leave unset; where it also sets
    a token-changing rule mmfast does not implement (e.g. Qwen2.5-VL's ``repetition_penalty: 1.05``), say so:
    transformers' ``generate`` would apply it, mmfast does not."""
    unapplied = {
        k: v
        for k in _UNAPPLIED_MODEL_KEYS
        if (v := getattr(model_generation_config, k, None)) is not None and v != _UNAPPLIED_NEUTRAL.get(k)
    }
    if unapplied:
        _warn_once(", ".join(f"{k}={v!r}" for k, v in unapplied.items()))


@functools.cache
def _warn_once(settings: str) -> None:
    """One warning per distinct setting, not one per call (an evaluation calls generate per batch)."""
    logger.warning(
        "the model's generation_config sets %s, which mmfast's decoders do not apply (transformers' generate "
        "would): the answers follow the search keywords only",
        settings,
    )


def _token_ids(value: Any) -> Any:
    """``2`` and ``[2]`` name the same stop token(s) (transformers takes either)."""
    return sorted(value) if isinstance(value, (list, tuple)) else [value]


def _config_values(generation_config: Any, model_generation_config: Any) -> dict[str, Any]:
    """The values a ``GenerationConfig`` sets (transformers 5 leaves unset ones at None)."""
    if not hasattr(generation_config, "to_diff_dict"):
        raise InputError(
            f"generation_config is a {type(generation_config).__name__}; pass a transformers.GenerationConfig "
            "(or the generation keywords themselves)"
        )
    values = {k: v for k, v in generation_config.to_diff_dict().items() if v is not None and k not in _BOOKKEEPING_KEYS}
    for key, followed in _FOLLOWED_SETTINGS.items():
        if key in values and values[key] == followed:
            del values[key]
    for key in _TOKEN_ID_KEYS:
        if key in values:
            own = getattr(model_generation_config, key, None)
            if _token_ids(values.pop(key)) != _token_ids(own) and own is not None:
                raise InputError(
                    f"generation_config.{key} differs from the model's ({own!r}); mmfast stops at the model's own "
                    f"special tokens: leave {key} unset"
                )
    unsupported = sorted(set(values) - set(GENERATION_KEYS))
    if unsupported:
        raise InputError(
            f"generation_config sets {', '.join(unsupported)}, which mmfast's decoders do not implement; "
            f"supported: {', '.join(GENERATION_KEYS)} (or pass decoding= for another decoder)"
        )
    return values


def parse_generation_args(
    kwargs: Mapping[str, Any],
    generation_config: Any = None,
    *,
    model_generation_config: Any = None,
    strict: bool = True,
) -> GenerationArgs:
    """Map transformers generation arguments onto an mmfast decoder.

    Args:
        kwargs: generation keywords (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``num_beams``,
            ``length_penalty``, ``max_new_tokens``); anything else is refused with a did-you-mean.
        generation_config: a ``transformers.GenerationConfig``; explicit keywords override its values.
        model_generation_config: the model's own ``generation_config`` (fills values left unset).
        strict: refuse sampling settings that have no effect (``temperature`` without ``do_sample=True``),
            as transformers would only warn about them. lmms-eval tasks pass such no-ops
            (``temperature: 0, do_sample: false``), so its plugin parses with ``strict=False``.
    """
    unknown = [k for k in kwargs if k not in GENERATION_KEYS]
    if unknown:
        key = unknown[0]
        raise InputError(
            f"generate() got an unknown keyword {key!r}{_did_you_mean(key, GENERATION_KEYS)}; mmfast accepts "
            f"{', '.join(GENERATION_KEYS)}, generation_config=, decoding= (a decoder name or {{method, params}}), "
            "seed=, meta= and streamer="
        )
    # None is "unset", as in transformers (wrappers forward ``temperature=None``): the config / model / defaults fill it
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    given = _config_values(generation_config, model_generation_config) if generation_config is not None else {}
    given.update(kwargs)
    max_new = given.pop("max_new_tokens", None)
    if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new!r}")
    if not any(k in given for k in SEARCH_KEYS):
        return GenerationArgs(None, max_new)
    base = {k: getattr(model_generation_config, k, None) for k in SEARCH_KEYS}
    _warn_unapplied(model_generation_config)
    values = {**HF_DEFAULTS, **{k: v for k, v in base.items() if v is not None}, **given}
    do_sample, num_beams = values["do_sample"], values["num_beams"]
    if not isinstance(do_sample, bool):
        raise InputError(f"do_sample must be True or False, got {do_sample!r}")
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise InputError(f"num_beams must be a positive integer, got {num_beams!r}")
    if do_sample and num_beams > 1:
        raise InputError(
            "do_sample=True with num_beams > 1 (beam sampling) has no mmfast decoder; use num_beams=1 to sample "
            "or do_sample=False for beam search"
        )
    if num_beams > 1:
        spec = {"method": "beam", "params": {"num_beams": num_beams, "length_penalty": values["length_penalty"]}}
        ignored: tuple[str, ...] = ("temperature", "top_k", "top_p")
    elif do_sample:
        spec = {"method": "sample", "params": {k: values[k] for k in ("temperature", "top_k", "top_p")}}
        ignored = ("length_penalty",)
    else:
        spec = {"method": "greedy", "params": {}}
        ignored = ("temperature", "top_k", "top_p", "length_penalty")
    # only explicit keywords are checked: a GenerationConfig may carry settings for another search
    unused = [k for k in ignored if k in kwargs and kwargs[k] != HF_DEFAULTS[k]]
    if unused:
        if strict:
            raise InputError(
                f"{', '.join(f'{k}={kwargs[k]!r}' for k in unused)} has no effect in {spec['method']} decoding; "
                + (
                    "drop it"
                    if spec["method"] != "greedy"
                    else "pass num_beams > 1 for beam search"  # length_penalty scores beams only
                    if unused == ["length_penalty"]
                    else "pass do_sample=True to sample"
                )
            )
        logger.debug("generation settings without effect in %s decoding: %s", spec["method"], unused)
    _validate(spec)
    return GenerationArgs(spec, max_new)


def _validate(spec: dict[str, Any]) -> None:
    """Range and type checks of the decoder's own Config, reported with the generation keyword."""
    try:
        DecodingConfig._from_recipe(spec, "decoding")
    except ConfigError as exc:
        key = exc.path.rsplit(".", 1)[-1]
        value = spec["params"].get(key, "?")
        raise InputError(f"{key}={value!r}: {exc.detail}") from None


def decoding_config(decoding: str | Mapping[str, Any], *, max_new_tokens: int, seed: int):
    """A validated :class:`~mmfast.config.DecodingConfig` from ``decoding=`` (a decoder name or a
    ``{method, params}`` mapping), keeping the recipe's ``max_new_tokens`` and ``seed``."""
    if isinstance(decoding, str):
        data: dict[str, Any] = {"method": decoding}
    elif isinstance(decoding, Mapping):
        data = dict(decoding)
        extra = sorted(set(data) - {"method", "params"})
        if extra:
            raise InputError(
                f"decoding= has keys {', '.join(extra)}; it takes only method and params (pass max_new_tokens= and "
                "seed= to generate itself)"
            )
        if "method" not in data:
            raise InputError("decoding= needs a method, e.g. {'method': 'vcd', 'params': {'alpha': 1.0}}")
    else:
        raise InputError(f"decoding= is a {type(decoding).__name__}; pass a decoder name or {{method, params}}")
    cfg = DecodingConfig._from_recipe(data, "decoding")
    return DecodingConfig(cfg.method, cfg.params, max_new_tokens, seed)
