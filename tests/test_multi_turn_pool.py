"""Tools run concurrently in tool-worker processes (rlpad.rollout.tool_pool): a turn of hung calls costs
about one timeout, nothing is left behind, outputs are checked before tokenising, the tools' prints
go to the log; and every multi-turn key is checked when the config loads."""

import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from rlpad.recipe.load import load_config
from rlpad.rollout.agent import run_agent_loop
from rlpad.rollout.base import Sampling
from rlpad.rollout.tools import ToolCall, ToolSet
from paths import ROOT, recipe
from processes import gone_within

RECIPE = recipe("grpo_tiny_tools")
MT = "actor_rollout_ref.rollout.multi_turn"


def children() -> list[int]:
    """This process's child processes (Linux /proc)."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == me:
                out.append(int(entry))
    return out


def test_hung_tools_cost_one_timeout_per_turn_and_leave_nothing_behind():
    """256 samples (32 prompts x 8) whose every turn calls a tool sleeping 3 s past a 1 s timeout, two
    turns: each turn costs about one timeout (the old loop: one per call, 256 s a turn), every call is
    an error, and afterwards no thread or process of the tools is left."""
    kids = set(children())
    tools = ToolSet(["mt_tools:hang"], "bracket", 1.0, 16, len, max_token_chars=1)

    def engine(contexts, sampling, seeds):  # every turn: a call, then the budget runs on
        ids = [ord(c) for c in "[hang(x)] and on"]
        return [ids] * len(contexts), [[0.0] * len(ids)] * len(contexts)

    start = time.perf_counter()
    trajs = run_agent_loop(engine, [[1]] * 32, Sampling(8, 1.0, 1.0, -1, 200), tools=tools, max_turns=3,
                           eos=frozenset({0}), decode=lambda ids: "".join(map(chr, ids)),
                           render_tool=lambda obs: [ord(c) for c in "".join(obs)])
    took = time.perf_counter() - start
    tools.close()
    print(f"256 samples x 2 turns of hung calls, tool_timeout 1 s: {took:.2f} s ({took / 2:.2f} s a turn; "
          "one timeout per call would be 256 s a turn)")
    assert len(trajs) == 256 and all(t.tool_calls == 2 == t.tool_errors for t in trajs)
    assert all(t.errors == ["hang timed out after 1 s"] * 2 for t in trajs)
    assert took < 20  # a behaviour check (about 2 timeouts), not a timing
    assert not [t.name for t in threading.enumerate() if t.name.startswith("rlpad-tool")]
    assert set(children()) <= kids  # no process of the tools left (other tests' may have ended meanwhile)


def test_a_hung_tool_and_what_it_started_are_killed(tmp_path):
    """The process of a call past its time is killed with its session: a process the tool started too."""
    tools = ToolSet(["mt_tools:spawner"], "bracket", 1.0, 16, len, max_token_chars=1)
    marker = tmp_path / "pid"
    try:
        [result] = tools.run([ToolCall("spawner", str(marker))])
    finally:
        tools.close()
    assert result.reason == "spawner timed out after 1 s"
    grandchild = int(marker.read_text())
    assert gone_within(grandchild, 5)


def test_outputs_checked_before_tokenising_async_tools_and_prints_to_the_log(capfd, caplog):
    """A 1 MB output is rejected by its length in characters (never tokenised, never sent whole); an
    async tool runs; a tool's prints reach the log (logger rlpad.tools: run.log), not the console."""
    counted: list[int] = []

    def count(text):
        counted.append(len(text))
        return len(text)

    caplog.set_level(logging.INFO, logger="rlpad.tools")
    tools = ToolSet(["mt_tools:vast", "mt_tools:later", "mt_tools:chatty", "mt_tools:pid"], "bracket", 5.0, 16,
                    count, max_token_chars=4)
    try:
        vast, later, chatty, pid = tools.run([ToolCall("vast", "x"), ToolCall("later", "ab"), ToolCall("chatty", "hi"),
                                              ToolCall("pid", "")])
    finally:
        tools.close()
    assert vast.reason == "vast returned 1000000 characters, over max_tool_response_length=16 tokens"
    assert vast.observation == "error: output to"  # the fixed text, cut to 16 tokens
    assert max(counted) <= 64  # nothing longer than 16 tokens x 4 characters was tokenised
    assert (later.observation, chatty.observation) == ("AB", "hi") and int(pid.observation) != os.getpid()
    out, err = capfd.readouterr()
    assert "chatty says" not in out + err
    logged = [r.getMessage() for r in caplog.records if r.name == "rlpad.tools"]
    assert any("chatty says hello on stdout" in m for m in logged)
    assert any("chatty says hello on stderr" in m for m in logged)


@pytest.mark.parametrize("override, says", [
    ("tools=[nope.module:fn]", f"{MT}.tools='nope.module:fn': cannot import module 'nope.module'"),
    ("tools=[rlpad.embedded.toy_tools:DATA_SOURCE]", "'DATA_SOURCE' is a str, not a function"),
    ("tools=[rlpad.embedded.toy_tools:LOW]", "'LOW' is an int, not a function"),  # was "is a int"
    ("tools=[mt_tools:calc,mt_tools:calc]", f"{MT}.tools: two tools named 'calc'"),
    ("tool_timeout=0", f"{MT}.tool_timeout=0.0 must be > 0"),
    ("format=json", f"{MT}.format='json' is not valid"),
    ("max_assistant_turns=0", f"{MT}.max_assistant_turns=0 must be >= 1"),
    ("max_user_turns=0", f"{MT}.max_user_turns=0 must be >= 1 or null"),
    ("max_tool_response_length=0", f"{MT}.max_tool_response_length=0 must be >= 1"),
    ("max_tool_response_length=-1", f"{MT}.max_tool_response_length=-1 must be >= 1"),
    ("max_parallel_calls=0", f"{MT}.max_parallel_calls=0 must be >= 1"),
    ("tools=[]", f"{MT}.enable=true with no {MT}.tools"),
    ("enable=false", f"{MT}.tools=['rlpad.embedded.toy_tools:calc'] is set but {MT}.enable=false"),
    ("tools=[mt_tools:add]", f"{MT}.tools: add cannot be called with one argument, as the bracket format"),
    ("tools=[mt_tools:explicit,processes:alive]", f"{MT}.tools='processes:alive': no schema"),
])
def test_every_multi_turn_key_is_checked_when_the_config_loads(override, says):
    """Control: each of these was caught only inside the rollout backend, after the actor started (or never)."""
    overrides = [f"{MT}.{override}"] + ([f"{MT}.advertise_tools=true"] if "explicit" in override else [])
    with pytest.raises(ValueError, match="invalid config") as e:
        load_config(RECIPE, overrides)
    assert says in str(e.value)


def test_a_bad_tool_stops_the_cli_with_one_line_and_rc_2(tmp_path):
    run = subprocess.run([sys.executable, "-m", "rlpad.train", "--config", RECIPE, f"{MT}.tools=[nope.module:fn]",
                          f"trainer.default_local_dir={tmp_path}"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["error: invalid config:", f"  {MT}.tools='nope.module:fn': cannot import "
                                               "module 'nope.module' (No module named 'nope')"]
