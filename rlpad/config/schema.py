"""Typed configuration: dataclasses with verl's key names, loaded from YAML recipes.

``load_config(path, overrides)`` lives in :mod:`rlpad.recipe.load`; this module only defines
the schema, so every component can import its section without pulling in YAML handling. The
reward, distillation, rollout and streaming (async_training) sections live in rewards.py, distillation.py,
rollout.py and streaming.py (imported here, so every section is importable from this module), the choices of the
enumerated keys in choices.py, verl's removed / legacy / no-effect keys in verl_keys.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlpad.config.checkpoint import CheckpointConfig
from rlpad.config.distillation import DistillationConfig
from rlpad.config.rewards import RewardConfig, RewardModelConfig
from rlpad.config.rollout import AgentConfig, MultiTurnConfig, RolloutConfig, ValidationSamplingConfig
from rlpad.config.streaming import AsyncTrainingConfig
from rlpad.config.vision import DataVisionKeys

__all__ = [
    "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "BypassCorrectionConfig", "Config",
    "CriticConfig", "CriticFSDPConfig", "CriticModelConfig", "DataConfig", "FSDPConfig", "FilterGroupsConfig",
    "ModelConfig", "MultiTurnConfig", "OptimConfig", "PolicyLossConfig", "RefConfig", "RefFSDPConfig",
    "RolloutConfig", "RolloutCorrectionConfig", "SFTConfig", "TrainerConfig", "ValidationSamplingConfig",
]


@dataclass
class ModelConfig:
    """The causal LM: a local HF checkpoint path (no hub) or ``tiny:<arch>`` for a random tiny model."""

    path: str = "tiny:qwen2"  # local HF checkpoint folder, tiny:<arch> (random) or embedded:<task> (warm-started)
    tokenizer_path: str | None = None  # defaults to ``path``
    use_remove_padding: bool = True  # score the valid tokens packed in one (1, nnz) row (false: the padded batch)
    share_prompts: bool = False  # each distinct prompt once per group in the packed row (needs use_remove_padding)
    # with share_prompts: a micro-batch whose shared prompts save less than this fraction of its valid
    # tokens runs plain remove-padding (0: always share); None: the device's default (docs/shared_prompts.md)
    share_prompts_min_saved_fraction: float | None = None
    # auto | flash_attention_2 | rlpad_varlen | sdpa (rlpad/core/attn_choice.py); sdpa runs the padded path only
    attn_implementation: str = "auto"
    enable_gradient_checkpointing: bool = False  # recompute activations in the backward (actor): less memory
    # liger-kernel's fused RMSNorm, SwiGLU and rotary in the decoder (verl's key; CUDA, liger-kernel
    # installed: rlpad/core/fused_modules.py); the LM head stays rlpad's
    use_liger: bool = False
    # each decoder layer's forward under torch.compile(dynamic=True) (rlpad/core/fused_modules.py: inductor,
    # exact on the CPU; CUDA: measured by `rlpad bench logprob --device cuda --columns compiled`, kept if it pays)
    compile_decoder_layers: bool = False
    dtype: str = "float32"  # float32 | bfloat16 | float16 (or fp32 | bf16 | fp16)
    logits_chunk_size: int | None = None  # LM head chunking (tokens); None = whole
    trust_remote_code: bool = False  # allow the checkpoint's own modelling code (transformers and vLLM)
    # LoRA (docs/lora.md; the actor only): adapters of this rank on the target linears, base weights frozen;
    # 0: off (full fine-tuning). The reference is then the actor with its adapters disabled (no second model).
    lora_rank: int = 0
    lora_alpha: int = 16  # the adapter's scale is lora_alpha / lora_rank
    # linear modules that get an adapter: names or name suffixes (q_proj, mlp.down_proj), or all-linear:
    # every linear of the decoder; the LM head and the embeddings never get one
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    exclude_modules: list[str] = field(default_factory=list)  # names or suffixes taken out of target_modules
    # start from a saved adapter (a peft folder: adapter_config.json + weights); its r, alpha and
    # target modules replace lora_rank, lora_alpha and target_modules
    lora_adapter_path: str | None = None
    use_shm: bool = False  # verl: copy the checkpoint into /dev/shm first; no effect here (NO_EFFECT_KEYS)
    use_fused_kernels: bool = False  # verl: its fused LM-head kernels; no effect here (NO_EFFECT_KEYS)

    @property
    def uses_lora(self) -> bool:
        """LoRA is on: a rank > 0 or a saved adapter to start from."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None


