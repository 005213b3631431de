"""Every bad input is a clear error (exit 2) naming the thing and the fix, never a traceback (issue 18).

Exit codes are checked through ``mmfast.cli.main`` in-process (it returns the code the process exits
with); the model-loading cases use the tiny random model of ``conftest.tiny_dir``.
"""

from __future__ import annotations

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
