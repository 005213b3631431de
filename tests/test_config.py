"""Strict recipes: unknown keys, wrong types, ranges, incompatible combinations, registries."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

import mmfast
from mmfast.cli import main
from mmfast.config import Recipe, load_recipe
from mmfast.errors import ConfigError, UnknownMethodError
from mmfast.registry import DECODERS


def _write(tmp_path, text: str):
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults():
    r = load_recipe({})
    assert r.decoding.method == "greedy" and r.decoding.max_new_tokens == 64
    assert r.model.name == "mmfast/tiny-world"
    assert len(r.hash()) == 16 and r.hash() == load_recipe({}).hash()


def test_hash_names_what_is_computed_not_where_it_goes():
    base = load_recipe({})
    assert load_recipe({"output": {"overwrite": True, "dir": "elsewhere"}}).hash() == base.hash()
    assert load_recipe({"decoding": {"max_new_tokens": 32}}).hash() != base.hash()
    assert load_recipe({"model": {"name": "other/model"}}).hash() != base.hash()


def test_unknown_key_has_dotted_path_and_suggestion(tmp_path):
    path = _write(
        tmp_path,
        """
        decoding:
          method: beam
          params:
            num_beam: 3
        """,
    )
    with pytest.raises(ConfigError) as exc:
        load_recipe(path)
    msg = str(exc.value)
    assert "decoding.params.num_beam" in msg and "did you mean 'num_beams'" in msg and str(path) in msg


def test_unknown_top_level_and_nested_keys():
    with pytest.raises(ConfigError, match=r"^modle: unknown key; did you mean 'model'"):
        load_recipe({"modle": {}})
    with pytest.raises(ConfigError, match=r"eval\.pope\.parsr: unknown key; did you mean 'parser'"):
        load_recipe({"eval": {"pope": {"parsr": "pope"}}})


def test_unknown_decoding_key_names_its_scalars():
    """A typo of decoding.max_new_tokens / decoding.seed was answered "allowed keys: method, params",
    the two keys the section accepts besides them left out and no suggestion made."""
    with pytest.raises(ConfigError, match=r"decoding\.max_new_toknes: unknown key; did you mean 'max_new_tokens'"):
        load_recipe({"decoding": {"max_new_toknes": 8}})
    with pytest.raises(
        ConfigError, match=r"decoding\.mx: unknown key; allowed keys: method, params, max_new_tokens, seed"
    ):
        load_recipe({"decoding": {"mx": 8}})


def test_types_and_ranges():
    with pytest.raises(ConfigError, match=r"decoding\.params\.num_beams: expected an integer"):
        load_recipe({"decoding": {"method": "beam", "params": {"num_beams": "five"}}})
    with pytest.raises(ConfigError, match=r"decoding\.params\.top_p: 1\.5 is out of range; allowed \[0\.0, 1\.0\]"):
        load_recipe({"decoding": {"method": "sample", "params": {"top_p": 1.5}}})
    with pytest.raises(ConfigError, match=r"model\.dtype: 'fp32' is not allowed"):
        load_recipe({"model": {"dtype": "fp32"}})
    with pytest.raises(ConfigError, match=r"decoding\.max_new_tokens: 0 is out of range"):
        load_recipe({"decoding": {"max_new_tokens": 0}})


def test_unknown_method_suggests():
    with pytest.raises(ConfigError, match=r"decoding\.method: unknown decoding method 'greddy'; did you mean 'greedy'"):
        load_recipe({"decoding": {"method": "greddy"}})
    with pytest.raises(UnknownMethodError):
        DECODERS.get("nope")


def test_overrides():
    r = load_recipe({}, overrides=["decoding.max_new_tokens=7", "model.dtype=bfloat16"])
    assert r.decoding.max_new_tokens == 7 and r.model.dtype == "bfloat16"


def test_dotted_list_index_as_lmms_model_args_write_it(capsys):
    # `--set pruning.0.budget.tokens=160` (the lmms plugin's spelling) is pruning[0].budget.tokens
    r = load_recipe(
        "examples/fastv_192", ["pruning.0.budget.tokens=160", "pruning.-1.params.k=1", "model.max_memory.0=1GiB"]
    )
    assert (r.pruning[0].budget.tokens, r.pruning[0].params.k) == (160, 1)
    assert r.model.max_memory == {"0": "1GiB"}  # a number below a mapping is still a key
    assert main(["-q", "validate", "examples/fastv_192", "--set", "pruning.0.budget.tokens=160"]) == 0
    assert "tokens: 160" in capsys.readouterr().out


@pytest.mark.parametrize(
    "item, path",
    [
        ("pruning.0.params.keep=abc", "pruning[0].params.keep"),
        ("pruning[0].params.kep=3", "pruning[0].params.kep"),
        ("pruning[0]={method: fastv, params: {keep: -1}}", "pruning[0].params.keep"),
        ("model.dtype=float64", "model.dtype"),
    ],
)
def test_override_errors_name_the_override_not_the_recipe_file(item, path, capsys):
    with pytest.raises(ConfigError) as info:
        load_recipe("examples/fastv_192", ["decoding.max_new_tokens=3", item])
    assert info.value.source == f"override {item!r}" and info.value.path == path
    assert main(["-q", "validate", "examples/fastv_192", "--set", item]) == 2
    err = capsys.readouterr().err
    assert f"error: override {item!r}: {path}:" in err and "fastv_192.yaml" not in err


def test_recipe_file_errors_still_name_the_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("pruning: [{method: fastv, params: {keep: x}}]\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(str(recipe), ["model.dtype=float32", "pruning[0].params.k=2"])
    assert info.value.source == str(recipe) and info.value.path == "pruning[0].params.keep"


def test_round_trip_dump():
    r = load_recipe({"decoding": {"method": "sample", "params": {"top_p": 0.9}, "seed": 4}})
    again = load_recipe(r.to_dict())
    assert again == r and again.hash() == r.hash()


def test_frozen():
    r = Recipe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"  # type: ignore[misc]


def test_list_methods():
    methods = mmfast.list_methods()
    assert {"pruning", "speculative", "decoding"} <= set(methods)
    assert any(name == "beam" for name, _ in methods["decoding"])


def test_cli_validate_and_exit_codes(tmp_path, capsys):
    good = _write(tmp_path, "decoding: {method: beam, params: {num_beams: 2}}\n")
    assert main(["validate", str(good)]) == 0
    out = capsys.readouterr().out
    assert "num_beams: 2" in out and "recipe hash" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("decoding: {method: beam, params: {num_beam: 2}}\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "decoding.params.num_beam" in err and "num_beams" in err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["list"]) == 0
    assert "decoding:" in capsys.readouterr().out


def test_cli_run(tiny_dir, images, tmp_path, capsys):
    img = tmp_path / "x.png"
    images[0].save(img)
    recipe = _write(tmp_path, f"model: {{name: {tiny_dir}, device: cpu}}\n")
    assert (
        main(
            ["-q", "run", str(recipe), "--image", str(img), "--prompt", "Describe.", "--max-new-tokens", "3", "--json"]
        )
        == 0
    )
    assert '"n_vision_tokens": 16' in capsys.readouterr().out
    assert main(["-q", "run", str(recipe), "--image", str(tmp_path / "nope.png"), "--prompt", "x"]) == 2


def test_bench_only_variants_filters_and_suggests():
    from pathlib import Path

    from mmfast.bench.common import only_variants, variants

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "configs" / "bench" / "pruning.yaml")
    cut = only_variants(recipe, ["visionzip-64", "fastv-192"])
    assert [v.name for v in variants(cut)] == ["baseline", "fastv-192", "visionzip-64"]
    with pytest.raises(ConfigError, match="did you mean 'fastv-192'"):
        only_variants(recipe, ["fastv-129"])


def test_bench_preflight_fails_before_any_work(tiny_dir, tmp_path):
    """A variant that cannot install on this model (here: missing trained weights) stops the bench
    before the baseline or any other variant runs."""
    from mmfast.bench import run_bench
    from mmfast.errors import InputError

    recipe = load_recipe(
        {
            "name": "b",
            "model": {"name": str(tiny_dir), "device": "cpu"},
            "bench": {
                "kind": "pruning",
                "compare": [
                    {"name": "ok", "pruning": [{"method": "random", "params": {"keep": 4}}]},
                    {
                        "name": "bad",
                        "pruning": [{"method": "dynamic_llava", "params": {"predictors": str(tmp_path / "none")}}],
                    },
                ],
            },
        }
    )
    with pytest.raises(InputError, match="bench variant 'bad'"):
        run_bench(recipe, output=str(tmp_path / "out"))
    assert not (tmp_path / "out" / "variants").exists()


def test_shaped_speed_skips_a_variant_the_slice_cannot_hold():
    """One variant that cannot install on the random shaped model is reported with its reason; the
    other rows are still measured."""
    from mmfast.bench.common import variants
    from mmfast.bench.pruning import _shaped_speed

    recipe = load_recipe(
        {
            "name": "s",
            "bench": {
                "kind": "pruning",
                "shape": "tiny",
                "repeats": 1,
                "warmup": 0,
                "params": {"shaped_samples": 1},
                "compare": [
                    {"name": "random-4", "pruning": [{"method": "random", "params": {"keep": 4}}]},
                    {
                        "name": "pdrop-deep",
                        "pruning": [{"method": "pyramiddrop", "params": {"layers": [8, 16, 24]}}],
                    },  # 2 layers
                ],
            },
        }
    )
    out = _shaped_speed(recipe, variants(recipe), torch.device("cpu"))
    assert [r["variant"] for r in out["rows"]] == ["baseline", "random-4"]
    assert [s["variant"] for s in out["skipped"]] == ["pdrop-deep"] and "params.layers" in out["skipped"][0]["reason"]


@pytest.mark.parametrize(
    "override, path",
    [
        ("bench.params.e2e_new_token=3", "bench.params.e2e_new_token"),  # a typo
        ("bench.params.e2e_new_tokens=many", "bench.params.e2e_new_tokens"),  # a wrong type
        ("bench.shape=llava-1.5-7b-slic", "bench.shape"),
        ("bench.params.shaped_variants=[visionzip-6]", "bench.params.shaped_variants[0]"),
    ],
)
def test_bench_section_is_strict(override, path):
    """Typos in bench.params / bench.shape fail at validation, not after every variant ran."""
    from mmfast.bench.common import variants

    with pytest.raises(ConfigError) as exc:
        variants(load_recipe("bench/pruning", overrides=[override]))
    assert exc.value.path == path


def test_shaped_speed_warms_up_and_takes_the_median_of_its_repeats(monkeypatch):
    """The slice's timings go through the embedded model's warmup/repeat helper: ``warmup`` untimed
    runs, then the median over ``repeats`` of every variant's LLM prefill; both are recorded."""
    import statistics

    import mmfast.bench.pruning as pruning
    from mmfast.bench.common import variants, warm_repeats

    seen = []

    def recording(fn, warmup, repeats):
        calls = []
        out = warm_repeats(lambda: calls.append(1) or fn(), warmup, repeats)
        seen.append((warmup, repeats, len(calls), [sum(r.timings.prefill_s for r in rs) for _, rs in out]))
        return out

    monkeypatch.setattr(pruning, "warm_repeats", recording)
    recipe = load_recipe(
        {
            "name": "s",
            "bench": {
                "kind": "pruning",
                "shape": "tiny",
                "repeats": 5,
                "warmup": 1,
                "params": {"shaped_samples": 1},
                "compare": [{"name": "random-4", "pruning": [{"method": "random", "params": {"keep": 4}}]}],
            },
        }
    )
    out = pruning._shaped_speed(recipe, variants(recipe), torch.device("cpu"))
    assert (out["warmup"], out["repeats"]) == (1, 5)
    assert [s[:3] for s in seen] == [(1, 5, 6), (1, 5, 6)]  # baseline, random-4: 1 + 5 runs each
    for row, s in zip(out["rows"], seen):
        assert row["prefill_s"] == statistics.median(s[3])


