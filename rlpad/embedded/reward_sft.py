"""The embedded reward model: a tiny ``Qwen2ForSequenceClassification`` that tells the toy task's right
answers from wrong ones, trained in set-up and cached like the warm start (:mod:`rlpad.embedded.sft`).

``reward.reward_model.model_path: embedded:toy`` resolves to it. It starts from the embedded teacher
(:func:`rlpad.embedded.sft.embedded_teacher`: the warm start's supervised recipe run longer, trained on the
same training problems; a new one-output ``score`` head): a verifier can only judge sums its backbone can
add, and the warm start's backbone adds 16% of the held-out sums. It trains on training problems only,
never a validation one, with two losses: Bradley-Terry ``-log sigmoid(s(right) - s(wrong))`` on pairs of
one problem's right answer and a wrong one, mostly one the warm-started policy (the policy GRPO trains)
samples for that problem (each distinct problem sampled ``samples`` times once), else a constructed one
(the sum off by 1-5, another number, an operand, the digits reversed, a random digit string); and a
listwise cross-entropy of the right answer among every number up to the largest sum and the policy's
samples. GRPO only compares the responses to one prompt, which is what both teach. The learning rate
warms up, then decays to 0 (cosine). Each sequence is the rollout's layout: the chat-templated prompt,
the answer, EOS; scored packed (:func:`rlpad.core.reward_model.compute_scores`).

The result lands in ``<cache>/rm-<key>`` (``key``: a hash of the warm start's key and these
settings), written to a temporary folder first and renamed; ``rlpad_rm.json`` records, on the held-out
validation problems, the pairwise accuracy against the policy's sampled wrong answers and the share of
problems whose right answer outscores every number up to the largest sum (``val_top1``). Command: ``python -m rlpad.embedded.reward_sft``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlpad.config.schema import SFTConfig
from rlpad.core.attention import VARLEN_ATTENTION
from rlpad.core.reward_model import compute_scores
from rlpad.embedded.cache import build_cached, cache_root
from rlpad.embedded.optim_step import optimizer_step
from rlpad.embedded.sft import cache_key, embedded_teacher, encode, warm_start
from rlpad.embedded.tasks import get_task
from rlpad.embedded.tiny import build_tokenizer
from rlpad.progress import Progress

__all__ = ["RM_SETTINGS", "listwise_candidates", "pairwise_accuracy", "sample_answers", "top1_accuracy", "toy_pairs", "toy_reward_model",
           "wrong_answer"]

RM_VERSION = "rlpad-toy-rm-2"  # bump when the recipe changes in a way the key cannot see
# sampled: the share of pairs whose wrong answer is one the warm-started policy samples (temperature 1) for
# the problem, the mistakes GRPO's groups hold (the rest: the kinds of wrong_answer)
# listwise: prompts per step whose right answer is contrasted with EVERY candidate at once (each number up to the
# largest sum, and the policy's sampled answers): softmax cross-entropy over the candidates' scores, so no
# answer outscores the right one (a pairwise loss alone left numbers that outscore it on most problems)
# backbone: "teacher" starts from the embedded teacher (the warm start's recipe run sft.teacher_steps), "policy" from
# the warm start itself; samples: the policy's answers sampled (once) per distinct training problem
RM_SETTINGS: dict[str, Any] = dict(steps=800, batch_size=64, lr=2e-3, weight_decay=0.0, seed=0, sampled=0.75,
                                   listwise=16, backbone="teacher", samples=16, anneal=True)
INFO_FILE = "rlpad_rm.json"
TASK = "toy"


def wrong_answer(a: int, b: int, rng: random.Random, largest: int) -> str:
    """A wrong answer to ``a+b=`` (never the sum), of one of the kinds the module docstring lists."""
    right = a + b
    while True:
        kind = rng.randrange(5)
        if kind == 0:
            value = str(max(0, right + rng.choice([-5, -4, -3, -2, -1, 1, 2, 3, 4, 5])))
        elif kind == 1:
            value = str(rng.randrange(0, 2 * largest + 1))
        elif kind == 2:
            value = str(rng.choice([a, b]))
        elif kind == 3:
            value = str(right)[::-1]
        else:
            value = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        if value != str(right):
            return value


def toy_pairs(examples: Sequence[tuple[str, str]], rng: random.Random, largest: int,
              sampled: Sequence[Sequence[str]] | None = None, share: float = 0.0) -> list[tuple[str, str, str]]:
    """``(prompt, right, wrong)`` for each ``(prompt "a+b=", right answer)``: with probability ``share`` a
    wrong one of ``sampled[i]`` (the policy's answers to problem i) when it has one, else :func:`wrong_answer`."""
    out = []
    for i, (prompt, right) in enumerate(examples):
        a, b = (int(x) for x in prompt.rstrip("=").split("+"))
        mistakes = [t for t in sampled[i] if t != right] if sampled is not None else []
        wrong = rng.choice(mistakes) if mistakes and rng.random() < share else wrong_answer(a, b, rng, largest)
        out.append((prompt, right, wrong))
    return out


@torch.no_grad()
def sample_answers(model: Any, tokenizer: Any, prompts: Sequence[str], n: int, max_new_tokens: int,
                   batch_size: int = 256) -> list[list[str]]:
    """``n`` answers per prompt sampled from the causal LM ``model`` at temperature 1 (decoded, EOS cut)."""
    out: list[list[str]] = []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        chunk = [p for p in prompts[start:start + batch_size] for _ in range(n)]
        enc = encode(tokenizer, [(p, "") for p in chunk])
        ids, mask = enc["input_ids"][:, :-1], enc["attention_mask"][:, :-1]  # drop the EOS column
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(gen[:, ids.shape[1]:], skip_special_tokens=True)
        out += [texts[i:i + n] for i in range(0, len(texts), n)]
    return out


def _scores(model: Any, tokenizer: Any, pairs: Sequence[tuple[str, str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s(right), s(wrong))`` (n,) of the pairs, one packed forward."""
    rows = encode(tokenizer, [(p, r) for p, r, _ in pairs] + [(p, w) for p, _, w in pairs])
    s = compute_scores(model, rows["input_ids"], rows["attention_mask"], rows["position_ids"])
    return s[: len(pairs)], s[len(pairs):]


@torch.no_grad()
def pairwise_accuracy(model: Any, tokenizer: Any, pairs: Sequence[tuple[str, str, str]]) -> float:
    """The share of pairs whose right answer scores above the wrong one."""
    model.eval()
    right, wrong = _scores(model, tokenizer, pairs)
    return float((right > wrong).float().mean())


@torch.no_grad()
def top1_accuracy(model: Any, tokenizer: Any, examples: Sequence[tuple[str, str]], numbers: Sequence[str]) -> float:
    """The share of ``(prompt, right)`` whose right answer scores highest among ``numbers`` (which hold it)."""
    model.eval()
    rows = encode(tokenizer, [(p, n) for p, _ in examples for n in numbers])
    scores = compute_scores(model, rows["input_ids"], rows["attention_mask"], rows["position_ids"])
    best = scores.view(len(examples), len(numbers)).argmax(1)
    return float(sum(numbers[i] == right for i, (_, right) in zip(best.tolist(), examples)) / len(examples))


def listwise_candidates(right: str, numbers: Sequence[str], sampled: Sequence[str]) -> list[str]:
    """The right answer first, then every other candidate once: ``numbers`` and the ``sampled`` answers."""
    return [right] + sorted((set(numbers) | set(sampled)) - {right})


def _listwise_loss(model: Any, tokenizer: Any, examples: Sequence[tuple[str, str]],
                   sampled: Sequence[Sequence[str]], numbers: Sequence[str]) -> torch.Tensor:
    """Mean over ``examples`` of the cross-entropy of the right answer among every candidate answer
    (``numbers`` and the sampled answers), one packed forward for all."""
    lists = [listwise_candidates(right, numbers, s) for (_, right), s in zip(examples, sampled)]
    rows = encode(tokenizer, [(p, c) for (p, _), cands in zip(examples, lists) for c in cands])
    scores = compute_scores(model, rows["input_ids"], rows["attention_mask"], rows["position_ids"])
    losses, start = [], 0
    for cands in lists:
        losses.append(-torch.log_softmax(scores[start:start + len(cands)], 0)[0])
        start += len(cands)
    return torch.stack(losses).mean()


def _lr_factor(step: int, total: int, anneal: bool) -> float:
    """Linear warm-up over the first 5% of steps, then constant, or with ``anneal`` a cosine decay to 0 (the
    reward model is never trained further, so unlike the warm start it may end annealed)."""
    warmup = max(1, total // 20)
    if step < warmup or not anneal:
        return min(1.0, (step + 1) / warmup)
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _key(cfg: SFTConfig, settings: dict[str, Any]) -> str:
    record = {"version": RM_VERSION, "policy": cache_key(cfg, seed=0, task=TASK), "settings": settings}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def toy_reward_model(cfg: SFTConfig | None = None, *, verbose: bool = False, **overrides: Any) -> str:
    """Path of the embedded reward model of the toy task (trained now, or found in the cache).
    ``overrides`` replace entries of :data:`RM_SETTINGS`. Deterministic: single-threaded, seeded."""
    cfg = cfg or SFTConfig()
    settings = {**RM_SETTINGS, **overrides}
    key = _key(cfg, settings)
    def build(folder: str) -> dict[str, Any]:
        policy = warm_start(cfg, seed=0, task=TASK)
        backbone = embedded_teacher(cfg, task=TASK) if settings["backbone"] == "teacher" else policy
        return _train(policy, backbone, cfg, settings, folder, verbose) | {"key": key, "policy": policy,
                                                                           "backbone": backbone, "settings": settings}

    return build_cached(cache_root(cfg), f"rm-{key}", INFO_FILE, settings["seed"], build)


def _train(policy: str, backbone: str, cfg: SFTConfig, settings: dict[str, Any], out: str,
           verbose: bool) -> dict[str, Any]:
    with Progress("the embedded reward model (cached after)", settings["steps"]) as progress:
        return _train_steps(policy, backbone, cfg, settings, out, None if verbose else progress)


def _train_steps(policy: str, backbone: str, cfg: SFTConfig, settings: dict[str, Any], out: str,
                 progress: Progress | None) -> dict[str, Any]:
    """:func:`_train`'s work; ``progress`` (None: the loss printed every tenth of the steps instead)."""
    spec = get_task(TASK)
    if progress is not None:
        progress.update(0, "sampling the policy's answers")
    tokenizer = build_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(backbone, num_labels=1,
                                                               attn_implementation=VARLEN_ATTENTION)
    rng = random.Random(settings["seed"])
    steps, size = settings["steps"], settings["batch_size"]
    examples = spec.sft_examples(cfg, steps * size)
    lm = AutoModelForCausalLM.from_pretrained(policy, attn_implementation=VARLEN_ATTENTION)
    problems = sorted({p for p, _ in examples})  # each distinct training problem sampled once, ``samples`` times
    pool = dict(zip(problems, sample_answers(lm, tokenizer, problems, settings["samples"], spec.max_answer_tokens)))
    sampled = [pool[p] for p, _ in examples]
    pairs = toy_pairs(examples, rng, cfg.max_operand * 2, sampled, settings["sampled"])
    val = spec.val_examples(cfg)
    val_sampled = sample_answers(lm, tokenizer, [p for p, _ in val], 8, spec.max_answer_tokens)
    del lm
    val_pairs = [(p, right, wrong) for (p, right), answers in zip(val, val_sampled) for wrong in answers if wrong != right]
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=settings["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps, settings["anneal"]))
    losses = []
    numbers = [str(n) for n in range(2 * cfg.max_operand + 1)]
    per = settings["listwise"]
    for step in range(steps):
        model.train()
        right, wrong = _scores(model, tokenizer, pairs[step * size:(step + 1) * size])
        loss = -torch.nn.functional.logsigmoid(right - wrong).mean()
        if per:
            idx = [(step * per + j) % len(examples) for j in range(per)]
            loss = loss + _listwise_loss(model, tokenizer, [examples[i] for i in idx], [sampled[i] for i in idx], numbers)
        losses.append(optimizer_step(model, opt, sched, loss))
        if progress is not None:
            progress.on_step(step, losses[-1])
        elif (step + 1) % max(1, steps // 10) == 0:
            print(f"reward model step {step + 1}/{steps} loss {losses[-1]:.4f}", flush=True)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # validation: each held-out problem's right answer against every wrong answer of 8 policy samples
    # and how often the right answer outscores every number up to the largest sum (what GRPO could find instead)
    return {"val_pairwise_accuracy": pairwise_accuracy(model, tokenizer, val_pairs), "val_pairs": len(val_pairs),
            "val_top1": top1_accuracy(model, tokenizer, val, numbers),
            "loss_first": losses[0], "loss_last": losses[-1]}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlpad.embedded.reward_sft``: train (or find cached) the toy reward model; print its path
    and its held-out pairwise and top-1 accuracies."""
    p = argparse.ArgumentParser(prog="python -m rlpad.embedded.reward_sft", description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=None, help="default: $XDG_CACHE_HOME/rlpad or ~/.cache/rlpad")
    p.add_argument("--steps", type=int, default=RM_SETTINGS["steps"])
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    path = toy_reward_model(SFTConfig(cache_dir=args.cache_dir), verbose=args.verbose, steps=args.steps)
    with open(os.path.join(path, INFO_FILE)) as f:
        info = json.load(f)
    print(path)
    print(f"val_pairwise_accuracy {info['val_pairwise_accuracy']:.3f}  val_top1 {info.get('val_top1', float('nan')):.2f}  "
          f"seconds {info['seconds']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
