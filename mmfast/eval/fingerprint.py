"""Content fingerprints of evaluation samples: what a stored record was computed from.

A sample's fingerprint is the sha256 of its task (record group), ``doc_id``, prompt, target, meta
(e.g. POPE's question text), ``max_new_tokens``, image path and the sha256 of the image's bytes, the
recipe hash and the weights fingerprint. Resume reuses a record only while its fingerprint equals the
planned sample's, so a question file or an image replaced under the same path is recomputed. Image
digests are cached per (path, mtime, size) so the POPE splits, which share images, hash each once.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .tasks import Sample

_MISSING = "missing"


def weights_fingerprint(model) -> str:
    """A cheap content fingerprint of a model's weights: every tensor's name, shape, dtype and first
    values (tensors offloaded to ``meta`` count by name and shape only). Retrained or swapped weights
    under the same path change it, so a resumed run never mixes answers of two models."""
    import torch  # here, so that reading records does not load torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            if t.device.type != "meta" and t.numel():
                h.update(t.detach().flatten()[:64].float().cpu().numpy().tobytes())
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


def sample_fingerprint(sample: Sample, recipe_hash: str, weights: str) -> str:
    """The digest of every input of ``sample`` (see the module docstring), 24 hex digits."""
    what = {
        "task": sample.task,
        "doc_id": sample.doc_id,
        "prompt": sample.prompt,
        "target": sample.target,
        "meta": sample.meta,
        "max_new_tokens": sample.max_new_tokens,
        "image": str(sample.image),
        "image_sha256": file_sha256(Path(sample.image)),
        "recipe_hash": recipe_hash,
        "weights": weights,
    }
    blob = json.dumps(what, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:24]


def digest_of(fingerprints: Iterable[str]) -> str:
    """One digest over the fingerprints of the scored records (in plan order): the exact data of a summary."""
    h = hashlib.sha256()
    for fp in fingerprints:
        h.update(fp.encode() + b"\n")
    return h.hexdigest()[:24]
