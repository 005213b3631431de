"""Every bad input is a clear error (exit 2) naming the thing and the fix, never a traceback (issue 18).

Exit codes are checked through ``mmfast.cli.main`` in-process (it returns the code the process exits
with); the model-loading cases use the tiny random model of ``conftest.tiny_dir``.
"""

from __future__ import annotations

import http.server
import json
import os
import time
from pathlib import Path

import pytest
import yaml

from mmfast.cli import main
from mmfast.config import MAX_RECIPE_BYTES, load_recipe, parse_yaml
from mmfast.errors import ConfigError, InputError


def _cli(capsys, *argv: str) -> tuple[int, str]:
    """Run the CLI in-process; returns (exit code, stderr)."""
    rc = main(["-q", *argv])
    return rc, capsys.readouterr().err


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# --------------------------------------------------------------------------- recipes (item 8)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_float_is_refused(tmp_path, capsys, value):
    recipe = _write(tmp_path, "r.yaml", f"decoding: {{method: sample, params: {{temperature: {value}}}}}\n")
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2
    assert "decoding.params.temperature" in err and "not a finite number" in err


def test_set_with_invalid_yaml_is_an_input_error(tmp_path, capsys):
    recipe = _write(tmp_path, "r.yaml", "name: r\n")
    rc, err = _cli(capsys, "validate", str(recipe), "--set", "decoding.seed=[")
    assert rc == 2
    assert "override 'decoding.seed=['" in err and "not valid YAML" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_set_indexed_paths():
    base = {"pruning": [{"method": "fastv"}], "decoding": "sample"}
    recipe = load_recipe(base, overrides=["pruning[0].params.k=1", "decoding.params.temperature=0.5"])
    assert recipe.pruning[0].params.k == 1
    assert recipe.decoding.method == "sample" and recipe.decoding.params.temperature == 0.5
    with pytest.raises(InputError, match=r"pruning has 1 entries, so \[3\] does not exist"):
        load_recipe(base, overrides=["pruning[3].params.k=1"])
    with pytest.raises(InputError, match=r"speculative is not in the recipe"):
        load_recipe(base, overrides=["speculative[0].method=msd"])
    with pytest.raises(InputError, match=r"decoding.max_new_tokens is 8, not a mapping"):
        load_recipe({"decoding": {"max_new_tokens": 8}}, overrides=["decoding.max_new_tokens.x=1"])
    with pytest.raises(InputError, match="not a dotted key path"):
        load_recipe(base, overrides=["pruning..k=1"])


def test_decoding_shorthand_string(tmp_path, capsys):
    assert load_recipe({"decoding": "beam"}).decoding.method == "beam"
    recipe = _write(tmp_path, "r.yaml", "decoding: beam\n")
    rc, _ = _cli(capsys, "validate", str(recipe))
    assert rc == 0
    with pytest.raises(ConfigError, match=r"decoding: expected a decoder name or a mapping"):
        load_recipe({"decoding": [1, 2]})


def test_duplicate_keys_refused_with_line(tmp_path, capsys):
    recipe = _write(tmp_path, "r.yaml", "name: a\ndecoding:\n  seed: 1\n  seed: 2\n")
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2
    assert "line 4: duplicate key 'seed' (first given at line 3)" in err
    # YAML merge keys are not duplicates
    assert parse_yaml("a: &a {x: 1}\nb:\n  <<: *a\n  y: 2\n") == {"a": {"x": 1}, "b": {"x": 1, "y": 2}}


def test_alias_bomb_fails_fast(tmp_path, capsys):
    lines = ["bench:", "  params:", "    a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"    {name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    recipe = _write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n")
    assert recipe.stat().st_size < 600
    t0 = time.perf_counter()
    rc, err = _cli(capsys, "validate", str(recipe))
    assert time.perf_counter() - t0 < 5
    assert rc == 2 and "aliases expand the document" in err
    # a reasonable use of anchors still loads
    assert parse_yaml("a: &a [1, 2]\nb: *a\n") == {"a": [1, 2], "b": [1, 2]}


def test_recursive_alias_refused():
    with pytest.raises(yaml.YAMLError, match="recursive alias"):
        parse_yaml("a: &a [1, *a]\n")


def test_binary_recipe_refused(tmp_path, capsys):
    recipe = _write(tmp_path, "r.yaml", b"\xff\xfe\x00\x01garbage\x80")
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2 and "not a text recipe (invalid UTF-8" in err


def test_oversized_recipe_refused(tmp_path, capsys):
    recipe = _write(tmp_path, "r.yaml", "# " + "x" * MAX_RECIPE_BYTES + "\nname: r\n")
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2 and "over the" in err and "byte limit" in err


def test_max_memory_integer_device_keys():
    """docs/scaling.md's example ``max_memory: {0: 38GiB, 1: 38GiB, cpu: 120GiB}`` validates."""
    recipe = load_recipe(parse_yaml("model: {device_map: auto, max_memory: {0: 38GiB, 1: 38GiB, cpu: 120GiB}}"))
    assert recipe.model.max_memory == {0: "38GiB", 1: "38GiB", "cpu": "120GiB"}
    again = load_recipe(parse_yaml(yaml.safe_dump(recipe.to_dict())))
    assert again.hash() == recipe.hash()


# --------------------------------------------------------------------------- models, images, prompts (item 9)


def test_cuda_device_without_cuda(tmp_path, capsys, tiny_dir, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from PIL import Image

    Image.new("RGB", (32, 32)).save(tmp_path / "x.png")
    recipe = _write(tmp_path, "r.yaml", f"model: {{name: {tiny_dir}, device: cuda}}\n")
    rc, err = _cli(capsys, "run", str(recipe), "--image", str(tmp_path / "x.png"), "--prompt", "hi")
    assert rc == 2 and "model.device 'cuda': CUDA is not available" in err and "device: cpu" in err


def test_bad_device_string(tiny_dir):
    import mmfast

    with pytest.raises(InputError, match="model.device 'gpu' is not a device"):
        mmfast.load(tiny_dir, device="gpu")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"attn_implementation": "bogus"}, "attn_implementation 'bogus' is not one of sdpa, eager"),
        ({"device_map": "everywhere"}, "device_map 'everywhere' is neither a placement strategy"),
        ({"use_safetensors": False}, "mmfast loads safetensors weights only"),
    ],
)
def test_load_checks_its_arguments_like_a_recipe(tiny_dir, kwargs, match):
    """mmfast.load refuses what a recipe's model section refuses, as an InputError, before anything loads
    (transformers' ValueError or a TypeError for a repeated keyword, before)."""
    import mmfast

    with pytest.raises(InputError, match=match):
        mmfast.load(tiny_dir, device="cpu", **kwargs)


