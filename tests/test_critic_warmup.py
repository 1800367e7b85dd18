"""``trainer.critic_warmup`` (verl's rule): with PPO, the actor is updated from step ``critic_warmup`` on
(steps counted from 1); before it only the critic trains. A real PPO run on the single-process stack
(trainer.backend=local, HF rollout), the workers passed through a recorder of their update calls."""

from __future__ import annotations

import pytest
import torch

from rlpad.recipe.load import load_config
from rlpad.train import fit
from paths import CACHE, recipe


class Recorder:
    """The workers, passed through; records the order of the generate and update calls."""

    def __init__(self, workers):
        self.workers, self.calls = workers, []

    def __getattr__(self, name):
        return getattr(self.workers, name)

    def update_critic(self, batch):
        self.calls.append("critic")
        return self.workers.update_critic(batch)

    def update_actor(self, batch):
        self.calls.append("actor")
        return self.workers.update_actor(batch)

    def generate(self, batch, seed):
        self.calls.append("gen")
        return self.workers.generate(batch, seed)


def _run(tmp_path, warmup: int):
    recorders = []

    def wrap(workers):
        recorders.append(Recorder(workers))
        return recorders[0]

    history = fit(load_config(recipe("ppo_tiny"), [
        f"trainer.default_local_dir={tmp_path / f'w{warmup}'}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
        "trainer.backend=local", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=3", "data.val_files=[]",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
        f"trainer.critic_warmup={warmup}",
    ]), wrap_workers=wrap)
    steps = [r for r in history if r["step"] > 0]
    per_step = " ".join(recorders[0].calls).split("gen")[1:]  # the updates after each step's generation
    return steps, [call.split() for call in per_step]


def test_critic_warmup_holds_the_actor_back(tmp_path):
    steps, updates = _run(tmp_path, warmup=3)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert updates == [["critic"], ["critic"], ["critic", "actor"]]  # verl: actor from global step 3 on
    for s in steps:
        assert torch.isfinite(torch.tensor(s["critic/vf_loss"]))
    assert not any(k.startswith("actor/") for s in steps[:2] for k in s)
    assert "actor/pg_loss" in steps[2] and "actor/lr" in steps[2]
    # The actor's LR warm-up (2 updates) did not advance while it waited: its first update has the LR
    # of a run's first update (half the peak), as in verl, where the scheduler steps in the update.
    no_warmup, updates0 = _run(tmp_path, warmup=0)
    assert updates0 == [["critic", "actor"]] * 3  # negative control: 0 updates the actor from step 1
    assert steps[2]["actor/lr"] == pytest.approx(no_warmup[0]["actor/lr"], rel=1e-12)
    # Step 1 is the same in both runs (same seeds, same initial weights): the critic's loss agrees.
    assert steps[0]["critic/vf_loss"] == pytest.approx(no_warmup[0]["critic/vf_loss"], rel=1e-6)
