"""The declared install range: pyproject's Python and transformers ranges are compat's, the Makefile
installs the top of the transformers range by default and the floor for the compat smoke run, and every
source file parses and compiles for each Python of the range (the oldest grammar; other interpreters
when present)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mmfast import compat

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "mmfast").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))


def test_requires_python_is_compat_range():
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^requires-python = "(.+)"$', text, re.M)
    assert m is not None
    assert m.group(1) == f">={compat.PYTHON_MIN},<{compat.PYTHON_MAX_EXCLUSIVE}"
    for v in compat.PYTHON_TESTED:
        major_minor = tuple(int(x) for x in v.split(".")[:2])
        lo = tuple(int(x) for x in compat.PYTHON_MIN.split("."))
        hi = tuple(int(x) for x in compat.PYTHON_MAX_EXCLUSIVE.split("."))
        assert lo <= major_minor < hi


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_transformers_range_is_compat_range():
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^    "transformers(.+)",$', text, re.M)
    assert m is not None
    assert m.group(1) == f">={compat.TRANSFORMERS_MIN},<{compat.TRANSFORMERS_MAX_EXCLUSIVE}"
    tested = sorted(compat.TESTED_VERSIONS, key=_minor)
    assert _minor(tested[0]) == _minor(compat.TRANSFORMERS_MIN)  # the floor was tested
    assert _minor(tested[-1]) < _minor(compat.TRANSFORMERS_MAX_EXCLUSIVE)
    assert _minor(tested[-1])[1] + 1 == _minor(compat.TRANSFORMERS_MAX_EXCLUSIVE)[1]  # so was the top minor
    docs = (ROOT / "docs" / "install.md").read_text()
    assert f"`transformers>={compat.TRANSFORMERS_MIN},<{compat.TRANSFORMERS_MAX_EXCLUSIVE}`" in docs


def test_makefile_installs_the_top_and_tests_the_floor():
    """``make setup`` pins the newest tested transformers (a new user gets the current release, and CI
    tests what it installs); ``make test-compat-floor`` pins the tested floor."""
    text = (ROOT / "Makefile").read_text()
    top = re.search(r"^TRANSFORMERS_SPEC\s+\?= transformers==(\S+)$", text, re.M)
    floor = re.search(r"^FLOOR_TRANSFORMERS_SPEC \?= transformers==(\S+)$", text, re.M)
    assert top is not None and floor is not None
    tested = sorted(compat.TESTED_VERSIONS, key=_minor)
    assert top.group(1) == tested[-1] and floor.group(1) == tested[0]
    assert '"$(TRANSFORMERS_SPEC)"' in text and '"$(FLOOR_TRANSFORMERS_SPEC)"' in text
    assert "make test-compat-floor" in (ROOT / ".ci" / "run").read_text()


def test_sources_parse_with_the_oldest_grammar():
    lo = tuple(int(x) for x in compat.PYTHON_MIN.split("."))
    bad = []
    for path in SOURCES:
        try:
            ast.parse(path.read_text(), filename=str(path), feature_version=lo)
        except SyntaxError as exc:
            bad.append(f"{path.relative_to(ROOT)}:{exc.lineno}: {exc.msg}")
    assert not bad, bad


@pytest.mark.parametrize("version", ["3.12"])
def test_sources_compile_under_other_pythons(version, tmp_path):
    candidates = [str(p) for p in sorted(Path("/root/.pyenv/versions").glob(f"{version}.*/bin/python"))]
    candidates += [c for c in [shutil.which(f"python{version}")] if c]
    exe = next((c for c in candidates if subprocess.run([c, "-c", "pass"], capture_output=True).returncode == 0), None)
    if exe is None:
        pytest.skip(f"no working Python {version} interpreter on this machine")
    code = (
        "import sys, pathlib\n"
        "bad = []\n"
        "for p in sys.argv[1:]:\n"
        "    try: compile(pathlib.Path(p).read_text(), p, 'exec')\n"
        "    except SyntaxError as e: bad.append(f'{p}:{e.lineno}: {e.msg}')\n"
        "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([exe, "-c", code, *map(str, SOURCES)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
