"""The embedded tasks by name: what the warm-start trains on and what ``<task>:train`` / ``<task>:val`` hold.

``toy`` is small-number addition (:mod:`rlpad.embedded.toy`, short sequences); ``toy_long`` is
an alphabet run (:mod:`rlpad.embedded.toy_long`, responses of 2-53 tokens, a padding-heavy batch);
``toy_tail`` the same runs with heavy-tailed lengths (:mod:`rlpad.embedded.toy_tail`: 10% 8x the median; streaming);
``toy_tools`` is two-digit addition with a calculator tool (:mod:`rlpad.embedded.toy_tools`, multi-turn);
``toy_python`` two-digit multiplication through the sandboxed Python tool (:mod:`rlpad.embedded.toy_python`);
``toy_guess`` guesses a number from an environment's higher / lower replies (:mod:`rlpad.embedded.toy_guess`,
the env_agent loop); ``toy_code`` asks for a program (:mod:`rlpad.embedded.toy_code`, run against hidden cases in the sandbox).
:data:`VL_TASKS` holds the vision-language ones (``vl_shapes``: questions about squares on 56x56 images,
:mod:`rlpad.embedded.vl_shapes`), each with its own warm start of a tiny VL model.
A recipe names a task through ``actor_rollout_ref.model.path: embedded:<task>`` and
``data.train_files: [<task>:train]``; the ``sft`` section's ``n_val`` and ``data_seed`` (and
``max_operand`` for ``toy``) pick the split, so the warm-start never sees a validation problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlpad.config.schema import SFTConfig
from rlpad.embedded import toy, toy_code, toy_guess, toy_long, toy_python, toy_tail, toy_tools, vl_shapes
from rlpad.embedded.tiny import CHARSET, CODE_CHARSET

__all__ = ["TASKS", "VL_TASKS", "EmbeddedTask", "EmbeddedVLTask", "dataset_folder", "dataset_spec", "get_task"]

Example = tuple[str, Any]  # (user message, answer: a string or [(text, in the loss)] segments)


@dataclass(frozen=True)
class EmbeddedTask:
    """One embedded task; every callable takes the run's :class:`SFTConfig` (its split settings)."""

    name: str
    sft_examples: Callable[[SFTConfig, int], list[Example]]  # (cfg, n): training examples
    val_examples: Callable[[SFTConfig], list[Example]]  # the held-out validation problems
    probe_examples: Callable[[SFTConfig], list[Example]]  # training problems for early stopping
    write_dataset: Callable[[str, SFTConfig], tuple[str, str]]  # (out_dir, cfg) -> (train, val) paths
    split_tag: Callable[[SFTConfig], str]  # the split settings' part of the dataset's folder (dataset_folder)
    score: Callable[[str, str], float]  # the task's reward of a response given the answer
    max_answer_tokens: int  # longest answer + EOS (greedy decoding stops there)
    version: str | None  # enters the warm-start cache key and names the dataset's folder (None: the name)
    charset: str = CHARSET  # the characters of the task's tokenizer (rlpad.embedded.tiny.build_tokenizer)
    # (responses, answers) -> their rewards at once (a task whose check runs programs); None: ``score`` each
    score_all: Callable[[list[str], list[str]], list[float]] | None = None
    runs_code: bool = False  # its warm start and its data run programs in the code sandbox (rlpad.code)


def _toy_val(cfg: SFTConfig) -> list[Example]:
    return [(f"{a}+{b}=", str(a + b)) for a, b in toy.split_pairs(cfg.n_val, cfg.data_seed, cfg.max_operand)[1]]


def _toy_probe(cfg: SFTConfig) -> list[Example]:
    pool, _ = toy.split_pairs(cfg.n_val, cfg.data_seed, cfg.max_operand)
    return [(f"{a}+{b}=", str(a + b)) for a, b in pool[:100]]


