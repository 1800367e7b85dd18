"""A sandboxed Python tool for the multi-turn loop: ``code_interpreter(code)`` (verl's / ReTool's name for
its code tool, one ``code`` argument) runs the model's program in rlpad/code's bubblewrap sandbox (a
fresh process tree per call: no network, no project files, rlimits on memory, processes, CPU, output;
docs/code.md) and returns what it printed, or a short error text the model can read.

List it in ``actor_rollout_ref.rollout.multi_turn.tools`` as ``rlpad.rollout.python_tool:code_interpreter``
(limits :data:`TOOL_LIMITS`), or build one with other limits: ``my_tool = python_tool(CodeConfig(...))`` in a
module of yours. The tool runs in the loop's tool-worker processes (rlpad.rollout.tool_pool), each with a
:class:`rlpad.code.pool.SandboxPool` of its own, made at its first call; its sandboxes carry the tag
``rlpad-tool-<worker pid>`` on their command line. A hung sandbox is killed at ``timeout_s``; a worker
killed at ``multi_turn.tool_timeout`` takes its sandboxes with it (``--die-with-parent``). Outputs longer
than ``max_tool_response_length`` tokens become the loop's ``error: output too long``, as for any tool.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import replace

from rlpad.code.pool import SandboxPool
from rlpad.config.code import CodeConfig

__all__ = ["TOOL_LIMITS", "CodeInterpreterTool", "code_interpreter", "observation", "py", "python_tool"]

# one call's sandbox: 5 s of wall and CPU time (under multi_turn.tool_timeout's default 10 s), 512 MiB of
# address space, 8 processes, 64 KiB of output, 16 MiB of /tmp; two sandboxes at once per tool worker
TOOL_LIMITS = CodeConfig(timeout_s=5.0, memory_limit_mb=512, max_processes=8, max_output_bytes=64 << 10,
                         scratch_mb=16, max_concurrent=2)


def observation(status: str, stdout: bytes, error: str, cfg: CodeConfig) -> str:
    """What the model reads of one run (rlpad.code.sandbox.CaseRun's fields); RuntimeError when the
    sandbox itself failed (the loop logs it and shows ``error: tool failed``)."""
    printed = stdout.decode("utf-8", "replace")
    if status == "ok":
        return printed
    if status in ("error", "compile_error", "syntax_error"):
        return f"{printed}error: {error}"
    if status == "timeout":
        return f"error: timed out after {cfg.timeout_s:g} s"
    if status == "oom":
        return f"error: out of memory (limit {cfg.memory_limit_mb} MiB)"
    if status == "output_limit":
        return f"error: more than {cfg.max_output_bytes} bytes of output"
    raise RuntimeError(f"the sandbox failed ({status}): {error}")


def python_tool(cfg: CodeConfig, name: str = "code_interpreter") -> Callable[[str], str]:
    """A tool function ``name(code) -> str`` running ``code`` under ``cfg``'s limits (one sandbox pool per
    process, made at the first call)."""
    pools: dict[int, SandboxPool] = {}  # pid -> its pool (a forked process makes its own)
    lock = threading.Lock()

    def pool() -> SandboxPool:
        with lock:
            if os.getpid() not in pools:
                made = SandboxPool(cfg)
                made.sandbox.tag = f"rlpad-tool-{os.getpid()}"  # on each sandbox's command line (ps, tests)
                pools[os.getpid()] = made
            return pools[os.getpid()]

    def tool(code: str) -> str:
        run = pool().run({"program": code, "fn_name": None, "input": ""})
        return observation(run.status, run.stdout, run.error, cfg)

    tool.__name__ = tool.__qualname__ = name
    tool.json_schema = {"type": "function", "function": {  # type: ignore[attr-defined]
        "name": name, "description": "Run a Python program in a sandbox and return what it prints.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "the program; print what you want to see"}},
            "required": ["code"]}}}
    return tool


code_interpreter = python_tool(TOOL_LIMITS)
_py = python_tool(TOOL_LIMITS, "py")


def py(code: str) -> str:
    """Run a Python program in the sandbox; what it printed, without the trailing newline (the toy_python task's
    tool: ``[py(print(34*58))]``, rlpad/embedded/toy_python.py).

    Args:
        code: the program (e.g. print(34*58))
    """
    return _py(code).rstrip("\n")


class CodeInterpreterTool:
    """The sandboxed Python tool as a stateful tool class (verl's BaseTool shape, for ``multi_turn.
    tool_config_path``: verl's sandbox tool YAML with its ``class_name`` set to this class): ``execute``
    runs ``parameters["code"]`` in a sandbox under :data:`TOOL_LIMITS`, ``config``'s ``default_timeout``
    (s) and ``memory_limit_mb`` (verl's sandbox keys) replacing those limits; other keys (verl's service
    URL, rate limits) have no use here. No state across calls (each program runs alone), no reward."""

    def __init__(self, config: dict, tool_schema: dict):
        limits = {"timeout_s": float(config.get("default_timeout", TOOL_LIMITS.timeout_s)),
                  "memory_limit_mb": int(config.get("memory_limit_mb", TOOL_LIMITS.memory_limit_mb))}
        self.run = python_tool(replace(TOOL_LIMITS, **limits), tool_schema.get("function", {}).get("name", "code_interpreter"))

    def create(self, instance_id: str, **kwargs) -> str:
        return instance_id

    def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[str, float, dict]:
        return self.run(str(parameters.get("code", ""))), 0.0, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    def release(self, instance_id: str, **kwargs) -> None:
        return None
