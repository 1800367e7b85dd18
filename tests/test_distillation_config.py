"""distillation.*: verl's keys load; bad values and bad teachers are refused in one line naming the key,
before anything is built."""

from __future__ import annotations

import json
import os

import pytest

from rlpad.algorithms.distillation_rules import distillation_notices, pair_problem, teacher_problems
from rlpad.core.models import load_tokenizer
from rlpad.embedded.tiny import build_tokenizer, tiny_config
from rlpad.recipe.load import load_config
from rlpad.train import check_inputs
from tests.bpe_chatml import build_bpe

RECIPE = os.path.join(os.path.dirname(__file__), "fixtures", "grpo_recipe.yaml")
ON = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=tiny:qwen2"]
LOSS = "distillation.distillation_loss"


def test_verls_keys_load():
    cfg = load_config(RECIPE, ON + [f"{LOSS}.loss_mode=forward_kl_topk", f"{LOSS}.topk=16",
                                    f"{LOSS}.use_policy_gradient=false", f"{LOSS}.use_task_rewards=false",
                                    f"{LOSS}.distillation_loss_coef=0.5", f"{LOSS}.log_prob_min_clamp=-10",
                                    f"{LOSS}.loss_max_clamp=10", "actor_rollout_ref.actor.use_kl_loss=false"])
    assert cfg.distillation.distillation_loss.topk == 16
    load_config(RECIPE, ON + [f"{LOSS}.loss_mode=k1", f"{LOSS}.use_policy_gradient=true"])
    load_config(RECIPE, ON + [f"{LOSS}.loss_mode=low_var_kl", f"{LOSS}.use_policy_gradient=false"])


def test_the_default_pair_is_verls_shipped_yaml_and_trains_toward_the_teacher():
    """verl 0.9.1's distillation.yaml: loss_mode k3, use_policy_gradient false (its dataclass's true is overridden);
    the old default here (k3 under the policy gradient) led away from the teacher (tests/test_distillation_gradients.py)."""
    loss = load_config(RECIPE, ON).distillation.distillation_loss
    assert (loss.loss_mode, loss.use_policy_gradient) == ("k3", False)
    assert pair_problem(loss.loss_mode, loss.use_policy_gradient) is None
    assert pair_problem("k3", True) is not None  # negative control: the old default


def test_k3_without_a_clamp_says_at_start_how_it_differs_from_verl(capsys):
    """verl clamps k3 at 10 inside its estimator whatever loss_max_clamp; rlpad's k3 is clamped by loss_max_clamp
    alone: a k3 run with it null starts with one line saying so (rlpad.train.prepare), none with a clamp or another
    mode."""
    from rlpad.train import prepare

    lifted = load_config(RECIPE, ON + [f"{LOSS}.loss_mode=low_var_kl", f"{LOSS}.loss_max_clamp=null"])
    (line,) = distillation_notices(lifted)
    assert "loss_max_clamp=null" in line and "verl 0.9.1 clamps k3 to [-10, 10]" in line
    with pytest.raises(FileNotFoundError, match="data.train_files"):  # the line comes first, before the inputs
        prepare(lifted)
    assert capsys.readouterr().err.count(line) == 1
    for other in ([f"{LOSS}.loss_max_clamp=10"], [f"{LOSS}.loss_mode=k2", f"{LOSS}.loss_max_clamp=null"],
                  ["distillation.enabled=false", f"{LOSS}.loss_max_clamp=null"]):
        assert distillation_notices(load_config(RECIPE, ON + other)) == [], other


def test_the_teachers_dtype_and_temperature_keys():
    """teacher_model.dtype (null: the actor's model.dtype) and temperature (1.0, verl's) reach the teacher's section."""
    from workers.teacher import teacher_section

    cfg = load_config(RECIPE, ON)
    teacher = cfg.distillation.teacher_models.teacher_model
    assert (teacher.dtype, teacher.temperature) == (None, 1.0)
    assert teacher_section(cfg, 64).model.dtype == cfg.actor_rollout_ref.model.dtype == "float32"
    cfg = load_config(RECIPE, ON + ["distillation.teacher_models.teacher_model.dtype=bfloat16",
                                    "distillation.teacher_models.teacher_model.temperature=0.5"])
    section = teacher_section(cfg, 64)
    assert section.model.dtype == "bfloat16" and section.distillation.teacher_models.teacher_model.temperature == 0.5
    assert cfg.actor_rollout_ref.model.dtype == "float32"  # the student's stays