def _copy_model(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_weights(tmp_path, tiny_dir):
    import mmfast
    from mmfast.errors import ModelLoadError

    d = _copy_model(tiny_dir, tmp_path / "m")
    weights = d / "model.safetensors"
    with weights.open("r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        mmfast.load(d, device="cpu")
    weights.unlink()
    with pytest.raises(ModelLoadError, match="has no model.safetensors"):
        mmfast.load(d, device="cpu")


def test_missing_tokenizer_files(tmp_path, tiny_dir):
    import mmfast
    from mmfast.errors import ModelLoadError

    d = _copy_model(tiny_dir, tmp_path / "m")
    for f in d.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ModelLoadError, match=r"cannot load the processor .*tokenizer\.json"):
        mmfast.load(d, device="cpu")


def test_image_placeholder_typed_in_prompt(tiny_mm, images):
    with pytest.raises(InputError, match=r"prompt 0 has 2 image placeholders '<image>' for 1 image\(s\)"):
        tiny_mm.prepare([images[0]], ["<image> What is this?"])


def test_invalid_utf8_prompt(tiny_mm, images):
    bad = b"caf\xe9?".decode("utf-8", "surrogateescape")  # what argv holds for a Latin-1 terminal
    with pytest.raises(InputError, match="prompt 0 is not valid UTF-8"):
        tiny_mm.prepare([images[0]], [bad])


def test_decompression_bomb_image(tmp_path, tiny_mm, monkeypatch):
    from PIL import Image

    path = tmp_path / "big.png"
    Image.new("L", (64, 64)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 4096 px > 2x the limit: Pillow's bomb error
    with pytest.raises(InputError, match="too large to decode safely"):
        tiny_mm.prepare([path], ["hi"])


def test_max_new_tokens_zero(tmp_path, capsys, tiny_mm, images):
    from mmfast.pipeline import apply

    with apply(tiny_mm) as s, pytest.raises(InputError, match="max_new_tokens must be a positive integer, got 0"):
        s.generate([images[0]], ["hi"], max_new_tokens=0)
    with pytest.raises(SystemExit) as exc:
        main(["run", "r.yaml", "--image", "x.png", "--prompt", "hi", "--max-new-tokens", "0"])
    assert exc.value.code == 2 and "--max-new-tokens: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_eval_limit_must_be_positive(capsys, limit):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "r.yaml", "--limit", limit])
    assert exc.value.code == 2 and "--limit: must be at least 1" in capsys.readouterr().err


# --------------------------------------------------------------------------- method params against the model (item 8)


def test_fastv_layer_beyond_the_model(tiny_mm):
    from mmfast.pipeline import apply

    with pytest.raises(ConfigError, match=r"pruning\[0\]\.params\.k: layer 999 does not exist in this 4-layer LLM"):
        apply(tiny_mm, {"pruning": [{"method": "fastv", "params": {"k": 999}}]})
    hooks = tiny_mm.adapter.layers[0]._forward_pre_hooks
    assert not hooks  # the failed session restored the model


def test_fastv_k_999_cli_exit_2(tmp_path, capsys, tiny_dir, images):
    image = tmp_path / "i.png"
    images[0].save(image)
    recipe = _write(
        tmp_path,
        "r.yaml",
        f"model: {{name: {tiny_dir}, device: cpu}}\npruning: [{{method: fastv, params: {{k: 999}}}}]\n",
    )
    rc, err = _cli(capsys, "run", str(recipe), "--image", str(image), "--prompt", "hi")
    assert rc == 2 and "pruning[0].params.k" in err


# --------------------------------------------------------------------------- context limits (item 7)


@pytest.fixture(scope="module")
def short_context_mm(tmp_path_factory):
    """The tiny model with a 64-token context."""
    import dataclasses

    import mmfast
    from mmfast.models.factory import SHAPES, random_llava, save_model

    model, processor = random_llava(dataclasses.replace(SHAPES["tiny"], max_positions=64), init_std=0.2)
    return mmfast.load(save_model(model, processor, tmp_path_factory.mktemp("ctx64")), device="cpu")


def _count_llm_forwards(mm) -> list[int]:
    calls: list[int] = []
    mm.adapter.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


def test_long_prompt_refused_before_compute(short_context_mm, images):
    from mmfast.pipeline import apply

    calls = _count_llm_forwards(short_context_mm)
    with apply(short_context_mm) as s:
        with pytest.raises(
            InputError, match=r"context of .* \(64 tokens\): sample 0: \d+ text \+ 0 vision tokens .* over"
        ):
            s.generate([images[0]], ["word " * 80], max_new_tokens=4)
        assert not calls
        assert s.generate([images[0]], ["hi"], max_new_tokens=2)  # a short one still runs


def test_many_images_refused_before_the_llm(short_context_mm, images):
    """3 images x 16 vision tokens + the prompt + 8 new tokens > 64: refused after the tower, before the LLM."""
    from mmfast.pipeline import apply

    calls = _count_llm_forwards(short_context_mm)
    with apply(short_context_mm) as s:
        with pytest.raises(InputError, match=r"48 vision tokens \(3 image\(s\)\) \+ 8 new tokens = \d+, \d+ over"):
            s.generate([images[:3]], ["Describe these images."], max_new_tokens=8)
        assert not calls


def test_context_limit_counts_max_new_tokens(short_context_mm, images):
    from mmfast.pipeline import apply

    with apply(short_context_mm) as s:
        with pytest.raises(InputError, match=r"\+ 60 new tokens"):
            s.generate([images[0]], ["hi"], max_new_tokens=60)


# --------------------------------------------------------------------------- output paths (item 9)


def test_output_pointing_at_a_file(tmp_path, capsys):
    target = _write(tmp_path, "afile", "x")
    recipe = _write(tmp_path, "r.yaml", "model: {name: /nonexistent-model-dir}\neval: {tasks: [pope]}\n")
    rc, err = _cli(capsys, "eval", str(recipe), "--output", str(target))
    assert rc == 2 and "is a file, not a directory" in err  # before the (missing) model is even looked at


def test_unwritable_output_dir(tmp_path, monkeypatch):
    import tempfile

    from mmfast.cli import check_output_dir

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(InputError, match="is not writable .*Permission denied"):
        check_output_dir(tmp_path / "new" / "run")


@pytest.mark.skipif(
    hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0, reason="root writes into read-only dirs"
)
def test_read_only_output_dir(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    recipe = _write(tmp_path, "r.yaml", "model: {name: /nonexistent-model-dir}\neval: {tasks: [pope]}\n")
    try:
        rc, err = _cli(capsys, "eval", str(recipe), "--output", str(ro / "run"))
    finally:
        ro.chmod(0o700)
    assert rc == 2 and "is not writable" in err


@pytest.mark.parametrize(
    "code,text,said",
    [
        ("ENOSPC", "No space left on device", "No space left on device (the disk is full"),
        ("EFBIG", "File too large", "File too large (the file system's largest file size"),
    ],
)
def test_full_disk_or_file_too_large_is_exit_2(code, text, said, capsys, monkeypatch):
    import errno

    from mmfast import cli

    def fail(args):
        raise OSError(getattr(errno, code), text, "runs/x/samples.jsonl")

    monkeypatch.setitem(cli.COMMANDS, "list", fail)
    rc, err = _cli(capsys, "list")
    assert rc == 2 and f"runs/x/samples.jsonl: {said}" in err


def test_corrupt_summary_in_report(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_bytes(b"\xff{not json")
    rc, err = _cli(capsys, "report", str(run), "--output", str(tmp_path / "rep"))
    assert rc == 2 and "summary.json: not valid JSON" in err


# --------------------------------------------------------------------------- data files (item 9)


@pytest.mark.parametrize("name", ["../secret.jpg", "/etc/passwd", "a/../../b.jpg"])
def test_pope_image_paths_stay_in_the_image_dir(tmp_path, name):
    import json

    from mmfast.eval.pope import PopeFormatError, load_pope_questions

    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": 1, "image": name, "text": "Is there a cat?", "label": "yes"}) + "\n")
    with pytest.raises(PopeFormatError, match=r"q.jsonl:1: image .* is not a file name inside the image directory"):
        load_pope_questions(path)
    path.write_text(
        json.dumps({"question_id": 1, "image": "sub/ok.jpg", "text": "Is there a cat?", "label": "yes"}) + "\n"
    )
    assert load_pope_questions(path)[0].image == "sub/ok.jpg"


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers every HEAD with 200 and records the request line (a hub, a mirror or an HTTP proxy)."""

    def do_HEAD(self) -> None:
        self.server.seen.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_hub(monkeypatch):
    """A loopback HTTP server; huggingface_hub online and its session rebuilt from this test's environment."""
    import threading

    import huggingface_hub.constants
    from huggingface_hub.utils import close_session

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.lower(), raising=False)
    close_session()  # the shared client reads the proxy variables when it is built
    yield server
    close_session()
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("suffix", ["", "/"])
def test_hub_check_asks_the_mirror_in_hf_endpoint(fake_hub, monkeypatch, suffix):
    from mmfast.model import _hub_error

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{fake_hub.server_port}{suffix}")
    assert _hub_error() is None
    assert fake_hub.seen == ["/"]


def test_hub_check_goes_through_the_proxy(fake_hub, monkeypatch):
    # the hub's host does not resolve here; only the proxy (the loopback server) can answer for it
    from huggingface_hub.utils import close_session

    from mmfast.model import _hub_error

    monkeypatch.setenv("HF_ENDPOINT", "http://hub.invalid")
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{fake_hub.server_port}")
    close_session()
    assert _hub_error() is None
    assert fake_hub.seen == ["http://hub.invalid/"]  # the absolute URI a client sends to its proxy


def test_unreachable_hub_names_the_endpoint_and_the_cause(fake_hub, monkeypatch):
    import mmfast
    from mmfast.errors import ModelLoadError

    closed = fake_hub.server_port
    fake_hub.shutdown()
    fake_hub.server_close()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    with pytest.raises(
        ModelLoadError,
        match=rf"cannot reach the Hugging Face hub to download 'no-org/no-model' "
        rf"\(http://127.0.0.1:{closed}: \w*Error",
    ):
        mmfast.load("no-org/no-model", device="cpu")


@pytest.mark.parametrize(
    ("endpoint", "why"), [("http://mirror.local:80x", "invalid port"), ("http://:8080", "names no host")]
)
def test_malformed_hf_endpoint(monkeypatch, endpoint, why):
    from mmfast.errors import ModelLoadError
    from mmfast.model import _hub_error

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(ModelLoadError, match=why):
        _hub_error()


def test_offline_cache_miss_names_the_hf_download_command(monkeypatch):
    import mmfast
    from mmfast.errors import ModelLoadError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"\(hf download no-org/no-model --revision v2\)"):
        mmfast.load("no-org/no-model", device="cpu", revision="v2")


# -- method parameters against the model's config, before any weights load --------------------------


@pytest.mark.parametrize(
    "stage, path",
    [
        (
            {"method": "mustdrop", "params": {"window": 2}},
            "pruning[0].params.layers",
        ),  # the paper's layers 2..14, 4-layer LLM
        ({"method": "fastv", "params": {"k": 999}}, "pruning[0].params.k"),
        ({"method": "mustdrop", "params": {"window": 5, "layer_mapping": "proportional"}}, "pruning[0].params.window"),
    ],
)
def test_method_params_checked_against_the_config_before_loading(stage, path, tiny_dir, tmp_path, monkeypatch, capsys):
    import mmfast.model
    from mmfast.capabilities import check_model_config

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the recipe was checked")

    monkeypatch.setattr(mmfast.model, "load_model", no_load)
    recipe = load_recipe({"model": {"name": str(tiny_dir)}, "pruning": [stage]})
    with pytest.raises(ConfigError) as exc:
        check_model_config(recipe)
    assert exc.value.path == path
    f = _write(tmp_path, "r.yaml", yaml.safe_dump({"model": {"name": str(tiny_dir)}, "pruning": [stage]}))
    code, err = _cli(capsys, "validate", str(f))
    assert code == 2 and path in err
    code, err = _cli(capsys, "run", str(f), "--image", "x.png", "--prompt", "hi")
    assert code == 2 and path in err  # refused before the (patched-out) load


# --------------------------------------------------------------------------- issue 29


def test_bench_refuses_a_folder_of_user_files(tmp_path, capsys, monkeypatch):
    """``mmfast bench`` into a folder holding someone's results.md / summary.json: exit 2 before any
    model loads, the files untouched (``eval`` refuses such a folder too)."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.md").write_text("my notes\n")
    (out / "summary.json").write_text('{"mine": 1}\n')
    recipe = _write(tmp_path, "b.yaml", "model: {name: mmfast/tiny-world}\nbench: {kind: pruning}\n")
    monkeypatch.setattr("mmfast.bench.load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    rc, err = _cli(capsys, "bench", str(recipe), "--output", str(out))
    assert rc == 2 and "not an mmfast bench directory" in err and "Traceback" not in err
    assert (out / "results.md").read_text() == "my notes\n" and (out / "summary.json").read_text() == '{"mine": 1}\n'
    assert sorted(p.name for p in out.iterdir()) == ["results.md", "summary.json"]


def test_bench_directory_of_mmfast_is_reused(tmp_path):
    from mmfast.bench.common import BENCH_MARKER, claim_bench_dir

    fresh = tmp_path / "new"
    claim_bench_dir(fresh, "pruning", "r")
    (fresh / "results.md").write_text("x")
    claim_bench_dir(fresh, "pruning", "r")  # a rerun into its own directory
    assert (fresh / BENCH_MARKER).is_file()
    legacy = tmp_path / "legacy"  # written before the marker: a bench summary
    legacy.mkdir()
    (legacy / "summary.json").write_text(
        json.dumps({"model": {"name": "m", "weights_fingerprint": "ab"}, "results": {}})
    )
    claim_bench_dir(legacy, "pruning", "r")


@pytest.mark.parametrize("size", [(40000, 1), (1, 100000), (2010, 10)])
def test_very_thin_image_refused_before_processing(tmp_path, tiny_mm, size):
    """A 199-byte 40000x1 PNG took a minute and 15 GB in the image processor (100000x1: MemoryError)."""
    from PIL import Image

    path = tmp_path / "thin.png"
    Image.new("L", size).save(path)
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"aspect ratio over 200:1.*crop or pad"):
        tiny_mm.prepare([path], ["hi"])
    with pytest.raises(InputError, match="aspect ratio over 200:1"):
        tiny_mm.prepare([Image.new("RGB", size)], ["hi"])
    assert time.perf_counter() - t0 < 5


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_huge_pixel_count_refused(tmp_path, tiny_mm, monkeypatch):
    from PIL import Image

    path = tmp_path / "big.png"
    Image.new("L", (40, 40)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 1600 px: over the limit, under Pillow's 2x bomb error
    with pytest.raises(InputError, match="1600 pixels, over the 1000-pixel limit"):
        tiny_mm.prepare([path], ["hi"])


def test_exif_rotated_jpeg_is_turned_upright(tmp_path, caplog, monkeypatch):
    import logging

    from PIL import Image

    import mmfast.inputs as model_mod

    monkeypatch.setattr(model_mod, "_EXIF_ROTATION_LOGGED", False)
    im = Image.new("RGB", (40, 20), (255, 0, 0))
    im.paste((0, 0, 255), (0, 0, 10, 20))  # blue left edge
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned: show rotated 90 degrees clockwise
    paths = [tmp_path / f"{i}.jpg" for i in range(2)]
    for p in paths:
        im.save(p, exif=exif, quality=95)
    with caplog.at_level(logging.INFO, logger="mmfast.inputs"):
        out = [model_mod.open_image(p) for p in paths]
    assert all(o.size == (20, 40) for o in out)  # upright: the viewer's orientation
    r, g, b = out[0].getpixel((10, 2))  # the blue edge is now on top
    assert b > 200 and r < 60
    assert sum("EXIF orientation" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("{{question}}", "has no {question} field ({{question}} is the literal text '{question}'"),
        ("{question} {foo}", "has the field(s) {foo}; the only field is {question}"),
        ("Q: {}", "has the field(s) {}"),
        ("{question", "is not a valid template"),
        ("{question!r}", "without a format spec or conversion"),
    ],
)
def test_pope_prompt_template_checked(tmp_path, capsys, prompt, expected):
    recipe = _write(
        tmp_path,
        "r.yaml",
        yaml.safe_dump(
            {
                "model": {"name": "/nonexistent/model"},
                "eval": {
                    "tasks": ["pope"],
                    "data": {"dataset": "coco", "root": str(tmp_path)},
                    "pope": {"prompt": prompt},
                },
            }
        ),
    )
    rc, err = _cli(capsys, "eval", str(recipe), "--output", str(tmp_path / "out"))
    assert rc == 2 and "eval.pope.prompt" in err and expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_pope_split_key_typo_refused(tmp_path, capsys):
    recipe = _write(
        tmp_path,
        "r.yaml",
        yaml.safe_dump(
            {
                "model": {"name": "/nonexistent/model"},
                "eval": {
                    "tasks": ["pope"],
                    "data": {"dataset": "coco", "root": str(tmp_path)},
                    "pope": {"files": {"randm": str(tmp_path / "q.json")}},
                },
            }
        ),
    )
    rc, err = _cli(capsys, "eval", str(recipe))
    assert rc == 2 and "eval.pope.files.randm: unknown POPE split 'randm'; did you mean 'random'?" in err
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "/nonexistent/model"},
                "eval": {
                    "tasks": ["pope"],
                    "data": {"dataset": "coco", "root": str(tmp_path)},
                    "pope": {"splits": ["random"], "files": {"popular": str(tmp_path / "q.json")}},
                },
            }
        )
    )
    rc, err = _cli(capsys, "eval", str(recipe))
    assert rc == 2 and "eval.pope.files.popular: split 'popular' is not in eval.pope.splits (random)" in err


@pytest.mark.parametrize(
    "text",
    [
        "bench: {kind: speculative, params: {workloads: " + "[" * 450 + "]" * 450 + "}}\n",
        "bench: {compare: [{name: a, eval: " + "{a: " * 450 + "1" + "}" * 450 + "}]}\n",
        "name: " + "[" * 20000 + "]" * 20000 + "\n",
    ],
)
def test_deeply_nested_yaml_refused(tmp_path, capsys, text):
    """Hundreds of levels were a RecursionError traceback when the resolved recipe was printed."""
    recipe = _write(tmp_path, "r.yaml", text)
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2 and "nested more than 64 levels deep" in err and "Traceback" not in err
    assert (
        load_recipe(parse_yaml("bench: {kind: speculative, compare: " + "[" * 20 + "]" * 20 + "}")).bench.kind
        == "speculative"
    )


@pytest.mark.parametrize(
    "value, expected",
    [
        ("runs/{nme}", "output.dir: 'runs/{nme}' uses {nme}; the only field is {name}"),
        ("runs/{name", "output.dir: 'runs/{name' is not a valid path template"),
        ("runs/{0}", "uses {0}"),
    ],
)
def test_output_dir_unknown_field(tmp_path, capsys, value, expected):
    recipe = _write(tmp_path, "r.yaml", yaml.safe_dump({"output": {"dir": value}}))
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2 and expected in err and "Traceback" not in err
    assert load_recipe({"output": {"dir": "runs/{{lit}}/{name}"}}).output.dir == "runs/{{lit}}/{name}"


def test_device_map_banana(tmp_path, capsys):
    recipe = _write(tmp_path, "r.yaml", "model: {device_map: banana}\n")
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2 and "model.device_map: 'banana' is neither a placement strategy" in err
    for ok in ("auto", "balanced_low_0", "cpu", "cuda:1"):
        assert load_recipe({"model": {"device_map": ok}}).model.device_map == ok


def test_weights_shapes_not_matching_the_config(tmp_path, tiny_dir):
    import mmfast
    from mmfast.errors import ModelLoadError

    d = _copy_model(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] += 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match="do not fit its config.json .*use the config.json saved with these weights"
    ):
        mmfast.load(d, device="cpu")


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "does not exist"),
        ("12\nabc\n", "line 2: 'abc' is not an image id"),
        ("12\n4\u00b2\n", "line 2: '4\u00b2' is not an image id"),  # str.isdigit() takes a superscript; int() does not
        ("12\n\n12\n", "line 3: image id 12 is listed twice (first at line 1)"),
        ("\n\n", "lists no image ids"),
        (b"\xff\xfe1", "cannot be read"),
    ],
)
def test_chair_image_ids_file_checked(tmp_path, content, expected):
    from mmfast.eval.tasks.chair import read_image_ids

    path = tmp_path / "ids.txt"
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(
        InputError, match=r"eval\.chair\.image_ids_file .*" + expected.replace("(", r"\(").replace(")", r"\)")
    ):
        read_image_ids(path)
    (tmp_path / "good.txt").write_text("5\n 7 \n\n9\n")
    assert read_image_ids(tmp_path / "good.txt") == [5, 7, 9]


def test_output_path_too_long(tmp_path, capsys):
    recipe = _write(tmp_path, "r.yaml", "eval: {tasks: [pope]}\nmodel: {name: /nonexistent/model}\n")
    rc, err = _cli(capsys, "eval", str(recipe), "--output", str(tmp_path / ("a" * 300) / "run"))
    assert rc == 2 and "File name too long (the path is longer than the file system allows" in err


# --------------------------------------------------------------------------- a new user's mistakes (audit)


def test_lmms_task_never_writes_over_a_folder_of_other_files(tmp_path, capsys):
    """``mmfast lmms-task --output``: a file is refused, a folder of someone's files (or an eval run) is refused
    untouched, an empty folder or one mmfast wrote is (re)written."""
    recipe = _write(tmp_path, "r.yaml", "model: {name: mmfast/tiny-world}\neval: {tasks: [pope]}\n")
    afile = _write(tmp_path, "afile.json", "{}")
    rc, err = _cli(capsys, "lmms-task", str(recipe), "--output", str(afile))
    assert rc == 2 and "is a file" in err and "Traceback" not in err
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "utils.py").write_text("def my_code(): ...\n")
    rc, err = _cli(capsys, "lmms-task", str(recipe), "--output", str(mine))
    assert rc == 2 and "not an lmms-eval task directory mmfast wrote" in err
    assert [p.name for p in mine.iterdir()] == ["utils.py"] and "my_code" in (mine / "utils.py").read_text()


def test_lmms_task_rewrites_its_own_directory(tmp_path):
    from mmfast.eval.lmms_tasks import MARKER, write_lmms_task

    recipe = load_recipe({"model": {"name": "mmfast/tiny-world"}, "eval": {"tasks": ["pope"]}})
    out = tmp_path / "task"
    first = write_lmms_task(recipe, out, name="w_pope")
    assert (out / MARKER).is_file()
    assert write_lmms_task(recipe, out, name="w_pope") == first  # a rerun into its own directory
    (out / MARKER).unlink()  # a directory written before the marker: its utils.py is mmfast's
    assert write_lmms_task(recipe, out, name="w_pope") == first


def test_clip_weights_are_never_unpickled(tiny_mm, tmp_path, monkeypatch):
    """CDPruner's and HICom's CLIP from a directory holding only a pickled ``pytorch_model.bin``: refused with
    what to do, and ``torch.load`` never runs."""
    import torch

    from mmfast.errors import ModelLoadError
    from mmfast.pruning._clip_text import load_clip_text
    from mmfast.pruning._hicom_guide import load_clip_guide, random_clip

    clip = random_clip(tiny_mm.model, tiny_mm.tokenizer)
    d = tmp_path / "clip-bin"
    clip.config.save_pretrained(d)
    torch.save(clip.state_dict(), d / "pytorch_model.bin")
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or pytest.fail("torch.load called"))
    with pytest.raises(ConfigError, match="no .safetensors weights.*never a pickled"):
        load_clip_text(str(d), "cpu", torch.float32, tiny_mm.tokenizer)
    with pytest.raises(ModelLoadError, match="no .safetensors weights"):
        load_clip_guide(str(d), tiny_mm.model, tiny_mm.tokenizer)
    with pytest.raises(ConfigError, match="that path does not exist"):
        load_clip_text(str(tmp_path / "nowhere"), "cpu", torch.float32, tiny_mm.tokenizer)
    assert loads == []


def test_a_closed_session_refuses_to_generate(tiny_mm, images, prompts):
    """After ``close`` (or its ``with`` block) the model is restored: generating then would give the unpruned
    model's answers under the recipe's name, so it is refused."""
    import mmfast

    recipe = load_recipe({"pruning": [{"method": "fastv", "params": {"k": 1, "drop_ratio": 0.5}}]})
    with mmfast.apply(tiny_mm, recipe) as s:
        s.generate(images[:1], prompts[:1], max_new_tokens=2)
    with pytest.raises(InputError, match="session .* is closed"):
        s.generate(images[:1], prompts[:1], max_new_tokens=2)
    with pytest.raises(InputError, match="is closed"):
        s.run(tiny_mm.prepare(images[:1], prompts[:1]), max_new_tokens=2)


def test_generate_inputs_that_are_not_images_or_prompts(tiny_mm, tmp_path):
    with pytest.raises(InputError, match="no prompts"):
        tiny_mm.generate([], [])
    with pytest.raises(InputError, match="PIL image or a file path, got int"):
        tiny_mm.generate([5], ["a"])
    with pytest.raises(InputError, match="is a directory; give an image file"):
        tiny_mm.generate([tmp_path], ["a"])


def test_pope_inputs_that_hold_no_questions(tmp_path, capsys):
    """A question file that is a directory or empty, or no split at all: exit 2 before any model loads, never a
    traceback or an evaluation of nothing that exits 0."""
    from mmfast.eval.pope import PopeFormatError, load_pope_questions

    with pytest.raises(PopeFormatError, match="is a directory"):
        load_pope_questions(tmp_path)
    with pytest.raises(PopeFormatError, match="holds no questions"):
        load_pope_questions(_write(tmp_path, "empty.jsonl", ""))
    recipe = _write(tmp_path, "r.yaml", "model: {name: mmfast/tiny-world}\neval: {tasks: [pope]}\n")
    for extra in (f"eval.pope.files.random={tmp_path}", f"eval.pope.files.random={tmp_path / 'empty.jsonl'}"):
        rc, err = _cli(
            capsys, "eval", str(recipe), "--limit", "1", "--output", str(tmp_path / "out"),
            "--set", "eval.pope.splits=[random]", "--set", extra,
        )  # fmt: skip
        assert rc == 2 and "Traceback" not in err and ("is a directory" in err or "holds no questions" in err), err
    with pytest.raises(ConfigError, match="eval.pope: splits is empty"):
        load_recipe({"eval": {"tasks": ["pope"], "pope": {"splits": []}}})


def test_a_method_without_params_says_so(capsys):
    rc, err = _cli(capsys, "validate", "world_eval", "--set", "decoding.params.alpha=2")
    assert rc == 2 and "decoding.params.alpha: unknown key; it takes no keys here" in err


def test_validate_refuses_a_model_path_that_does_not_exist(tmp_path, capsys):
    recipe = _write(tmp_path, "r.yaml", f"model: {{name: {tmp_path / 'no-such-model'}}}\n")
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2 and "does not exist" in err


def test_run_checks_its_inputs_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("mmfast.model.load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    rc, err = _cli(capsys, "run", "world_eval", "--image", str(tmp_path), "--prompt", "hi")
    assert rc == 2 and "is a directory; give an image file" in err
    rc, err = _cli(capsys, "run", "world_eval", "--image", str(tmp_path / "none.png"), "--prompt", "hi")
    assert rc == 2 and "not found" in err
    rc, err = _cli(capsys, "run", "world_eval", "--image", "x.png", "--num-frames", "4", "--prompt", "hi")
    assert rc == 2 and "--num-frames: how a video's frames are sampled; pass --video too" in err


def test_run_checks_its_video_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Bad input gets a clear error before any model loads (exit 2): a missing --video, a negative --fps,
    and --video on a family without video input (world_eval's LLaVA) are refused naming the fix."""
    monkeypatch.setattr("mmfast.model.load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    rc, err = _cli(capsys, "run", "world_eval", "--video", str(tmp_path / "none"), "--prompt", "hi")
    assert rc == 2 and "--video" in err and "not found" in err
    with pytest.raises(SystemExit) as exc:  # argparse's own error
        _cli(capsys, "run", "world_eval", "--video", str(tmp_path), "--fps", "-1", "--prompt", "hi")
    assert exc.value.code == 2 and "--fps: must be a positive finite number, got '-1'" in capsys.readouterr().err
    rc, err = _cli(capsys, "run", "world_eval", "--video", str(tmp_path), "--prompt", "hi")
    assert rc == 2 and "which has no video input" in err


def test_an_empty_recipe_file_and_a_string_of_overrides_are_refused(tmp_path, capsys):
    rc, err = _cli(capsys, "validate", str(_write(tmp_path, "empty.yaml", "# nothing yet\n")))
    assert rc == 2 and "the recipe is empty" in err
    with pytest.raises(InputError, match="wrap it in a list"):
        load_recipe("world_eval", overrides="eval.batch_size=3")


def test_bench_only_with_no_names_is_refused():
    from mmfast.bench.common import only_variants

    with pytest.raises(InputError, match="--only names no variant"):
        only_variants(load_recipe("configs/bench/pruning.yaml"), [])


def test_video_sampling_and_seeds_must_be_finite_whole_numbers(tiny_mm, images, prompts):
    from mmfast.video import VideoSampling

    for bad in ({"num_frames": float("inf")}, {"fps": float("inf"), "video_fps": 24}, {"video_fps": float("inf")}):
        with pytest.raises(InputError, match="positive finite number"):
            VideoSampling(**bad)
    for seed in (-1, "1", 1.5, True):
        with pytest.raises(InputError, match="seed must be a whole number >= 0"):
            tiny_mm.generate(images[:1], prompts[:1], max_new_tokens=1, seed=seed)


def test_model_generation_settings_mmfast_does_not_apply_are_named(tiny_mm, images, prompts, caplog, monkeypatch):
    """transformers-style keywords take unset values from the model's generation_config; a token-changing rule
    there that no mmfast decoder applies (Qwen2.5-VL ships repetition_penalty 1.05) is named, not dropped quietly."""
    from mmfast import generation

    generation._warn_once.cache_clear()  # warned once per setting and process
    monkeypatch.setattr(tiny_mm.model.generation_config, "repetition_penalty", 1.05)
    tiny_mm.generate(images[:1], prompts[:1], max_new_tokens=1, do_sample=True, seed=0)
    assert "repetition_penalty=1.05, which mmfast's decoders do not apply" in caplog.text


def test_aliases_cannot_nest_past_the_depth_limit(tmp_path, capsys):
    """Each anchor alone is shallow, but an alias of a deep anchor inside another one nests them: the
    expanded depth is refused (it crashed `validate` with a RecursionError, exit 1)."""
    items = ["&a0 " + "[" * 50 + "1" + "]" * 50]
    items += [f"&a{i} " + "[" * 50 + f"*a{i - 1}" + "]" * 50 for i in range(1, 30)]
    text = "bench:\n  kind: speculative\n  params:\n    workloads: [" + ", ".join(items) + "]\n"
    recipe = _write(tmp_path, "deep.yaml", text)
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2 and "nested more than 64 levels deep once aliases are expanded" in err
    with pytest.raises(yaml.YAMLError, match="levels deep"):
        parse_yaml("a: &a " + "[" * 40 + "1" + "]" * 40 + "\nb: " + "[" * 30 + "*a" + "]" * 30 + "\n")
    # within the limit, aliases still expand
    assert parse_yaml("a: &a [[1]]\nb: [*a]\n") == {"a": [[1]], "b": [[[1]]]}


@pytest.mark.parametrize("value", ["2024-01-01", "!!binary aGVsbG8=", "!!set {a, b}", "{2024-01-01: x}"])
def test_tagged_values_in_free_form_keys_are_config_errors(tmp_path, capsys, value):
    """A date, bytes or a set in a free-form (Any) value was accepted, then crashed hashing (exit 1)."""
    recipe = _write(tmp_path, "r.yaml", f"bench:\n  kind: speculative\n  params:\n    workloads: {value}\n")
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2 and "bench.params.workloads" in err and "Traceback" not in err
    rc, err = _cli(capsys, "validate", "world_eval", "--set", f"bench.compare=[{{name: a, x: {value}}}]")
    assert rc == 2 and "bench.compare[0].x" in err


@pytest.mark.parametrize(
    "text, path",
    [
        ("decoding: {method: greedy, params: []}\n", "decoding.params"),
        ("pruning: [{method: fastv, params: false}]\n", "pruning[0].params"),
        ("pruning: false\n", "pruning"),
        ("speculative: 0\n", "speculative"),
    ],
)
def test_wrong_section_types_are_not_read_as_empty(tmp_path, capsys, text, path):
    """`params: []`, `pruning: false`, `speculative: 0` were silently read as "nothing set"."""
    rc, err = _cli(capsys, "validate", str(_write(tmp_path, "r.yaml", text)))
    assert rc == 2 and f"{path}: expected" in err
    assert load_recipe({"pruning": None, "speculative": None, "decoding": {"params": None}}).pruning == ()


def test_a_bench_variant_name_must_be_a_string(tmp_path, capsys):
    recipe = _write(tmp_path, "r.yaml", "bench: {kind: pruning, compare: [{name: [a]}]}\n")
    rc, err = _cli(capsys, "validate", str(recipe))
    assert rc == 2 and "bench.compare[0].name: expected the variant's name as a string" in err


@pytest.mark.parametrize("source, overrides", [(None, None), (["world_eval"], None), ("world_eval", [3])])
def test_load_recipe_refuses_wrong_argument_types(source, overrides):
    with pytest.raises(InputError, match="load_recipe got|override 3"):
        load_recipe(source, overrides)


@pytest.mark.parametrize("ext", ["png", "jpg"])
def test_an_unreadable_exif_block_does_not_crash(tmp_path, ext):
    """PIL raises SyntaxError for a malformed EXIF block: open_image let it out (`mmfast run` exited 1
    with a traceback); the pixels are fine, so the image is used as stored, with a warning."""
    from PIL import Image

    from mmfast.inputs import open_image

    path = tmp_path / f"bad_exif.{ext}"
    Image.new("RGB", (32, 24), (200, 10, 10)).save(path, exif=b"garbage, not a TIFF header")
    im = open_image(path)
    assert im.size == (32, 24) and im.mode == "RGB"


@pytest.mark.parametrize(
    "text, message",
    [
        ("decoding: {max_new_tokens: " + "1" * 5000 + "}\n", "line 1: '1111"),  # over Python's int-parsing limit
        ("description: 2024-13-45\n", "'2024-13-45' cannot be read as timestamp (month must be in 1..12)"),
        ("decoding: {seed: 0x" + "f" * 5000 + "}\n", "decoding.seed: a 20000-bit integer is too large"),
        ("bench: {kind: speculative, params: {workloads: [0x" + "f" * 40 + "]}}\n", "workloads[0]: a 160-bit integer"),
    ],
)
def test_scalars_yaml_cannot_hold_are_input_errors(tmp_path, capsys, text, message):
    """PyYAML's constructors raise ValueError for a timestamp that is no date or an integer past Python's
    4300-digit limit, and a huge hex integer crashed printing the resolved recipe: exit 1, a traceback."""
    rc, err = _cli(capsys, "validate", str(_write(tmp_path, "r.yaml", text)))
    assert rc == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("meta", [[{"doc_id": "x"}], [1, 2], "ab", [{}, {}, {}]])
def test_meta_must_be_one_dict_per_prompt(tiny_mm, images, meta):
    """``meta[b]["doc_id"]`` seeds sample b's random stream: a short, long or non-dict meta was silently
    ignored (sample b then drew from another stream than asked)."""
    with pytest.raises(InputError, match="meta is one dict per prompt"):
        tiny_mm.prepare([images[0], images[1]], ["a", "b"], meta=meta)
    assert tiny_mm.prepare(images[0], "a", meta={"doc_id": "x"}).meta == [{"doc_id": "x"}]


def test_pope_split_key_typo_refused_by_validate(capsys):
    """`mmfast validate` passed a recipe with eval.pope.files.randm that `mmfast eval` then refused: the
    check ran only when the task was planned."""
    rc, err = _cli(capsys, "validate", "world_eval", "--set", "eval.pope.files={randm: /tmp/q.json}")
    assert rc == 2 and "eval.pope.files.randm: unknown POPE split 'randm'; did you mean 'random'?" in err
    with pytest.raises(ConfigError, match="split 'popular' is not in eval.pope.splits"):
        load_recipe({"eval": {"pope": {"splits": ["random"], "files": {"popular": "q.json"}}}})


@pytest.mark.parametrize("save_as", ["png", "tiff", "pil", "pil_I"])
def test_16_bit_grey_image_is_scaled_not_clipped_to_white(tmp_path, save_as):
    """A 16-bit greyscale PNG / TIFF (PIL mode I;16, or I from older Pillow) went through PIL's convert("RGB"),
    which clips at 255: the whole image came out white. It now equals its 8-bit version."""
    import numpy as np
    from PIL import Image

    from mmfast.inputs import open_image

    grey = np.arange(256, dtype=np.uint16).reshape(16, 16)
    wide = Image.fromarray(grey * 257)  # the same picture in 16 bits (v * 257: 255 -> 65535)
    if save_as in ("png", "tiff"):
        wide.save(tmp_path / f"g16.{save_as}")
        wide = tmp_path / f"g16.{save_as}"
    elif save_as == "pil_I":
        wide = wide.convert("I")
    clean = np.asarray(open_image(Image.fromarray(grey.astype(np.uint8))))
    assert np.array_equal(np.asarray(open_image(wide)), clean)


def test_float_and_out_of_range_integer_images_are_refused():
    """PIL mode F (a float TIFF, or fromarray of floats in 0..1) was clipped by convert("RGB"): all black."""
    import numpy as np
    from PIL import Image

    from mmfast.inputs import open_image

    with pytest.raises(InputError, match=r"32-bit float pixels \(PIL mode F\).*convert it to 8-bit RGB"):
        open_image(Image.fromarray(np.random.default_rng(0).random((8, 8)).astype(np.float32)))
    with pytest.raises(InputError, match="from -3 to 70000, outside 16-bit range"):
        open_image(Image.fromarray(np.array([[-3, 70000]], dtype=np.int32)))


def test_a_pil_image_whose_file_is_truncated_or_closed(tmp_path, tiny_mm):
    """A lazily opened PIL image decodes in open_image: a truncated file (OSError) or a closed one
    (ValueError) escaped as a traceback, where the same file given as a path was an InputError."""
    import numpy as np
    from PIL import Image

    path = tmp_path / "x.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(path)
    data = path.read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="an image cannot be read .*truncated"):
        tiny_mm.prepare([Image.open(tmp_path / "cut.jpg")], ["hi"])
    closed = Image.open(path)
    closed.close()
    with pytest.raises(InputError, match="an image cannot be read .*closed"):
        tiny_mm.prepare([closed], ["hi"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"device_map": "cuda:1"}, "device_map 'cuda:1': CUDA is not available here"),
        ({"device_map": {"": 0}}, "device_map 'cuda:0': CUDA is not available here"),
        ({"device_map": {"": "cuda:1"}}, "device_map 'cuda:1': CUDA is not available here"),
        ({"device_map": "meta"}, "device_map 'meta': the meta device holds no weights"),
        ({"device": "xla"}, "model.device 'xla': this torch .* has no xla device"),
        ({"device": "meta"}, "model.device 'meta': the meta device holds no weights"),
    ],
)
def test_devices_this_machine_does_not_have(tiny_dir, monkeypatch, kwargs, match):
    """device_map='cuda:1' on a machine without CUDA crashed with torch's AssertionError ("Torch not compiled
    with CUDA enabled") after the config and processor loaded; device='xla' with a RuntimeError; 'meta'
    loaded a model without weights. Each is refused before loading, naming the setting."""
    import torch

    import mmfast

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match=match):
        mmfast.load(tiny_dir, **kwargs)


