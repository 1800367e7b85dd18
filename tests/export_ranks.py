"""The rank function of tests/test_export.py's 2-rank export, in a module that imports only the actor (each
spawned rank imports this module, not the test's)."""

import os

from workers.actor import ActorWorker


def two_ranks(rank: int, world: int, port: int, config, ckpt: str, out: str, batch):
    """The run's actor on 2 ranks: its step-2 checkpoint loaded (resharded), scored, saved at 2 ranks, and
    written as an HF folder streamed from the 2 ranks' shards; returns the log-probs of ``batch``."""
    w = ActorWorker(config.actor_rollout_ref, rank=rank, world_size=world, master_port=port, device="cpu", seed=1)
    w.init_model()
    w.load_checkpoint(ckpt)
    lp = w.compute_log_prob(batch)["old_log_probs"]
    w.save_checkpoint(os.path.join(out, "checkpoints", "global_step_2", "actor"))
    w.save_hf(os.path.join(out, "hf2"))
    w.shutdown()
    return lp