def test_a_topk_above_the_tokenizers_ids_is_refused_at_start():
    """Before any worker starts (rlpad.train.prepare passes topk), not at the teacher's first call."""
    tok = build_tokenizer()
    (problem,) = teacher_problems("tiny:qwen2", tok, "tiny:qwen2", topk=len(tok) + 1)
    assert problem == f"{LOSS}.topk={len(tok) + 1} is more than the tokenizer's {len(tok)} ids (at 'tiny:qwen2')"
    assert teacher_problems("tiny:qwen2", tok, "tiny:qwen2", topk=len(tok)) == []
    from rlpad.train import prepare

    cfg = load_config(RECIPE, ON + [f"{LOSS}.loss_mode=forward_kl_topk", f"{LOSS}.topk={len(tok) + 1}",
                                    "data.train_files=[toy:train]", "data.val_files=[toy:val]"])
    with pytest.raises(ValueError, match=f"{LOSS}.topk={len(tok) + 1} is more than the tokenizer's"):
        prepare(cfg)


def test_one_sample_per_prompt_needs_no_group_without_task_rewards():
    """The teacher's loss alone reads no task advantage, so GRPO's n >= 2 does not bind; mixed with the
    task's GRPO loss (use_task_rewards) it does."""
    one = ["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=grpo", f"{LOSS}.loss_mode=forward_kl_topk",
           f"{LOSS}.topk=4", f"{LOSS}.use_policy_gradient=false"]
    alone = [f"{LOSS}.use_task_rewards=false", "actor_rollout_ref.actor.use_kl_loss=false"]
    assert load_config(RECIPE, ON + one + alone).actor_rollout_ref.rollout.n == 1
    with pytest.raises(ValueError, match=r"rollout.n=1: GRPO compares responses within a group and needs n >= 2"):
        load_config(RECIPE, ON + one + [f"{LOSS}.use_task_rewards=true"])
    with pytest.raises(ValueError, match=r"rollout.n=1: GRPO compares responses within a group and needs n >= 2"):
        load_config(RECIPE, one)  # no distillation: the task's loss


@pytest.mark.parametrize("overrides,wanted", [
    ([f"{LOSS}.loss_mode=reverse_kl_topk"], f"{LOSS}.loss_mode='reverse_kl_topk' is not a verl distillation loss mode"),
    ([f"{LOSS}.loss_mode=k3+"], "is not a verl distillation loss mode"),
    ([f"{LOSS}.loss_mode=k3", f"{LOSS}.topk=8"], f"{LOSS}.topk=8 is set but loss_mode=k3 scores the sampled token only"),
    ([f"{LOSS}.loss_mode=forward_kl_topk"], f"{LOSS}.topk is missing"),
    ([f"{LOSS}.loss_mode=forward_kl_topk", f"{LOSS}.topk=0"], f"{LOSS}.topk=0 must be an int >= 1"),
    ([f"{LOSS}.loss_mode=k1", f"{LOSS}.use_policy_gradient=false"],
     "loss_mode=k1 with use_policy_gradient=false: back-propagated, k1's gradient is that of the student's log-prob"),
    ([f"{LOSS}.loss_mode=kl", f"{LOSS}.use_policy_gradient=false"], "verl refuses this too"),
    ([f"{LOSS}.use_policy_gradient=true"], f"{LOSS}.loss_mode=k3 with use_policy_gradient=true: under the policy "
     "gradient the advantage -k3 is detached, which drops the estimator's own dependence on the student: the expected "
     "gradient is grad KL(s||t) - grad KL(t||s)"),
    ([f"{LOSS}.loss_mode=low_var_kl", f"{LOSS}.use_policy_gradient=true"], "verl accepts this pair"),
    ([f"{LOSS}.loss_mode=mse", f"{LOSS}.use_policy_gradient=true"], "grad E_s[d^2/2] - grad KL(s||t)"),
    ([f"{LOSS}.loss_mode=abs", f"{LOSS}.use_policy_gradient=true"], "grad E_s|d| - E_s[sign(d) grad log s]"),
    ([f"{LOSS}.loss_mode=forward_kl_topk", f"{LOSS}.topk=4", f"{LOSS}.use_policy_gradient=true"],
     "does not depend on the token sampled there, so its expected gradient is zero"),
    ([f"{LOSS}.policy_loss_mode=gspo"], "only vanilla is supported"),
    (["distillation.teacher_models.teacher_model.dtype=int8"],
     "distillation.teacher_models.teacher_model.dtype='int8' is not valid"),
    (["distillation.teacher_models.teacher_model.temperature=0"],
     "distillation.teacher_models.teacher_model.temperature=0.0 must be > 0"),
    ([f"{LOSS}.use_task_rewards=false", "actor_rollout_ref.actor.use_kl_loss=true"],
     f"actor_rollout_ref.actor.use_kl_loss=True has no effect with {LOSS}.use_task_rewards=false"),
    ([f"{LOSS}.use_task_rewards=false", "actor_rollout_ref.actor.entropy_coeff=0.01"],
     f"actor_rollout_ref.actor.entropy_coeff=0.01 has no effect with {LOSS}.use_task_rewards=false"),
    ([f"{LOSS}.loss_max_clamp=0"], f"{LOSS}.loss_max_clamp=0.0 must be > 0"),
    ([f"{LOSS}.log_prob_min_clamp=1"], f"{LOSS}.log_prob_min_clamp=1.0 must be < 0"),
    (["distillation.teacher_key=data_source"], "distillation.teacher_key='data_source': rlpad has one teacher"),
    (["distillation.teacher_models.teacher_model.model_path=null"],
     "distillation.teacher_models.teacher_model.model_path is missing"),
])
def test_bad_values_are_refused_in_one_line(overrides, wanted):
    with pytest.raises(ValueError) as e:
        load_config(RECIPE, ON + overrides)
    assert wanted in str(e.value)
    line = next(ln for ln in str(e.value).splitlines() if wanted.split(":")[0] in ln)
    assert wanted in line  # one line says it all


