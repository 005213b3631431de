# mmfast quick start:  make demo  (set up + run the main job on the embedded model)
#                      make test  (set up + run the test suite)
# GPU users: make setup TORCH_SPEC=torch   (or install your CUDA torch into .venv first)

PYTHON     ?= python3.11
VENV       ?= .venv
PY         := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEMO_LIMIT ?= 100

export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# CHAIR's tagger and lemma data ship in the package; NLTK_DATA is only read if you set it yourself.

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: setup
	$(VENV)/bin/mmfast eval configs/world_eval.yaml --limit $(DEMO_LIMIT) --output runs/demo

test: setup
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