@dataclass
class OptimConfig:
    """AdamW and its LR schedule (workers/optim.py): linear warm-up, then constant; the schedule
    advances once per training step (one update call), as verl's does."""

    lr: float = 1e-6  # peak learning rate
    weight_decay: float = 0.01  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2)
    lr_warmup_steps: int = 0  # warm-up length in training steps; > 0 wins over lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # warm-up length as a fraction of total_training_steps
    total_training_steps: int = -1  # horizon of lr_warmup_steps_ratio; -1: the trainer fills in the run's steps


@dataclass
class FSDPConfig:
    """The actor's state during generation in the colocated layout (``trainer.colocate``)."""

    param_offload: bool = False  # parameters and gradients to host memory while the engine generates
    optimizer_offload: bool = False  # optimizer state (AdamW moments) to host memory while the engine generates


@dataclass
class RefFSDPConfig:
    """The reference model's state between its calls (verl's keys; workers/offload.py, any layout)."""

    param_offload: bool = False  # parameters in host memory, on the device only while the reference log-probs run


@dataclass
class CriticFSDPConfig:
    """The critic's state between its calls (verl's keys; workers/offload.py, any layout)."""

    param_offload: bool = False  # parameters and gradients in host memory, on the device only while the critic runs
    optimizer_offload: bool = False  # optimizer state (AdamW moments) in host memory, on the device only in its update


@dataclass
class BypassCorrectionConfig:
    """``loss_mode=bypass_mode``: the rollout policy is the old policy (verl's
    ``policy_loss.rollout_correction``; the weights are pi_current / pi_rollout, detached)."""

    loss_type: str = "ppo_clip"  # ppo_clip: vanilla PPO clip, no weights | reinforce: -w * A * log_prob
    # token | sequence (one weight per row: exp of the row's log-ratio sum) | null: no weights
    rollout_is: str | None = "sequence"
    # "C": weights truncated at C (TIS); "L_U" (e.g. "0.5_2.0"): weights outside [L, U] set to 0 (IcePop)
    rollout_is_threshold: str = "2.0"
    rollout_is_batch_normalize: bool = False  # divide the weights by their mean over the piece (per token or per row)


@dataclass
class PolicyLossConfig:
    """The policy-loss mode and its keys (verl's names; the modes: rlpad/algorithms/policy_loss.py, docs/dapo.md)."""

    # a name in rlpad.algorithms.policy_loss.POLICY_LOSSES: vanilla | gspo | cispo | geo_mean | clip_cov | kl_cov |
    # dppo_tv | dppo_kl | sapo | gpg | dro | bypass_mode
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of a micro-batch's tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: a token is a candidate when its covariance is above this...
    clip_cov_ub: float = 5.0  # clip_cov: ... and below this
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of a micro-batch's tokens (highest covariance) given the KL term
    ppo_kl_coef: float = 0.1  # kl_cov: weight of |log_prob - old_log_prob| on those tokens
    dro_beta: float | None = None  # dro: weight of the quadratic penalty 0.5 * beta * (log_prob - old_log_prob)^2 (> 0)
    rollout_correction: BypassCorrectionConfig = field(default_factory=BypassCorrectionConfig)  # bypass_mode only


