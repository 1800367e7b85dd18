"""The tiny GRPO job submitted with `ray job submit` to a local Ray head on 127.0.0.1: its outputs land
where the command line says, a second job resumes from the first one's checkpoint, and a relative
output folder (which would land in Ray's temporary copy of the working dir) is refused."""

import json
import os
import re
import sys

import pytest
from ray_cluster import RayCluster, listening, submit_job
from paths import CACHE, ROOT

pytest.importorskip("vllm")
pytestmark = [pytest.mark.ray, pytest.mark.vllm]



@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on 127.0.0.1 with its own token; afterwards exactly its processes are ended."""
    cluster = RayCluster()
    cluster.start_head(num_cpus=8)
    try:
        yield cluster.dashboard_url, cluster.env, cluster
    finally:
        cluster.stop()


def _entry(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "rlpad.train", "--config", "recipes/grpo_tiny.yaml", "trainer.test_freq=-1",
            f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]", *overrides]


def _metrics(out_dir: str) -> dict[int, dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def test_ray_job_submit_runs_tiny_grpo_and_resumes(ray_head, tmp_path):
    address, env, cluster = ray_head
    out_dir = str(tmp_path / "job")  # absolute, as the refusal below asks
    _, status, logs = submit_job(address, env, ROOT, _entry("trainer.total_training_steps=2", "trainer.save_freq=2",
                                                            f"trainer.default_local_dir={out_dir}"))
    assert re.search(r"succeeded", status, re.IGNORECASE), f"{status}\n{logs[-4000:]}"
    steps = _metrics(out_dir)
    assert sorted(steps) == [0, 1, 2]
    assert 0.0 <= steps[2]["reward/mean"] <= 1.0 and "val/reward" in steps[2]
    assert "validation reward" in logs  # the final summary table was printed
    for name in ("config.yaml", "run.log", "checkpoints/global_step_2/trainer_state.json"):
        assert os.path.isfile(os.path.join(out_dir, name)), name
    sockets = listening(cluster.pids())
    assert len(sockets) >= 8 and all(addr == "127.0.0.1" for addr, _, _ in sockets), sockets

    # A second job with the same folder and the default resume_mode=auto finds the checkpoint.
    _, status, logs = submit_job(address, env, ROOT, _entry("trainer.total_training_steps=3",
                                                            "trainer.val_before_train=false",
                                                            f"trainer.default_local_dir={out_dir}"))
    assert re.search(r"succeeded", status, re.IGNORECASE), f"{status}\n{logs[-4000:]}"
    assert f"resumed from {out_dir}/checkpoints/global_step_2 at step 2" in logs, logs[-4000:]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2, 3]  # appended: only step 3 ran again


def test_ray_job_refuses_a_relative_output_dir(ray_head):
    address, env, _ = ray_head
    _, status, logs = submit_job(address, env, ROOT, _entry("trainer.total_training_steps=1",
                                                            "trainer.default_local_dir=outputs/job_rel"))
    assert re.search(r"failed", status, re.IGNORECASE), f"{status}\n{logs[-4000:]}"
    m = re.search(r"error: trainer.default_local_dir='outputs/job_rel' is relative, and this is a `ray job submit` "
                  r"job: it would resolve inside Ray's temporary copy of the working dir \((.+?)\)", logs)
    assert m, logs[-4000:]
    assert os.path.realpath(m.group(1)) != ROOT and "_ray_pkg_" in m.group(1)  # where it would have gone
    assert "trainer.default_local_dir=$PWD/outputs/job_rel" in logs
    assert not os.path.exists(os.path.join(m.group(1), "outputs")) and "rlpad: starting" not in logs  # nothing ran