TASKS: dict[str, EmbeddedTask] = {
    "toy": EmbeddedTask(
        name="toy",
        sft_examples=lambda cfg, n: toy.sft_examples(n, seed=cfg.data_seed, n_val=cfg.n_val,
                                                     max_operand=cfg.max_operand),
        val_examples=_toy_val,
        probe_examples=_toy_probe,
        write_dataset=lambda out, cfg: toy.write_toy_dataset(out, n_val=cfg.n_val, seed=cfg.data_seed,
                                                             max_operand=cfg.max_operand),
        split_tag=lambda cfg: f"{cfg.data_seed}-{cfg.n_val}-{cfg.max_operand}",
        score=toy.toy_score,
        max_answer_tokens=4,  # the longest answer ("40") plus EOS, with one spare
        version=None,
    ),
    "toy_tools": EmbeddedTask(
        name="toy_tools",
        sft_examples=lambda cfg, n: toy_tools.sft_examples(n, seed=cfg.data_seed, n_val=cfg.n_val),
        # greedy without the tool (the warm start's own check): the call, then the model's guess
        val_examples=lambda cfg: [(f"{a}+{b}=", str(a + b)) for a, b in toy_tools.split_pairs(cfg.n_val, cfg.data_seed)[1]],
        probe_examples=lambda cfg: [(f"{a}+{b}=", str(a + b)) for a, b in toy_tools.split_pairs(cfg.n_val, cfg.data_seed)[0][:100]],
        write_dataset=lambda out, cfg: toy_tools.write_dataset(out, n_val=cfg.n_val, seed=cfg.data_seed),
        split_tag=lambda cfg: f"{cfg.data_seed}-{cfg.n_val}",
        score=toy_tools.tools_score,
        max_answer_tokens=20,  # "[calc(99+99)]" + "198" + EOS, with spares
        version="toy_tools-calc-2",
    ),
    "toy_python": EmbeddedTask(
        name="toy_python",
        sft_examples=lambda cfg, n: toy_python.sft_examples(n, seed=cfg.data_seed, n_val=cfg.n_val),
        val_examples=lambda cfg: [(f"{a}*{b}=", str(a * b)) for a, b in toy_python.split_pairs(cfg.n_val, cfg.data_seed)[1]],
        probe_examples=lambda cfg: [(f"{a}*{b}=", str(a * b))
                                    for a, b in toy_python.split_pairs(cfg.n_val, cfg.data_seed)[0][:100]],
        write_dataset=lambda out, cfg: toy_python.write_dataset(out, n_val=cfg.n_val, seed=cfg.data_seed),
        split_tag=lambda cfg: f"{cfg.data_seed}-{cfg.n_val}",
        score=toy_tools.tools_score,
        max_answer_tokens=30,  # "[py(print(99*99))]" (18) + "9801" + "9801" + EOS, with spares
        version="toy_python-2",
        runs_code=True,  # its tool runs the model's programs in the code sandbox
    ),
    "toy_guess": EmbeddedTask(
        name="toy_guess",
        sft_examples=lambda cfg, n: toy_guess.sft_examples(n, seed=cfg.data_seed),
        # greedy without the environment (the warm start's own check): the first guess is the secret
        val_examples=lambda cfg: [(toy_guess.PROMPT, str(s)) for s in range(toy_guess.LO, toy_guess.HI + 1)],
        probe_examples=lambda cfg: [(toy_guess.PROMPT, str(s)) for s in range(toy_guess.LO, toy_guess.HI + 1)],
        write_dataset=lambda out, cfg: toy_guess.write_dataset(out, seed=cfg.data_seed),
        split_tag=lambda cfg: f"{cfg.data_seed}",
        score=toy_guess.guess_score,
        max_answer_tokens=4,  # "15" + EOS, with a spare
        version="toy_guess-1",
    ),
    "toy_long": EmbeddedTask(
        name="toy_long",
        sft_examples=lambda cfg, n: toy_long.sft_examples(n, seed=cfg.data_seed, n_val=cfg.n_val),
        val_examples=lambda cfg: [(toy_long.prompt_of(p), toy_long.answer_of(p))
                                  for p in toy_long.split_problems(cfg.n_val, cfg.data_seed)[1]],
        probe_examples=lambda cfg: toy_long.sft_examples(100, seed=cfg.data_seed + 1000, n_val=cfg.n_val),
        write_dataset=lambda out, cfg: toy_long.write_dataset(out, n_val=cfg.n_val, seed=cfg.data_seed),
        split_tag=lambda cfg: f"{cfg.data_seed}-{cfg.n_val}",
        score=toy_long.run_score,
        max_answer_tokens=toy_long.MAX_RESPONSE_TOKENS,
        version="toy_long-alphabet-1",
    ),
    "toy_tail": EmbeddedTask(
        name="toy_tail",
        sft_examples=lambda cfg, n: toy_tail.sft_examples(n, seed=cfg.data_seed, n_val=cfg.n_val),
        val_examples=lambda cfg: [(toy_tail.prompt_of(p), toy_tail.answer_of(p))
                                  for p in toy_tail.split_problems(cfg.n_val, cfg.data_seed)[1]],
        probe_examples=lambda cfg: toy_tail.sft_examples(100, seed=cfg.data_seed + 1000, n_val=cfg.n_val),
        write_dataset=lambda out, cfg: toy_tail.write_dataset(out, n_val=cfg.n_val, seed=cfg.data_seed),
        split_tag=lambda cfg: f"{cfg.data_seed}-{cfg.n_val}",
        score=toy_tail.run_score,
        max_answer_tokens=toy_tail.MAX_RESPONSE_TOKENS,
        version="toy_tail-alphabet-1",
    ),
    "toy_code": EmbeddedTask(
        name="toy_code",
        sft_examples=lambda cfg, n: toy_code.sft_examples(n, seed=cfg.data_seed, n_val=cfg.n_val),
        val_examples=lambda cfg: [(toy_code.prompt_of(p), toy_code.canonical(p))
                                  for p in toy_code.split_problems(cfg.n_val, cfg.data_seed)[1]],
        probe_examples=lambda cfg: [(toy_code.prompt_of(p), toy_code.canonical(p))
                                    for p in toy_code.split_problems(cfg.n_val, cfg.data_seed)[0][:100]],
        write_dataset=lambda out, cfg: toy_code.write_dataset(out, n_val=cfg.n_val, seed=cfg.data_seed),
        split_tag=lambda cfg: f"{cfg.data_seed}-{cfg.n_val}",
        score=toy_code.code_score,
        max_answer_tokens=toy_code.MAX_RESPONSE_TOKENS,
        version="toy_code-lambda-1",
        charset=CODE_CHARSET,
        score_all=toy_code.code_scores,
        runs_code=True,
    ),
}


