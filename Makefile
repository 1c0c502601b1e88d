# vgrpo: `make run` and `make test` each install first, so each is one command on a fresh machine.
VENV       ?= .venv
PY         := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Two pytest-xdist workers: the files on the session's Ray run in order on one, the rest on the other
# (tests/suite_groups.py). PYTEST_ARGS="-n 0" runs the suite in one process.
XDIST      ?= -n 2 --dist loadgroup
STAMP      := $(VENV)/.installed

.PHONY: install run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	# HPSv3's instruction text is read from its wheel; its own deps pin an old transformers.
	$(PY) -m pip install -q --no-deps "hpsv3==1.0.0"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/vgrpo train -c configs/quickstart.yaml

test: install
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
