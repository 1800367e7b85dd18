"""The choices of the config's enumerated keys, each defined once (torch-free, so loading stays light).

Keys whose choices come from a registry derive from it instead: algorithm.adv_estimator
(rlpad.algorithms.advantages.ESTIMATORS), actor_rollout_ref.rollout.name (rlpad.rollout.BACKENDS),
trainer.logger (rlpad.training.metrics.LOGGERS).
"""

from __future__ import annotations

__all__ = [
    "ATTN_IMPLEMENTATIONS", "BACKENDS", "DEVICES", "DISTILLATION_LOSS_MODES", "DTYPES", "FILTER_METRICS",
    "KL_KINDS", "LOG_LEVELS", "LOSS_AGG_MODES", "OLD_LOG_PROB_LAYOUTS", "REWARD_MANAGERS",
    "ROLLOUT_CORRECTION_MODES", "SAMPLED_TOKEN_MODES", "TOPK_MODES", "TRUNCATION_MODES", "VLLM_MAX_TEMPERATURE",
    "VL_MODEL_TYPES", "kl_kind",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # each may end in "+" (straight-through)


def kl_kind(kind: str) -> tuple[str, bool]:
    """``(estimator, straight_through)`` of a KL kind: ``"k3+"`` -> ``("k3", True)`` (a trailing ``+``
    keeps the estimator's value and takes k2's gradient). ValueError naming the choices otherwise."""
    base = kind.removesuffix("+")
    if base not in KL_KINDS:
        raise ValueError(f"unknown kl kind {kind!r}; choose one of {', '.join(KL_KINDS)} (optionally with a "
                         "trailing '+')")
    return base, kind.endswith("+")


# distillation.distillation_loss.loss_mode (verl's names; the math: rlpad/algorithms/distillation.py):
# per-token estimators of KL(student || teacher) at the sampled token, and the forward KL over the teacher's top-k
SAMPLED_TOKEN_MODES = KL_KINDS  # without verl's straight-through "+": its distillation registry has none
TOPK_MODES = ("forward_kl_topk",)
DISTILLATION_LOSS_MODES = SAMPLED_TOKEN_MODES + TOPK_MODES
TRUNCATION_MODES = ("error", "left", "right")  # data.truncation: a prompt longer than max_prompt_length
# model.attn_implementation (what each means and needs: rlpad/core/attn_choice.py)
VL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")  # the vision-language model_types the scoring core runs (rlpad.core.vision)
ATTN_IMPLEMENTATIONS = ("auto", "flash_attention_2", "rlpad_varlen", "sdpa")
BACKENDS = ("ray", "local")  # trainer.backend: Ray worker groups, or everything in the driver process
DEVICES = ("auto", "cpu", "cuda")  # trainer.device; auto: cuda when torch sees a GPU (rlpad.topology.resolve_device)
ROLLOUT_CORRECTION_MODES = ("none", "token_tis", "seq_mask")  # algorithm.rollout_correction.mode
# algorithm.filter_groups.metric: the per-response value whose spread within a group decides if it is kept
# (rlpad/training/dynamic_sampling.py); each is read before the overlong shaping
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses a request above it ("temperature must be in [0, 2]")
OLD_LOG_PROB_LAYOUTS = ("update", "log_prob")  # actor_rollout_ref.actor.old_log_prob_layout
LOG_LEVELS = ("error", "warning", "info", "debug")  # trainer.log_level, most to least severe
# model.dtype / rollout.dtype: the accepted names, each -> its canonical name (torch.<name>, vLLM's dtype)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
# reward.reward_manager.name: verl's reward managers rlpad has. Each scores each response with the reward
# function (reward.fn); dapo's overlong shaping is reward_model.overlong_buffer, which works under any of them;
# gdpo (verl's, for adv_estimator=gdpo) keeps every key of a returned dict, as the others do in rlpad
REWARD_MANAGERS = ("naive", "dapo", "gdpo")
