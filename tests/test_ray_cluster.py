"""Local Ray stays on the loopback, and the test cluster helper stops exactly what it started.

The first test needs no Ray: a fake `ray start` (a session leader that leaves daemons behind, one
of which starts a session of its own, like a job driver, and has a child without the marker,
like a retitled worker) and a bystander process with the same environment but no marker.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from ray_cluster import MARKER, RayCluster, RayNode, listening, node_pids

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


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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
