"""math-verify's fall-backs are never silent (issue 44, finding 3): a timeout and a missing package are
counted in ``reward/math_verify_fallbacks``, warned about once per kind, and a run whose lenient reward
would score a math data source without math-verify is refused before any compute.

The missing package is real: a child process that blocks ``math_verify`` in ``sys.modules`` (its import
then fails), not a mock of the scorer."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest

from rlpad.data import write_rows
from rlpad.embedded.tiny import build_tokenizer, tiny_config
from rlpad.recipe.load import load_config
from rlpad.rewards import math_verifier
from rlpad.rewards.math_verifier import FALLBACK_METRIC, available, drain_fallbacks
from rlpad.rewards.rules import compute_score, math_verify_score, reward_source_problems

RESPONSE, TRUTH = "We add the two parts: $\\frac{68}{2}$.\nAnswer: 34", "34"
LENIENT = "rlpad.rewards.rules:compute_score"


# sympy computes this power in C for minutes: no check of it ends within a timeout (an answer math-verify
# has just checked may come back from its cache within any timeout, so a short timeout alone is not enough)
TOWER = " so the answer is $\\boxed{9^{9^{9^{9^{9}}}}}$"


@pytest.mark.skipif(not available(), reason="math-verify is not installed (the timeout needs it)")
def test_a_timeout_is_counted_and_warned_once(caplog):
    """Each response whose check times out falls back and is counted; the first timeout is warned about,
    the second is not; a step without math-verify calls gets no metric."""
    drain_fallbacks()
    assert math_verify_score(RESPONSE, TRUTH, timeout_s=60.0) == 1.0  # math-verify's verdict (starts the child)
    assert drain_fallbacks() == {FALLBACK_METRIC: 0.0}  # asked, no fall-back: the metric is there, 0
    math_verifier._TALLY.warned.discard("timeout")
    with caplog.at_level(logging.WARNING, logger="rlpad.rewards.math_verifier"):
        scores = [math_verify_score(RESPONSE + TOWER, TRUTH, timeout_s=0.5) for _ in range(2)]
    assert scores == [0.0, 0.0]
    assert drain_fallbacks() == {FALLBACK_METRIC: 2.0}
    warned = [r.getMessage() for r in caplog.records if "math-verify fell back" in r.getMessage()]
    assert len(warned) == 1 and "took longer than its timeout" in warned[0], warned
    assert drain_fallbacks() == {}  # nothing asked since: no metric
    assert math_verify_score(RESPONSE, TRUTH, timeout_s=60.0) == 1.0  # a fresh child decides again


MISSING = textwrap.dedent("""
    import json, logging, sys
    sys.modules["math_verify"] = None  # import math_verify now raises ImportError: as if not installed
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
    from rlpad.rewards.math_verifier import available, drain_fallbacks
    from rlpad.rewards.rules import compute_score, reward_source_problems
    try:
        import math_verify
        imported = True
    except ImportError:
        imported = False
    scores = [compute_score("math", {response!r}, {truth!r}) for _ in range(3)]
    print("RESULT " + json.dumps({{"imported": imported, "available": available(), "scores": scores,
                                  "metrics": drain_fallbacks(),
                                  "problems": reward_source_problems({lenient!r}, ["math", "openai/gsm8k"]),
                                  "default_problems": reward_source_problems(None, ["math"])}}))
