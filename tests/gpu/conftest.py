"""The GPU lane (``make test-gpu``, scripts/test_gpu.sh): tests that need a CUDA device.

In the CPU suite its tests are skipped, one line per module. Each test writes its figures with the
``record`` fixture to ``$RLPAD_GPU_OUT/parts/<test>.json`` (default results/gpu), which
scripts/gpu_report.py folds into the lane's report, failed tests included.
"""

import json
import os
import re

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(items):
    """Mark this folder's tests ``cuda``; without a CUDA device, skip them (one line per module)."""
    skip = pytest.mark.skip(reason="the GPU lane (make test-gpu) needs a CUDA device")
    for item in items:
        if str(item.path).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)


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
