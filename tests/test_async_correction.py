"""The rollout correction at k >= 1 corrects: on a one-token bandit whose behaviour policy (the engine,
versions behind) differs from the proximal one (the actor before the update), the expected policy
gradient of each mode, enumerated exactly over the actions, against the true gradient of E_pi[r].

The batch goes through the trainer's own correction (``Trainer._corrected``, k = 1) and the real
policy loss (rlpad.algorithms.losses.compute_policy_loss); the oracle is the score-function gradient in float64.
"""

from __future__ import annotations

import pytest
import torch

from rlpad.algorithms.losses import compute_policy_loss
from rlpad.batch import Batch
from rlpad.recipe.load import load_config
from rlpad.training.trainer import Trainer

REWARD = torch.tensor([1.0, -0.5, 2.0, 0.25], dtype=torch.float64)
PI = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)  # proximal = the policy being trained, at the update
BEHAVIOUR_IN_BAND = torch.tensor([0.15, 0.25, 0.3, 0.3], dtype=torch.float64)  # pi / mu in [1/2, 2]: nothing dropped
BEHAVIOUR_DROPS_0 = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64)  # pi / mu = 0.25 for action 0: dropped


class Submits:
    """Enough of the workers for the trainer to take k >= 1 (its correction needs no call)."""

    def submit_generate(self, batch, seed):
        raise AssertionError("not called")


class Loader:
    def __len__(self):
        return 1

    def next_batch(self):
        raise AssertionError("not called")


def trainer(mode: str, k: int) -> Trainer:
    config = load_config(None, ["actor_rollout_ref.rollout.n=2", f"trainer.max_off_policy_steps={k}",
                                f"algorithm.rollout_correction.mode={mode}",
                                "algorithm.rollout_correction.threshold=2.0", "trainer.total_training_steps=1"])
    return Trainer(config, Submits(), None, Loader(), None)


def expected_gradient(mode: str, behaviour: torch.Tensor, k: int = 1) -> torch.Tensor:
    """E over a ~ behaviour of the gradient wrt the logits of the step's loss, one row per action.

    Row a's advantage is ``K * mu(a) * r(a)`` and the loss a token-mean over K tokens, so the loss is
    ``sum_a mu(a) * loss(a)``: the expectation of the one-sample loss, whatever the correction drops."""
    logits = PI.log().clone().requires_grad_(True)
    n = len(PI)
    old = PI.log().unsqueeze(1)
    batch = Batch({"old_log_probs": old, "rollout_log_probs": behaviour.log().unsqueeze(1),
                   "response_mask": torch.ones(n, 1, dtype=torch.long)})
    corrected, _ = trainer(mode, k)._corrected(batch)
    log_prob = torch.log_softmax(logits, 0).unsqueeze(1)  # equals old: the first mini-batch, ratio 1
    advantages = (n * behaviour * REWARD).unsqueeze(1)
    weights = corrected["rollout_is_weights"] if "rollout_is_weights" in corrected else None
    loss, _ = compute_policy_loss(old, log_prob, advantages, corrected["response_mask"], global_tokens=float(n),
                                  rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(-loss, logits)  # ascent direction
    return grad


def true_gradient(kept: torch.Tensor | None = None) -> torch.Tensor:
    """d/dlogits of sum_a pi(a) r(a) (over ``kept`` actions only): sum_a pi(a) r(a) (e_a - pi)."""
    kept = torch.ones(len(PI), dtype=torch.bool) if kept is None else kept
    eye = torch.eye(len(PI), dtype=torch.float64)
    return sum(PI[a] * REWARD[a] * (eye[a] - PI) for a in range(len(PI)) if kept[a])


@pytest.mark.parametrize("mode", ["token_tis", "seq_mask"])
def test_every_mode_gives_the_true_gradient_when_nothing_is_clipped_or_dropped(mode):
    got = expected_gradient(mode, BEHAVIOUR_IN_BAND)
    torch.testing.assert_close(got, true_gradient(), rtol=1e-12, atol=1e-14)
    # Negative control: the gradient a mask alone gives (weight 1 on every kept sample) is the behaviour
    # policy's; the synchronous seq_mask (k = 0, kernel noise only) is exactly that, and far off here.
    unweighted = expected_gradient("seq_mask", BEHAVIOUR_IN_BAND, k=0)
    assert (unweighted - true_gradient()).abs().max() > 0.01


def test_seq_mask_weights_the_sequences_it_keeps():
    got = expected_gradient("seq_mask", BEHAVIOUR_DROPS_0)
    kept = torch.tensor([False, True, True, True])
    torch.testing.assert_close(got, true_gradient(kept), rtol=1e-12, atol=1e-14)  # the dropped action's term only
    tis = expected_gradient("token_tis", BEHAVIOUR_DROPS_0)  # nothing clipped (max weight 2.0 = C): exact
    torch.testing.assert_close(tis, true_gradient(), rtol=1e-12, atol=1e-14)
    assert (expected_gradient("seq_mask", BEHAVIOUR_DROPS_0, k=0) - true_gradient(kept)).abs().max() > 0.01
