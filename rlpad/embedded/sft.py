"""Supervised warm-start of the embedded default model, cached on disk.

:func:`warm_start` builds a tiny Qwen2 model (fp32, head size 32 so vLLM's CPU attention runs it)
and the character tokenizer of :mod:`rlpad.embedded.tiny`, teaches it an embedded task of
:mod:`rlpad.embedded.tasks` (the toy addition by default, or ``toy_long``, alphabet runs) for a
few hundred AdamW steps (loss on the answer and EOS tokens only), and saves
both with ``save_pretrained``. The result lands in ``<cache>/sft-<key>`` (the cache:
rlpad.embedded.cache, by default ~/.cache/rlpad), ``key`` being a hash of everything that
shapes the weights (model config, tokenizer, SFT settings, seed, a version string), and is
written to a temporary folder first and renamed into place, so an interrupted run never leaves
a half cache. A later call with the same settings returns the path at once.

The warm start is deliberately short: the model gets a moderate share of the held-out validation
problems right, so GRPO has reward variance to learn from and room to improve. The defaults
(``SFTConfig``: 300 steps of 64 examples, lr 3e-3 warmed up then constant, weight decay 0.1) take
about 10 s on one CPU thread and give 0.15-0.3 greedy validation accuracy; ``target_accuracy``
can stop earlier at a chosen accuracy on training problems instead.

Command: ``python -m rlpad.embedded.sft [--task toy_long] [--steps N] [--seed S]`` prints the path and the
validation accuracy and reward.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlpad.config.schema import SFTConfig
from rlpad.core.forward import compute_log_probs
from rlpad.core.layout import position_ids_from_mask
from rlpad.embedded.optim_step import optimizer_step
from rlpad.embedded.cache import build_cached, cache_root
from rlpad.embedded.tasks import get_task
from rlpad.embedded.shapes import WARM_START_DIMS
from rlpad.embedded.tiny import build_tokenizer, tiny_config, tiny_model
from rlpad.progress import Progress

__all__ = [
    "DEFAULT_DIMS", "SFT_VERSION", "accuracy", "cache_key", "check_vllm_shape", "embedded_teacher", "encode",
    "greedy_answers", "main",
    "read_info", "sft_loss", "train_sft", "val_accuracy", "val_score", "warm_start",
]

SFT_VERSION = "rlpad-sft-1"  # bump when the training recipe changes in a way the key cannot see
ARCH = "qwen2"
DEFAULT_DIMS: dict[str, Any] = WARM_START_DIMS  # the embedded default model (rlpad.embedded.shapes)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
INFO_FILE = "rlpad_sft.json"
MAX_ANSWER_TOKENS = 4  # the toy task's longest answer ("40") plus EOS, with one spare


# ----------------------------------------------------------------------------- data


def encode(tokenizer: PreTrainedTokenizerBase, examples: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Rollout-layout tensors for ``(prompt, answer)`` pairs: chat-templated prompts LEFT-padded,
    then answer + EOS RIGHT-padded; ``response_length`` is the width of the answer part. An answer
    is a string, or segments ``[(text, in_the_loss), ...]`` (a tool trace: the tool's output is
    context, outside the loss); ``loss_mask`` (B, R) marks the answer tokens the loss reads."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=False) for p, _ in examples]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    answers = [[(a, True)] if isinstance(a, str) else list(a) for _, a in examples]
    answer_ids, trained = [], []
    for segments in answers:
        ids_, keep = [], []
        for text, in_loss in segments:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids_ += piece
            keep += [int(in_loss)] * len(piece)
        answer_ids.append(ids_ + [tokenizer.eos_token_id])
        trained.append(keep + [1])
    P, R = max(map(len, prompt_ids)), max(map(len, answer_ids))
    ids = torch.full((len(examples), P + R), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    loss_mask = torch.zeros((len(examples), R), dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompt_ids, answer_ids)):
        ids[i, P - len(p):P + len(a)] = torch.tensor(p + a)
        mask[i, P - len(p):P + len(a)] = 1
        loss_mask[i, :len(a)] = torch.tensor(trained[i])
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
            "response_length": R, "loss_mask": loss_mask}


def sft_loss(model: PreTrainedModel, batch: dict[str, Any]) -> torch.Tensor:
    """Mean negative log-likelihood of the answer tokens in ``loss_mask`` (answer and EOS; never a
    tool's output) of an :func:`encode` batch."""
    R = batch["response_length"]
    mask = batch["loss_mask"]
    log_probs, _ = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], R,
                                     use_remove_padding=False, response_mask=mask)
    return -(log_probs * mask).sum() / mask.sum()


# ----------------------------------------------------------------------------- train / evaluate