@pytest.mark.parametrize(
    "kind, key", [("pruning", "e2e_new_tokens"), ("pruning", "shaped_samples"), ("decoding", "cost_new_tokens")]
)
@pytest.mark.parametrize("value", [0, -2])
def test_bench_counts_below_one_are_refused(kind, key, value):
    """A count of new tokens or samples below one loaded, then failed only in the timing pass, after the baseline's
    whole evaluation (max_new_tokens 0 refused there; no shaped samples: a division by a zero prefill time)."""
    with pytest.raises(ConfigError) as exc:
        load_recipe({"bench": {"kind": kind, "params": {key: value}}})
    assert exc.value.path == f"bench.params.{key}" and ">= 1" in str(exc.value)
    assert load_recipe({"bench": {"kind": kind, "params": {key: 1}}}).bench.params == {key: 1}


def test_embedded_scoring_overhead_excludes_the_warmup(monkeypatch):
    """The embedded model's scoring overhead comes from the timed prefill calls, as its prefill time does: the
    warm-up calls (where one-off work such as a first capture or calibration lands) are not averaged in."""
    import contextlib
    from types import SimpleNamespace

    import mmfast.bench.pruning as pruning

    prefills = []

    class Session:
        def run(self, batch, max_new_tokens):
            if max_new_tokens == 1:
                prefills.append(batch)
            warm = len(prefills) <= 2 * 2  # two warm-up calls of two batches
            return [SimpleNamespace(stats={"scoring_s": 100.0 if warm else 1.0})]

    monkeypatch.setattr(pruning, "apply", lambda mm, recipe, calibration=None: contextlib.nullcontext(Session()))
    mm = SimpleNamespace(prepare=lambda images, prompts: prompts[0])
    samples = [SimpleNamespace(image=None, prompt=p) for p in ("a", "b")]
    out = pruning.time_variant(mm, SimpleNamespace(recipe=None), samples, 2, 3, 4)
    assert len(prefills) == (2 + 3) * 2
    assert out["scoring_s"] == 2.0  # a timed call's scoring over both samples


