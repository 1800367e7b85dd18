"""What every rollout backend shares: sampling options, the generate driver, weight-name helpers.

A backend turns left-padded prompts into the rollout layout (docs/design.md): prompts left-padded,
responses right-padded, ``rollout_log_probs`` of the sampled tokens under the distribution they
were sampled from (``log_softmax(logits / temperature)``, renormalised over the top-k/top-p
support). Without top-k/top-p that is what :func:`rlpad.core.forward.compute_log_probs` returns at
``batch.meta["temperature"]`` (1.0 for greedy).
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rlpad.batch import Batch
from rlpad.config.schema import DataConfig, RolloutConfig
from rlpad.rollout.agent import AGENT_COUNTS, run_agent_loop, run_named_loops, turn_scores
from rlpad.rollout.agent_loops import AgentContext, default_loop, load_agent_loop_config, loop_names
from rlpad.rollout.env_loop import EnvSetup
from rlpad.rollout.environments import EnvRunner, observation_renderer
from rlpad.rollout.layout import build_rollout_batch, check_sampling, prompt_token_lists
from rlpad.rollout.interactions import load_interaction_config
from rlpad.rollout.stateful_tools import (TOOL_REWARD_SCORES, TOOL_STEP_REWARDS, StatefulTools, advertised_schemas,
                                          load_tool_config)
from rlpad.rollout.function_tools import tool_specs
from rlpad.rollout.tools import ToolSet

__all__ = ["PROBES", "NamedTensors", "RolloutBackend", "Sampling", "eos_token_ids", "named_pairs", "rollout_samplings",
           "tool_turn_renderer"]

log = logging.getLogger("rlpad.tools")

# Full weights by HF checkpoint name: (name, tensor) pairs or a state dict.
NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Sampling:
    """Sampling options of one generate call; ``temperature == 0`` means greedy."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: tuple[str, ...] = ()  # strings that end a sample besides EOS, kept in its tokens (the turn's rule)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature at which ``rollout_log_probs`` are computed (1.0 when greedy)."""
        return 1.0 if self.greedy else float(self.temperature)


