# Two commands set everything up on a fresh machine (run as root there; apt-get needs it):
#   make demo   create .venv, install, run the main job
#   make test   create .venv, install with test extras, run pytest
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU torch wheel lies on the dev/CI machines; pinning it first stops pip from pulling a CUDA build.
# pyproject accepts torch>=2.6, so GPU users keep their own CUDA build (make TORCH= to skip the pin).
TORCH ?= torch==2.13.0
# torchcodec, the faster of the two video decoders, loads the system's shared FFmpeg libraries (4-8);
# its build must match torch's (0.13 for torch 2.13). make TORCHCODEC= to go without (PyAV decodes then).
TORCHCODEC ?= torchcodec==0.13.0
# Debian packages: headless OpenGL for MuJoCo (EGL through Mesa's software renderer; OSMesa as the
# fallback, MUJOCO_GL=osmesa); ffmpeg for the shared libraries torchcodec loads (the package pulls in
# libavcodec/libavformat/libavfilter/libavdevice/libswscale of whatever Debian release this is).
# PyAV's wheel bundles its own FFmpeg.
APT_PACKAGES := libegl1 libegl-mesa0 libgl1 libgles2 libosmesa6 $(if $(strip $(TORCHCODEC)),ffmpeg)
# The official LIBERO source (bddl files, init states; no assets) to check the bundled suites against.
LIBERO_OFFICIAL := .cache/libero-0.1.1

.PHONY: demo test test-all bench system venv install clean

system:
	@if [ -z "$(strip $(APT_PACKAGES))" ]; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
		missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
		if [ -n "$$missing" ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
		fi; \
	else echo "note: not root or no apt-get; skipping system packages ($(APT_PACKAGES))"; fi

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# openpi's own client, for the serve tests and `kilovla bench serve`: 0.1.2 pins numpy<2, which it does not need,
# so it goes in --no-deps beside our numpy, with what it imports (dm-tree, pillow, typing_extensions).
OPENPI_CLIENT := openpi-client==0.1.2

# The pins the last install put in, written when it finished: `venv` installs again only when they, pyproject.toml
# or this Makefile changed (a satisfied install still takes pip ~6 s, every make demo and make test).
INSTALLED := $(VENV)/.installed
PINS := $(TORCH) $(TORCHCODEC) $(OPENPI_CLIENT)

venv: $(BIN)/python
	@if [ -f $(INSTALLED) ] && [ "$$(cat $(INSTALLED))" = "$(PINS)" ] && [ $(INSTALLED) -nt pyproject.toml ] \
		&& [ $(INSTALLED) -nt Makefile ]; then echo "$(VENV): installed, pyproject.toml unchanged"; \
	else $(MAKE) --no-print-directory install; fi

install: $(BIN)/python
	rm -f $(INSTALLED)
	@if [ -n "$(TORCH)" ]; then $(BIN)/pip install -q "$(TORCH)"; fi
	$(BIN)/pip install -q -e ".[dev,rl,sim,libero,serve,lora,tensorboard]"
	$(BIN)/pip install -q --no-deps "$(OPENPI_CLIENT)"
	$(BIN)/pip install -q dm-tree pillow typing_extensions
	@# --no-deps: torchcodec must not pull another torch; its PyPI wheel up to 0.13 is the CPU build.
	@if [ -n "$(TORCHCODEC)" ]; then $(BIN)/pip install -q --no-deps "$(TORCHCODEC)"; fi
	@echo "$(PINS)" > $(INSTALLED)

$(LIBERO_OFFICIAL):
	mkdir -p .cache
	$(BIN)/pip download -q --no-deps --no-binary :all: -d .cache libero==0.1.1
	tar xzf .cache/libero-0.1.1.tar.gz -C .cache

demo: system venv
	$(BIN)/kilovla demo

# Everything but the gpu marker, slow tests included (LIBERO, the Ray RL runs, the RL canary), in two runs:
# the fast tests and the slow ones whose results do not depend on timing (marker shares_cpu: the RL canary,
# the sync and kill -9 Ray runs) on two pytest workers, then the other slow ones alone, since they time out
# hung workers and ranks and compare speeds. --no-loadscope-reorder keeps tests/conftest.py's order (the long
# shares_cpu modules first; xdist's default, most tests first, left the canary's one test running alone at
# the end). ~18 minutes on 2 cores (13 + 5); plain `pytest` (not slow, not gpu) takes ~6.
# KILOVLA_REQUIRE_TORCHCODEC: both video decoders are tested; a torchcodec that fails to load fails.
TEST_ENV = KILOVLA_REQUIRE_TORCHCODEC=$(if $(strip $(TORCHCODEC)),1,0) KILOVLA_LIBERO_OFFICIAL=$(LIBERO_OFFICIAL)
# pytest exits 5 when it collects no test: that is a broken suite here, not a pass.
PYTEST_RC = rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; [ $$rc -eq 0 ] || exit $$rc
test: system venv $(LIBERO_OFFICIAL)
	$(TEST_ENV) $(BIN)/python -m pytest -q -n 2 --dist loadscope -m "not gpu and (shares_cpu or not (slow or ray))" \
		--no-loadscope-reorder --durations=15; $(PYTEST_RC)
	$(TEST_ENV) $(BIN)/python -m pytest -q -m "not gpu and (slow or ray) and not shares_cpu" --durations=15; $(PYTEST_RC)

test-all: venv $(LIBERO_OFFICIAL)
	KILOVLA_LIBERO_OFFICIAL=$(LIBERO_OFFICIAL) $(BIN)/python -m pytest -q -m ""; rc=$$?; [ $$rc -eq 5 ] && exit 1; exit $$rc

bench: venv
	$(BIN)/kilovla bench all

clean:
	rm -rf $(VENV) .cache bench-results demo-output eval-output build src/*.egg-info
