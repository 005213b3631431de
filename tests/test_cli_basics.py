"""CLI basics: help without heavy imports, --version, a closed pipe ends quietly."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mmfast
from mmfast.errors import InputError


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_help_and_import_do_not_load_torch():
    # `mmfast --help` builds the parser; neither it nor `import mmfast` may pull in torch / transformers
    out = _run(
        "import sys, mmfast, mmfast.cli; mmfast.cli._parser(); print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    assert out == "[]"
    # the public API still resolves on first use
    assert _run("import mmfast; print(mmfast.load_recipe.__module__, mmfast.PRUNERS.kind)") == "mmfast.config pruning"


def test_version():
    out = subprocess.run([sys.executable, "-m", "mmfast", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"mmfast {mmfast.__version__}"


def test_closed_pipe_exits_quietly():
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmfast", "list", "-v"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away, as `| head -1` does
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=120)
    assert "Traceback" not in err and "internal error" not in err, err
    assert code in (0, 141)


def test_shipped_recipes_resolve_by_name_from_anywhere(tmp_path):
    from mmfast.config import load_recipe, shipped_recipes

    names = shipped_recipes()
    assert {"world_eval", "bench/pruning", "coco_pope"} <= set(names)
    for name in names:  # every shipped recipe validates
        load_recipe(name)
    out = subprocess.run(
        [sys.executable, "-m", "mmfast", "validate", "world_eval"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0 and "recipe hash" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "mmfast", "list", "recipes"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0 and "world_eval" in out.stdout and "pruning:" not in out.stdout


def test_readme_configs_paths_work_outside_a_checkout(tmp_path, monkeypatch):
    # the README's commands name configs/...; an installed wheel has no configs/ beside the user
    from mmfast.config import RECIPES_DIR, load_recipe, resolve_recipe_path

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmfast",
            "validate",
            "configs/examples/fastv_192.yaml",
            "--set",
            "pruning[0].budget.tokens=160",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "recipe hash" in out.stdout, out.stderr
    assert "using the shipped recipe examples/fastv_192" in out.stderr
    assert resolve_recipe_path("./configs/bench/pruning") == RECIPES_DIR / "bench" / "pruning.yaml"
    monkeypatch.chdir(tmp_path)
    assert load_recipe("configs/world_eval.yaml").name == "world_eval"
    with pytest.raises(InputError, match="recipe 'configs/no_such.yaml' not found"):
        load_recipe("configs/no_such.yaml")


def test_wheel_carries_recipes_and_the_embedded_model(tmp_path):
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(root),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    wheel = next(tmp_path.glob("mmfast-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "mmfast/recipes/world_eval.yaml" in names and "mmfast/recipes/bench/pruning.yaml" in names
    assert "mmfast/assets/tiny-world/config.json" in names
    # the embedded model's weights, packed (mmfast/weights_pack.py): what a new user's first load unpacks
    assert {"mmfast/assets/tiny-world/weights.pack.xz", "mmfast/assets/tiny-world/packed.json"} <= names


def test_quiet_hides_transformers_loading_bar(tiny_dir, images, tmp_path, capfd, monkeypatch):
    import transformers.utils.logging
    from huggingface_hub.utils import enable_progress_bars

    from mmfast.cli import main

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # restored afterwards, as are the bars below
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name: {tiny_dir}, device: cpu}}\n")
    images[0].save(tmp_path / "a.png")
    cmd = ["run", str(recipe), "--image", str(tmp_path / "a.png"), "--prompt", "Describe.", "--max-new-tokens", "1"]
    try:
        transformers.utils.logging.enable_progress_bar()
        assert main(cmd) == 0
        assert "Loading weights" in capfd.readouterr().err  # the bar this test looks for
        assert main(["-q", *cmd]) == 0
        assert "Loading weights" not in capfd.readouterr().err
    finally:
        transformers.utils.logging.enable_progress_bar()
        enable_progress_bars()


@pytest.mark.parametrize("only", ["", " , "])
def test_bench_only_naming_no_variant_is_refused(tmp_path, monkeypatch, capsys, only):
    """`--only ""` (an empty shell variable) ran every variant of the bench, as if --only were absent."""
    import mmfast.bench

    def run_bench(*args, **kwargs):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(mmfast.bench, "run_bench", run_bench)
    from mmfast.cli import main

    rc = main(["-q", "bench", "bench/pruning", "--only", only, "--output", str(tmp_path / "b")])
    assert rc == 2 and "--only names no variant" in capsys.readouterr().err


def test_list_verbose_names_the_families_a_method_reaches_with_its_params(capsys):
    """`mmfast list -v` printed each method's families under its defaults only, so FastVID lacked LLaVA-OneVision,
    which it runs on with siglip_head (README's table lists it): such families are named with those params."""
    from mmfast.cli import main

    assert main(["list", "methods", "-v"]) == 0
    lines = capsys.readouterr().out.splitlines()
    fams = {lines[i - 1].split()[0]: line for i, line in enumerate(lines) if line.strip().startswith("families:")}
    assert fams["fastvid"].endswith(
        "qwen2_5_vl (videos only), qwen2_vl (videos only), qwen3_vl (videos only), "
        "llava_onevision (videos only) with siglip_head"
    )
    assert "with" not in fams["fastv"] and "with" not in fams["hicom"]


@pytest.mark.parametrize("rank", [0, 1])
def test_only_the_main_process_of_a_torchrun_eval_prints_the_metrics(rank, tmp_path, monkeypatch, capsys, caplog):
    """Under torchrun / accelerate every process returns the run's summary; each printed the metrics table (and
    logged the failures): only the main process does, and every process exits with the run's status."""
    import mmfast.eval.distributed as distributed
    import mmfast.eval.runner as runner
    from mmfast.cli import main

    counts = {"planned": 4, "finished": 3, "failed": 1, "not_run": 0}
    summary = {"metrics": {"pope": {"mean_f1": 0.5}}, "counts": counts}
    monkeypatch.setattr(runner, "run_eval", lambda *a, **k: summary)
    monkeypatch.setattr(distributed, "shard_info", lambda: (rank, 2))
    rc = main(["-q", "eval", "world_eval", "--output", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert rc == runner.EXIT_SAMPLES_FAILED
    assert ("all figures" in out) is (rank == 0) and ("1 of 4 samples failed" in caplog.text) is (rank == 0)
