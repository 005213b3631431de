# mmfast quick start:  make demo  (set up + run the main job on the embedded model)
#                      make test  (set up + run the test suite)
# GPU users: make setup TORCH_SPEC=torch   (or install your CUDA torch into .venv first)

PYTHON     ?= python3.11
VENV       ?= .venv
PY         := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# transformers: the top of mmfast/compat.py's range (a new user gets the current release); the floor
# of the range gets a smoke subset in its own venv (make test-compat-floor)
TRANSFORMERS_SPEC       ?= transformers==5.24.0
FLOOR_TRANSFORMERS_SPEC ?= transformers==5.17.0
DEMO_LIMIT ?= 100

export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# CHAIR's tagger and lemma data ship in the package; NLTK_DATA is only read if you set it yourself.

.PHONY: setup demo test lint clean lmms-setup test-lmms floor-setup test-compat-floor

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]" "$(TRANSFORMERS_SPEC)"
	touch $@

demo: setup
	$(VENV)/bin/mmfast eval configs/world_eval.yaml --limit $(DEMO_LIMIT) --output runs/demo

test: setup
	$(PY) -m pytest

# ruff: the linter and formatter configured in pyproject.toml (CI runs this)
lint: setup
	$(PY) -m ruff check mmfast tests scripts
	$(PY) -m ruff format --check mmfast tests scripts

# lmms-eval end to end (tests/test_lmms_eval_e2e.py): a second venv, since lmms-eval needs torchvision,
# which imports only beside torch 2.14.1 here (a CUDA build, 5.6 GB, installed from this machine's disk)
LMMS_VENV  ?= .venv-lmms
LMMS_PY    := $(LMMS_VENV)/bin/python

lmms-setup: $(LMMS_VENV)/.installed

$(LMMS_VENV)/.installed: pyproject.toml
	test -x $(LMMS_PY) || $(PYTHON) -m venv $(LMMS_VENV)
	$(LMMS_PY) -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
	$(LMMS_PY) -m pip install -q "lmms-eval==0.7.3" "filelock<4"
	$(LMMS_PY) -m pip install -q -e ".[test,lmms]"
	touch $@

test-lmms: lmms-setup
	$(LMMS_PY) -m pytest tests/test_lmms_eval_e2e.py tests/test_lmms_tasks.py tests/test_lmms_plugin.py

# the floor of the transformers range (mmfast/compat.py TRANSFORMERS_MIN), in its own venv: the tests
# that exercise the hooks transformers' internals feed (cache, masks, attention, each family's forward)
FLOOR_VENV  ?= .venv-floor
FLOOR_PY    := $(FLOOR_VENV)/bin/python
FLOOR_TESTS ?= tests/test_compat.py tests/test_install_range.py tests/test_generate.py tests/test_session.py \
               tests/test_probe.py tests/test_qwen_families.py tests/test_graph_reuse.py

floor-setup: $(FLOOR_VENV)/.installed

$(FLOOR_VENV)/.installed: pyproject.toml Makefile
	test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q "$(TORCH_SPEC)"
	$(FLOOR_PY) -m pip install -q -e ".[test]" "$(FLOOR_TRANSFORMERS_SPEC)"
	touch $@

test-compat-floor: floor-setup
	$(FLOOR_PY) -m pytest $(FLOOR_TESTS)

clean:
	rm -rf $(VENV) $(LMMS_VENV) $(FLOOR_VENV) runs .pytest_cache