def test_cli_device_map_without_cuda_is_exit_2(tmp_path, capsys, tiny_dir, monkeypatch):
    import torch
    from PIL import Image

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    Image.new("RGB", (32, 32)).save(tmp_path / "x.png")
    recipe = _write(tmp_path, "r.yaml", f"model: {{name: {tiny_dir}, device_map: 'cuda:1'}}\n")
    rc, err = _cli(capsys, "run", str(recipe), "--image", str(tmp_path / "x.png"), "--prompt", "hi")
    assert rc == 2 and "device_map 'cuda:1': CUDA is not available" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "index, match",
    [
        ("{not json", "is not a shard index"),
        ('{"metadata": {}}', "has no weight_map"),
        ("[]", "is not a shard index"),
    ],
)
def test_sharded_checkpoint_with_a_broken_index(tmp_path, tiny_dir, index, match):
    """A sharded checkpoint whose model.safetensors.index.json is not JSON crashed with JSONDecodeError,
    one without its weight_map with KeyError('weight_map'), from inside transformers."""
    import mmfast
    from mmfast.errors import ModelLoadError

    d = _copy_model(tiny_dir, tmp_path / "m")
    shards = mmfast.load(d, device="cpu").model
    (d / "model.safetensors").unlink()
    shards.save_pretrained(d, max_shard_size="200KB")
    assert not (d / "model.safetensors").exists() and len(list(d.glob("model-*.safetensors"))) > 1
    mmfast.load(d, device="cpu")  # the sharded checkpoint loads
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors\.index\.json {match}"):
        mmfast.load(d, device="cpu")


