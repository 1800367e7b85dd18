"""The RL math on ``(B, R)`` response tensors, pure torch: advantage estimators (the registry in
advantages.py, their math in estimators.py), policy / value losses and KL (losses.py), the
policy-loss modes (the registry in policy_loss.py, their math in loss_modes.py) and the
rollout-vs-actor mismatch correction (rollout_correction.py). Imports only rlpad.config and
rlpad.batch; the registries stay torch-free."""
