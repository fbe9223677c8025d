# Every target bootstraps .venv from pyproject.toml on first use, so a fresh clone needs nothing else.
# CPython 3.12 or 3.13 when this machine has one (on PATH, or installed through pyenv): there a
# worker copies fewer of the template's pages (workers/immortal.py). Any 3.11+ works otherwise.
PYTHON ?= $(shell for v in 3.12 3.13; do \
	  if python$$v -c '' 2>/dev/null; then echo python$$v; exit; fi; \
	  p=$$(pyenv prefix $$v 2>/dev/null) && [ -x "$$p/bin/python$$v" ] && { echo "$$p/bin/python$$v"; exit; }; \
	done; echo python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench soak lint clean

# pip shows what the build backend warns. setuptools' note on every editable install (a folder
# named like the package may shadow it) is information, and this checkout's folders are the package.
PIP_INSTALL := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install --quiet \
	--disable-pip-version-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --clear $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(PIP_INSTALL) -e '.[dev]'
	touch $(STAMP)

# The demo needs the package and its four dependencies only, not the dev extra (the
# integrations' SDKs, Ray, mypy: over a gigabyte); once `make test` has installed that, the
# demo runs from it.
DEMO_STAMP := $(VENV)/.demo-installed

$(DEMO_STAMP): pyproject.toml
	@if [ $(STAMP) -nt pyproject.toml ]; then touch $@; exit 0; fi; \
	echo "make demo: first use: installing sandbx-pool and its dependencies (pyzmq, msgspec," \
	    "loguru, ripgrep) into $(VENV); about 20 s, a minute or two if pip downloads them"; \
	$(PYTHON) -m venv --clear $(VENV) && $(PIP_INSTALL) -e . && touch $@

demo: $(DEMO_STAMP)
	$(BIN)/sandbx-pool demo

# The whole suite, every time (CI runs this); it ends by saying how long it took.
test: $(STAMP)
	@start=$$(date +%s); $(BIN)/pytest -q; status=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s"; exit $$status

# Everything but the tests marked slow (the soaks and crash loops), for a quick check while editing.
test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python -m bench

# The fault soak: 10,000 calls while every fault a batch meets is injected (bench/faults.py).
soak: $(STAMP)
	$(BIN)/python -m bench.faults

# mypy checks the package as it is installed, sandbx_pool/ with workers/ inside it: it follows no
# import hook, so it cannot see the editable install's mapping of workers/ to sandbx_pool.workers.
# The tree it reads is a copy (never a link: see pyproject.toml); its messages name the real files.
TYPECHECK := build/typecheck

lint: $(STAMP)
	$(BIN)/ruff check sandbx_pool workers tests bench
	$(BIN)/ruff format --check sandbx_pool workers tests bench
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	cp -r sandbx_pool $(TYPECHECK)/sandbx_pool && cp -r workers $(TYPECHECK)/sandbx_pool/workers
	cd $(TYPECHECK) && ../../$(BIN)/mypy --config-file ../../pyproject.toml \
	    --cache-dir ../../.mypy_cache > mypy.out; status=$$?; \
	    sed -e 's#^sandbx_pool/workers/#workers/#' mypy.out; exit $$status

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
