#!/usr/bin/env bash
# The GPU lane's install step: the wheels of .whl/ (scripts/gpu_wheels.sh) into a scratch TARGET on
# top of the machine's own python3 (no venv, no `make setup`, no network), then a check that rlpad
# imports with nothing but them, the repository and what that python3 has.
#   scripts/gpu_site.sh TARGET        then: export PYTHONPATH=<repo>:TARGET
# PY (default python3) may carry interpreter flags; RLPAD_WHEELS overrides the wheel folder.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python3}
TARGET=${1:?usage: scripts/gpu_site.sh TARGET}
WHEELS=${RLPAD_WHEELS:-$HERE/.whl}

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "gpu_site: no wheels in $WHEELS; run scripts/gpu_wheels.sh where pip reaches PyPI" >&2
    exit 1
fi
rm -rf "$TARGET"
# shellcheck disable=SC2086  # PY may be "python3 -S"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "${wheels[@]}"
export PYTHONPATH="$HERE:$TARGET${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC2086
$PY - <<'PYCODE'
import sys

# Everything the lane runs: the training entry point and its local stack, the CLI, the harness.
import rlpad, rlpad.cli, rlpad.recipe.load, rlpad.embedded.exactness, rlpad.train, workers.actor, workers.local  # noqa: E401,F401
import omegaconf, torch, transformers

unexpected = [m for m in ("ray", "vllm", "flash_attn") if m in sys.modules]
if unexpected:
    sys.exit(f"gpu_site: importing rlpad pulled in {unexpected}")
print(f"gpu_site: rlpad imports (torch {torch.__version__}, transformers {transformers.__version__}, "
      f"omegaconf {omegaconf.__version__})")
print(f"gpu_site: rlpad from {rlpad.__file__}, omegaconf from {omegaconf.__file__}")
PYCODE