@dataclass
class ActorConfig:
    """The policy update: PPO-clip loss, batching and KL loss (workers/actor.py)."""

    ppo_mini_batch_size: int = 16  # in prompts, multiplied by rollout.n (verl semantics)
    ppo_micro_batch_size_per_gpu: int | None = 4  # rows per forward/backward on each rank
    use_dynamic_bsz: bool = False  # micro-batches by a token budget (balanced) instead of a row count
    ppo_max_token_len_per_gpu: int = 16384  # the token budget of a micro-batch with use_dynamic_bsz
    ppo_epochs: int = 1  # passes over each step's batch
    shuffle: bool = False  # shuffle the rows before splitting them into mini-batches (each epoch)
    clip_ratio: float = 0.2  # PPO clip: the ratio is kept in [1 - clip_ratio, 1 + clip_ratio]
    clip_ratio_low: float | None = None  # default: clip_ratio
    clip_ratio_high: float | None = None  # default: clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (> 1); dppo_*: the cap of the detached ratio
    tau_pos: float = 1.0  # sapo: gate temperature of tokens with a positive advantage
    tau_neg: float = 1.05  # sapo: gate temperature of the other tokens
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm | token-sum (how token losses
    # are reduced; token-sum: the sum over the mini-batch's valid tokens, no normaliser, as verl 0.9.1)
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = False  # add a KL-to-reference term to the loss (starts a reference model)
    kl_loss_coef: float = 0.001  # weight of the KL loss
    kl_loss_type: str = "low_var_kl"  # KL estimator: kl/k1, abs, mse/k2, low_var_kl/k3 (+ at the end: straight-through)
    entropy_coeff: float = 0.0  # entropy bonus weight
    grad_clip: float = 1.0  # clip the gradient's global norm to this
    # How the actor's old log-probs are micro-batched. "update": with this section's mini-/micro-batch
    # split (ppo_micro_batch_size_per_gpu or the token budget), the one the first epoch's update uses,
    # so the first mini-batch of every step is exactly on-policy (ratio 1, ppo_kl 0, bitwise).
    # "log_prob": with rollout.log_prob_* (verl's behaviour; ratio off by the kernels' batch variance).
    old_log_prob_layout: str = "update"
    ulysses_sequence_parallel_size: int = 1  # Ulysses sequence parallelism: ranks splitting each packed row; 1: off
    # the actor's log-prob pass also returns sum_pi_squared (sum over the vocabulary of pi^2 per response token),
    # which algorithm.adv_estimator=optimal_token_baseline | tir_optimal_token_baseline reads (verl's key)
    calculate_sum_pi_squared: bool = False
    freeze_vision_tower: bool = False  # a VL model: the vision tower gets no gradient and no optimizer state, never re-sent to the engines
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def old_log_probs_split_as_update(self: ActorConfig) -> bool:
        """The step's old log-probs are split over ranks and micro-batches as the update splits the batch."""
        return self.old_log_prob_layout == "update"


@dataclass
class RefConfig:
    """The reference policy (for a KL loss or a KL penalty): how its log-probs are micro-batched."""

    log_prob_micro_batch_size_per_gpu: int | None = 8  # rows per forward on each rank
    log_prob_use_dynamic_bsz: bool = False  # micro-batches by a token budget instead of a row count
    log_prob_max_token_len_per_gpu: int = 16384  # the token budget with log_prob_use_dynamic_bsz
    ulysses_sequence_parallel_size: int | None = None  # the reference's sequence parallelism; null: the actor's
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)


@dataclass
class ActorRolloutRefConfig:
    """The policy: one model shared by the actor, the reference and the rollout (verl's layout)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticModelConfig(ModelConfig):
    """The critic's model keys (as the actor's) and verl's ``critic.model.fsdp_config``."""

    fsdp_config: CriticFSDPConfig = field(default_factory=CriticFSDPConfig)


@dataclass
class CriticConfig:
    """The value model of PPO (algorithm.adv_estimator=gae; workers/critic.py)."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)  # the critic's base model (a value head is added)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 16  # in prompts, multiplied by rollout.n
    ppo_micro_batch_size_per_gpu: int | None = 4  # rows per forward/backward on each rank
    use_dynamic_bsz: bool = False  # micro-batches by a token budget instead of a row count
    ppo_max_token_len_per_gpu: int = 16384  # the token budget with use_dynamic_bsz
    ppo_epochs: int = 1  # passes over each step's batch
    cliprange_value: float = 0.5  # value clip around the old values
    loss_agg_mode: str = "token-mean"  # how token losses are averaged (as actor.loss_agg_mode)
    grad_clip: float = 1.0  # clip the gradient's global norm to this
    ulysses_sequence_parallel_size: int = 1  # the critic's sequence parallelism (as the actor's)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class RolloutCorrectionConfig:
    """Correct the policy gradient for rollout-vs-actor log-prob mismatch (rlpad/algorithms/rollout_correction.py)."""

    mode: str = "none"  # none | token_tis | seq_mask
    threshold: float = 2.0  # C: token_tis caps weights at C, seq_mask keeps geometric-mean ratios in [1/C, C]


@dataclass
class KLControlConfig:
    """verl's ``algorithm.kl_ctrl``: the weight of the KL penalty in the reward (``use_kl_in_reward``)."""

    type: str = "fixed"  # fixed (the weight stays kl_coef); verl's adaptive controller is refused at load
    kl_coef: float = 0.001  # weight of the KL penalty
    horizon: int = 10000  # verl's adaptive controller's horizon: no effect (NO_EFFECT_KEYS)
    target_kl: float = 0.1  # verl's adaptive controller's target KL: no effect (NO_EFFECT_KEYS)


