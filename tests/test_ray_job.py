"""The tiny GRPO job submitted with `ray job submit` to a local Ray head on 127.0.0.1."""

import json
import os
import re
import sys

import pytest
from ray_cluster import RayCluster, listening, submit_job

pytest.importorskip("vllm")
pytestmark = [pytest.mark.ray, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "rlpad")


@pytest.fixture
def ray_head():
    """A Ray head on 127.0.0.1 with its own token; afterwards exactly its processes are ended."""
    cluster = RayCluster()
    cluster.start_head(num_cpus=8)
    try:
        yield cluster.dashboard_url, cluster.env, cluster
    finally:
        cluster.stop()


def test_ray_job_submit_runs_tiny_grpo(ray_head, tmp_path):
    address, env, cluster = ray_head
    out_dir = str(tmp_path / "job")
    entry = [sys.executable, "-m", "rlpad.train", "--config", "recipes/grpo_tiny.yaml",
             "trainer.total_training_steps=2", "trainer.test_freq=-1", f"trainer.default_local_dir={out_dir}",
             f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]"]
    _, status, logs = submit_job(address, env, ROOT, entry)
    assert re.search(r"succeeded", status, re.IGNORECASE), f"{status}\n{logs[-4000:]}"
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        steps = {r["step"]: r for r in map(json.loads, f)}
    assert sorted(steps) == [0, 1, 2]
    assert 0.0 <= steps[2]["reward/mean"] <= 1.0 and "val/reward" in steps[2]
    assert "validation reward" in logs  # the final summary table was printed
    sockets = listening(cluster.pids())
    assert len(sockets) >= 8 and all(addr == "127.0.0.1" for addr, _, _ in sockets), sockets