def test_chair_image_dir_with_files_not_named_by_an_image_id(tmp_path, caplog):
    """A stray file in the image folder (macOS's ._COCO_val2014_... beside each image on a network drive, a
    notes.jpg) crashed the CHAIR task with a bare ValueError (`mmfast eval` exited 1 with a traceback). They
    are not COCO images: left out of the pool (with a warning), the draw equals the clean folder's."""
    import logging
    import shutil

    from mmfast.eval.data import resolve_data
    from mmfast.eval.tasks import build_tasks
    from mmfast.world import write_world

    write_world(tmp_path / "w", seed=0, n_train=0, n_val=8, pope_images=4, progress=False)
    recipe = load_recipe({"eval": {"tasks": ["chair"], "data": {"dataset": "world", "root": str(tmp_path / "w")}}})

    def chair_ids() -> list[int]:
        (task,) = build_tasks(recipe.eval, resolve_data(recipe.eval, ["chair"]), cache_dir=None)
        return task.image_ids

    clean = chair_ids()
    val = tmp_path / "w" / "images" / "val"
    first = sorted(val.iterdir())[0]
    shutil.copy(first, val / f"._{first.name}")
    shutil.copy(first, val / "notes.jpg")
    with caplog.at_level(logging.WARNING, logger="mmfast.eval.tasks.chair"):
        assert chair_ids() == clean
    assert "2 file(s)" in caplog.text and "notes.jpg" in caplog.text