@dataclass
class FilterGroupsConfig:
    """Dynamic sampling (DAPO): drop groups whose responses all got the same metric, generate more
    prompts until ``data.train_batch_size`` groups are kept (rlpad/training/dynamic_sampling.py)."""

    enable: bool = False  # filter zero-spread groups and refill from the loader (data.gen_batch_size prompts at a time)
    metric: str = "acc"  # acc | score | seq_reward | seq_final_reward (all before the overlong shaping)
    max_num_gen_batches: int = 0  # generation batches per step at most; past it the step fails; <= 0: no cap


@dataclass
class AlgorithmConfig:
    """Advantages, the KL penalty in the reward, and rollout correction."""

    adv_estimator: str = "grpo"  # the advantage estimator (docs/estimators.md; gae trains a critic)
    # grpo, grpo_passk: divide by the group's std; false: Dr.GRPO (mean only); grpo_vectorized and gdpo refuse false
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0  # discount of gae and reinforce_plus_plus
    lam: float = 1.0  # GAE lambda
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef x KL(policy, reference) from the token rewards
    kl_penalty: str = "kl"  # the KL estimator of that penalty (as actor.kl_loss_type)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # gdpo: the keys of the reward function's returned dict, one reward component each, normalised per group apart
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None  # gdpo: one weight per gdpo_reward_keys entry; null: all 1
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class DataConfig(DataVisionKeys):
    """Prompt files (parquet/jsonl in verl's columns, rlpad/data.py), batch size and lengths."""

    train_files: list[str] = field(default_factory=list)  # training prompts (.parquet/.jsonl) or <task>:train
    val_files: list[str] = field(default_factory=list)  # validation prompts or <task>:val; []: no validation
    prompt_key: str = "prompt"  # the column holding the chat messages
    train_batch_size: int = 16  # prompts per step (each gets rollout.n responses)
    # prompts per generation batch with algorithm.filter_groups.enable (the loader's batch); None: train_batch_size
    gen_batch_size: int | None = None
    val_batch_size: int | None = None  # None: the whole validation set at once
    max_prompt_length: int = 512  # tokens after the chat template; prompts are left-padded to it
    max_response_length: int = 512  # tokens generated at most per response
    truncation: str = "error"  # a longer prompt: error | left (keep its end) | right (keep its start)
    shuffle: bool = True  # shuffle the training prompts each epoch
    seed: int = 1  # the shuffle's seed
    # drop the prompts longer than max_prompt_length (after the chat template) when the dataset is built,
    # the count logged, before truncation applies; verl's key
    filter_overlong_prompts: bool = False
    return_raw_chat: bool = True  # verl: keep the chat messages in the batch; no effect here (NO_EFFECT_KEYS)


