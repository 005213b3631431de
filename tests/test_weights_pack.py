"""The embedded model's packed weights (mmfast/weights_pack.py): lossless, unpacked once into the cache,
damage detected and repaired, clear errors, and the package's pack is the model the tests load."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmfast import weights_pack as wp
from mmfast.errors import ModelLoadError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MMFAST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _model_dir(root: Path) -> tuple[Path, dict[str, bytes]]:
    d = root / "m"
    (d / "sub").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 33, generator=g)
    save_file({"w": w, "b": torch.randn(7, generator=g)}, str(d / "model.safetensors"))
    # a repeated tensor, and a dtype whose data is not a multiple of 4 bytes (a tail)
    save_file({"w_copy": w.clone(), "h": torch.randn(5, generator=g).half()}, str(d / "sub" / "part.safetensors"))
    (d / "config.json").write_text('{"model_type": "llava"}')
    (d / "sub" / "config.json").write_text("{}")
    return d, {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_round_trip_is_byte_exact_and_the_originals_go(tmp_path, cache):
    d, before = _model_dir(tmp_path)
    wp.pack(d)
    assert not list(d.rglob("*.safetensors")) and (d / wp.PACK).is_file() and (d / wp.MANIFEST).is_file()
    out = wp.materialise(d)
    assert out.parent.parent == cache and out != d
    after = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert {k: v for k, v in after.items() if k != wp.MANIFEST} == before
    assert torch.equal(
        load_file(str(out / "sub" / "part.safetensors"))["w_copy"], load_file(str(out / "model.safetensors"))["w"]
    )


def test_unpacked_once_then_reused(tmp_path, cache):
    d, _ = _model_dir(tmp_path)
    wp.pack(d)
    out = wp.materialise(d)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert wp.materialise(d) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary directory left


def test_a_damaged_copy_is_unpacked_again(tmp_path, cache):
    d, before = _model_dir(tmp_path)
    wp.pack(d)
    out = wp.materialise(d)
    (out / "model.safetensors").write_bytes(before["model.safetensors"][:100])  # truncated
    (out / "sub" / "part.safetensors").unlink()
    assert wp.materialise(d) == out
    assert (out / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert (out / "sub" / "part.safetensors").read_bytes() == before["sub/part.safetensors"]


def test_a_new_pack_gets_a_new_copy(tmp_path, cache):
    """The cache is keyed by the manifest and the other files: repacked (retrained) weights or an edited
    config never load a stale copy."""
    d, _ = _model_dir(tmp_path)
    wp.pack(d)
    first = wp.materialise(d)
    for p in (d / wp.PACK, d / wp.MANIFEST):
        p.unlink()
    save_file({"w": torch.zeros(3)}, str(d / "model.safetensors"))
    wp.pack(d)
    second = wp.materialise(d)
    assert second != first and load_file(str(second / "model.safetensors"))["w"].tolist() == [0.0, 0.0, 0.0]
    (d / "sub" / "config.json").write_text('{"edited": 1}')
    third = wp.materialise(d)
    assert third not in (first, second) and (third / "sub" / "config.json").read_text() == '{"edited": 1}'


def test_an_unpacked_directory_is_used_in_place(tmp_path, cache):
    d, _ = _model_dir(tmp_path)
    assert wp.materialise(d) == d and not cache.exists()


def test_corrupt_pack_is_refused_with_the_fix(tmp_path, cache):
    d, _ = _model_dir(tmp_path)
    wp.pack(d)
    blob = bytearray((d / wp.PACK).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (d / wp.PACK).write_bytes(bytes(blob))
    with pytest.raises(ModelLoadError, match="corrupt.*reinstall mmfast"):
        wp.materialise(d)
    assert not cache.exists() or not any(p.name.startswith("m-") for p in (cache / "models").iterdir())


def test_a_wrong_hash_is_refused(tmp_path, cache):
    d, _ = _model_dir(tmp_path)
    wp.pack(d)
    m = json.loads((d / wp.MANIFEST).read_text())
    m["files"][0]["sha256"] = hashlib.sha256(b"x").hexdigest()
    (d / wp.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ModelLoadError, match="does not match its sha256"):
        wp.materialise(d)


def test_loose_weights_beside_a_pack_are_refused(tmp_path, cache):
    """Retraining writes plain files into the packed directory: loading says to pack again."""
    d, _ = _model_dir(tmp_path)
    wp.pack(d)
    save_file({"w": torch.zeros(3)}, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="pack_weights.py"):
        wp.materialise(d)


def test_an_unwritable_cache_names_the_variable(tmp_path, monkeypatch):
    d, _ = _model_dir(tmp_path)
    wp.pack(d)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MMFAST_CACHE", str(tmp_path / "a-file" / "cache"))  # no directory can be made there
    with pytest.raises(ModelLoadError, match="set MMFAST_CACHE to a writable directory"):
        wp.materialise(d)


def test_the_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("MMFAST_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert wp.cache_root() == tmp_path / "xdg" / "mmfast"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert wp.cache_root() == tmp_path / "home" / ".cache" / "mmfast"


def test_the_embedded_model_is_packed_and_unpacks_to_its_manifest():
    """The package ships only the pack; the directory the embedded name resolves to holds every listed file
    with its sha256 (checked when unpacked; re-checked here) and the package's other files."""
    from mmfast.checkpoint import ASSETS, embedded_dir

    src = ASSETS / "tiny-world"
    if not (src / wp.MANIFEST).is_file():
        pytest.skip("embedded model not packed")
    out = embedded_dir()
    assert not list(src.rglob("*.safetensors"))
    for e in json.loads((src / wp.MANIFEST).read_text())["files"]:
        assert hashlib.sha256((out / e["path"]).read_bytes()).hexdigest() == e["sha256"]
    for p in src.rglob("*"):
        if p.is_file() and p.name != wp.PACK:
            assert (out / p.relative_to(src)).read_bytes() == p.read_bytes()


