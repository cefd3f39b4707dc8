# Two commands: `make demo` (the main job) and `make test` (the whole suite).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo info serve test bench clean

# Re-installs only when pyproject.toml changes; creating .venv twice is harmless.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# llama.cpp's own GGUF converter, the oracle of `k3 export --format gguf` (tests/interop/test_gguf.py): the vendored
# llama.cpp of llama-cpp-python's source distribution, of which only the converter's Python is unpacked (nothing built).
LLAMA_CPP := llama_cpp_python-0.3.36
PEERS     := $(VENV)/peers
CONVERTER := $(PEERS)/$(LLAMA_CPP)/vendor/llama.cpp/convert_hf_to_gguf.py
$(CONVERTER): $(STAMP)
	$(BIN)/python -m pip download --quiet --no-deps --no-binary llama-cpp-python -d $(PEERS) \
		llama-cpp-python==0.3.36
	tar xzf $(PEERS)/$(LLAMA_CPP).tar.gz -C $(PEERS) $(addprefix $(LLAMA_CPP)/vendor/llama.cpp/,convert_hf_to_gguf.py \
		conversion gguf-py models/templates)
	rm $(PEERS)/$(LLAMA_CPP).tar.gz
	touch $@

# The main job: five minutes of training the mini preset (2.3M parameters, every K3 mechanism on) on the
# Python standard library's source -- the shape and schedule that learned most in five minutes on 2 cores
# (benchmarks/demo.py) -- then a sample from the checkpoint, and last its bits per byte on the whole held-out text
# beside zlib -9 and xz -9e on the same bytes. Run again, it reuses the finished run.
demo: $(STAMP)
	$(BIN)/k3 train --preset mini --out runs/mini --resume --steps 350 --tokens-per-step 4096 \
		--curriculum 0:256 --eval-every 50 --ckpt-every 50 --max-minutes 5
	$(BIN)/k3 generate --ckpt runs/mini --prompt "def " --max-tokens 120 --temperature 0.8 --top-p 0.95 --seed 0
	$(BIN)/k3 eval --ckpt runs/mini --all

info: $(STAMP)
	$(BIN)/k3 info --preset paper

# An OpenAI-compatible server for the demo checkpoint on 127.0.0.1:8000.
serve: $(STAMP)
	$(BIN)/k3 serve --ckpt runs/mini

# The chat page's browser test drives Debian's headless Chromium, and torch.compile's CPU backend (the compiled
# decode tests) needs a C++ compiler: both installed here when missing and running as root (as CI does).
# Two pytest-xdist workers, one file each at a time and one torch thread each (two threads per worker would spin
# against the other worker's): 19-22 minutes on 2 cores instead of 32-36 one file after another.
test: $(STAMP) $(CONVERTER)
	@{ command -v chromium && command -v chromedriver && command -v g++; } >/dev/null 2>&1 || \
		[ "$$(id -u)" != 0 ] || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
			--no-install-recommends chromium chromium-driver g++)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(BIN)/python benchmarks/kda.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
