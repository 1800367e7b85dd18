"""A tool that kills its own process, and the processes tools start at shutdown (rlpad.rollout.tool_pool,
rlpad.rollout.tool_worker, workers.rollout.RolloutReplicas.shutdown), with the real pool and real Ray.

- A call doing ``os._exit`` among many fast calls: it and every other call in flight on its worker are
  answered "error: tool crashed", the others their result, the pool replaces the worker, and the next
  turn works (before: the send loop hit BrokenPipeError and the pool stayed wedged).
- A process a tool started dies when the pool's owner goes: on the Ray stack RolloutReplicas.shutdown
  closes each replica's pool before ray.kill, and a tool worker whose pipe ends (its owner killed
  without closing it: a bare ray.kill, a SIGKILLed process) kills its own session."""

import os
import signal
import subprocess
import sys

import pytest

from workers.launcher import QUIET_ENV, init_local_ray  # workers before ray: Ray stays on the loopback

import ray  # noqa: E402

from rlpad.recipe.load import load_config  # noqa: E402
from rlpad.rollout.tools import ERROR_TEXTS, ToolCall, ToolSet  # noqa: E402
from paths import ROOT, recipe  # noqa: E402
from processes import alive, gone_within  # noqa: E402

TESTS = os.path.join(ROOT, "tests")


def test_a_tool_exiting_its_process_answers_its_calls_crashed_and_the_pool_recovers():
    """Concurrency 4 over 2 workers, 3000 fast calls with one os._exit among them, 6 turns on one pool."""
    tools = ToolSet(["mt_tools:die", "mt_tools:add"], "bracket", 30.0, 64, len, max_token_chars=1, workers=2,
                    concurrency=4)
    crashed = ERROR_TEXTS["crashed"]
    try:
        for turn in range(6):
            where = 100 + 450 * turn  # the dying call at another place each turn
            calls = [ToolCall("add", {"a": i, "b": 1}) for i in range(3000)]
            calls.insert(where, ToolCall("die", {"text": "x"}))
            results = tools.run(calls)
            assert results[where].observation == crashed
            assert results[where].reason == "die killed its process (exit code 3)"
            others = results[:where] + results[where + 1:]  # add(i, 1) in order
            lost = [r for r in others if r.observation == crashed]
            # the calls in flight on the dying worker with it: at most its other slot (ceil(4 / 2) - 1)
            assert len(lost) <= 1, turn
            assert all(r.reason == "add killed its process (exit code 3)" for r in lost)
            assert all(r.observation in (crashed, str(i + 1)) for i, r in enumerate(others))
            after = tools.run([ToolCall("add", {"a": i, "b": i}) for i in range(200)])  # a following turn works
            assert [r.observation for r in after] == [str(2 * i) for i in range(200)]
    finally:
        tools.close()


OWNER = """
import sys, time
from rlpad.rollout.tools import ToolCall, ToolSet
tools = ToolSet(["mt_tools:background"], "bracket", 30.0, 16, len, max_token_chars=1, workers=1, concurrency=1)
print(tools.run([ToolCall("background", sys.argv[1])])[0].observation, flush=True)
time.sleep(120)  # killed by the test, the pool never closed
"""


def test_a_tool_worker_at_the_end_of_its_pipe_kills_what_its_tools_started(tmp_path):
    """The pool's process is SIGKILLed without closing the pool: the worker sees the end of its pipe and
    kills its session, the tool's sleeping child with it."""
    marker = tmp_path / "pid"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(marker)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "started"
        child = int(marker.read_text())
        assert alive(child)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert gone_within(child, 10), f"the tool's child {child} outlived its pool's process"
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait()


@pytest.fixture(scope="module")
def ray_session():
    env = dict(QUIET_ENV, PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    init_local_ray(2, runtime_env={"env_vars": env}, log_to_driver=False)
    yield
    ray.shutdown()


def _start_tool_child(replica, path: str) -> str:
    """Inside the replica's actor: run the ``background`` tool through the backend's own tool pool."""
    def call(worker):
        tools, _ = worker.backend._agent_tools()
        return tools.run([ToolCall("background", path)])[0].observation

    return ray.get(replica.__ray_call__.remote(call))


@pytest.mark.ray
@pytest.mark.parametrize("how", ["shutdown", "bare_kill"])
def test_what_tools_start_ends_with_the_rollout_replicas_on_ray(ray_session, tmp_path, how):
    """A replica (HF backend, tiny model) runs a tool that leaves a sleeping child; after
    RolloutReplicas.shutdown (the pool closed first) or a bare ray.kill (the worker's end of pipe),
    the child's PID is gone."""
    from workers.rollout import RolloutReplicas

    config = load_config(recipe("grpo_tiny_tools"), [
        "actor_rollout_ref.model.path=tiny:qwen2", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.multi_turn.tools=[mt_tools:background]"])
    replicas = RolloutReplicas("tiny:qwen2", config.actor_rollout_ref.rollout, config.data, num_replicas=1)
    marker = tmp_path / "pid"
    try:
        assert _start_tool_child(replicas.actors[0], str(marker)) == "started"
        child = int(marker.read_text())
        assert alive(child)
    finally:
        if how == "shutdown":
            replicas.shutdown()
        else:
            for actor in replicas.actors:
                ray.kill(actor)
    assert gone_within(child, 15), f"{how}: the tool's child {child} outlived the replica"