def test_a_packed_local_directory_loads_like_the_embedded_name(tmp_path, monkeypatch):
    """Pointing at the package's directory itself (or any packed copy) resolves to the unpacked copy."""
    from mmfast.checkpoint import ASSETS, _resolve, embedded_dir

    if not (ASSETS / "tiny-world" / wp.MANIFEST).is_file():
        pytest.skip("embedded model not packed")
    assert _resolve(str(ASSETS / "tiny-world")) == (str(embedded_dir()), True)


def test_processes_unpacking_at_once_share_one_complete_copy(tmp_path, cache):
    """Ranks of a data-parallel run load the embedded model together: each unpacks into its own temporary
    directory and renames it into place; the last to finish finds the first's complete copy and uses it."""
    import subprocess
    import sys

    d, before = _model_dir(tmp_path)
    wp.pack(d)
    code = "import sys; from mmfast.weights_pack import materialise; print(materialise(sys.argv[1]))"
    env = {**os.environ, "MMFAST_CACHE": str(cache)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(d)], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(4)
    ]
    outs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(outs) == 1
    out = Path(outs.pop())
    assert (out / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary directory left


@pytest.mark.parametrize("path", ["../../../escaped.bin", "<absolute>", "a/../../escaped.bin", ""])
def test_a_manifest_path_cannot_leave_the_directory(tmp_path, cache, path):
    """A model directory's packed.json names where each unpacked file goes: a path outside the copy
    (``..``, absolute) wrote a file anywhere the user can write."""
    import lzma

    d = tmp_path / "evil"
    d.mkdir()
    path = str(tmp_path / "abs" / "escaped.bin") if path == "<absolute>" else path
    payload = b"not yours\n"
    (d / "config.json").write_text("{}")
    (d / wp.PACK).write_bytes(lzma.compress(payload, format=lzma.FORMAT_XZ))
    entry = {"path": path, "size": len(payload), "header": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (d / wp.MANIFEST).write_text(json.dumps({"format": wp.FORMAT, "pack": wp.PACK, "files": [entry]}))
    with pytest.raises(ModelLoadError, match="unreadable"):
        wp.materialise(d)
    assert not any(p.name == "escaped.bin" for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("text", ["[]", '"x"', '{"format": "mmfast-weights-pack/1", "files": [["a"]]}'])
def test_a_manifest_that_is_not_an_object_is_refused(tmp_path, cache, text):
    """A packed.json holding a JSON list or string crashed with AttributeError ('list' object has no attribute
    'get') instead of naming the file."""
    d, _ = _model_dir(tmp_path)
    wp.pack(d)
    (d / wp.MANIFEST).write_text(text)
    with pytest.raises(ModelLoadError, match="packed.json is unreadable.*reinstall mmfast"):
        wp.materialise(d)
