"""20 steps of the default GRPO job on CUDA, everything in this process: the single-process stack
(``trainer.backend=local``), the HF rollout and the FSDP2 actor on the GPU. It learns (validation
reward up), and its peak GPU memory is reported. The Ray + vLLM stack is the same job where both
are installed.
"""

import importlib.util
import json
import os
import time

import pytest
import torch

from rlpad.recipe.load import load_config
from rlpad.train import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(ROOT, "recipes", "grpo_tiny.yaml")
STEPS = 20
MIN_GAIN = 0.05  # validation reward, step 20 - step 0 (measured on CPU with the same overrides: +0.21)


def train(out_dir: str, *overrides: str) -> tuple[dict, dict]:
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    summary = run(load_config(GRPO, [
        f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={os.path.join(out_dir, 'cache')}",
        "trainer.logger=[jsonl]", "trainer.device=cuda", f"trainer.total_training_steps={STEPS}", *overrides,
    ]))  # fmt: skip
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    figures = {
        "val_reward": [(r["step"], r["val/reward"]) for r in records if "val/reward" in r],
        "peak_gpu_memory_mib": torch.cuda.max_memory_allocated() / 2**20,
        "wall_s": time.perf_counter() - start,
        "median_step_s": summary.get("step_s"),
        "tokens_per_s": {k: v for k, v in summary.items() if k.startswith("tokens_per_s/")},
    }
    return summary, figures


def test_default_grpo_job_learns_on_cuda_local_hf(tmp_path, record):
    summary, figures = train(str(tmp_path), "trainer.backend=local", "actor_rollout_ref.rollout.name=hf")
    gain = summary["val_reward_final"] - summary["val_reward_initial"]
    record(stack="local + hf", steps=STEPS, gain=gain, **figures)
    assert gain >= MIN_GAIN, figures["val_reward"]


@pytest.mark.skipif(not (importlib.util.find_spec("vllm") and importlib.util.find_spec("ray")),
                    reason="needs vLLM and Ray (not installed): the default job on the Ray + vLLM stack")
def test_default_grpo_job_learns_on_cuda_ray_vllm(tmp_path, record):
    summary, figures = train(str(tmp_path), "trainer.backend=ray", "actor_rollout_ref.rollout.name=vllm",
                             "trainer.n_gpus_per_node=1")  # fmt: skip
    figures.pop("peak_gpu_memory_mib")  # the workers are other processes: this one's peak says nothing
    gain = summary["val_reward_final"] - summary["val_reward_initial"]
    record(stack="ray + vllm", steps=STEPS, gain=gain, **figures)
    assert gain >= MIN_GAIN, figures["val_reward"]
