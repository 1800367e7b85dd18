"""Local Ray stays on the loopback, and the test cluster helper stops exactly what it started.

The first test needs no Ray: a fake `ray start` (a session leader that leaves daemons behind, one
of which starts a session of its own, like a job driver, and has a child without the marker,
like a retitled worker) and a bystander process with the same environment but no marker.
"""

import json
import os
import secrets
import subprocess
import sys

import pytest
from processes import alive
from ray_cluster import MARKER, SINGLE_NODE_ENV, RayCluster, RayNode, node_pids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]

# A job driver: a session of its own, and a child whose environment lacks the marker.
DRIVER = f"""
import subprocess, sys, time
child = subprocess.Popen({SLEEP!r}, env={{}})
print(child.pid, flush=True)
time.sleep(600)
"""
# `ray start`: leaves daemons behind and exits at once; they live on, reparented.
FAKE_RAY_START = f"""
import subprocess, sys
same_session = subprocess.Popen({SLEEP!r})
driver = subprocess.Popen([sys.executable, "-c", {DRIVER!r}], start_new_session=True, stdout=subprocess.PIPE, text=True)
print(same_session.pid, driver.pid, driver.stdout.readline().strip(), flush=True)
"""


# workers before ray, as rlpad.train does; prints the TCP sockets Ray's processes listen on.
LOCAL_RAY = f"""
import json, os, sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from workers.launcher import init_local_ray
import ray
from ray_cluster import descendants, listening
init_local_ray(1, log_to_driver=False)
print(json.dumps(listening(descendants({{os.getpid()}}))))
ray.shutdown()
"""


def test_stop_ends_the_nodes_processes_and_nothing_else():
    marker = "fake-node"
    env = dict(os.environ, **{MARKER: marker})
    bystander = subprocess.Popen(SLEEP, env={k: v for k, v in env.items() if k != MARKER}, start_new_session=True)
    with subprocess.Popen([sys.executable, "-c", FAKE_RAY_START], env=env, stdout=subprocess.PIPE, text=True,
                          start_new_session=True) as leader:
        daemons = [int(p) for p in leader.stdout.readline().split()]
    try:
        assert len(daemons) == 3
        # Own session, marker in its own session, descendant without the marker: all found; not the bystander.
        assert set(node_pids(marker, leader.pid)) == set(daemons)
        cluster = RayCluster(nodes=[RayNode(ip=None, num_cpus=0, marker=marker, temp_dir="/nonexistent",
                                            ports={}, session=leader.pid)])
        cluster.stop(timeout=10)
        assert not any(alive(p) for p in daemons)
        assert alive(bystander.pid)  # negative control: same environment but no marker, another session
    finally:
        for pid in [bystander.pid, *daemons]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        bystander.wait()


@pytest.mark.ray
def test_local_ray_of_the_launcher_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", SINGLE_NODE_ENV)}
    env.update(RAY_AUTH_TOKEN=secrets.token_hex(16))  # token auth without ~/.ray/auth_token

    def sockets(**extra: str) -> tuple[list, str]:
        out = subprocess.run([sys.executable, "-c", LOCAL_RAY], env={**env, **extra}, cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr

    listening, _ = sockets()
    assert len(listening) >= 3, listening  # GCS, node manager, object manager at least
    assert {addr for addr, _, _ in listening} == {"127.0.0.1"}, listening
    # Negative control: multi-node mode (what Ray does when ray is imported first) listens elsewhere.
    listening, stderr = sockets(**{SINGLE_NODE_ENV: "1"})
    assert {addr for addr, _, _ in listening} - {"127.0.0.1"}, listening
    assert "not 127.0.0.1 only" in stderr
