"""The tiny GRPO job submitted with `ray job submit` to a local Ray head on 127.0.0.1."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from ray_cluster import RAY, RayCluster, listening

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
    submit = subprocess.run([RAY, "job", "submit", "--address", address, "--working-dir", ROOT, "--no-wait", "--", *entry],
                            env=env, capture_output=True, text=True, timeout=300)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job_id = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)
    deadline, status = time.time() + 900, ""
    while time.time() < deadline:
        status = subprocess.run([RAY, "job", "status", "--address", address, job_id], env=env,
                                capture_output=True, text=True, timeout=60).stdout
        if re.search(r"succeeded|failed|stopped", status, re.IGNORECASE):
            break
        time.sleep(3)
    logs = subprocess.run([RAY, "job", "logs", "--address", address, job_id], env=env,
                          capture_output=True, text=True, timeout=60).stdout
    assert re.search(r"succeeded", status, re.IGNORECASE), f"{status}\n{logs[-4000:]}"
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        steps = {r["step"]: r for r in map(json.loads, f)}
    assert sorted(steps) == [0, 1, 2]
    assert 0.0 <= steps[2]["reward/mean"] <= 1.0 and "val/reward" in steps[2]
    assert "validation reward" in logs  # the final summary table was printed
    sockets = listening(cluster.pids())
    assert len(sockets) >= 8 and all(addr == "127.0.0.1" for addr, _, _ in sockets), sockets