def test_the_data_cache_is_the_model_cache(tmp_path, monkeypatch):
    """eval's cache (the world, CHAIR's ground truth) read $MMFAST_CACHE without expanding '~' (a folder named
    '~' in the working directory) and ignored $XDG_CACHE_HOME, which the embedded model's cache honours."""
    from mmfast.eval.data import cache_root, world_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MMFAST_CACHE", "~/mm")
    assert cache_root() == tmp_path / "home" / "mm"
    assert world_cache_dir(0).parent == tmp_path / "home" / "mm"
    monkeypatch.delenv("MMFAST_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "mmfast"


def test_data_paths_in_a_recipe_expand_the_home_directory(tmp_path, monkeypatch):
    """eval.data.root expanded '~' but image_dir, instances, captions and eval.pope.files did not: a recipe
    with `image_dir: ~/coco/val2014` was refused as missing data though the folder was there."""
    from mmfast.eval.data import resolve_data

    home = tmp_path / "home"
    for d in ("coco/val2014", "coco/annotations", "coco/pope", "imgs"):
        (home / d).mkdir(parents=True)
    for f in ("coco/annotations/i.json", "coco/annotations/c.json", "coco/pope/r.json"):
        (home / f).write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    recipe = load_recipe(
        {
            "eval": {
                "tasks": ["pope", "chair"],
                "pope": {"splits": ["random"], "files": {"random": "~/coco/pope/r.json"}},
                "data": {
                    "dataset": "coco",
                    "root": "~/coco",
                    "image_dir": "~/imgs",
                    "instances": ["~/coco/annotations/i.json"],
                    "captions": ["~/coco/annotations/c.json"],
                },
            }
        }
    )
    data = resolve_data(recipe.eval, recipe.eval.tasks)
    assert data.image_dir == home / "imgs" and data.instances == (home / "coco/annotations/i.json",)
    assert data.captions == (home / "coco/annotations/c.json",)
    assert data.files_of("pope") == {"random": home / "coco/pope/r.json"}


def test_chair_image_ids_file_with_a_byte_order_mark(tmp_path):
    """An ids file saved by a Windows editor (UTF-8 BOM, CRLF) was refused: line 1 '\\ufeff5' is not an image id."""
    from mmfast.eval.tasks.chair import read_image_ids

    (tmp_path / "ids.txt").write_bytes(b"\xef\xbb\xbf5\r\n7\r\n")
    assert read_image_ids(tmp_path / "ids.txt") == [5, 7]


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA", "P_transparency"])
def test_transparent_images_match_the_checkpoints_processor(tiny_mm, mode):
    """open_image's convert("RGB") dropped the alpha: a transparent PNG's clear pixels showed the colour they
    store (often black), where the checkpoint's own processor (transformers' convert_to_rgb, what
    `processor(images=im)` gives) composites onto white. The pixel values now equal the processor's."""
    import numpy as np
    import torch
    from PIL import Image

    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)
    alpha = np.full((40, 48), 255, dtype=np.uint8)
    alpha[:20] = 0  # the top half clear
    alpha[20:, :10] = 128
    rgb[:20] = 0  # stored black under the clear pixels, as editors save them
    if mode == "RGBA":
        im = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    elif mode == "LA":
        im = Image.fromarray(np.dstack([rgb[..., 0], alpha]), "LA")
    elif mode == "PA":
        im = Image.fromarray(np.dstack([rgb, alpha]), "RGBA").convert("PA")
    else:
        im = Image.fromarray(rgb).quantize(16)
        im.info["transparency"] = int(np.asarray(im)[0, 0])  # the palette entry of the (black) top half
    expected = tiny_mm.image_processor(images=[im], return_tensors="pt")["pixel_values"]
    assert torch.equal(tiny_mm.prepare([im], ["hi"]).pixel_values, expected)


