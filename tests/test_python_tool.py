"""The sandboxed Python tool (rlpad.rollout.python_tool) through the loop's tool set: an honest program's
output, its error text, and hostile programs of the code-RL tests (tests/hostile_code.py) contained,
each a short error observation (memory, fork bomb, network, file escape, infinite loop), nothing left."""

from __future__ import annotations

import os
import time

import pytest

from hostile_code import FORK_BOMB, Listener, hostile_programs
from rlpad.rollout.python_tool import TOOL_LIMITS
from rlpad.rollout.tools import ToolCall, ToolSet, tool_schema

SPEC = "rlpad.rollout.python_tool:code_interpreter"
pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/bwrap") and os.system("which bwrap >/dev/null") != 0,
                                reason="bubblewrap is not installed")


def tagged(pids: list[int]) -> list[int]:
    """Processes on this machine whose command line carries a tool worker's sandbox tag."""
    tags = [f"rlpad-tool-{pid}".encode() for pid in pids]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if any(t in cmd for t in tags):
            found.append(int(pid))
    return found


def test_python_tool_runs_code_and_contains_hostile_programs(tmp_path):
    home, outside = tmp_path / "home", tmp_path / "outside.txt"
    home.mkdir()
    (home / "canary").write_text("kept")
    listener = Listener()
    hostile = {h.name: h.program for h in hostile_programs(listener.port, str(home), __file__, str(outside))}
    programs = {
        "honest": "print(sum(range(10)))\n",
        "raises": "print('before')\n1 / 0\n",
        "allocate_4gb": hostile["allocate_4gb"],
        "fork_bomb": FORK_BOMB.format(forks=10_000, sleep=60),
        "socket": hostile["socket"],
        "write_outside": hostile["write_outside"],
        "delete_home": hostile["delete_home"],
        "infinite_loop": hostile["infinite_loop"],
    }
    tools = ToolSet([SPEC], "hermes", timeout=30.0, max_tokens=64, count_tokens=len, max_token_chars=1, workers=1,
                    concurrency=len(programs))
    try:
        start = time.monotonic()
        results = dict(zip(programs, tools.run([ToolCall("code_interpreter", {"code": p}) for p in programs.values()])))
        seconds = time.monotonic() - start
        pids = [w.proc.pid for w in tools.pool._workers if w is not None]
        assert pids and tagged(pids) == [], "sandboxed processes outlived their call"
    finally:
        tools.close()
        listener.close()
    said = {k: r.observation for k, r in results.items()}
    assert all(r.reason is None for r in results.values()), said  # each is the tool's own answer
    assert said["honest"] == "45\n"
    assert said["raises"].startswith("before\nerror: ZeroDivisionError")
    assert said["allocate_4gb"] == f"error: out of memory (limit {TOOL_LIMITS.memory_limit_mb} MiB)"
    forked = int(said["fork_bomb"].split()[1])
    assert said["fork_bomb"].startswith("forked ") and forked < TOOL_LIMITS.max_processes
    assert said["socket"].startswith("error: ") and listener.accepted == 0
    assert said["write_outside"].startswith("error: ") and not outside.exists()
    assert said["delete_home"].startswith("error: ") and (home / "canary").read_text() == "kept"
    assert said["infinite_loop"] == f"error: timed out after {TOOL_LIMITS.timeout_s:g} s"
    assert all(len(o) <= 200 for o in said.values()), said  # short observations
    assert seconds < 25, seconds  # the fork bomb's sleepers are killed with their sandbox, not waited for


def test_the_tool_has_verls_name_and_one_code_argument_and_loads_from_a_recipe():
    from rlpad.config.schema import MultiTurnConfig
    from rlpad.rollout.python_tool import code_interpreter
    from rlpad.rollout.tools import multi_turn_problems

    schema = tool_schema(code_interpreter, SPEC)["function"]
    assert schema["name"] == "code_interpreter" and schema["parameters"]["required"] == ["code"]
    for fmt in ("hermes", "bracket"):
        assert multi_turn_problems(MultiTurnConfig(enable=True, format=fmt, tools=[SPEC])) == []


def test_toy_python_task_the_tool_answers_what_the_trace_copies():
    """The embedded Python-tool task (rlpad.embedded.toy_python): the recipe's ``py`` tool, called as the
    bracket format calls it in its tool worker, prints the product the warm-start trace then copies (the
    reward's answer); a direct guess off by one scores 0; validation problems are not in the training pool."""
    from rlpad.embedded import toy_python
    from rlpad.rewards.rules import compute_score

    toolset = ToolSet(["rlpad.rollout.python_tool:py"], "bracket", 10.0, 8, len, max_token_chars=1)
    try:
        (got,) = toolset.run([ToolCall("py", "print(34*58)")])
    finally:
        toolset.close()
    assert got.observation == "1972" == str(34 * 58)
    call, printed, answer = toy_python.trace(34, 58)
    assert call == ("[py(print(34*58))]", True) and printed == (got.observation, False)
    own = "".join(text for text, trained in (call, printed, answer) if trained)  # what the reward reads
    assert compute_score("rlpad/toy_python", own, "1972") == 1.0
    assert compute_score("rlpad/toy_python", "1973", "1972") == 0.0
    pool, val = toy_python.split_pairs(100)
    assert len(val) == 100 and not set(val) & set(pool)
    examples = toy_python.sft_examples(1000)
    assert 250 < sum(len(segments) == 3 for _, segments in examples) < 350  # tool_share 0.3
