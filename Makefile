# Two commands set everything up on a fresh clone:
#   make demo   - creates .venv, installs raystream, runs the key-count demo on local Ray
#   make test   - creates .venv, installs raystream with test extras, runs the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench check-java clean

$(STAMP): setup.cfg pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "raystream needs Python >= 3.11, found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test,bench]"
	$(BIN)/python -m compileall -q raystream  # each Ray worker process then loads bytecode
	@touch $(STAMP)

check-java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "Java 17+ is needed by PySpark and was not found on PATH."; \
	  echo "Install it with:  sudo apt-get install -y openjdk-17-jre-headless   (Debian/Ubuntu)"; \
	  echo "             or:  brew install openjdk@17                           (macOS)"; \
	  exit 1; }

demo: $(STAMP)
	cd examples && ../$(BIN)/python -m raystream.demo

# unit tests (no Ray) on both cores; then one session for everything that starts Ray or Spark
# (they share one embedded Ray; two Ray suites at once on 2 cores slow each other down)
test: $(STAMP) check-java
	$(BIN)/pytest -n 2 tests/unit
	$(BIN)/pytest tests/e2e tests/integration

clean:
	rm -rf $(VENV) build *.egg-info