def _lr_factor(step: int, total: int) -> float:
    """Linear warm-up over the first 5% of steps, then constant.

    No decay on purpose: a model annealed to a small learning rate sits in a sharp spot where
    GRPO's noisy updates at a useful learning rate wreck it; one trained at a constant rate
    tolerates updates of that size.
    """
    warmup = max(1, total // 20)
    return min(1.0, (step + 1) / warmup)


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: SFTConfig,
    *,
    task: str = "toy",
    callback: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place with AdamW on batches of ``cfg.batch_size`` examples of the embedded
    ``task`` (:mod:`rlpad.embedded.tasks`), none from the ``(cfg.n_val, cfg.data_seed)`` validation split.

    Runs ``cfg.steps`` steps, or fewer with ``cfg.target_accuracy``: every ``cfg.eval_every`` steps
    the greedy accuracy on the task's probe (training problems) is measured and training stops
    once it reaches the target. Returns the per-step losses; ``callback(step, loss)`` runs after
    every step.
    """
    spec = get_task(task)
    examples = spec.sft_examples(cfg, cfg.steps * cfg.batch_size)
    probe = spec.probe_examples(cfg) if cfg.target_accuracy is not None else []
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg.steps))
    losses = []
    for step in range(cfg.steps):
        model.train()
        batch = encode(tokenizer, examples[step * cfg.batch_size:(step + 1) * cfg.batch_size])
        losses.append(optimizer_step(model, opt, sched, sft_loss(model, batch)))
        if callback is not None:
            callback(step, losses[-1])
        if probe and (step + 1) % cfg.eval_every == 0 and \
                accuracy(model, tokenizer, probe, spec.max_answer_tokens) >= cfg.target_accuracy:
            break
    model.eval()
    return losses


@torch.no_grad()
def greedy_answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str],
                   max_new_tokens: int = MAX_ANSWER_TOKENS) -> list[str]:
    """Greedy completions of the (chat-templated) ``prompts``, cut at EOS, decoded."""
    batch = encode(tokenizer, [(p, "") for p in prompts])
    ids, mask = batch["input_ids"][:, :-1], batch["attention_mask"][:, :-1]  # drop the EOS column
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                       use_cache=False).logits[:, -1]
        nxt = torch.where(done, tokenizer.pad_token_id, logits.argmax(-1))
        out.append(nxt)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
        done |= nxt == tokenizer.eos_token_id
        if done.all():
            break
    new = torch.stack(out, dim=1).tolist()
    texts = []
    for row in new:
        if tokenizer.eos_token_id in row:
            row = row[:row.index(tokenizer.eos_token_id)]
        texts.append(tokenizer.decode([t for t in row if t != tokenizer.pad_token_id]))
    return texts


def accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[tuple[str, str]],
             max_new_tokens: int = MAX_ANSWER_TOKENS) -> float:
    """Greedy exact-match accuracy on ``(prompt, answer)`` examples."""
    model.eval()
    answers = greedy_answers(model, tokenizer, [p for p, _ in examples], max_new_tokens)
    return sum(got == want for got, (_, want) in zip(answers, examples)) / len(examples)


def val_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: SFTConfig, task: str = "toy") -> float:
    """Greedy exact-match accuracy on the validation problems of ``task`` (the held-out split of ``cfg``)."""
    spec = get_task(task)
    return accuracy(model, tokenizer, spec.val_examples(cfg), spec.max_answer_tokens)


def val_score(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: SFTConfig, task: str = "toy") -> float:
    """Mean task reward of the greedy answers to the validation problems (what GRPO validation reports)."""
    spec = get_task(task)
    examples = spec.val_examples(cfg)
    model.eval()
    answers = greedy_answers(model, tokenizer, [p for p, _ in examples], spec.max_answer_tokens)
    if spec.score_all is not None:
        return sum(spec.score_all(answers, [want for _, want in examples])) / len(examples)
    return sum(spec.score(got, want) for got, (_, want) in zip(answers, examples)) / len(examples)


# ----------------------------------------------------------------------------- cache


def _settings(cfg: SFTConfig, seed: int, dims: dict[str, Any], task: str = "toy") -> dict[str, Any]:
    config = tiny_config(ARCH, **dims).to_dict()
    config.pop("transformers_version", None)
    tokenizer = build_tokenizer(charset=get_task(task).charset)
    sft = {k: v for k, v in asdict(cfg).items() if k != "cache_dir"}
    out = {"version": SFT_VERSION, "arch": ARCH, "config": config, "sft": sft, "seed": seed,
           "vocab": sorted(tokenizer.get_vocab().items()), "chat_template": tokenizer.chat_template}
    version = get_task(task).version
    if version is not None:  # the default task keeps the key it always had
        out["task"] = version
    return out


def check_vllm_shape(config: Any) -> None:
    """Raise ValueError unless vLLM (CPU) can run a Qwen2 model of this config."""
    heads, head_dim = config.num_attention_heads, config.head_dim
    if config.hidden_size != heads * head_dim:
        raise ValueError(f"hidden_size={config.hidden_size} must equal num_attention_heads * head_dim = {heads} * "
                         f"{head_dim}: vLLM's Qwen2 derives the head size as hidden_size // num_attention_heads")
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(f"head_dim={head_dim} is not a head size vLLM's CPU attention supports {VLLM_CPU_HEAD_SIZES}")


def cache_key(cfg: SFTConfig, *, seed: int = 0, task: str = "toy", **arch_overrides: Any) -> str:
    """A 16-hex-digit hash of everything that determines the warm-started weights."""
    settings = _settings(cfg, seed, {**DEFAULT_DIMS, **arch_overrides}, task)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def warm_start(
    sft_cfg: SFTConfig | None = None,
    *,
    seed: int = 0,
    task: str = "toy",
    callback: Callable[[int, float], None] | None = None,
    verbose: bool = False,
    **arch_overrides: Any,
) -> str:
    """Path of the tiny model + tokenizer warm-started on the embedded ``task``, trained now or
    found in the cache.

    ``arch_overrides`` replace entries of :data:`DEFAULT_DIMS` (or any Qwen2 config field).
    Deterministic in ``seed``: training runs single-threaded (the model is tiny, so this costs
    little) so the weights do not depend on the machine's thread count. The folder also holds
    ``rlpad_sft.json`` (settings, losses, validation accuracy, seconds).
    """
    cfg = sft_cfg or SFTConfig()
    dims = {**DEFAULT_DIMS, **arch_overrides}
    check_vllm_shape(tiny_config(ARCH, **dims))
    spec = get_task(task)
    key = cache_key(cfg, seed=seed, task=task, **dims)

    def build(folder: str) -> dict[str, Any]:
        tokenizer = build_tokenizer(charset=spec.charset)
        model = tiny_model(ARCH, seed=seed, **dims)
        every = max(1, cfg.steps // 10)
        log = None
        if verbose:
            def log(s: int, l: float) -> None:
                if (s + 1) % every == 0:
                    print(f"sft step {s + 1}/{cfg.steps} loss {l:.4f}", flush=True)
        with Progress(f"warm start of embedded:{task}, {cfg.steps} steps (cached after)", cfg.steps) as progress:
            losses = train_sft(model, tokenizer, cfg, task=task, callback=callback or log or progress.on_step)
            val_acc = val_accuracy(model, tokenizer, cfg, task)
            probe_acc = accuracy(model, tokenizer, spec.probe_examples(cfg), spec.max_answer_tokens)
        info = {"key": key, "settings": _settings(cfg, seed, dims, task), "task": task, "val_accuracy": val_acc,
                "val_reward": val_score(model, tokenizer, cfg, task), "probe_accuracy": probe_acc,
                "steps_run": len(losses), "loss_first": losses[0] if losses else None,
                "loss_last": losses[-1] if losses else None}
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return info

    return build_cached(cache_root(cfg), f"sft-{key}", INFO_FILE, seed, build)


def embedded_teacher(cfg: SFTConfig | None = None, *, task: str = "toy", verbose: bool = False) -> str:
    """Path of the embedded teacher of ``task``: the warm start's supervised recipe run ``cfg.teacher_steps``
    steps with no early stop (a stronger model than the policy; built once, cached beside it)."""
    cfg = cfg or SFTConfig()
    longer = replace(cfg, steps=cfg.teacher_steps, target_accuracy=None)
    return warm_start(longer, seed=0, task=task, verbose=verbose)


def read_info(path: str) -> dict[str, Any]:
    """The ``rlpad_sft.json`` record of a warm-started model folder."""
    with open(os.path.join(path, INFO_FILE)) as f:
        return json.load(f)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlpad.embedded.sft``: warm-start (or find cached) and print the path and val accuracy."""
    defaults = SFTConfig()
    p = argparse.ArgumentParser(prog="python -m rlpad.embedded.sft", description="Warm-start the embedded tiny model.")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--cache-dir", default=defaults.cache_dir, help="default: $XDG_CACHE_HOME/rlpad or ~/.cache/rlpad")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", default="toy", help="embedded task: toy (addition) or toy_long (list reversal)")
    p.add_argument("--verbose", action="store_true", help="print the loss every 10%% of the steps")
    args = p.parse_args(argv)
    cfg = replace(defaults, steps=args.steps, lr=args.lr, batch_size=args.batch_size, cache_dir=args.cache_dir)
    path = warm_start(cfg, seed=args.seed, task=args.task, verbose=args.verbose)
    info = read_info(path)
    print(path)
    print(f"val_accuracy {info['val_accuracy']:.3f}  val_reward {info.get('val_reward', float('nan')):.3f}  "
          f"sft_seconds {info['seconds']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