def test_pre_templated_texts_one_per_prompt(tiny_mm, images):
    """prepare(texts=...) took a list of another length than the prompts: the batch held 1 token row for 2
    images and prompts, and the session crashed with IndexError; a bare string was split into characters."""
    text = tiny_mm.chat_text("hi", 1)
    for texts in ([text], [text] * 3, text):
        with pytest.raises(InputError, match=r"texts= is a list of templated strings, one per prompt \(2 here\)"):
            tiny_mm.prepare(images[:2], ["a", "b"], texts=texts)
    assert tiny_mm.prepare(images[0], "hi", texts=text).token_ids == tiny_mm.prepare(images[0], "hi").token_ids


def test_a_coco_root_given_to_the_world_dataset_is_not_written_into(tmp_path, capsys, monkeypatch):
    """eval.data.root pointing at a COCO root without `dataset: coco` (the default is the world) generated the
    synthetic world into the user's folder (500 images, annotations, POPE files among theirs) and evaluated on it,
    with no message. Refused; a new, empty or partly written world folder is still generated into."""
    import mmfast.world
    from mmfast.eval.data import resolve_data

    written: list[Path] = []

    def stub(root, **kw):  # writes an empty world directory
        written.append(root)
        Path(root).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(mmfast.world, "write_world", stub)
    coco = tmp_path / "coco"
    for d in ("val2014", "annotations", "pope"):
        (coco / d).mkdir(parents=True)
    recipe = load_recipe({"eval": {"tasks": ["pope"], "data": {"root": str(coco)}}})
    with pytest.raises(InputError, match=r"is not an mmfast world .*holds val2014.*set eval\.data\.dataset: coco"):
        resolve_data(recipe.eval, recipe.eval.tasks)
    assert written == []
    rc, err = _cli(capsys, "eval", str(_write(tmp_path, "r.yaml", f"eval: {{tasks: [pope], data: {{root: {coco}}}}}")))
    assert rc == 2 and "is not an mmfast world" in err and written == []
    for fresh in (tmp_path / "new", tmp_path / "partial"):
        (tmp_path / "partial" / "images" / "val").mkdir(parents=True, exist_ok=True)
        recipe = load_recipe({"eval": {"tasks": ["pope"], "data": {"root": str(fresh)}}})
        with pytest.raises(InputError, match="missing evaluation data"):  # the stub wrote nothing
            resolve_data(recipe.eval, recipe.eval.tasks)
    # a new directory is written aside and renamed into place; a partly written one in place
    assert [p.name for p in written] == [f".new.{os.getpid()}.partial", "partial"] and (tmp_path / "new").is_dir()


