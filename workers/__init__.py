"""The Ray side of rlpad: FSDP2 actor/reference and critic workers, worker groups, the rollout worker.

``workers.actor``, ``workers.critic`` and ``workers.fsdp`` run without Ray (one process, world 1);
``workers.group`` starts them as Ray actors in one torch.distributed group.
"""