class RolloutBackend(ABC):
    """Shared driver: validate prompts, sample with the backend, build the rollout batch.

    Every backend is built as ``Backend(model_path, rollout, data, *, tokenizer_path=None,
    trust_remote_code=False, device="cpu", sleep_mode=False, lora_rank=0)`` (``device``: cpu | cuda, where
    the engine runs; ``sleep_mode``: build it able to give memory back in :meth:`sleep`; ``lora_rank``: > 0
    builds it to serve adapters of that rank, :meth:`load_lora_adapter`); a backend
    documents the arguments it has no use for. What a backend can do is declared by the class
    attributes below, which the config checks and the launchers read (never the backend's name);
    register a new backend in :data:`rlpad.rollout.BACKENDS`.
    """

    # A prompt's samples depend only on (seed, its index in the step's batch), so the prompts can be
    # split over several replicas (and colocated engines) without changing what is sampled.
    seeds_per_prompt: ClassVar[bool] = False
    # sleep() gives the engine's device memory back (on CUDA, when built with sleep_mode=True).
    sleep_frees_memory: ClassVar[bool] = False
    # model_path must be a local checkpoint directory (not ``tiny:<arch>`` or a model object).
    needs_local_dir: ClassVar[bool] = False
    # load_lora_adapter: generates with a LoRA adapter over its weights (built with lora_rank > 0;
    # actor_rollout_ref.rollout.lora_sync=adapter)
    serves_lora: ClassVar[bool] = False

    pad_token_id: int
    eos_token_ids: frozenset[int]
    tokenizer: object  # a Hugging Face tokenizer (multi-turn: decodes turns, renders tool messages)
    tools: ToolSet | None = None  # multi-turn tools (rollout.multi_turn.enable), built at first use
    stateful: StatefulTools | None = None  # with them: rollout.multi_turn.tool_config_path's tool classes
    _tool_renderer: Callable[[list[str]], list[int]] | None = None  # tool_turn_renderer(tokenizer), with them
    vocab_size: int | None = None  # the model's (output ids below it); None: the tokenizer's length
    _agent_configs: dict[str, Any] | None = None  # rollout.agent.agent_loop_config_path's loops, read at first use
    _env: EnvSetup | None = None  # env_agent's worker processes and renderer, built at first use

    def __init__(self, model_path: object, rollout: RolloutConfig, data: DataConfig):
        self.rollout, self.data = rollout, data
        self.sampling, self.val_sampling = rollout_samplings(rollout, data)
        val = rollout.val_kwargs
        self.greedy_sampling = Sampling(1, 0.0, 1.0, -1, data.max_response_length)  # remax's baseline (verl's rule)
        check_sampling(**vars(self.sampling), who="actor_rollout_ref.rollout")
        check_sampling(**vars(self.val_sampling), who="actor_rollout_ref.rollout.val_kwargs")
        if val.do_sample and val.temperature <= 0:
            raise ValueError(f"actor_rollout_ref.rollout.val_kwargs.temperature must be > 0 with do_sample, got {val.temperature}")
        if self.needs_local_dir and not (isinstance(model_path, str) and os.path.isdir(model_path)):
            raise ValueError(f"{type(self).__name__} (actor_rollout_ref.rollout.name={rollout.name}) needs a local "
                             f"checkpoint directory, got {model_path!r}")

    def sleep(self) -> None:
        """Free the engine's device memory between generations (colocated layout); here a no-op."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what :meth:`sleep` freed (``tags``: "weights", "kv_cache"; None: all); here a no-op."""

    def shutdown(self) -> None:
        """Stop the engine and free what it holds (the backend is unusable afterwards); here: the tool processes."""
        self.close_tools()

    def generate(self, batch: Batch, seed: int | None = None, prompt_offset: int = 0) -> Batch:
        """B prompt rows -> B*n rollout rows sampled with the rollout config.

        With ``seed`` the samples of a prompt depend only on (seed, its index in the step's
        batch): the trainer passes ``rollout.seed + step`` so a resumed run samples exactly what an
        uninterrupted one did. ``prompt_offset`` is the index of this batch's first prompt in the
        step's batch, for a replica that generates one slice of it (only a backend with
        :attr:`seeds_per_prompt`; the others seed the whole call).
        """
        self._check_offset(seed, prompt_offset)
        return self._generate(batch, self.sampling, seed, prompt_offset)

    def generate_validation(self, batch: Batch, seed: int | None = None, prompt_offset: int = 0) -> Batch:
        """Validation rollout: greedy, or ``rollout.val_kwargs`` sampling when ``do_sample`` (seeded like
        :meth:`generate`: the trainer passes a seed per step and validation batch, so a resumed run
        samples what an uninterrupted one did)."""
        self._check_offset(seed, prompt_offset)
        return self._generate(batch, self.val_sampling, seed, prompt_offset)

    def generate_greedy(self, batch: Batch, seed: int | None = None, prompt_offset: int = 0) -> Batch:
        """One greedy response per prompt (temperature 0, n = 1, the rollout's response length): remax's
        baseline, verl's rule; B prompt rows -> B rollout rows."""
        self._check_offset(seed, prompt_offset)
        return self._generate(batch, self.greedy_sampling, seed, prompt_offset)

    def _check_offset(self, seed: int | None, prompt_offset: int) -> None:
        if isinstance(prompt_offset, bool) or not isinstance(prompt_offset, int) or prompt_offset < 0:
            raise ValueError(f"prompt_offset must be an int >= 0, got {prompt_offset!r}")
        if prompt_offset and seed is not None and not self.seeds_per_prompt:
            raise ValueError(f"{type(self).__name__} seeds a whole generate call, not each prompt: it cannot generate "
                             "a slice of a step's batch (prompt_offset > 0); use one replica or a backend that "
                             "seeds each prompt")

    def _generate(self, batch: Batch, sampling: Sampling, seed: int | None = None, prompt_offset: int = 0) -> Batch:
        batch.require("input_ids", "attention_mask", who="rollout.generate")
        prompts = prompt_token_lists(batch["input_ids"], batch["attention_mask"],
                                     max_prompt_length=self.data.max_prompt_length, truncation=self.data.truncation)
        images = list(batch["multi_modal_inputs"]) if "multi_modal_inputs" in batch else None  # a VL batch
        if images is not None and not any(images):
            images = None  # text-only rows: the text path
        start = time.perf_counter()
        generated = counts = None
        mt, trajs = self.rollout.multi_turn, None
        names = self._loop_names(batch)
        if any(name != ("tool_agent" if mt.enable else "single_turn_agent") for name in names):
            trajs = self._run_named_loops(batch, prompts, names, sampling, seed, prompt_offset, images)
        elif not mt.enable:  # every row single_turn_agent: the backend's own call (its seeding unchanged)
            responses, log_probs = (self._sample(prompts, sampling, seed, prompt_offset) if images is None else
                                    self._sample(prompts, sampling, seed, prompt_offset, images=images))
        else:  # every row tool_agent: the batched tool loop
            tools, renderer = self._agent_tools()
            trajs = run_agent_loop(
                self._sample_each, prompts, sampling, tools=tools, max_turns=mt.max_assistant_turns,
                max_user_turns=mt.max_user_turns,
                eos=self.eos_token_ids, decode=self._decode, render_tool=renderer,
                max_parallel_calls=mt.max_parallel_calls, seed=seed, prompt_offset=prompt_offset, images=images,
                stateful=self.stateful, extra_info=list(batch["extra_info"]) if "extra_info" in batch else None,
            )  # fmt: skip
        if trajs is not None:
            responses, log_probs, generated = ([getattr(t, k) for t in trajs] for k in ("tokens", "log_probs", "generated"))
        env = None if trajs is None else turn_scores(trajs, sampling.max_tokens)
        for t in trajs if env is not None else []:  # each failed environment call's reason (run.log)
            for reason in t.errors if t.turn_rewards is not None else []:
                log.warning("env_agent: %s", reason)
        if env is None and self._may_run_environments(batch):  # every slice of the step carries the fields
            env = torch.zeros(len(responses), sampling.max_tokens), torch.zeros(len(responses), dtype=torch.bool)
        if trajs is not None and mt.enable:
            counts = {k: torch.tensor([getattr(t, k) for t in trajs]) for k in AGENT_COUNTS}
            for reason in (r for t in trajs for r in t.errors):
                log.warning("multi_turn: tool call failed: %s", reason)
        seconds = time.perf_counter() - start
        out = build_rollout_batch(
            batch, prompts, responses, log_probs, n=sampling.n, prompt_width=batch["input_ids"].shape[1],
            response_length=sampling.max_tokens, pad_token_id=self.pad_token_id, eos_token_ids=self.eos_token_ids,
            generated=generated,
        )
        if counts is not None:
            for key, value in counts.items():
                out[key] = value
            out["tool_error"] = [t.errors[0] if t.errors else "" for t in trajs]  # each row's first failure
        if env is not None:  # the environments' per-turn rewards: the reward stage's scores of those rows
            out["env_scores"], out["env_rows"] = env
        if trajs is not None and self.stateful is not None:  # the stateful tools' rewards (verl's columns), every
            # row of every slice ({} / [] where none ran): the reward stage hands them to the reward function
            out[TOOL_REWARD_SCORES] = [dict(t.tool_rewards or {}) for t in trajs]
            out[TOOL_STEP_REWARDS] = [list(t.tool_step_rewards or []) for t in trajs]
        out.meta.update(temperature=sampling.logprob_temperature, rollout_gen_s=seconds,
                        rollout_response_tokens=int(out["response_mask"].sum()))
        return out

    def _loop_names(self, batch: Batch) -> list[str]:
        """Each prompt row's agent loop: its ``agent_name`` (verl's data column), else the default."""
        given = batch["agent_name"] if "agent_name" in batch else [None] * len(batch)
        return loop_names(given, self.rollout.agent, self.rollout.multi_turn.enable)

    def _may_run_environments(self, batch: Batch) -> bool:
        """Whether some row of the step may run env_agent (the default loop, or a row's ``agent_name`` column):
        then every slice of it (a replica's, a micro-batch) carries ``env_scores`` / ``env_rows``, so the slices
        concatenate whichever of them ran an environment."""
        return "agent_name" in batch or default_loop(self.rollout.agent, self.rollout.multi_turn.enable) == "env_agent"

    def _run_named_loops(self, batch: Batch, prompts: list[list[int]], names: list[str], sampling: Sampling,
                         seed: int | None, prompt_offset: int, images: list[Any] | None) -> list[Any]:
        """The rows by their loops over a BatchingClient on this backend (rlpad.rollout.agent.run_named_loops)."""
        mt, agent = self.rollout.multi_turn, self.rollout.agent
        if self._agent_configs is None:
            path = agent.agent_loop_config_path
            self._agent_configs = load_agent_loop_config(path) if path else {}
        tools, renderer = self._agent_tools() if mt.enable else (None, None)
        context = AgentContext(eos=self.eos_token_ids, decode=self._decode, tools=tools, render_tool=renderer,
                               max_turns=mt.max_assistant_turns, max_user_turns=mt.max_user_turns,
                               max_parallel_calls=mt.max_parallel_calls,
                               stateful=self.stateful, env=self._env_setup() if "env_agent" in names else None)
        fields = {k: list(v) for k, v in batch.non_tensors.items()}
        return run_named_loops(self, prompts, names, fields, sampling, context=context, configs=self._agent_configs,
                               vocab_size=self.vocab_size or len(self.tokenizer), seed=seed,
                               prompt_offset=prompt_offset, images=images)

    @abstractmethod
    def _sample(self, prompts: list[list[int]], sampling: Sampling, seed: int | None = None,
                prompt_offset: int = 0, images: list[Any] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """Token ids and their log-probs of ``n`` samples per prompt, prompt-major (B*n lists). A VL
        batch passes ``images=`` each prompt's ``multi_modal_inputs`` (``{}``: none): only to a backend
        whose :meth:`image_support` is None."""

    @classmethod
    def image_support(cls) -> str | None:
        """None when this backend generates from prompts with images (a VL model), else why not (one line)."""
        return f"the {cls.__name__} rollout backend does not take images"

    def _sample_each(self, contexts: list[list[int]], sampling: Sampling, seeds: list[int] | None,
                     images: list[Any] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """One sample (``sampling.n`` is 1) per context, context ``i`` drawn with ``seeds[i]`` (None:
        unseeded) and its prompt's ``images`` (a VL batch): a turn of the agent loop. Here through
        :meth:`_sample`, seeding the whole call with ``seeds[0]`` (backends without :attr:`seeds_per_prompt`)."""
        extra = {} if images is None else {"images": images}
        return self._sample(contexts, sampling, None if seeds is None else seeds[0], **extra)

    def _agent_tools(self) -> tuple[ToolSet, Callable[[list[str]], list[int]]]:
        """The tools and the tool-turn renderer, built at first use (the tokenizer exists then); a template
        that cannot render tool turns fails here, before sampling."""
        if self.tools is None:
            mt, tok = self.rollout.multi_turn, self.tokenizer
            self._tool_renderer = tool_turn_renderer(tok, advertised_schemas(mt))
            longest = max((len(t) for t in tok.get_vocab()), default=1)  # characters of the longest token
            self.tools = ToolSet(tool_specs(mt), mt.format, mt.tool_timeout, mt.max_tool_response_length,
                                 lambda text: len(tok.encode(text, add_special_tokens=False)), max_token_chars=longest,
                                 workers=mt.tool_workers, concurrency=mt.max_concurrent_tool_calls)
            if mt.tool_config_path:
                self.stateful = StatefulTools(load_tool_config(mt.tool_config_path), self.tools)
        return self.tools, self._tool_renderer

    def _env_setup(self) -> EnvSetup:
        """env_agent's environment processes and renderer (rollout.agent.environment / env_timeout / env_workers,
        multi_turn.interaction_config_path's interactions), built at first use."""
        if self._env is None:
            agent, path = self.rollout.agent, self.rollout.multi_turn.interaction_config_path
            self._env = EnvSetup(EnvRunner(timeout=agent.env_timeout, workers=agent.env_workers),
                                 observation_renderer(self.tokenizer), agent.environment,
                                 interactions=load_interaction_config(path) if path else {})
        return self._env

    def close_tools(self) -> None:
        """Stop the tool and environment processes (a backend's :meth:`shutdown` calls it)."""
        if self.tools is not None:
            self.tools.close()
        if self._env is not None:
            self._env.runner.close()

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    @abstractmethod
    def load_weights_bucket(self, named_tensors: NamedTensors, partial: bool = False) -> float:
        """Load some full weights (HF names, whole units: rlpad.rollout.buckets); returns the seconds.

        Weights not named keep their values; call :meth:`finish_weight_update` after the last bucket.
        ``partial``: one bucket of several (a backend may then skip its "weights not loaded" warnings).
        """

    def load_lora_adapter(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], spec: Any,
                          version: int) -> float:
        """Generate from now on with this LoRA adapter (HF module name -> ``(lora_A (r, in), lora_B (out, r))``,
        :class:`rlpad.lora.rules.LoraSpec` ``spec``) over the loaded weights, as policy ``version``; returns the
        seconds. Backends with ``serves_lora`` only."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters (serves_lora is false)")

    def finish_weight_update(self) -> None:
        """Drop state computed with the old weights (vLLM: the prefix cache)."""

    def update_weights(self, named_tensors: NamedTensors) -> float:
        """Load full weights (HF checkpoint names) in one bucket; returns the seconds taken."""
        start = time.perf_counter()
        self.load_weights_bucket(named_tensors)
        self.finish_weight_update()
        return time.perf_counter() - start


def rollout_samplings(rollout: RolloutConfig, data: DataConfig) -> tuple[Sampling, Sampling]:
    """The training and the validation sampling a config asks for (``rollout.n`` / ``val_kwargs.n`` samples per
    prompt; validation greedy unless ``val_kwargs.do_sample``), responses up to ``data.max_response_length``."""
    val = rollout.val_kwargs
    return (Sampling(rollout.n, rollout.temperature, rollout.top_p, rollout.top_k, data.max_response_length),
            Sampling(val.n, val.temperature if val.do_sample else 0.0, val.top_p, val.top_k, data.max_response_length))


def named_pairs(named_tensors: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a state dict or of an iterable of pairs."""
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors


def pad_token_id(tokenizer: Any) -> int:
    """The id padded slots hold: the tokenizer's pad token, else its EOS (a tokenizer without a pad token)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def eos_token_ids(*values: int | list[int] | None) -> set[int]:
    """The union of EOS ids given as ints or lists (tokenizer and model config may disagree)."""
    ids: set[int] = set()
    for v in values:
        if isinstance(v, int):
            ids.add(v)
        elif v:
            ids.update(int(x) for x in v)
    if not ids:
        raise ValueError("the tokenizer and model config define no EOS token id")
    return ids


PROBES = ("rlpad-probe-observation-1", "rlpad-probe-observation-2")  # sentinel tool outputs


def tool_turn_renderer(tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> Callable[[list[str]], list[int]]:
    """``observations -> tokens`` appended after an assistant turn that the agent loop cut at the end of
    its tool calls: the chat template's close of that assistant message (ChatML: ``<|im_end|>\\n``, which
    the policy never generated), one tool message per call in order (Qwen's templates gather them in one
    ``user`` block, a ``<tool_response>`` each) and the next assistant prompt, and nothing else (no
    default system block, which templates such as Qwen's write at the start of a conversation).

    Found as the text by which one conversation's rendering extends another's:
    ``[user, assistant, tool...] + prompt`` minus ``[user] + prompt`` and the assistant's content,
    both rendered with ``tools`` (the schemas the prompts advertise). ValueError when the template
    cannot render tool messages, does not extend its own rendering, or drops them: two sentinel
    observations (:data:`PROBES`) must appear, in order, in what is appended.
    """
    user, content = {"role": "user", "content": "?"}, "?"

    def render(messages: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    def conversation(observations: Sequence[str]) -> str:
        return render([user, {"role": "assistant", "content": content},
                       *({"role": "tool", "content": o} for o in observations)])

    try:
        head = render([user]) + content
        probe = conversation(PROBES)
    except Exception as e:  # a template without a tool role raises its own exception type
        raise ValueError(f"multi_turn: the tokenizer's chat template cannot render a tool message: {e}") from e
    if not probe.startswith(head):
        raise ValueError("multi_turn: the tokenizer's chat template does not extend a conversation's rendering when "
                         f"a tool message is added (expected a prefix {head!r}, got {probe[:len(head) + 40]!r})")
    suffix = probe[len(head):]
    first = suffix.find(PROBES[0])
    if first < 0 or suffix.find(PROBES[1], first + len(PROBES[0])) < 0:
        raise ValueError("multi_turn: the tokenizer's chat template drops tool messages (two tool outputs rendered "
                         f"after an assistant turn do not appear in the text: {suffix[:120]!r}); the model would never "
                         "see a tool's output")

    def tool_turn(observations: list[str]) -> list[int]:
        return list(tokenizer.encode(conversation(observations)[len(head):], add_special_tokens=False))

    return tool_turn
