"""The embedded model's weights, packed losslessly for shipping, and unpacked once into a cache.

Why: the package ships ~43 MB of fp32 ``*.safetensors`` (the model, its CLIP, the drafts, HICom's
and Dynamic-LLaVA's trained parts). The low three bytes of a trained fp32 weight are noise, but the
top byte (sign and exponent) repeats, and the CLIP's vision tower is a copy of the model's. Packed as
one solid xz stream with every file's data region split into byte planes, they take ~33 MB, which
keeps the repository (and a copy sent to a GPU machine) well under 50 MB.

Format (``packed.json`` beside ``weights.pack.xz`` in a model directory):
- the manifest lists each packed file (relative path, size, sha256, and ``header``: the bytes kept as
  they are, the safetensors length prefix and JSON header);
- the pack is the xz stream of, file after file, ``header bytes + plane 0 + plane 1 + plane 2 + plane 3
  + tail``, where plane ``i`` is every 4th byte of the data region from byte ``i`` and the tail is the
  region's last ``len % 4`` bytes.
Unpacking inverts that exactly; every file's sha256 is checked before the directory is used, and the
files are then read by ``safetensors`` as before (nothing here executes data).

``materialise`` copies a packed directory into ``$MMFAST_CACHE`` (default ``$XDG_CACHE_HOME/mmfast``
or ``~/.cache/mmfast``) once, keyed by the hash of the manifest and the other files (an edited config
never loads a stale copy): it writes a temporary directory and renames it into place, so concurrent
processes never see a partial one. Older copies are left in place (``models/<name>-<key>``).
A directory without ``packed.json`` (e.g. freshly written by ``scripts/train_embedded.py``) is used in
place. Pack it with ``python scripts/pack_weights.py DIR``.

A leaf: it imports only the standard library and :mod:`mmfast.errors`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import lzma
import os
import shutil
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from .errors import ModelLoadError

logger = logging.getLogger(__name__)

MANIFEST = "packed.json"
PACK = "weights.pack.xz"
FORMAT = "mmfast-weights-pack/1"
STRIDE = 4  # fp32: byte planes of 4-byte words (other dtypes still round-trip exactly, only less compressed)


@dataclass(frozen=True)
class PackedFile:
    path: str  # relative to the model directory, "/"-separated
    size: int  # bytes of the original file
    header: int  # leading bytes stored as they are (8-byte length + safetensors JSON header)
    sha256: str


def _header_len(blob: bytes, name: str) -> int:
    if len(blob) < 8:
        raise ValueError(f"{name} is not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise ValueError(f"{name} is not a safetensors file (header length {n} past the end)")
    return 8 + n


def _shuffle(region: bytes) -> bytes:
    m = len(region) - len(region) % STRIDE
    return b"".join(region[i:m:STRIDE] for i in range(STRIDE)) + region[m:]


def _unshuffle(blob: bytes) -> bytes:
    m = len(blob) - len(blob) % STRIDE
    plane = m // STRIDE
    out = bytearray(len(blob))
    for i in range(STRIDE):
        out[i:m:STRIDE] = blob[i * plane : (i + 1) * plane]
    out[m:] = blob[m:]
    return bytes(out)


def pack(directory: str | os.PathLike) -> Path:
    """Pack every ``*.safetensors`` under ``directory`` into ``weights.pack.xz`` + ``packed.json`` and
    delete the originals (after checking that the pack unpacks to them byte for byte)."""
    d = Path(directory)
    # the largest first: a later file repeating an earlier one (the CLIP's vision tower) is found
    files = sorted((p for p in d.rglob("*.safetensors") if p.is_file()), key=lambda p: (-p.stat().st_size, p))
    if not files:
        raise ValueError(f"no *.safetensors under {d} to pack")
    entries, parts = [], []
    for p in files:
        blob = p.read_bytes()
        h = _header_len(blob, str(p))
        entries.append(PackedFile(p.relative_to(d).as_posix(), len(blob), h, hashlib.sha256(blob).hexdigest()))
        parts += [blob[:h], _shuffle(blob[h:])]
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": 64 << 20}]
    data = lzma.compress(b"".join(parts), format=lzma.FORMAT_XZ, filters=filters)
    manifest = {"format": FORMAT, "pack": PACK, "files": [asdict(e) for e in entries]}
    (d / PACK).write_bytes(data)
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    with tempfile.TemporaryDirectory() as tmp:  # the round trip, before anything is deleted
        _unpack_into(d, Path(tmp))
    for p in files:
        p.unlink()
    logger.info(
        "packed %d files (%d bytes) into %s (%d bytes)", len(files), sum(e.size for e in entries), d / PACK, len(data)
    )
    return d / PACK


def _read_manifest(d: Path) -> list[PackedFile]:
    try:
        m = json.loads((d / MANIFEST).read_text())
        if m.get("format") != FORMAT:
            raise ValueError(f"format {m.get('format')!r}, expected {FORMAT!r}")
        entries = [PackedFile(**e) for e in m["files"]]
        for e in entries:
            _check_entry(e)
        return entries
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # AttributeError: not a JSON object
        raise ModelLoadError(f"{d / MANIFEST} is unreadable ({exc}); reinstall mmfast") from None


def _check_entry(e: PackedFile) -> None:
    """A manifest entry names a file inside the model directory (the unpacked copy is written there)."""
    if not isinstance(e.path, str) or not e.path:
        raise ValueError(f"file path {e.path!r} is not a relative path")
    parts = PurePosixPath(e.path).parts
    if not parts or "\\" in e.path or PurePosixPath(e.path).is_absolute() or ".." in parts:
        raise ValueError(f"file path {e.path!r} leaves the model directory; packed paths are relative, without '..'")
    for name in ("size", "header"):
        v = getattr(e, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} {v!r} of {e.path!r} is not a byte count")


def _unpack_into(d: Path, out: Path) -> None:
    entries = _read_manifest(d)
    try:
        blob = lzma.decompress((d / PACK).read_bytes(), format=lzma.FORMAT_XZ)
    except (OSError, lzma.LZMAError) as exc:
        raise ModelLoadError(
            f"the packed weights {d / PACK} are missing or corrupt ({exc}); reinstall mmfast"
        ) from None
    at = 0
    for e in entries:
        raw = blob[at : at + e.header] + _unshuffle(blob[at + e.header : at + e.size])
        at += e.size
        if len(raw) != e.size or hashlib.sha256(raw).hexdigest() != e.sha256:
            raise ModelLoadError(f"{e.path} unpacked from {d / PACK} does not match its sha256; reinstall mmfast")
        target = out / e.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(raw)
    if at != len(blob):
        raise ModelLoadError(
            f"{d / PACK} holds {len(blob) - at} bytes that {d / MANIFEST} does not list; reinstall mmfast"
        )


def cache_root() -> Path:
    """mmfast's cache directory (the embedded model's copy, the evaluation world, CHAIR ground truth):
    ``$MMFAST_CACHE``, else ``$XDG_CACHE_HOME/mmfast``, else ``~/.cache/mmfast``; ``~`` expanded."""
    if os.environ.get("MMFAST_CACHE"):
        return Path(os.environ["MMFAST_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "mmfast"


def _key(d: Path) -> str:
    """Hash of every file the copy is made of: the manifest (hence the weights' sha256) and the small files
    copied as they are (config, tokenizer, ...), so an edited file never loads a stale copy."""
    h = hashlib.sha256()
    for p in sorted(p for p in d.rglob("*") if p.is_file() and p.name != PACK and "__pycache__" not in p.parts):
        h.update(p.relative_to(d).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _complete(target: Path, entries: list[PackedFile]) -> bool:
    return all((target / e.path).is_file() and (target / e.path).stat().st_size == e.size for e in entries)


def materialise(directory: str | os.PathLike) -> Path:
    """The directory to load ``directory``'s model from: itself when it is not packed, else its unpacked
    copy in the cache (made on first use, checked by size on every use and remade when damaged)."""
    d = Path(directory)
    if not (d / MANIFEST).is_file():
        return d
    entries = _read_manifest(d)
    loose = [e.path for e in entries if (d / e.path).exists()]
    if loose:
        raise ModelLoadError(
            f"{d} holds both packed weights ({MANIFEST}) and unpacked files ({', '.join(loose)}); after retraining, "
            f"pack them again with `python scripts/pack_weights.py {d}`"
        )
    key = _key(d)
    target = cache_root() / "models" / f"{d.name}-{key}"
    if _complete(target, entries):
        return target
    logger.info("unpacking %s into %s (once)", d / PACK, target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    except OSError as exc:
        raise ModelLoadError(
            f"cannot unpack the embedded model's weights into {target.parent} ({exc}); set MMFAST_CACHE to a writable "
            "directory"
        ) from None
    try:
        shutil.copytree(d, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(PACK, "__pycache__"))
        _unpack_into(d, tmp)
        if target.exists():  # damaged (or another process finished first: then it is complete, keep it)
            if _complete(target, entries):
                return target
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _complete(target, entries):  # not another process's finished copy: a real failure
                raise
    except OSError as exc:
        raise ModelLoadError(
            f"cannot unpack the embedded model's weights into {target} ({exc}); set MMFAST_CACHE to a writable "
            "directory with 50 MB free"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
