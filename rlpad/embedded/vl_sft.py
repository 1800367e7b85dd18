"""Supervised warm start of the embedded vision-language model on :mod:`rlpad.embedded.vl_shapes`, cached.

:func:`vl_warm_start` builds the tiny Qwen2.5-VL (``tiny:qwen2_5_vl``: 2 text layers of width 64, a
depth-2 vision tower), teaches it the task for a few hundred AdamW steps with images (loss on the
answer and EOS only, the vision tower trained too; the scoring core's padded forward with the
batch's ``multi_modal_inputs``), and saves model, tokenizer and image processor as one folder
(:func:`rlpad.embedded.vl_processor.save_vl_folder`) under ``<cache>/vl-sft-<key>``, ``key`` hashing
everything that shapes the weights. Like the text warm start (:mod:`rlpad.embedded.sft`) it is kept
short on purpose, stopped once greedy accuracy on training problems reaches ``sft.target_accuracy``,
so GRPO has reward variance to learn from. Built once; later calls return the folder at once.

Command: ``python -m rlpad.embedded.vl_sft [--steps N]`` prints the path and the validation reward.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch

from rlpad.config.schema import SFTConfig
from rlpad.core.forward import compute_log_probs
from rlpad.core.layout import left_pad, position_ids_from_mask
from rlpad.core.models import mask_vision_logits
from rlpad.embedded.cache import build_cached, cache_root
from rlpad.embedded.optim_step import optimizer_step
from rlpad.embedded.tiny import build_tokenizer
from rlpad.embedded.tiny_vl import tiny_vl_config, tiny_vl_model
from rlpad.embedded.vl_processor import build_image_processor, save_vl_folder
from rlpad.embedded.vl_shapes import VERSION, Problem, images_of, shapes_score, split_problems
from rlpad.multimodal.processor import VLProcessor, load_vl_processor
from rlpad.multimodal.generate import generate_image_inputs

__all__ = ["ARCH", "VL_SFT_VERSION", "greedy", "vl_cache_key", "vl_warm_start", "vl_val_score"]

VL_SFT_VERSION = "rlpad-vl-sft-2"  # bump when the recipe changes in a way the key cannot see
ARCH = "qwen2_5_vl"
INFO_FILE = "rlpad_sft.json"
MAX_ANSWER_TOKENS = 3  # one character + EOS, with a spare


def _processor(tokenizer: Any) -> VLProcessor:
    processor = load_vl_processor(f"tiny:{ARCH}", tokenizer)
    assert processor is not None
    return processor


def _encode(processor: VLProcessor, problems: Sequence[Problem], with_answers: bool = True) -> dict[str, Any]:
    """Left-padded prompts then right-padded answer + EOS; each row's ``multi_modal_inputs``."""
    tok = processor.tokenizer
    prompts, mm = [], []
    for p in problems:
        ids, inputs = processor.encode([{"role": "user", "content": p.text}], images_of(p))
        prompts.append(ids)
        mm.append(inputs)
    answers = [tok(p.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] if with_answers else []
               for p in problems]
    width, R = max(map(len, prompts)), max(1, max(map(len, answers)))
    prompt_ids, prompt_mask = left_pad(prompts, width, tok.pad_token_id)
    resp = torch.full((len(problems), R), tok.pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros_like(resp)
    for i, a in enumerate(answers):
        resp[i, :len(a)], resp_mask[i, :len(a)] = torch.tensor(a, dtype=torch.long), 1
    mask = torch.cat([prompt_mask, resp_mask], 1)
    return {"input_ids": torch.cat([prompt_ids, resp], 1), "attention_mask": mask,
            "position_ids": position_ids_from_mask(mask), "response_mask": resp_mask, "R": R, "mm": mm,
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask}


def _loss(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    lp, _ = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["R"],
                              use_remove_padding=False, response_mask=batch["response_mask"],
                              multi_modal_inputs=batch["mm"])
    mask = batch["response_mask"]
    return -(lp * mask).sum() / mask.sum()


@torch.no_grad()
def greedy(model: Any, processor: VLProcessor, problems: Sequence[Problem], batch_size: int = 64) -> list[str]:
    """Greedy answers (decoded, cut at EOS) of ``problems``."""
    tok, out = processor.tokenizer, []
    model.eval()
    for s in range(0, len(problems), batch_size):
        b = _encode(processor, problems[s:s + batch_size], with_answers=False)
        ids, mask = b["prompt_ids"], b["prompt_mask"]
        seq = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_ANSWER_TOKENS,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             **generate_image_inputs(ids, b["mm"], model.config, ids.device))
        for row in seq[:, ids.shape[1]:].tolist():
            row = row[:row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
            out.append(tok.decode([t for t in row if t != tok.pad_token_id], skip_special_tokens=True))
    return out


def vl_val_score(model: Any, processor: VLProcessor, problems: Sequence[Problem]) -> float:
    """Mean reward of the greedy answers (what GRPO's validation reports)."""
    answers = greedy(model, processor, problems)
    return sum(shapes_score(a, p.answer) for a, p in zip(answers, problems)) / len(problems)


def _settings(cfg: SFTConfig, seed: int) -> dict[str, Any]:
    config = tiny_vl_config(ARCH).to_dict()
    config.pop("transformers_version", None)
    tokenizer = build_tokenizer(vision=True)
    sft = {k: v for k, v in asdict(cfg).items() if k in ("steps", "lr", "batch_size", "weight_decay", "n_val",
                                                          "data_seed", "target_accuracy", "eval_every")}
    return {"version": VL_SFT_VERSION, "task": VERSION, "arch": ARCH, "config": config, "sft": sft, "seed": seed,
            "vocab": sorted(tokenizer.get_vocab().items()), "chat_template": tokenizer.chat_template,
            "image_processor": build_image_processor().to_dict()}


def vl_cache_key(cfg: SFTConfig, seed: int = 0) -> str:
    """A 16-hex-digit hash of everything that determines the warm-started weights."""
    return hashlib.sha256(json.dumps(_settings(cfg, seed), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _train(model: Any, processor: VLProcessor, cfg: SFTConfig, train: list[Problem],
           callback: Callable[[int, float], None] | None) -> list[float]:
    rng = random.Random(cfg.data_seed)
    probe = train[:100]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    warmup = max(1, cfg.steps // 20)  # then constant, as the text warm start (rlpad.embedded.sft._lr_factor)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    losses: list[float] = []
    for step in range(cfg.steps):
        model.train()
        losses.append(optimizer_step(model, opt, sched, _loss(model, _encode(processor, rng.sample(train, cfg.batch_size)))))
        if callback is not None:
            callback(step, losses[-1])
        if cfg.target_accuracy is not None and (step + 1) % cfg.eval_every == 0 and \
                vl_val_score(model, processor, probe) >= cfg.target_accuracy:
            break
    model.eval()
    return losses


def vl_warm_start(sft_cfg: SFTConfig | None = None, *, seed: int = 0, verbose: bool = False,
                  callback: Callable[[int, float], None] | None = None) -> str:
    """Path of the tiny VL model (+ tokenizer + image processor) warm-started on vl_shapes, trained now or
    found in the cache. Its ``rlpad_sft.json`` holds the settings, losses, validation reward and seconds."""
    cfg = sft_cfg or SFTConfig()
    key = vl_cache_key(cfg, seed)

    def build(folder: str) -> dict[str, Any]:
        tokenizer = build_tokenizer(vision=True)
        processor = _processor(tokenizer)
        model = mask_vision_logits(tiny_vl_model(ARCH, seed=seed))
        train, val = split_problems(cfg.n_val, cfg.data_seed)

        def log(s: int, l: float) -> None:
            if verbose and (s + 1) % max(1, cfg.steps // 10) == 0:
                print(f"vl sft step {s + 1}/{cfg.steps} loss {l:.4f}", flush=True)

        losses = _train(model, processor, cfg, train, callback or log)
        info = {"key": key, "settings": _settings(cfg, seed), "task": "vl_shapes", "steps_run": len(losses),
                "loss_first": losses[0], "loss_last": losses[-1], "val_reward": vl_val_score(model, processor, val),
                "probe_reward": vl_val_score(model, processor, train[:100])}
        save_vl_folder(model, tokenizer, folder)
        return info

    return build_cached(cache_root(cfg), f"vl-sft-{key}", INFO_FILE, seed, build)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlpad.embedded.vl_sft``: warm-start (or find cached) and print the path and val reward."""
    defaults = SFTConfig()
    parser = argparse.ArgumentParser(prog="python -m rlpad.embedded.vl_sft", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--target-accuracy", type=float, default=None)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    cfg = replace(defaults, steps=args.steps, lr=args.lr, target_accuracy=args.target_accuracy, cache_dir=args.cache_dir)
    path = vl_warm_start(cfg, verbose=True)
    with open(f"{path}/{INFO_FILE}") as f:
        info = json.load(f)
    print(path)
    print(f"steps {info['steps_run']}, validation reward {info['val_reward']:.3f}, {info['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
