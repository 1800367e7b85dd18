"""Where the ranks of a worker group run: nodes chosen up front, one placement group per node.

Like verl's resource pools, a group of ``nnodes x ranks_per_node`` ranks reserves one
``STRICT_PACK`` placement group per node (a bundle per rank) and numbers the ranks node by node
(the driver's node first when it has room, then the others in IP order). Unlike a plain pool, every bundle also asks for a sliver of the node's own
``node:<ip>`` resource, so each placement group lands on the node it was planned for: on CPU a
"gpu slot" is one CPU, and without the pin Ray may pack two nodes' bundles onto one machine.

:func:`plan_nodes` checks the cluster before anything is reserved and raises ``ValueError``
naming, per node, what is missing; :func:`reserve` waits for the placement groups with a timeout.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

__all__ = ["Node", "alive_nodes", "engine_resources", "my_placement", "node_bundle", "plan_nodes", "release", "reserve"]

NODE_PIN = 0.001  # share of a node's ``node:<ip>`` resource each bundle asks for (the node has 1.0)


@dataclass(frozen=True)
class Node:
    """An alive Ray node: id, IP and total resources."""

    node_id: str
    ip: str
    resources: dict[str, float]


def _ip_key(ip: str) -> tuple[int, Any]:
    try:
        return 0, ipaddress.ip_address(ip)
    except ValueError:
        return 1, ip


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes, in IP order."""
    nodes = [Node(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {}))) for n in ray.nodes() if n["Alive"]]
    return sorted(nodes, key=lambda n: (_ip_key(n.ip), n.node_id))


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items()) if not k.startswith(("node:", "memory",
                                                                                                     "object_store"))) + "}"


def _missing(have: dict[str, float], need: dict[str, float]) -> dict[str, float]:
    """What ``have`` lacks of ``need``, per resource."""
    return {k: v - have.get(k, 0.0) for k, v in need.items() if have.get(k, 0.0) < v}


def plan_nodes(nnodes: int, per_node: dict[str, float], *, what: str, first: str | None = None) -> list[Node]:
    """The first ``nnodes`` alive nodes whose total resources hold ``per_node``: node ``first``
    (a node id; by default the caller's, the driver's node) if it fits, then the others in IP order.

    ``per_node``: what one node must hold for everything planned on it (all groups' ranks of
    that node). Raises ``ValueError`` naming each node's shortfall when fewer nodes fit.
    Rank 0 lands on the first node, so by default next to the driver.
    """
    if nnodes < 1:
        raise ValueError(f"{what}: nnodes must be >= 1, got {nnodes}")
    first = first or ray.get_runtime_context().get_node_id()
    nodes = sorted(alive_nodes(), key=lambda n: n.node_id != first)  # stable: IP order after the first
    ips = [n.ip for n in nodes]
    if len(set(ips)) != len(ips):
        raise ValueError(f"{what}: several alive nodes share an IP ({ips}); ranks are pinned to nodes by IP")
    fit, report = [], []
    for node in nodes:
        missing = _missing(node.resources, per_node)
        if missing:
            report.append(f"node {node.ip} has {_fmt(node.resources)}, missing {_fmt(missing)}")
        else:
            fit.append(node)
    if len(fit) < nnodes:
        lines = "; ".join(report) or "no alive node"
        raise ValueError(
            f"{what} needs {nnodes} node(s) with {_fmt(per_node)} each; {len(fit)} of the cluster's {len(nodes)} "
            f"alive node(s) fit ({', '.join(n.ip for n in fit) or 'none'}). {lines}"
        )
    return fit[:nnodes]


def engine_resources(replicas: int, tensor_parallel: int, gpus: int) -> dict[str, float]:
    """The Ray resources of ``replicas`` vLLM engines together: one CPU each, and ``tensor_parallel`` GPUs
    each where ``gpus`` (1 on CUDA, else 0)."""
    return {"CPU": float(replicas)} | ({"GPU": float(replicas * tensor_parallel)} if gpus else {})


def check_cluster_room(needs: dict[str, float], *, what: str) -> None:
    """``ValueError`` unless the cluster's alive nodes hold ``needs`` in total (resources asked for
    outside the per-node plan, e.g. rollout engines that Ray may place on any node)."""
    totals: dict[str, float] = {}
    for node in alive_nodes():
        for k, v in node.resources.items():
            totals[k] = totals.get(k, 0.0) + v
    missing = _missing(totals, needs)
    if missing:
        raise ValueError(f"{what} needs {_fmt(needs)} in the cluster, which has {_fmt(totals)}: missing {_fmt(missing)}")


def node_bundle(node: Node, bundle: dict[str, float]) -> dict[str, float]:
    """``bundle`` pinned to ``node`` (through its ``node:<ip>`` resource)."""
    return {**bundle, f"node:{node.ip}": NODE_PIN}


def reserve(nodes: list[Node], ranks_per_node: int, bundle: dict[str, float], *, what: str,
            timeout_s: float) -> list[PlacementGroup]:
    """One STRICT_PACK placement group of ``ranks_per_node`` bundles per node; waits ``timeout_s``.

    On timeout every group is removed and ``RuntimeError`` names the nodes still waiting and the
    resources available at that moment (other jobs may hold what the totals promised).
    """
    pgs = [placement_group([node_bundle(n, bundle) for _ in range(ranks_per_node)], strategy="STRICT_PACK")
           for n in nodes]
    refs = [pg.ready() for pg in pgs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        waiting = [n.ip for n, ref in zip(nodes, refs) if ref not in ready]
        release(pgs)
        raise RuntimeError(
            f"{what}: could not reserve {ranks_per_node} x {_fmt(bundle)} on node(s) {waiting} within "
            f"{timeout_s:.0f} s (available now in the cluster: {_fmt(ray.available_resources())})"
        )
    return pgs


def release(pgs: list[PlacementGroup]) -> None:
    """Remove placement groups (ignoring ones already gone)."""
    for pg in pgs:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed
            pass


def my_placement() -> dict[str, Any]:
    """Where the calling Ray actor runs, as Ray reports it: its node, placement group id (None
    outside one) and the resources Ray assigned to it (bundle-indexed names such as
    ``CPU_group_1_<pg id>`` inside a placement group bundle)."""
    ctx = ray.get_runtime_context()
    return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "placement_group_id": ctx.get_placement_group_id(),
            "assigned_resources": ctx.get_assigned_resources()}
