"""Hostile programs for the sandbox tests (tests/test_code_sandbox.py, tests/test_code_train.py): each with the
problem it answers, the outcome rlpad must score it with, and what it tries.

They bypass verl's Python-level guard (``os.fork`` is None: they call ``posix.fork``), so what stops them
is the sandbox. Everything they could harm if the sandbox were broken is a throwaway: the HOME they
delete, the folder they write to, the server they connect to are the test's own; the fork bomb is
bounded (10,000 forks, children that exit), the allocations outside the sandbox (the controls) small.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

# stdin problem: double a number (one case; its input is what a reader of "another case" would look for)
DOUBLE = json.dumps({"inputs": ["21\n"], "outputs": ["42\n"]})
# call-based problem: solve(x) = 2x
CALL_DOUBLE = json.dumps({"fn_name": "solve", "inputs": ["21"], "outputs": ["42"]})
HONEST = "print(2 * int(input()))\n"  # passes DOUBLE: run beside the hostile ones, it must still pass

FORK_BOMB = """import posix, time
n = 0
for i in range({forks}):
    try:
        pid = posix.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep({sleep})
        posix._exit(0)
    n += 1
print('forked', n)
"""

FIND_EXPECTED = """import gc, sys
text = sys.stdin.read()
found = 'nothing'
for obj in gc.get_objects():
    if isinstance(obj, dict) and isinstance(obj.get('outputs'), list) and text in obj.get('inputs', []):
        found = obj['outputs'][obj['inputs'].index(text)]
print(found.strip())
"""

PATCH_HARNESS = """import builtins, json, sys
class Always(str):
    def __eq__(self, other):
        return True
    __hash__ = str.__hash__
json.dumps = lambda *args, **kwargs: '{"status": "ok", "value": 42}'
json.loads = lambda *args, **kwargs: 42
builtins.print = None
def solve(x):
    return Always('wrong')
"""

DELETE_TREE = """import posix
def rm(path):
    for name in posix.listdir(path):
        p = path + '/' + name
        try:
            posix.unlink(p)
        except IsADirectoryError:
            rm(p)
            posix.rmdir(p)
rm({home!r})
print('deleted', {home!r})
"""


@dataclass
class Hostile:
    name: str
    program: str
    ground_truth: str
    outcome: str  # what rlpad must score it with

    @property
    def response(self) -> str:
        return f"Here it is.\n```python\n{self.program}```\n"


class Listener:
    """A TCP server on 127.0.0.1 (an ephemeral port) counting the connections it accepts."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def hostile_programs(port: int, home: str, project_file: str, outside: str) -> list[Hostile]:
    """One program of each kind the acceptance names; ``home``, ``outside`` are the test's throwaway folders."""
    return [
        Hostile("infinite_loop", "while True:\n    pass\n", DOUBLE, "timeout"),
        Hostile("fork_bomb", FORK_BOMB.format(forks=10_000, sleep=60), DOUBLE, "wrong"),
        Hostile("allocate_4gb", "block = bytearray(4 << 30)\nprint(len(block))\n", DOUBLE, "oom"),
        Hostile("print_1gb", "import sys\nline = 'x' * 1023 + '\\n'\nfor i in range(1 << 20):\n    sys.stdout.write(line)\n",
                DOUBLE, "output_limit"),
        Hostile("socket", f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n"
                "print(42)\n", DOUBLE, "error"),
        Hostile("read_project", f"print(len(open({project_file!r}).read()))\n", DOUBLE, "error"),
        Hostile("read_shadow", "print(len(open('/etc/shadow').read()))\n", DOUBLE, "error"),
        Hostile("write_outside", f"open({outside!r}, 'w').write('escaped')\nprint(42)\n", DOUBLE, "error"),
        Hostile("delete_home", DELETE_TREE.format(home=home), DOUBLE, "error"),
        Hostile("setsid_child", "import posix, time\nif posix.fork() == 0:\n    posix.setsid()\n    time.sleep(120)\n"
                "    posix._exit(0)\nprint('parent done')\n", DOUBLE, "wrong"),
        Hostile("exit_before_tests", "import sys\nsys.exit(0)\nprint(2 * int(input()))\n", DOUBLE, "wrong"),
        Hostile("patch_harness", PATCH_HARNESS, CALL_DOUBLE, "wrong"),
        Hostile("read_expected", FIND_EXPECTED, DOUBLE, "wrong"),
        # the result channel is the harness's argv[1]: a forged sandbox failure must not count as one (enough
        # of them in a row would stop the run)
        Hostile("forge_sandbox_error", "import os, sys\nos.write(int(sys.argv[1]), b'{\"status\": \"sandbox_error\"}\\n')\n"
                "os._exit(0)\n", DOUBLE, "error"),
    ]


def sandbox_processes(pool) -> list[int]:
    """Pids of every process on this machine left by ``pool``'s sandboxes (none between cases): running as one
    of its uids (as root), or with its tag on the command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                tagged = pool.sandbox.tag.encode() in f.read()
            with open(f"/proc/{pid}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if tagged or uid in pool.uids:
            found.append(int(pid))
    return found


def run_outside(program: str, cwd: str, stdin: str = "", env: dict | None = None, timeout: float = 30
                ) -> subprocess.CompletedProcess:
    """A control: ``program`` run as a plain Python process in a throwaway folder, no sandbox."""
    return subprocess.run([sys.executable, "-c", program], cwd=cwd, input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env, start_new_session=True)
