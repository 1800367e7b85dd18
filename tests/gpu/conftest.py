"""The GPU lane (``make test-gpu``, scripts/test_gpu.sh): tests that need a CUDA device.

In the CPU suite this whole folder is one skip line. Each test writes its figures with the
``record`` fixture to ``$RLPAD_GPU_OUT/parts/<test>.json`` (default results/gpu), which
scripts/gpu_report.py folds into the lane's report, failed tests included.
"""

import json
import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the GPU lane (make test-gpu) needs a CUDA device", allow_module_level=True)


@pytest.fixture
def record(request):
    """``record(**figures)``: add this test's figures to the lane's report."""
    figures: dict = {}
    yield figures.update
    if figures:
        parts = os.path.join(os.environ.get("RLPAD_GPU_OUT", "results/gpu"), "parts")
        os.makedirs(parts, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name).strip("_")
        with open(os.path.join(parts, f"{name}.json"), "w") as f:
            json.dump({"test": request.node.nodeid, **figures}, f, indent=1, default=str)
