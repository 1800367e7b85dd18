"""Where a config's roles run: the device, the colocated or separate layout, the rollout engines.

The rules config validation (:func:`layout_problems`, from rlpad.recipe.load) and the
launchers (workers/launcher.py, workers/local.py) apply, each written once. What a rollout
backend can do comes from its class (rlpad.rollout.backend_class), never from its name; its
module is imported only when a rule needs it. Torch-free: :func:`resolve_device` asks torch
only for ``trainer.device=auto``.
"""

from __future__ import annotations

from rlpad.config.schema import Config
from rlpad.rollout import BACKENDS, backend_class

__all__ = ["colocated", "layout_problems", "resolve_device", "rollout_replicas"]


def resolve_device(config: Config) -> str:
    """``cpu`` or ``cuda``: ``trainer.device``, where ``auto`` is cuda when torch sees a GPU."""
    if config.trainer.device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.trainer.device


def _pool(config: Config) -> int:
    return config.trainer.n_gpus_per_node * config.trainer.nnodes


def _splits(name: str) -> bool:
    """Whether backend ``name`` can split a step's prompts over several engines."""
    return backend_class(name).seeds_per_prompt


def _splitting_backends() -> str:
    return ", ".join(name for name in BACKENDS if _splits(name))


def _offload_problem(config: Config, on: bool, cuda: bool) -> str | None:
    """``actor.fsdp_config`` offload without the colocated layout (nothing would use the freed memory)."""
    trainer, arr = config.trainer, config.actor_rollout_ref
    fsdp = arr.actor.fsdp_config
    if on or not (fsdp.param_offload or fsdp.optimizer_offload):
        return None
    return ("actor_rollout_ref.actor.fsdp_config.param_offload / optimizer_offload need trainer.colocate=true (they free "
            "the actor's memory for the rollout engine on the same GPU); it resolves to false here "
            f"(colocate={trainer.colocate}, {'cuda' if cuda else 'cpu'}, backend={trainer.backend}, "
            f"tensor_model_parallel_size={arr.rollout.tensor_model_parallel_size})")


def _colocate(config: Config, cuda: bool) -> bool:
    """``trainer.colocate``, or its default: true on CUDA with ``backend=ray``,
    ``tensor_model_parallel_size=1``, a rollout that can fill the pool (one engine per bundle) and
    the synchronous loop (``max_off_policy_steps=0``: asynchronous training needs separate GPUs)."""
    trainer, rollout = config.trainer, config.actor_rollout_ref.rollout
    if trainer.colocate is not None:
        return trainer.colocate
    pool = _pool(config)
    return (cuda and trainer.backend == "ray" and rollout.tensor_model_parallel_size == 1
            and trainer.max_off_policy_steps == 0
            and rollout.num_replicas in (None, pool) and (pool == 1 or _splits(rollout.name)))


def colocated(config: Config, cuda: bool) -> bool:
    """Whether the run uses the colocated layout: ``trainer.colocate``, or its default (true on CUDA
    with ``backend=ray``, ``tensor_model_parallel_size=1``, a rollout backend that can fill the
    pool and ``max_off_policy_steps=0``, false otherwise). Raises ValueError when ``actor.fsdp_config`` offload
    is asked for without it."""
    on = _colocate(config, cuda)
    problem = _offload_problem(config, on, cuda)
    if problem:
        raise ValueError(problem)
    return on


def rollout_replicas(config: Config, cuda: bool) -> int:
    """The number of rollout engines: ``rollout.num_replicas``, or its default.

    Colocated (:func:`colocated`): one engine per ``tensor_model_parallel_size`` bundles of the
    pool. Otherwise the default is one engine per ``tensor_model_parallel_size`` GPUs of the
    rollout's ``n_gpus_per_node x nnodes`` on CUDA, and one engine on CPU or with a backend that
    cannot split a step's prompts (``seeds_per_prompt`` false).
    """
    rollout = config.actor_rollout_ref.rollout
    per_tp = max(1, _pool(config) // rollout.tensor_model_parallel_size)
    if colocated(config, cuda):
        return per_tp
    if rollout.num_replicas is not None:
        return rollout.num_replicas
    if not cuda or not _splits(rollout.name):
        return 1
    return per_tp


def layout_problems(config: Config) -> list[str]:
    """What is wrong with the config's layout (replicas, colocation, offload), as config errors.

    The offload rule is checked here when the layout is known without a device probe
    (``trainer.colocate`` set, or ``trainer.device`` not auto), else by :func:`colocated` at launch.
    """
    problems: list[str] = []
    trainer, rollout = config.trainer, config.actor_rollout_ref.rollout
    pool, known_backend = _pool(config), rollout.name in BACKENDS
    replicas = rollout.num_replicas
    if replicas is not None and replicas < 1:
        problems.append(f"actor_rollout_ref.rollout.num_replicas={replicas} must be >= 1 (or null for the default)")
    elif (replicas or 1) > 1 and known_backend and not _splits(rollout.name):
        problems.append(f"actor_rollout_ref.rollout.num_replicas={replicas}: the {rollout.name} backend seeds a whole "
                        "generate call, not each prompt, so replicas would change the samples; use 1 or a backend "
                        f"that seeds each prompt ({_splitting_backends()})")
    elif trainer.backend == "local" and (replicas or 1) > 1:
        problems.append(f"actor_rollout_ref.rollout.num_replicas={replicas}: trainer.backend=local runs one rollout "
                        "engine in the driver process; use 1 or trainer.backend=ray")
    if trainer.colocate:
        if trainer.backend == "local":
            problems.append("trainer.colocate=true places Ray actors on a shared pool; trainer.backend=local runs "
                            "everything in one process (set trainer.colocate=false or trainer.backend=ray)")
        if rollout.tensor_model_parallel_size != 1:
            problems.append(f"trainer.colocate=true supports actor_rollout_ref.rollout.tensor_model_parallel_size=1 "
                            f"only (got {rollout.tensor_model_parallel_size}): a tensor-parallel engine would span "
                            "several bundles of the pool; set trainer.colocate=false for tensor parallelism")
        elif replicas is not None and replicas != pool:
            problems.append(f"actor_rollout_ref.rollout.num_replicas={replicas}: with trainer.colocate=true "
                            f"every bundle of the pool hosts one engine, so it must be null or {pool} "
                            "(n_gpus_per_node x nnodes / tensor_model_parallel_size)")
        if pool > 1 and known_backend and not _splits(rollout.name):
            problems.append(f"trainer.colocate=true puts one engine on each of the pool's {pool} bundles, and the "
                            f"{rollout.name} backend cannot be split into replicas; use a backend that seeds each prompt "
                            f"({_splitting_backends()}) or trainer.colocate=false")
    k = trainer.max_off_policy_steps
    if k >= 1 and trainer.backend == "local":
        problems.append(f"trainer.max_off_policy_steps={k}: asynchronous training generates in rollout engines of "
                        "their own while the actor trains; trainer.backend=local runs both in one process "
                        "(set trainer.backend=ray or max_off_policy_steps=0)")
    if k >= 1 and trainer.colocate:
        problems.append(f"trainer.max_off_policy_steps={k}: asynchronous training needs the rollout engines on "
                        "resources of their own; trainer.colocate=true time-shares them with the actor (set "
                        "trainer.colocate=false or max_off_policy_steps=0)")
    cuda = {"cpu": False, "cuda": True}.get(trainer.device)
    if trainer.colocate is not None or cuda is not None:
        problem = _offload_problem(config, _colocate(config, bool(cuda)), bool(cuda))
        if problem:
            problems.append(problem)
    return problems
