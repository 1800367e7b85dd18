"""A 2-node Ray cluster on this machine, the tiny GRPO job submitted with ``ray job submit``.

The head takes the host's address (Ray 2.60 turns ``--node-ip-address=127.0.0.1`` into it for
any cluster that may take other nodes); the second node is 127.0.0.2 (Linux routes all of
127.0.0.0/8 to the loopback), so the two nodes have distinct IPs on one machine.

The cluster runs twice (the one-node reference job once, on the first): each node with its own --temp-dir, so the worker node does not see the
driver's copy of the working dir (as on a real second machine), and both nodes in one temp dir
(as two raylets on one host by default), where they share one unpacked copy of the job's
working-dir package that either node's runtime-env agent may replace: nothing the driver builds
may live in it (the warm start goes to the per-user cache, here ``XDG_CACHE_HOME=<repo>/.cache``,
the tests' shared warm-start cache). The test stops only the processes it started
(tests/ray_cluster.py; never ``ray stop``).
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from ray_cluster import RayCluster, submit_job
from run_compare import assert_same_metrics, compared_keys
from workers.net import interface_towards

pytest.importorskip("vllm")
pytestmark = [pytest.mark.ray, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_HOME = os.path.join(ROOT, ".cache")  # the job's $XDG_CACHE_HOME: the warm start in <repo>/.cache/rlpad


@pytest.fixture(scope="module", params=["own_temp_dirs", "shared_temp_dir"])
def two_nodes(request):
    """A head (its IP: the host's) and a node on 127.0.0.2, 3 CPUs each; yields (dashboard URL, env).

    tests/ray_cluster.py: each node has its own temp dir (or, the second time, both the head's) and
    ports, the cluster its own token, and stopping it ends exactly its processes.
    """
    # On a loaded machine a second raylet may need more than Ray's 30 s to register with the GCS.
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "90")  # below ray_cluster.py's 180 s limit
    cluster = RayCluster(shared_temp_dir=request.param == "shared_temp_dir")
    try:
        cluster.start_head(num_cpus=3, local_only=False)
        cluster.add_node(num_cpus=3, ip="127.0.0.2")
        yield cluster.dashboard_url, cluster.env
    finally:
        cluster.stop()


def _submit(address: str, env: dict, out_dir: str, *overrides: str) -> tuple[str, str, str]:
    """Submit the tiny GRPO job, wait for it; returns (submission id, final status, logs)."""
    entry = [sys.executable, "-m", "rlpad.train", "--config", "recipes/grpo_tiny.yaml", "trainer.total_training_steps=2",
             "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.default_local_dir={out_dir}",
             "trainer.logger=[jsonl]", *overrides]
    return submit_job(address, env, ROOT, entry, env_vars={"XDG_CACHE_HOME": CACHE_HOME})


STATE = """
import json, sys
from ray.util.state import list_actors, list_nodes
address = sys.argv[1]
nodes = {n.node_id: n.node_ip for n in list_nodes(address=address)}
actors = list_actors(address=address, filters=[("class_name", "=", "ActorWorker")], detail=True, limit=1000)
print(json.dumps({"nodes": nodes, "pids": {a.pid: a.node_id for a in actors}}))
"""


def _state(address: str, env: dict) -> tuple[dict[str, str], dict[int, str]]:
    """(node id -> node IP, actor pid -> node id of every ActorWorker) from the Ray state API."""
    out = subprocess.run([sys.executable, "-c", STATE, address], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    state = json.loads(out.stdout.strip().splitlines()[-1])
    return state["nodes"], {int(pid): node for pid, node in state["pids"].items()}


def _metrics(out_dir: str) -> dict[int, dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


ONE_NODE: dict[int, dict] = {}  # the one-node run's metrics, filled by the first two-node test


def test_grpo_job_on_two_nodes_equals_one_node(two_nodes, tmp_path):
    address, env = two_nodes
    two, one = str(tmp_path / "two_nodes"), str(tmp_path / "one_node")
    _, status, logs = _submit(address, env, two, "trainer.nnodes=2", "trainer.n_gpus_per_node=1")
    assert re.search(r"succeeded", status, re.IGNORECASE), f"{status}\n{logs[-4000:]}"

    # Where the actor ranks ran, from the Ray state API (queried in a subprocess: token auth is read
    # at import), matched to this job's ranks by pid.
    nodes, node_of_pid = _state(address, env)
    assert len(nodes) == 2 and "127.0.0.2" in nodes.values()
    head_ip = next(ip for ip in nodes.values() if ip != "127.0.0.2")  # the host's address
    with open(os.path.join(two, "workers.json")) as f:
        ranks = json.load(f)["actor"]
    ran_on = [nodes[node_of_pid[r["pid"]]] for r in ranks]
    assert ran_on == [head_ip, "127.0.0.2"]  # rank 0 next to the driver on the head, rank 1 on the other node

    # Every rank used rank 0's node IP as MASTER_ADDR, and the interface that reaches it.
    assert [r["node_ip"] for r in ranks] == ran_on
    assert {r["master_addr"] for r in ranks} == {ranks[0]["node_ip"]}
    assert {r["master_port"] for r in ranks} == {ranks[0]["master_port"]}
    expected_ifname = interface_towards(head_ip)[0]
    assert {r["socket_ifname"] for r in ranks} == {expected_ifname}
    # The warm start was built by the driver on the head: rank 0 read it there, rank 1 a shipped copy.
    (model_path,) = ranks[0]["paths_read"]
    assert ranks[0]["paths_read"][model_path] == model_path
    assert model_path.startswith(os.path.join(CACHE_HOME, "rlpad", "sft-"))  # the per-user cache, not Ray's package
    shipped = ranks[1]["paths_read"][model_path]
    assert shipped != model_path and os.path.basename(shipped).startswith(os.path.basename(model_path))

    if not ONE_NODE:  # the same job on one node: run once, the reference for either temp-dir layout
        _, status, logs = _submit(address, env, one, "trainer.nnodes=1", "trainer.n_gpus_per_node=2")
        assert re.search(r"succeeded", status, re.IGNORECASE), f"{status}\n{logs[-4000:]}"
        with open(os.path.join(one, "workers.json")) as f:
            assert {r["node_ip"] for r in json.load(f)["actor"]} == {head_ip}
        ONE_NODE.update(_metrics(one))
    a, b = _metrics(two), ONE_NODE
    assert sorted(a) == sorted(b) == [1, 2]
    assert {"actor/pg_loss", "reward/mean"} <= set(compared_keys(a[1], b[1]))
    assert_same_metrics(a, b)  # two nodes vs one: another gloo reduction path (tests/run_compare.py)


@pytest.mark.parametrize("two_nodes", ["own_temp_dirs"], indirect=True)  # the same checks either way
def test_cluster_without_room_fails_fast_naming_nodes(two_nodes, tmp_path):
    address, env = two_nodes
    start = time.time()
    _, status, logs = _submit(address, env, str(tmp_path / "big"), "trainer.nnodes=2", "trainer.n_gpus_per_node=4")
    assert re.search(r"failed", status, re.IGNORECASE), status
    assert "needs 2 node(s) with {CPU: 4} each; 0 of the cluster's 2 alive node(s) fit" in logs, logs[-3000:]
    assert "node 127.0.0.2 has {CPU: 3}, missing {CPU: 1}" in logs, logs[-3000:]
    assert time.time() - start < 300
    # The groups fit (1 CPU per node) but 5 engines do not: the whole cluster is checked first.
    _, status, logs = _submit(address, env, str(tmp_path / "engines"), "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                              "actor_rollout_ref.rollout.num_replicas=5")
    assert re.search(r"failed", status, re.IGNORECASE), status
    assert "actor groups and 5 rollout engine(s) needs {CPU: 7} in the cluster" in logs, logs[-3000:]
    assert "missing {CPU: 1}" in logs, logs[-3000:]
