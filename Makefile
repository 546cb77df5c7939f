# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv and install the package (pinned torch first, in one pip call) when needed;
# later runs only compare timestamps and start at once.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true

.PHONY: install demo test test-fast bench compare clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
	$(PY) -m pip install --quiet -e ".[dev,faiss,protocol]"
	touch $(STAMP)

install: $(STAMP)

## Train on the embedded Glyphs dataset through the CLI and print the retrieval table.
demo: $(STAMP)
	$(VENV)/bin/lightning-dml fit --config configs/glyphs.yaml

# pytest-xdist workers: one per core, at most 4 (each worker holds torch in memory and runs on one thread)
JOBS   ?= $(shell $(PYTHON) -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))" 2>/dev/null || echo 2)
# -rs: the skipped tests and their reasons at the end of the log (CI shows whether peft, Milvus Lite, chromium ran)
PYTEST := $(PY) -m pytest -q -rs -n $(JOBS) --dist worksteal

## peft (LoRA adapters, the `peft` extra) and what it pulls in, in a folder of their own put on PYTHONPATH for the
## adapter tests only: in the venv, transformers would be imported by torchmetrics in every test process (+0.8 s each,
## about 2 minutes of the suite) and rich would change Lightning's default progress bar. The versions tested.
PEFT_SITE     := $(VENV)/peft-site
PEFT_PACKAGES := peft==0.21.2 transformers==5.24.0 accelerate==1.15.0 tokenizers==0.23.3 regex typer rich \
                 shellingham markdown-it-py mdurl
$(PEFT_SITE)/.installed: $(STAMP)
	rm -rf $(PEFT_SITE)
	$(PY) -m pip install --quiet --no-deps --target $(PEFT_SITE) $(PEFT_PACKAGES)
	touch $@

## The whole test suite, slow tests included (what CI runs); the adapter tests again with peft (above).
test: $(STAMP) $(PEFT_SITE)/.installed
	$(PYTEST)
	PYTHONPATH=$(abspath $(PEFT_SITE)) LIGHTNING_DML_PEFT_TESTS=1 $(PY) -m pytest -q -n 0 tests/test_adapters.py

## The inner loop: everything but the tests marked slow.
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

## Speed benchmarks against pytorch-metric-learning and faiss (see docs/benchmarks.md).
bench: $(STAMP)
	$(PY) bench/losses.py
	$(PY) bench/evaluation.py

## The worked comparison of losses on Glyphs (docs/protocol.md): sweep + cv of each loss with one budget, one table
## in logs/compare/comparison.md; 9 minutes on the quiet 2-core CPU (docs/protocol.md). Rerunning resumes.
compare: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) bench/protocol_comparison.py --out logs/compare

## Mutation check (docs/testing.md): small mutants of losses/, metrics/, miners/, data/samplers.py, retrieval/ and
## index/rerank.py against the
## matching fast tests, run on copies under /tmp (the working tree is never modified), at nice 19; report in
## logs/mutants/report.md. Options through MUTANTS_ARGS, e.g. MUTANTS_ARGS="--sample 600" (a seeded sample) or
## MUTANTS_ARGS="--survivors-of logs/mutants/report.json" (rerun the last survivors); exit status 1 when one of
## issue 19's targeted mutants survives.
.PHONY: mutants
mutants: $(STAMP)
	nice -n 19 $(PY) tools/mutants.py $(MUTANTS_ARGS)

## The GPU check (docs/gpu.md). gpu-wheels: download here the few wheels a GPU machine lacks, for its Python 3.12,
## into gpu-wheels/ (ignored; about 1 MiB). gpu-check: on the GPU machine, with its own python3 (never .venv: the
## device copies the working tree, not the venv), tests, benchmarks and a fit on CUDA within 450 s, summary in
## $(OUT)/gpu-check.md and .json. gpu-check-dry: the same steps on the CPU at tiny sizes (tests/test_gpu_check.py).
.PHONY: gpu-wheels gpu-check gpu-check-dry
OUT ?= logs/gpu-check
gpu-wheels: $(STAMP)
	$(PY) tools/gpu_check.py --download-wheels gpu-wheels
gpu-check:
	$(PYTHON) tools/gpu_check.py --out "$(OUT)" --wheels gpu-wheels $(GPU_CHECK_ARGS)
gpu-check-dry: $(STAMP)
	$(PY) tools/gpu_check.py --dry-run --out logs/gpu-check-dry $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) logs lightning_logs wandb *.egg-info .pytest_cache