def test_quantized_checkpoint_without_its_backend(tmp_path, tiny_dir):
    """A 4-bit hub checkpoint (config.json's quantization_config) without bitsandbytes / optimum installed
    crashed with transformers' ImportError from inside from_pretrained."""
    import importlib.util

    import mmfast
    from mmfast.errors import ModelLoadError

    if importlib.util.find_spec("optimum") is not None:
        pytest.skip("optimum is installed")
    d = _copy_model(tiny_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"is a quantized checkpoint \(gptq\) whose backend is not installed"):
        mmfast.load(d, device="cpu")


def test_array_and_tensor_images_are_refused_with_the_fix(tiny_mm):
    """A numpy array or a torch tensor as an image was refused with its repr cut at 80 characters (lines of
    zeros) and no fix; the error now gives its shape and dtype and how to wrap it."""
    import numpy as np
    import torch

    for image, shown in (
        (np.zeros((40, 48, 3), np.uint8), r"ndarray of shape \(40, 48, 3\) and dtype uint8"),
        (torch.zeros(3, 40, 48), r"Tensor of shape \(3, 40, 48\) and dtype torch.float32"),
    ):
        with pytest.raises(InputError, match=shown + r".*PIL\.Image\.fromarray"):
            tiny_mm.generate([image], ["hi"])


