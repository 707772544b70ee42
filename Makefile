# toolenv: two commands on a fresh machine: `make run` and `make test`.
VENV        ?= .venv
PY          := $(VENV)/bin/python
PYTEST_ARGS ?=
ARGS        ?=
HOST        ?= 127.0.0.1
PORT        ?= 8080

.PHONY: run test setup-system venv venv-test model bench lint fmt clean help compose-up compose-down

help:
	@echo "make run    - create .venv, install, start the embedded service on $(HOST):$(PORT)"
	@echo "make test   - install every system component the tests need, then run the whole suite"
	@echo "             (a subset: make test PYTEST_ARGS=\"tests/gateway -k trace\")"
	@echo "make bench  - run the benchmarks (figures as ratios against a baseline of the same run)"
	@echo "make lint   - ruff and import-linter (the layering contracts in pyproject.toml)"
	@echo "make compose-up / compose-down - the whole environment under docker compose"

run: venv
	@scripts/ensure_bwrap.sh
	@echo "[run] the toolenv command is in $(VENV)/bin: 'source $(VENV)/bin/activate' puts it on your PATH (or: export PATH=\"$(abspath $(VENV))/bin:\$$PATH\")"
	exec $(VENV)/bin/toolenv serve --host $(HOST) --port $(PORT)

test: setup-system venv-test model
	scripts/run_pytest.sh $(PY) $(PYTEST_ARGS)

setup-system:
	@scripts/setup_system.sh

venv:
	@scripts/setup_venv.sh run

venv-test:
	@scripts/setup_venv.sh test

model: venv-test
	@$(PY) scripts/make_test_model.py

bench: setup-system venv-test
	$(PY) -m benchmarks.run $(ARGS)

lint: venv-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

fmt: venv-test
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

compose-up: setup-system venv
	scripts/build_toolenv_image.sh
	TOOLENV_BASE_IMAGE=toolenv/debian-base:bookworm docker compose up

compose-down:
	docker compose --profile "*" down -v

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
