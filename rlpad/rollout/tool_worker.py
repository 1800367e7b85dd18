"""A tool-worker process: loads the tools by name and runs the calls it is sent, each in a thread.

Started by :class:`rlpad.rollout.tool_pool.ToolPool` as ``python -m rlpad.rollout.tool_worker READ_FD
WRITE_FD SPECS_JSON THREADS MAX_CHARS``. Messages (pickled, :class:`multiprocessing.connection.Connection`
over two pipes): in, ``(call_id, tool name, arguments)`` or None (exit); out, first ``("ready", None,
None)`` (or ``("failed", None, reason)``), then ``(call_id, status, payload)`` per call, status one of
:data:`STATUSES`. A tool's own prints go to this process's stderr, which the pool logs (run.log), never to
the console. The pool kills the whole process (its session) to stop a call that runs past its time, so
no thread of a hung tool outlives it. At the end of its input pipe (the pool closed it, or the pool's
process died) the worker kills its own session too: nothing a tool started outlives it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from rlpad.rollout.tools import load_tools  # stdlib-only imports: the worker starts light

__all__ = ["STATUSES", "end_session", "execute", "main"]

# status -> what the payload is: the output / "Type: message" / the returned type's name / its length
STATUSES = ("ok", "raised", "not_text", "too_long")


def execute(fn: Callable[..., Any], arguments: Any, max_chars: int) -> tuple[str, Any]:
    """``(status, payload)`` of one call: keywords for a dict of arguments, else one positional argument;
    an async tool's coroutine is run to completion here; outputs longer than ``max_chars`` are not sent."""
    try:
        out = fn(**arguments) if isinstance(arguments, dict) else fn(arguments)
        if inspect.isawaitable(out):
            out = asyncio.run(_wait(out))
    except BaseException as e:  # noqa: BLE001 - a tool's failure is reported, never raised here
        return "raised", f"{type(e).__name__}: {e}"[:2000]
    if not isinstance(out, str):
        return "not_text", type(out).__name__
    if len(out) > max_chars:
        return "too_long", len(out)
    return "ok", out


async def _wait(awaitable: Any) -> Any:
    return await awaitable


def main(argv: list[str]) -> None:
    read_fd, write_fd, specs, threads, max_chars = int(argv[0]), int(argv[1]), json.loads(argv[2]), int(argv[3]), int(argv[4])
    _hold_session(read_fd, write_fd)
    os.dup2(2, 1)  # the tools' prints: stderr (the pool logs it), never the message pipe nor the console
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        tools = load_tools(specs)
    except BaseException as e:  # noqa: BLE001 - reported to the pool, which raises it
        outbox.send(("failed", None, f"{type(e).__name__}: {e}"))
        os._exit(1)
    outbox.send(("ready", None, None))
    lock = threading.Lock()
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rlpad-tool")

    def run(call_id: int, name: str, arguments: Any) -> None:
        status, payload = execute(tools[name], arguments, max_chars)
        with lock:
            outbox.send((call_id, status, payload))

    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):  # the pool is gone (closed, or its process killed without closing it)
            end_session()
        if message is None:
            end_session()
        pool.submit(run, *message)


_GROUP: list[int] = []  # the process group this worker may kill at its end (its holder's own group), if any


def _hold_session(read_fd: int, write_fd: int) -> None:
    """Split in two. The process the pool started (leading its own session) becomes a holder that only
    waits for its child and exits with the child's status; the child returns and runs the tools. Ray kills
    an actor's direct children (the holder) when the actor dies: the child then sees the end of its pipe
    and kills the whole group (:func:`end_session`), what its tools started included."""
    pid = os.fork()
    if pid == 0:
        if os.getpgrp() == os.getppid():  # the holder leads the group: a group of this worker's alone
            _GROUP.append(os.getpgrp())
        return
    os.close(read_fd)
    os.close(write_fd)  # the pool sees the end of the pipe when the child is gone
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(code if code >= 0 else 128 - code)


def end_session() -> None:
    """Exit, killing what the tools started: the whole group when it is this worker's alone (a group
    shared with another process is left alone)."""
    if _GROUP:
        os.killpg(_GROUP[0], signal.SIGKILL)  # this process included
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
