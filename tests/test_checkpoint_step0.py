"""A checkpoint saved before the first update (step 0) changes nothing a resume can observe.

torch's ``get_state_dict`` creates a missing optimizer state by running ``optimizer.step()`` on
zero gradients; AdamW then counts that step, so every later bias correction is off by one. Here a
worker that saves at step 0 (then goes on, or is resumed in a fresh worker) must equal one that
never saved, bitwise: weights, AdamW step counts and moments, LR, metrics.
"""

import pytest
import torch

from rlpad.batch import WORKER_SECONDS
from rlpad.embedded.synthetic import ppo_batch
from test_workers_local import P, R, VOCAB, actor_config, critic_config
from workers.actor import ActorWorker
from workers.critic import CriticWorker


def _worker(role: str):
    if role == "actor":
        w = ActorWorker(actor_config(ppo_mini_batch_size=4, use_kl_loss=True), seed=7, device="cpu")
        w.config.actor.optim.lr_warmup_steps = 3
    else:
        w = CriticWorker(critic_config(), seed=7, device="cpu")
        w.config.optim.lr_warmup_steps = 3
    w.init_model()
    return w


def _batches(role: str):
    batches = [ppo_batch(8, P, R, vocab_size=VOCAB, seed=s) for s in (2, 3)]
    if role == "critic":
        for b in batches:
            b["values"] = torch.zeros_like(b["response_mask"], dtype=torch.float32)
    return batches


def _train(w, role: str) -> list[dict]:
    update = w.update_actor if role == "actor" else w.update_critic
    out = []
    for b in _batches(role):
        m = update(b)
        assert m.pop(WORKER_SECONDS) > 0  # timing, not a result
        out.append(m)
    return out


def _observed(w) -> dict:
    """Everything a resume can observe: weights, AdamW state (step, moments), LR schedule, update count."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    state = {f"w/{k}": full(v) for k, v in w.root.state_dict().items()}
    for i, p in enumerate(w.optimizer.param_groups[0]["params"]):
        for k, v in w.optimizer.state[p].items():
            state[f"opt/{i}/{k}"] = full(v)
    state["lr"] = torch.tensor(w.optimizer.param_groups[0]["lr"])
    state["sched"] = torch.tensor(w.scheduler.last_epoch)
    state["update_steps"] = torch.tensor(w.update_steps)
    return state


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_step0_checkpoint_resumes_like_a_run_that_never_saved(tmp_path, role):
    never = _worker(role)
    m_never = _train(never, role)
    s_never = _observed(never)
    assert int(s_never["opt/0/step"]) == 2 * (2 if role == "actor" else 1)  # AdamW steps: mini-batches x updates

    saved = _worker(role)
    saved.save_checkpoint(str(tmp_path / "ck"))  # before the first update
    m_saved = _train(saved, role)  # the run that saved goes on
    assert m_saved == m_never
    _assert_equal(_observed(saved), s_never)

    resumed = _worker(role)
    resumed.load_checkpoint(str(tmp_path / "ck"))
    assert resumed.update_steps == 0
    m_resumed = _train(resumed, role)
    assert m_resumed == m_never
    _assert_equal(_observed(resumed), s_never)