def test_a_teacher_path_that_does_not_exist_is_refused_before_anything_runs(tmp_path):
    cfg = load_config(RECIPE, ON[:1] + [f"distillation.teacher_models.teacher_model.model_path={tmp_path}/nope",
                                        f"trainer.default_local_dir={tmp_path}/out", "data.train_files=[toy:train]",
                                        "data.val_files=[toy:val]"])
    with pytest.raises(ValueError, match="distillation.teacher_models.teacher_model.model_path=.*nope' is not a directory"):
        check_inputs(cfg)
    assert teacher_problems(str(tmp_path / "nope"), build_tokenizer(), "tiny:qwen2")[0].endswith(
        "does not exist (a local Hugging Face checkpoint folder; nothing is downloaded)")


def save_model_folder(path, config, tokenizer):
    path.mkdir()
    config.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def test_not_a_causal_lm_is_refused(tmp_path):
    from transformers import BertConfig

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     architectures=["BertForMaskedLM"])
    path = save_model_folder(tmp_path / "bert", cfg, build_tokenizer())
    (problem,) = teacher_problems(path, build_tokenizer(), "tiny:qwen2")
    assert "is not a causal LM" in problem and "BertForMaskedLM" in problem
    (tmp_path / "empty").mkdir()
    (problem,) = teacher_problems(str(tmp_path / "empty"), build_tokenizer(), "tiny:qwen2")
    assert "is not a model folder" in problem


def test_tokenizers_that_differ_are_refused_naming_both(tmp_path):
    path = save_model_folder(tmp_path / "bpe_teacher", tiny_config("qwen2", vocab_size=512), build_bpe())
    (problem,) = teacher_problems(path, build_tokenizer(), "/models/student")
    assert "its tokenizer" in problem and "differs from the student's at '/models/student'" in problem
    assert str(len(build_bpe())) in problem and str(len(build_tokenizer())) in problem


def test_the_same_tokenizer_with_padded_embeddings_of_other_sizes_is_accepted(tmp_path):
    """Qwen's 152064 vs 151936 rows: one tokenizer, heads padded past it differently."""
    tok = build_tokenizer()
    teacher = save_model_folder(tmp_path / "teacher", tiny_config("qwen2", vocab_size=len(tok) + 24), tok)
    assert teacher_problems(teacher, load_tokenizer(teacher), "student") == []
    short = save_model_folder(tmp_path / "short", tiny_config("qwen2", vocab_size=len(tok) - 1), tok)
    (problem,) = teacher_problems(short, tok, "student")
    assert "fewer than the tokenizer's" in problem
    assert json.loads((tmp_path / "teacher" / "config.json").read_text())["vocab_size"] == len(tok) + 24


def test_the_embedded_teacher_is_the_warm_start_trained_further_and_cached(tmp_path):
    from rlpad.embedded.resolve import resolve_embedded

    cache = str(tmp_path / "cache")
    overrides = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=embedded-teacher:toy",
                 "actor_rollout_ref.model.path=embedded:toy", f"sft.cache_dir={cache}", "sft.steps=4",
                 "sft.teacher_steps=12", "data.train_files=[toy:train]", "data.val_files=[toy:val]"]
    cfg = resolve_embedded(load_config(RECIPE, overrides))
    teacher, student = cfg.distillation.teacher_models.teacher_model.model_path, cfg.actor_rollout_ref.model.path
    assert teacher != student and teacher.startswith(cache) and student.startswith(cache)
    info = {p: json.load(open(os.path.join(p, "rlpad_sft.json"))) for p in (teacher, student)}
    assert info[teacher]["steps_run"] == 12 and info[student]["steps_run"] == 4
    assert teacher_problems(teacher, load_tokenizer(student), student) == []  # one tokenizer
    again = resolve_embedded(load_config(RECIPE, overrides))  # cached: the same folder, not rebuilt
    assert again.distillation.teacher_models.teacher_model.model_path == teacher
    with pytest.raises(ValueError, match="sft.teacher_steps=0 must be >= 1"):
        load_config(RECIPE, overrides + ["sft.teacher_steps=0"])
