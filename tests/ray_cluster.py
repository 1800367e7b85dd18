"""A throw-away Ray cluster for tests, started with the `ray` CLI and stopped without `ray stop`.

Every port Ray lets us choose is pinned to a port that was free when all of them were picked
together; a start that fails on a port clash is retried once with fresh ports. Each node's
processes carry a marker in their environment (inherited by workers and job drivers, which
run in sessions of their own), so :meth:`RayCluster.stop` ends exactly this cluster's
processes and checks that they are gone. The token for Ray 2.60's token auth is made per
cluster and passed in the environment: ``~/.ray/auth_token`` is neither read nor written.

Each node has a temp dir of its own (as on separate machines), or, with ``shared_temp_dir``, every
node uses the head's (as two raylets on one host do by default: one session folder, one copy of a
job's working-dir package).

``start_head(local_only=True)`` keeps the head on 127.0.0.1: node IP, GCS, raylet, agents,
metrics and dashboard listen on the loopback only. Ray 2.60 turns ``--node-ip-address=127.0.0.1``
into the machine's external address unless it runs as a single-node cluster
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), and such a head cannot take other nodes; for a
multi-node test use ``start_head(local_only=False)`` (Ray then picks the head's address and
its gRPC servers listen on every interface) and ``add_node(ip="127.0.0.2")``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
MARKER = "RLPAD_TEST_RAY_NODE"
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": node IP 127.0.0.1, servers on loopback
HEAD_PORTS = ("port", "dashboard-port", "ray-client-server-port")
NODE_PORTS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")
ENV_PORTS = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")  # head-only daemons, set by env
# Worth one more try: a port taken meanwhile, or Ray's fixed 30 s wait for the raylet to register
# running out on a loaded machine ("The current node timed out during startup").
RETRY_ON = ("address already in use", "errno 98", "failed to bind", "already running", "timed out during startup")

__all__ = ["RayCluster", "RayNode", "descendants", "free_ports", "listening", "node_pids"]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports, each free on every interface at the moment all are held."""
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def _proc_table() -> dict[int, tuple[int, int, list[bytes]]]:
    """pid -> (ppid, session id, environment entries) for every live (not zombie) process we can read."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "(comm)", which may hold spaces
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if fields[0] != b"Z":  # a zombie is dead already; its parent (maybe not us) has to reap it
            table[int(entry)] = (int(fields[1]), int(fields[3]), env)
    return table


def descendants(roots: set[int], table: dict | None = None) -> set[int]:
    """``roots`` and every live process below them."""
    table = _proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(roots), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def node_pids(marker: str, session: int) -> list[int]:
    """Live processes of one `ray start`: its session, the ones whose environment holds the
    marker (job drivers start sessions of their own), and all their descendants (processes
    that retitle themselves, like ``ray::IDLE``, overwrite what /proc shows of their environment)."""
    needle = f"{MARKER}={marker}".encode()
    table = _proc_table()
    roots = {pid for pid, (_, sid, env) in table.items() if (sid == session and pid != session) or needle in env}
    return sorted(descendants(roots, table) & set(table))


def listening(pids: set[int] | list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state held by one of ``pids`` (via ``ss``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True, timeout=30).stdout
    wanted, found = set(pids), []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 6:
            continue
        address, _, port = cols[3].rpartition(":")
        address = address.strip("[]").removeprefix("::ffff:")
        for pid in re.findall(r"pid=(\d+)", cols[5]):
            if int(pid) in wanted:
                found.append((address, int(port), int(pid)))
    return sorted(set(found))


@dataclass
class RayNode:
    """One `ray start` of this cluster: its address, pinned ports and CLI output."""

    ip: str | None
    num_cpus: int
    marker: str
    temp_dir: str
    ports: dict[str, int]
    output: str = ""  # stdout + stderr of `ray start`
    port_files_before: tuple[str, ...] = ()  # agents' port files of other nodes in a shared temp dir
    command: str = ""
    head: bool = False
    returncode: int = 0
    session: int = -1  # session id of the daemons: the pid of the `ray start` that made them


@dataclass
class RayCluster:
    """Head plus extra nodes on this machine; use as a context manager or call :meth:`stop`."""

    token: str = field(default_factory=lambda: secrets.token_hex(16))
    nodes: list[RayNode] = field(default_factory=list)
    local_only: bool = True
    shared_temp_dir: bool = False  # every node uses the head's --temp-dir

    @property
    def env(self) -> dict[str, str]:
        """Environment for clients of this cluster (`ray job ...`, drivers): its token, no RAY_ADDRESS,
        and the single-node switch as the head has it (a driver of a multi-node cluster needs "1")."""
        # Not the test process's own pins: an in-process FSDP worker of an earlier test may have set
        # the gloo/nccl interface for its own rendezvous; the cluster's ranks choose their own.
        dropped = ("RAY_ADDRESS", MARKER, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, **{SINGLE_NODE_ENV: "0" if self.local_only else "1"})
        return env

    @property
    def head(self) -> RayNode:
        if not self.nodes or not self.nodes[0].head:
            raise RuntimeError("no head started")
        return self.nodes[0]

    @property
    def gcs_address(self) -> str:
        """host:port of the GCS, as nodes and drivers join it."""
        return f"{self.head.ip or '127.0.0.1'}:{self.head.ports['port']}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.head.ports['dashboard-port']}"

    def start_head(self, num_cpus: int, *, local_only: bool = True, include_dashboard: bool = True) -> RayNode:
        """Start the head with ``num_cpus`` logical CPUs; see the module doc for ``local_only``."""
        if self.nodes:
            raise RuntimeError("this cluster already has a head")
        self.local_only = local_only
        args = ["--head", "--dashboard-host=127.0.0.1", f"--include-dashboard={include_dashboard}"]
        if local_only:
            args.append("--node-ip-address=127.0.0.1")
        return self._start(args, HEAD_PORTS + NODE_PORTS, num_cpus, ip="127.0.0.1" if local_only else None,
                           head=True, single_node=local_only)

    def add_node(self, num_cpus: int, *, ip: str = "127.0.0.2") -> RayNode:
        """Join a node with node IP ``ip`` (a loopback address other than 127.0.0.1 works)."""
        if not self.nodes:
            raise RuntimeError("start the head first")
        if self.local_only:
            raise ValueError("a head started with local_only=True cannot take other nodes in Ray 2.60; "
                             "start it with local_only=False")
        args = [f"--address={self._gcs_for_nodes()}", f"--node-ip-address={ip}"]
        return self._start(args, NODE_PORTS, num_cpus, ip=ip, head=False, single_node=False)

    def _gcs_for_nodes(self) -> str:
        return f"127.0.0.1:{self.head.ports['port']}"  # Ray resolves 127.0.0.1 to the head's own address

    def _start(self, args: list[str], port_names: tuple[str, ...], num_cpus: int, *, ip: str | None,
               head: bool, single_node: bool) -> RayNode:
        failures = []
        for _attempt in range(2):
            node = self._start_once(args, port_names, num_cpus, ip=ip, head=head, single_node=single_node)
            if node.returncode:
                problem = f"{node.command}\nexit {node.returncode}\n{node.output}"
            else:
                problem = _agent_http_problem(node)
            if not problem:
                self.nodes.append(node)
                return node
            failures.append(problem)
            self._kill([node])
            self._remove_temp_dir(node)
            if not any(word in problem.lower() for word in RETRY_ON):
                break
        raise RuntimeError("`ray start` failed:\n" + "\n--- retried with fresh ports ---\n".join(failures))

    def _start_once(self, args: list[str], port_names: tuple[str, ...], num_cpus: int, *, ip: str | None,
                    head: bool, single_node: bool) -> RayNode:
        names = port_names + (ENV_PORTS if head else ())
        ports = dict(zip(names, free_ports(len(names))))
        marker = secrets.token_hex(8)
        if self.shared_temp_dir and not head:
            temp_dir = self.head.temp_dir
        else:
            temp_dir = tempfile.mkdtemp(prefix="rlpad-ray-")  # short: Ray's socket paths live under it
        before = tuple(glob.glob(_agent_port_files(temp_dir)))
        env = self.env
        env.update({MARKER: marker, SINGLE_NODE_ENV: "0" if single_node else "1"})
        env.update({name: str(ports[name]) for name in ENV_PORTS if name in ports})
        cmd = [RAY, "start", *args, f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}", "--disable-usage-stats",
               "--min-worker-port=0", "--max-worker-port=0",  # workers bind OS-chosen ports: no range to collide
               *(f"--{name}={ports[name]}" for name in port_names)]
        # A new session keeps the daemons out of pytest's process group; the marker finds them.
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as proc:
            try:
                out, err = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                err += "\n(`ray start` timed out after 180 s)"
        return RayNode(ip=ip, num_cpus=num_cpus, marker=marker, temp_dir=temp_dir, ports=ports, head=head,
                       returncode=proc.returncode or 0, session=proc.pid, port_files_before=before,
                       command="$ " + " ".join(cmd), output=f"{out}\n{err}")

    def _remove_temp_dir(self, node: RayNode) -> None:
        """Remove ``node``'s temp dir unless a node of this cluster still uses it."""
        if not any(n.temp_dir == node.temp_dir for n in self.nodes if n is not node):
            shutil.rmtree(node.temp_dir, ignore_errors=True)

    def pids(self, node: RayNode | None = None) -> list[int]:
        """Live processes of ``node`` (default: every node of this cluster)."""
        return sorted({p for n in ([node] if node else self.nodes) for p in node_pids(n.marker, n.session)})

    def stop_node(self, node: RayNode, timeout: float = 30.0) -> None:
        """End ``node``'s processes (SIGTERM, then SIGKILL) and check that none is left."""
        self._kill([node], timeout)
        self.nodes.remove(node)
        self._remove_temp_dir(node)

    def stop(self, timeout: float = 30.0) -> None:
        """End every process this cluster started, newest node first; raise if any survives."""
        nodes, self.nodes = self.nodes[::-1], []
        self._kill(nodes, timeout)
        for node in nodes:
            self._remove_temp_dir(node)

    def _kill(self, nodes: list[RayNode], timeout: float = 30.0) -> None:
        """SIGTERM the nodes' processes, SIGKILL what is left after a grace period, until none is left."""
        start = time.monotonic()
        signalled: set[int] = set()
        while alive := {p for n in nodes for p in node_pids(n.marker, n.session)}:
            waited = time.monotonic() - start
            if waited > timeout:
                raise RuntimeError(f"Ray processes {sorted(alive)} survived SIGKILL")
            sig = signal.SIGKILL if waited > min(5.0, timeout / 2) else signal.SIGTERM
            for pid in alive - signalled if sig == signal.SIGTERM else alive:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            signalled |= alive
            time.sleep(0.2)

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _agent_port_files(temp_dir: str) -> str:
    """The glob of the files in which nodes' dashboard agents record their HTTP port (one per node)."""
    return os.path.join(temp_dir, "session_latest", "dashboard_agent_listen_port_*")