@dataclass
class SFTConfig:
    """Supervised warm-start of the embedded tiny model (``model.path: embedded:<task>``; cached
    after the first run)."""

    steps: int = 300  # optimizer steps (the cap with target_accuracy)
    lr: float = 3e-3  # AdamW peak learning rate
    batch_size: int = 64  # examples per step
    # Where the driver builds the warm start and the toy datasets (rlpad.embedded.cache); null: the per-user
    # cache, $XDG_CACHE_HOME/rlpad or ~/.cache/rlpad. A relative path is taken from the working
    # directory, which under `ray job submit --working-dir` is Ray's unpacked copy of it: avoid that.
    cache_dir: str | None = None
    weight_decay: float = 0.1  # AdamW weight decay
    # The toy split the examples come from; keep equal to the dataset's (``python -m rlpad.embedded.toy``
    # defaults) so no validation problem is ever trained on.
    n_val: int = 100
    data_seed: int = 0  # seed of the toy split (keep equal to the dataset's)
    max_operand: int = 20  # toy addition: operands in [0, max_operand]
    # Stop early once greedy accuracy on 100 training problems reaches this (checked every
    # ``eval_every`` steps); ``steps`` is then the cap. None: always run ``steps``.
    target_accuracy: float | None = None
    eval_every: int = 10  # steps between the target_accuracy checks
    # The embedded teacher (distillation's model_path embedded-teacher:<task>): the same supervised recipe run
    # this many steps, with no early stop (a stronger model; cached beside the warm start)
    teacher_steps: int = 1000


@dataclass
class TrainerConfig:
    """The loop, its outputs and where it runs (rlpad/training/trainer.py, workers/launcher.py)."""

    project_name: str = "rlpad"  # the wandb project
    experiment_name: str = "run"  # the wandb run name
    total_training_steps: int | None = None  # None: total_epochs passes over data.train_files
    total_epochs: int = 1  # passes over the training prompts (when total_training_steps is None)
    n_gpus_per_node: int = 1  # ranks of each role per node (GPUs on CUDA, processes on CPU)
    nnodes: int = 1  # nodes (see docs/cluster.md, Multi-node)
    save_freq: int = -1  # checkpoint every this many steps and after the last; -1: never
    # the actor as a Hugging Face folder with every checkpoint and after the last step: <default_local_dir>/hf/step_<k>
    # and hf/latest (what transformers and vllm serve load; docs/export.md)
    save_hf: bool = False
    test_freq: int = -1  # validate every this many steps; -1: only before training and after the last step
    val_before_train: bool = True  # validate before the first step
    # metrics.jsonl, config.yaml, run.log, checkpoints and the reward curve go here
    default_local_dir: str = "outputs/run"
    resume_mode: str = "auto"  # auto | disable | <checkpoint path>
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # names in rlpad.training.metrics.LOGGERS
    # The least severe message of Ray, vLLM and the workers shown on the console: error | warning | info |
    # debug (`--verbose`: info). All of it, at warning or lower, also goes to <default_local_dir>/run.log.
    log_level: str = "error"
    seed: int = 1  # the workers' seed: critic value-head init, shuffled mini-batch order
    device: str = "auto"  # auto (cuda when torch sees a GPU) | cpu | cuda
    # ray: worker groups as Ray actors (workers/launcher.py); local: the same workers in this
    # process, world size 1, no Ray (workers/local.py)
    backend: str = "ray"
    # One pool of nnodes x n_gpus_per_node bundles shared by actor, ref, critic and rollout, time-shared
    # phase by phase (workers/launcher.py); false: each role on its own GPUs. null: true on CUDA (with
    # backend=ray, tensor_model_parallel_size=1, max_off_policy_steps=0), false on CPU (rlpad.topology.colocated).
    colocate: bool | None = None
    max_off_policy_steps: int = 0  # k >= 1: generate the next k steps' batches while the actor trains; 0: synchronous
    # PPO: the actor is updated from step critic_warmup on (verl's rule, steps counted from 1: the first
    # critic_warmup - 1 steps train the critic alone); 0 or 1: from the first step
    critic_warmup: int = 0
    use_legacy_worker_impl: str = "auto"  # verl: which of its worker implementations; no effect here (NO_EFFECT_KEYS)


@dataclass
class Config:
    """A whole run: every section of a recipe."""

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)  # streaming rollouts (docs/streaming.md)

    @property
    def uses_ref(self) -> bool:
        """A reference policy is needed: a KL loss or a KL penalty in the reward."""
        return bool(self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward)

    @property
    def ref_in_actor(self) -> bool:
        """The reference log-probs come from the actor with its LoRA adapters disabled (no reference model)."""
        return self.uses_ref and self.actor_rollout_ref.model.uses_lora

    @property
    def builds_ref(self) -> bool:
        """A reference model (worker group) of its own is built."""
        return self.uses_ref and not self.ref_in_actor