""")


def test_a_missing_math_verify_is_counted_warned_and_refused():
    code = MISSING.format(response=RESPONSE, truth=TRUTH, lenient=LENIENT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    assert result["imported"] is False and result["available"] is False
    assert result["scores"] == [0.0, 0.0, 0.0]  # the fall-back reads no boxed / #### answer here
    assert result["metrics"] == {FALLBACK_METRIC: 3.0}
    warnings = [line for line in out.splitlines() if line.startswith("LOG math-verify fell back")]
    assert len(warnings) == 1 and "not installed" in warnings[0], out
    assert result["problems"] == [f"reward.fn={LENIENT} scores data_source 'math' with math-verify, which is not "
                                  "installed (pip install math-verify; it is in rlpad's cpu / gpu extras), or use "
                                  "the default reward.fn"]
    assert result["default_problems"] == []  # verl's default reward does not use math-verify


def test_with_math_verify_installed_nothing_is_refused():
    """Negative control of the refusal: the same check in this process (the default set-up installs
    math-verify: rlpad's cpu / gpu extras) finds no problem."""
    assert available(), "the default set-up (make setup: extras cpu,dev) installs math-verify"
    assert reward_source_problems(LENIENT, ["math", "math_dapo", "openai/gsm8k"]) == []
    assert compute_score("math", "\\boxed{34}", "34") == 1.0


START = textwrap.dedent("""
    import sys
    sys.modules["math_verify"] = None
    from rlpad.recipe.load import load_config
    from rlpad.train import prepare
    cfg = load_config(None, {overrides!r})
    try:
        prepare(cfg)
        print("STARTED")
    except ValueError as e:
        print("REFUSED " + str(e).replace("\\n", " | "))
""")


@pytest.mark.parametrize("reward_fn, refused", [(LENIENT, True), (None, False)])
def test_the_run_is_refused_at_start(tmp_path, reward_fn, refused):
    """``rlpad.train.prepare`` (what ``python -m rlpad.train`` runs before any worker) refuses a math
    data set scored by the lenient reward without math-verify; the default reward starts."""
    model = tmp_path / "model"
    build_tokenizer(model)
    tiny_config().save_pretrained(model)
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"},
             "data_source": "math"}] * 4
    write_rows(rows, tmp_path / "train.parquet")
    overrides = [f"actor_rollout_ref.model.path={model}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
                 "data.val_files=[]", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]
    if reward_fn:
        overrides.append(f"reward.fn={reward_fn}")
    load_config(None, overrides)  # the overrides themselves are fine
    out = subprocess.run([sys.executable, "-c", START.format(overrides=overrides)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if refused:
        assert "REFUSED invalid config: |   reward.fn=rlpad.rewards.rules:compute_score scores data_source 'math' " \
               "with math-verify, which is not installed" in out.stdout, out.stdout
    else:
        assert "STARTED" in out.stdout, out.stdout + out.stderr[-2000:]


REWARD = textwrap.dedent("""
    from rlpad.rewards.rules import math_verify_score

    def score(data_source, solution_str, ground_truth, extra_info=None):
        # math-verify on every response; with the tower appended no check ends in time: each falls back
        return math_verify_score(solution_str + {tail!r}, ground_truth, timeout_s={timeout})
""")


@pytest.mark.skipif(not available(), reason="math-verify is not installed (the timeout needs it)")
def test_a_training_step_reports_the_fallbacks(tmp_path):
    """One real training step (local stack, HF rollout) whose reward times out on every response: the
    step's record holds ``reward/math_verify_fallbacks`` = every response scored (2 prompts x 2); with
    checks that end in time (negative control), 0."""
    from paths import CACHE, recipe
    from rlpad.train import fit

    counts = {}
    for timeout, tail in ((0.5, TOWER), (60.0, "")):
        reward = tmp_path / f"reward_{timeout}.py"
        reward.write_text(REWARD.format(timeout=timeout, tail=tail))
        out = tmp_path / f"run_{timeout}"
        cfg = load_config(recipe("grpo_tiny"), [
            f"trainer.default_local_dir={out}", f"sft.cache_dir={CACHE}", "trainer.logger=[jsonl]",
            "trainer.backend=local", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "data.val_files=[]",
            f"reward.fn={reward}:score"])
        fit(cfg)
        with open(out / "metrics.jsonl") as f:
            (record,) = [r for r in map(json.loads, f) if r.get("step") == 1]
        counts[timeout] = record[FALLBACK_METRIC]
    assert counts == {0.5: 4.0, 60.0: 0.0}