def _agent_http_problem(node: RayNode, timeout: float = 60.0) -> str:
    """Wait for the node's dashboard agent to record its HTTP port (the job API goes through it).

    `ray start` succeeds even when the agent could not bind that port; the agent then records -1.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in set(glob.glob(_agent_port_files(node.temp_dir))) - set(node.port_files_before):
            with open(path) as f:
                value = f.read().strip()
            if value == "-1":
                return (f"{node.command}\n{node.output}\nthe dashboard agent failed to bind its HTTP port "
                        f"{node.ports.get('dashboard-agent-listen-port')}: address already in use?")
            if value:
                return ""
        time.sleep(0.5)
    return f"{node.command}\n{node.output}\nthe dashboard agent did not record its HTTP port within {timeout:.0f} s"


def submit_job(address: str, env: dict[str, str], working_dir: str, entry: list[str],
               timeout_s: float = 900, env_vars: dict[str, str] | None = None) -> tuple[str, str, str]:
    """`ray job submit --no-wait` of ``entry`` (``env_vars``: the job's runtime env), then wait for
    its end; returns (job id, status, logs)."""
    runtime_env = ["--runtime-env-json", json.dumps({"env_vars": env_vars})] if env_vars else []
    submit = subprocess.run([RAY, "job", "submit", "--address", address, "--working-dir", working_dir, *runtime_env,
                             "--no-wait", "--", *entry], env=env, capture_output=True, text=True, timeout=300)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job_id = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)
    deadline, status = time.time() + timeout_s, ""
    while time.time() < deadline:
        status = subprocess.run([RAY, "job", "status", "--address", address, job_id], env=env,
                                capture_output=True, text=True, timeout=60).stdout
        if re.search(r"succeeded|failed|stopped", status, re.IGNORECASE):
            break
        time.sleep(3)
    logs = subprocess.run([RAY, "job", "logs", "--address", address, job_id], env=env,
                          capture_output=True, text=True, timeout=60).stdout
    return job_id, status, logs