def test_a_dotted_index_below_a_missing_list_names_the_override(capsys):
    """`pruning.0.budget.tokens=160` (lmms-eval's spelling) on a recipe without pruning made a mapping
    {"0": ...} and failed as `pruning[0].0: unknown key`, blamed on the recipe file; a number below a
    missing mapping (`model.max_memory.0`) is still a key."""
    assert main(["-q", "validate", "world_eval", "--set", "pruning.0.budget.tokens=160"]) == 2
    err = capsys.readouterr().err
    assert "override 'pruning.0.budget.tokens': pruning is not in the recipe, so [0] does not exist" in err
    assert "world_eval.yaml" not in err
    assert load_recipe("world_eval", ["model.max_memory.0=1GiB"]).model.max_memory == {"0": "1GiB"}


@pytest.mark.parametrize(
    "override, key",
    [
        ("bench.compare=[{name: a, bogus: 1}]", "bench.compare"),
        ("bench.methods=[fastv]", "bench.methods"),
        ("bench.params={e2e_new_tokens: 4}", "bench.params"),
    ],
)
def test_bench_settings_without_a_bench_kind_are_refused(capsys, override, key):
    """bench.compare / methods / params with bench.kind none were never read, so never validated (an unknown
    key in a compare item passed `mmfast validate`): a forgotten kind is refused, naming the key."""
    assert main(["-q", "validate", "world_eval", "--set", override]) == 2
    assert f"{key}: is set but bench.kind is none" in capsys.readouterr().err
    assert load_recipe("world_eval", ["bench.kind=pruning", "bench.compare=[{name: a}]"]).bench.compare


