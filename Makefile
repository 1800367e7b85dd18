# Two entry points: `make demo` (set-up + the main job) and `make test` (set-up + the tests).
# `make setup` builds .venv with the CPU stack exactly as a fresh machine needs it.
# `make image-cpu` / `make image-gpu` build the images; `make test-images` builds and runs them.
# `make gpu-run OUT=DIR` is the prepared GPU run (the lane, the head's tile sweep, the CUDA benches, one
# report in DIR) on the machine's own python3 (CUDA torch, transformers, pytest) plus the wheels of .whl/
# (scripts/gpu_wheels.sh), no .venv; `make test-gpu` is the same into results/gpu/.
PY     ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.rlpad-setup

.PHONY: setup demo test test-gpu gpu-run bench clean image-cpu image-gpu test-images

$(STAMP): pyproject.toml scripts/setup_cpu.sh
	PY=$(PY) bash scripts/setup_cpu.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlpad check
	$(VENV)/bin/python -m rlpad.train --config recipes/grpo_tiny.yaml

# The exactness tests again on another vector unit: ATen, MKL and oneDNN kernels held to AVX2, so a
# bound that holds only for one CPU's rounding fails here, whatever CPU CI lands on. The 15 that launch Ray
# worker stacks (~5 of the suite's ~80 minutes) run once: their bounds are run_compare's, checked on both units.
# A CPU without AVX-512 or AVX-VNNI (neither avx512f nor avx_vnni flag; AMX needs AVX-512 too) ran the first
# pass on AVX2 kernels already, so the second would repeat it kernel for kernel: skipped there, a line says so.
AVX2_ONLY := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
# Two pytest processes (pytest-xdist), whole files to each (a module's Ray stack and fixtures stay in one
# process): one process alone leaves the 2 cores ~30% idle while Ray and vLLM start. TEST_WORKERS=1: serial.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(VPY) -m pytest -q $(XDIST) --durations=40 tests
	@if grep -qwE 'avx512f|avx_vnni' /proc/cpuinfo; then \
		echo "$(AVX2_ONLY) $(VPY) -m pytest -q $(XDIST) -m 'exactness and not ray' tests"; \
		$(AVX2_ONLY) $(VPY) -m pytest -q $(XDIST) -m "exactness and not ray" tests; \
	else \
		echo "make test: this CPU has no AVX-512 (nor AVX-VNNI), so the pass above ran on AVX2 kernels: the AVX2-only exactness pass would repeat it"; \
	fi

test-gpu:
	@PY="$(PY)" bash scripts/test_gpu.sh

OUT ?= results/gpu
gpu-run:
	@PY="$(PY)" bash scripts/test_gpu.sh "$(OUT)"

# The images (docker/): `docker build` where a Docker daemon answers, else buildah; the base is
# made with debootstrap where no image registry is reachable (scripts/build_image.sh says which).
image-cpu:
	bash scripts/build_image.sh cpu

image-gpu:
	bash scripts/build_image.sh gpu

# Opt-in, never part of `make test`: builds both images (gigabytes of downloads) and runs the job,
# `rlpad check` and a two-container Ray cluster in them; prints sizes and times.
test-images:
	bash scripts/test_images.sh all

bench: $(STAMP)
	$(VENV)/bin/rlpad bench

clean:
	rm -rf $(VENV) build *.egg-info
