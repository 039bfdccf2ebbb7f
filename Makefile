# make demo: venv + CPU demo (ZeRO-3, 2 processes). make test: venv + lint + the whole suite.
VENV := .venv
# The demo's config: its DeepSpeed op is built from it ($(VENV)/demo-ops), and the demo launches with it.
DEMO_CONFIG := accelerate_configs/ds_zero3.yaml
PY := $(VENV)/bin/python
# Two CPU ranks share the cores: one thread each.
export OMP_NUM_THREADS ?= 1
# Every launch starts several Python processes: let them read shardtune's compiled bytecode (__pycache__, ignored
# by git) instead of compiling it again each time.
unexport PYTHONDONTWRITEBYTECODE
export TOKENIZERS_PARALLELISM := false
# DeepSpeed's compiled CPU ops live in the virtualenv, beside the stamp that says they are built (not ~/.cache).
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions

.PHONY: demo demo-dpo test unit lint gpu-check gpu-wheels device-rehearsal clean

$(VENV)/installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# DeepSpeed JIT-compiles its CPU ops (CPU Adam for offload, async I/O for NVMe offload) on first use: once per
# virtualenv, minutes on 2 cores. Build them here, with libaio for the NVMe path, so tests time the tests (the
# suite stops at once if they are missing from TORCH_EXTENSIONS_DIR).
$(VENV)/deepspeed-ops: $(VENV)/installed scripts/build_deepspeed_ops.py
	@echo "Building DeepSpeed's CPU ops into $(TORCH_EXTENSIONS_DIR): once per virtualenv, several minutes on 2 cores."
	dpkg -s libaio-dev >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libaio-dev; } \
		|| echo "libaio-dev could not be installed: the NVMe offload test will fail"
	$(PY) scripts/build_deepspeed_ops.py
	touch $@

# The demo's op alone, chosen from its config by the same script: the shared-memory collectives (42 s on 2 idle
# cores), not CPU Adam or async I/O. An op built here is not compiled again by the rule above.
$(VENV)/demo-ops: $(VENV)/installed scripts/build_deepspeed_ops.py $(DEMO_CONFIG) \
		$(wildcard accelerate_configs/deepspeed/*.json)
	@echo "Building the DeepSpeed op $(DEMO_CONFIG) uses into $(TORCH_EXTENSIONS_DIR): once per virtualenv."
	$(PY) scripts/build_deepspeed_ops.py --config $(DEMO_CONFIG)
	touch $@

# tests/launch/test_slurm.py starts its own munged, slurmctld and two slurmd. Without the SLURM binaries it skips when
# pytest runs alone, and fails under `make test` (SHARDTUNE_REQUIRE below).
$(VENV)/slurm: $(VENV)/installed
	dpkg -s slurmctld slurmd slurm-client munge >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge; } \
		|| echo "slurm-wlm could not be installed: the SLURM test will fail"
	touch $@

# The op first, visibly (DeepSpeed would otherwise compile its shared-memory op silently inside the launch).
demo: $(VENV)/demo-ops
	$(VENV)/bin/accelerate launch --config_file $(DEMO_CONFIG) --num_processes 2 recipes/tiny.py --use_cpu true --overwrite_output_dir true

# After `make demo`: align its model with DPO on the bundled preference pairs (docs/dpo.md).
demo-dpo: $(VENV)/demo-ops
	$(VENV)/bin/accelerate launch --config_file $(DEMO_CONFIG) --num_processes 2 recipes/tiny.py --use_cpu true --overwrite_output_dir true --method dpo --model_name_or_path outputs/tiny

# On one GPU within 480 s, nothing downloaded: fp8, Liger and the levers first, then DDP, FSDP and ZeRO-3 on a 1.2B
# model, each phase's peak measured against the plan, each row appended to logs/gpu-check/results.jsonl as it ends
# (`$(PY) scripts/gpu_check.py --out logs/gpu-check/results.jsonl --rest` runs what the budget cut). Refuses in one
# line without a GPU. On the device tool: its two calls in docs/planner.md (`scripts/device_budget.py` prints them).
gpu-check: $(VENV)/installed
	$(PY) scripts/gpu_check.py --out logs/gpu-check/results.jsonl --table logs/gpu-check/table.txt

# The wheels the device tool's GPU machine lacks (scripts/device_packages.txt: what it has), for its Python 3.12, into
# the ignored .whl/; scripts/device_wheels.json records them. Ignored, so .whl travels only where the call's `carry`
# names it (docs/planner.md gives the call).
gpu-wheels: $(VENV)/installed
	$(PY) scripts/gpu_wheels.py --dest .whl

# The device's machine rehearsed here, on CPU, before device time is spent: a virtualenv of its versions (torch 2.11,
# transformers 5.17, accelerate 1.15; built once into $(VENV)/device-rehearsal, several GB) with the carried wheels
# installed as the device command installs them, then each gpu-check case's launch with the tiny model to its end.
device-rehearsal: $(VENV)/installed
	$(PY) scripts/device_rehearsal.py

lint: $(VENV)/installed
	$(VENV)/bin/ruff check .

# Two pytest-xdist workers, each taking a whole test file at a time (a file's runs are made once, on one worker):
# the ranks of a launch wait on each other, and the second worker fills the cores meanwhile. Files in collection
# order, the launched ones (the longest) first, the many short unit files last to even out the end.
WORKERS := -n 2 --dist loadfile --no-loadscope-reorder

# The unit tests alone (tests/unit: nothing launched), a few minutes: for a change to the planner's arithmetic.
unit: $(VENV)/installed
	$(PY) -m pytest -q $(WORKERS) tests/unit

# Here (and in CI, which runs this target) a skipped NVMe-offload or SLURM test counts as a failure: both are
# installed above. A processor feature cannot be: fp16 under DeepSpeed on CPU (Intel AVX512-FP16 or AMX-FP16, no AMD
# processor) skips where it is missing, its reason printed (-rs); SHARDTUNE_REQUIRE=nvme,slurm,cpu_fp16 on a runner
# known to have it makes that skip a failure too.
test: lint $(VENV)/deepspeed-ops $(VENV)/slurm
	SHARDTUNE_REQUIRE=nvme,slurm $(PY) -m pytest -q -rs --durations=15 $(WORKERS)

clean:
	rm -rf $(VENV) assets outputs