def test_a_sections_own_check_names_the_override_that_set_its_key(capsys):
    """`--set eval.pope.splits=[]` fails in the pope section's own check, at `eval.pope`: the error named only
    the recipe file, as if the file were wrong; it names the override too."""
    assert main(["-q", "validate", "world_eval", "--set", "eval.pope.splits=[]"]) == 2
    err = capsys.readouterr().err
    assert "world_eval.yaml with override 'eval.pope.splits=[]': eval.pope: splits is empty" in err
    with pytest.raises(ConfigError) as exc:
        load_recipe({"eval": {"pope": {"splits": ["random"]}}}, ["eval.pope.splits=[]"])
    assert exc.value.source == "override 'eval.pope.splits=[]'"


def test_unquoted_off_in_yaml_is_the_literal_off(tmp_path):
    # YAML 1.1 reads an unquoted `off` as False: `model.compile: off`, as the docs and the static-cache error
    # message write it, must mean "off", in a recipe file and in a --set override
    path = _write(
        tmp_path,
        """
        model:
          compile: off
        """,
    )
    assert load_recipe(path).model.compile == "off"
    assert load_recipe({}, overrides=["model.compile=off"]).model.compile == "off"
    assert load_recipe({"model": {"compile": False}}).hash() == load_recipe({}).hash()  # off, auto: one hash
    with pytest.raises(ConfigError, match=r"model\.compile: True is not allowed"):
        load_recipe({}, overrides=["model.compile=true"])
