#!/usr/bin/env bash
# The wheels `make test-gpu` carries to a GPU machine: the pure-Python packages rlpad needs that
# such a machine lacks, for its Python 3.12 on x86-64 Linux, downloaded into .whl/ (or $1). Run it
# where pip reaches PyPI; the GPU machine has no network and installs them with scripts/gpu_site.sh.
#
# What the GPU image has (torch >= 2.11, transformers, numpy, pyarrow, pyyaml, tqdm, tokenizers,
# pytest) is not carried. Of rlpad's dependencies (pyproject.toml) it lacks omegaconf, which needs
# only PyYAML. liger-kernel (pure Python on torch + Triton, which CUDA torch brings) for use_liger and
# bench logprob's packed_liger column. vLLM, Ray and flash-attn are not carried: the lane skips what needs them.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python3}
DEST=${1:-$HERE/.whl}
# liger_kernel with an underscore: as its wheel's file name, which the removal below and the lane's test match
WHEELS=(omegaconf==2.4.0 liger_kernel==0.8.5)

mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do  # one version of each: two would stop the install
    rm -f "$DEST/${spec%%==*}"-*.whl
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${WHEELS[@]}"
ls "$DEST"/*.whl
