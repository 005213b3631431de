"""Shared fixtures: tiny random LLaVA models built from configs (offline, CPU, seconds)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

torch.set_num_threads(1)  # tiny models: one thread is fastest, and the suite shares the machine

# NLTK data the product could pick up from the machine (CHAIR ships its own; see mmfast/assets/chair).
_MACHINE_NLTK_DATA = (
    "taggers/averaged_perceptron_tagger_eng",
    "taggers/averaged_perceptron_tagger_eng.zip",
    "corpora/wordnet",
    "corpora/wordnet.zip",
)


def pytest_sessionstart(session: pytest.Session) -> None:
    """With ``MMFAST_BARE=1`` (``.ci/run``) refuse to run unless the product is on its own: no
    ``$NLTK_DATA`` and no tagger or WordNet anywhere on NLTK's default path (``~/nltk_data``,
    ``/usr/share/nltk_data``, ``sys.prefix``/..., ...), so a test passing cannot rest on them.
    The CHAIR identity tests load reference data explicitly (``MMFAST_REFERENCE_NLTK_DATA``)."""
    if os.environ.get("MMFAST_BARE") != "1":
        return
    import nltk

    problems = [f"NLTK_DATA is set ({os.environ['NLTK_DATA']})"] if os.environ.get("NLTK_DATA") else []
    problems += [
        f"{os.path.join(root, rel)} exists"
        for root in nltk.data.path
        for rel in _MACHINE_NLTK_DATA
        if os.path.exists(os.path.join(root, rel))
    ]
    if problems:
        pytest.exit(
            "MMFAST_BARE=1, but NLTK data outside the clone is visible: "
            + "; ".join(problems)
            + " (unset NLTK_DATA, use an empty HOME, remove the folders)",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random LLaVA (4x4 patch grid) saved with save_pretrained."""
    from mmfast.models.factory import random_llava, save_model

    model, processor = random_llava("tiny", init_std=0.2)
    return save_model(model, processor, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory) -> Path:
    """A tiny LLaVA whose LM uses grouped-query attention (4 heads, 2 KV heads)."""
    import dataclasses

    from mmfast.models.factory import SHAPES, random_llava, save_model

    shape = dataclasses.replace(SHAPES["tiny"], text_kv_heads=2)
    model, processor = random_llava(shape, init_std=0.2, seed=1)
    return save_model(model, processor, tmp_path_factory.mktemp("tiny_gqa"))


@pytest.fixture(scope="session")
def tiny_mm(tiny_dir):
    import mmfast

    return mmfast.load(tiny_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)) for _ in range(4)]


PROMPTS = [
    "Describe the image.",
    "Is there a cat in the image?",
    "What color is the car? Tell me now please.",
    "How many dogs are there?",
]


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    return list(PROMPTS)


def video_models():
    """A loader of the tiny random video models (LLaVA-OneVision, or the Qwen-VL family named; seed 1) that
    builds each family once: a video test module keeps one (``_mm = video_models()``) for its tests."""
    import mmfast

    models: dict[str, object] = {}

    def load(family: str = "llava_onevision"):
        if family not in models:
            from mmfast.models.factory import random_llava_onevision, random_qwen_vl

            if family == "llava_onevision":
                model, proc = random_llava_onevision(seed=1)
            else:
                model, proc = random_qwen_vl(family, seed=1)
            models[family] = mmfast.load(model, proc)
        return models[family]

    return load


def random_video(n: int, seed: int = 0, size: tuple[int, int] = (28, 28)) -> np.ndarray:
    """``n`` random RGB frames of ``size`` (H, W): [n, H, W, 3] uint8."""
    return np.random.default_rng(seed).integers(0, 255, (n, *size, 3), dtype=np.uint8)