@dataclass(frozen=True)
class EmbeddedVLTask:
    """A vision-language embedded task: its warm start builds its own tiny VL model folder."""

    name: str
    warm_start: Callable[[SFTConfig], str]  # cfg -> the warm-started model folder (built once, cached)
    write_dataset: Callable[[str, SFTConfig], tuple[str, str]]  # (out_dir, cfg) -> (train, val) paths
    split_tag: Callable[[SFTConfig], str]  # the split settings' part of the dataset's folder (dataset_folder)
    version: str  # names the dataset's folder (bump when the rows change)
    runs_code: bool = False  # no VL task runs programs yet (the field every dataset_spec answers)


def _vl_shapes_warm_start(cfg: SFTConfig) -> str:
    from rlpad.embedded.vl_sft import vl_warm_start  # torch and the VL model: on first use

    return vl_warm_start(cfg)


def _vl_shapes_dataset(out: str, cfg: SFTConfig) -> tuple[str, str]:
    from rlpad.embedded.vl_shapes import write_dataset

    return write_dataset(out, n_val=cfg.n_val, seed=cfg.data_seed)


VL_TASKS: dict[str, EmbeddedVLTask] = {
    "vl_shapes": EmbeddedVLTask(name="vl_shapes", warm_start=_vl_shapes_warm_start, write_dataset=_vl_shapes_dataset,
                                split_tag=lambda cfg: f"{cfg.data_seed}-{cfg.n_val}", version=vl_shapes.VERSION),
}


def dataset_spec(name: str) -> EmbeddedTask | EmbeddedVLTask:
    """The task called ``name``, text (:data:`TASKS`) or vision-language (:data:`VL_TASKS`), for its dataset."""
    return VL_TASKS[name] if name in VL_TASKS else get_task(name)


def dataset_folder(spec: EmbeddedTask | EmbeddedVLTask, cfg: SFTConfig) -> str:
    """The cache folder name of ``spec``'s dataset: ``<version>-<split tag>`` (``<name>-...`` for a task without
    a version), so a task whose rows changed (its version bumped) never reuses the old rows."""
    return f"{spec.version or spec.name}-{spec.split_tag(cfg)}"


def get_task(name: str) -> EmbeddedTask:
    """The task called ``name``; ValueError listing the known ones otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown embedded task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name]
