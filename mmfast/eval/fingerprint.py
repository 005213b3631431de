"""Content fingerprints of evaluation samples: what a stored record was computed from.

A sample's fingerprint is the sha256 of its task (record group), ``doc_id``, prompt, target, meta
(e.g. POPE's question text), ``max_new_tokens``, image path and the sha256 of the image's bytes (for a
video: its directory, the name and sha256 of every frame, and the frame sampling), the
run identity (:func:`mmfast.eval.runner.run_identity`: the recipe less the settings that change no
answer, plus the calibration set of a calibrated budget, its images' bytes included, and the weights the
recipe's methods loaded, :func:`mmfast.eval.runner.methods_fingerprint`) and the weights fingerprint (every
byte). Resume reuses a record only while its fingerprint equals the planned sample's, so a question file or
an image replaced under the same path is recomputed. Image digests are cached per (path, mtime, size) so the
POPE splits, which share images, hash each once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..video import frame_files

if TYPE_CHECKING:
    from .tasks import Sample

_MISSING = "missing"


_FINGERPRINT_CHUNK = 1 << 26  # bytes hashed per slice: a GPU tensor is copied to the host a slice at a time


def hash_tensors(h: Any, named: Iterable[tuple[str, Any]]) -> None:
    """Feed ``h`` every tensor's name, shape, dtype and every byte of its values (``meta`` tensors: name and
    shape only), in chunks so that no large tensor is copied whole to the host."""
    import torch  # here, so that reading records does not load torch

    with torch.no_grad():
        for name, t in named:
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            if t.device.type == "meta" or not t.numel():
                continue
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [numel * itemsize] bytes, any dtype
            for start in range(0, raw.numel(), _FINGERPRINT_CHUNK):
                h.update(raw[start : start + _FINGERPRINT_CHUNK].cpu().numpy().tobytes())


def weights_fingerprint(model) -> str:
    """The content fingerprint of a model's weights: the sha256 of every tensor's name, shape, dtype
    and every byte of its values (tensors offloaded to ``meta`` count by name and shape only).
    Retrained or swapped weights under the same path change it (a swap of two rows anywhere does), so a
    resumed run never mixes answers of two models. Not cached: weights changed in place between two calls
    (through ``.data`` too, which no version counter sees) give another fingerprint; an evaluation hashes
    them once (:func:`mmfast.eval.runner.run_eval`)."""
    h = hashlib.sha256()
    hash_tensors(h, model.state_dict().items())
    return h.hexdigest()[:16]


#: the files of a model directory, besides its weights, that decide its answers: configs (model, generation,
#: processor), chat templates, tokenizer files
_MODEL_FILE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")


def model_files_fingerprint(mm) -> str | None:
    """The digest of what a model loaded from a local directory answers by besides its weights: every config,
    chat template and tokenizer file there (``config.json``, ``preprocessor_config.json``,
    ``chat_template.jinja``, ``tokenizer.json``, ...; not the weights' index, and each JSON file less its
    ``transformers_version``), read from disk, so that it does not depend on the installed transformers. A
    file edited under the same path gives another digest (16 hex digits). None for a model that was not
    loaded from a local directory (a model built in memory; a hub snapshot, fixed by its revision)."""
    where = Path(str(getattr(mm.model, "name_or_path", "") or ""))
    if not where.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(where.iterdir()):
        if not f.is_file() or f.suffix not in _MODEL_FILE_SUFFIXES or f.name.endswith(".index.json"):
            continue
        data = f.read_bytes()
        if f.suffix == ".json":
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None  # not JSON after all: its bytes
            if isinstance(obj, dict):
                obj.pop("transformers_version", None)
                data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")
        h.update(f"{f.name}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class _FileKey:
    path: str
    mtime_ns: int
    size: int
    inode: int


_DIGESTS: dict[_FileKey, str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of the file's bytes (cached per path, mtime, size and inode); ``"missing"`` when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return _MISSING
    key = _FileKey(str(path), st.st_mtime_ns, st.st_size, st.st_ino)
    digest = _DIGESTS.get(key)
    if digest is None:
        h = hashlib.sha256()
        try:
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        except OSError:
            return _MISSING
        digest = _DIGESTS[key] = h.hexdigest()
    return digest


def video_sha256(directory: Path) -> str:
    """sha256 over a video directory's frames as they are read (:func:`mmfast.video.frame_files`): each
    frame's file name and the sha256 of its bytes; ``"missing"`` when the directory cannot be listed."""
    try:
        files = frame_files(directory)
    except OSError:
        return _MISSING
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{file_sha256(f)}\n".encode())
    return h.hexdigest()


def sample_fingerprint(sample: Sample, recipe_hash: str, weights: str) -> str:
    """The digest of every input of ``sample`` (see the module docstring), 24 hex digits."""
    what = {
        "task": sample.task,
        "doc_id": sample.doc_id,
        "prompt": sample.prompt,
        "target": sample.target,
        "meta": sample.meta,
        "max_new_tokens": sample.max_new_tokens,
        "recipe_hash": recipe_hash,
        "weights": weights,
    }
    if sample.video is None:
        what.update({"image": str(sample.image), "image_sha256": file_sha256(Path(sample.image))})
    else:
        what.update(
            {
                "video": str(sample.video),
                "frames_sha256": video_sha256(Path(sample.video)),
                "video_sampling": dataclasses.asdict(sample.video_sampling),
            }
        )
    blob = json.dumps(what, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:24]