def test_a_checkpoint_without_a_chat_template(tmp_path, tiny_dir):
    """A checkpoint saved without its chat template (older conversions) loaded, then every prompt crashed with
    transformers' ValueError ("this processor does not have a chat template"). Refused at load, before the weights."""
    from transformers import AutoProcessor

    import mmfast
    from mmfast.errors import ModelLoadError

    d = _copy_model(tiny_dir, tmp_path / "m")
    (d / "chat_template.jinja").unlink()
    with pytest.raises(
        ModelLoadError, match=r"cannot apply a chat template .*save the processor with its chat_template"
    ):
        mmfast.load(d, device="cpu")
    processor = AutoProcessor.from_pretrained(d)
    with pytest.raises(InputError, match=r"processor= cannot apply a chat template"):
        mmfast.load(tiny_dir, processor=processor, device="cpu")


def test_swapped_images_and_prompts_and_a_prompt_given_as_an_image(tiny_mm, images):
    """generate("Describe.", image) (arguments swapped) crashed with TypeError "object of type 'Image' has no
    len()"; a long prompt taken as an image path crashed with OSError "File name too long"."""
    with pytest.raises(InputError, match=r"got Image \(images and prompts swapped\? the images come first\)"):
        tiny_mm.generate("Describe the image.", images[0])
    with pytest.raises(InputError, match=r"is not a usable path \(File name too long\)"):
        tiny_mm.generate(["Describe the image in detail. " * 20], ["hi"])


def test_a_bench_variant_evaluating_other_samples_is_refused(tmp_path):
    """A bench.compare item's ``eval`` override that plans other samples (another limit, CHAIR seed) ran on them
    and entered the table and ratios beside the baseline's (6 POPE questions against 12) under the note "the same
    samples"; refused before any weights load. Overrides that keep the inputs (batch_size) still run."""
    from mmfast.bench import run_bench
    from mmfast.bench.common import check_same_samples, variants
    from mmfast.errors import InputError

    def recipe(override):
        return load_recipe(
            {
                "model": {"name": "mmfast/tiny-world"},
                "eval": {"tasks": ["pope", "chair"], "limit": 4, "chair": {"n_images": 3}},
                "bench": {
                    "kind": "pruning",
                    "compare": [{"name": "vz", "pruning": [{"method": "visionzip"}], "eval": override}],
                },
            }
        )

    out = tmp_path / "bench"
    for override in ({"limit": 2}, {"chair": {"seed": 5}}):
        with pytest.raises(InputError, match="bench variant 'vz': its eval override plans other inputs"):
            run_bench(recipe(override), output=str(out))
        assert not out.exists()
    check_same_samples(variants(recipe({"batch_size": 2})), None)
    check_same_samples(variants(recipe({"limit": 2})), 3)  # --limit plans every variant alike
