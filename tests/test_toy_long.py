"""The embedded long task (alphabet runs): reward, held-out split, padding of its batches, recipe."""

import os

import pytest

from rlpad.config.schema import SFTConfig
from rlpad.recipe.load import load_config
from rlpad.data import PromptDataset, read_rows
from rlpad.embedded import toy_long
from rlpad.embedded.tasks import get_task
from rlpad.embedded.tiny import build_tokenizer
from rlpad.rewards.rules import compute_score
from rlpad.embedded.resolve import resolve_embedded
from paths import recipe

RECIPE = recipe("grpo_tiny_long")


@pytest.mark.parametrize(("response", "expected"), [
    ("cdefgh", 1.0),            # exact
    ("cdefg", 5 / 6),           # stopped one letter early
    ("cdefghij", 6 / 8),        # ran two letters past the end
    ("cdXfgh", 5 / 6),          # one wrong letter
    ("", 0.0),                  # nothing
    ("123456", 0.0),            # malformed: digits
    (" cdefgh", 0.0),           # malformed: a leading space shifts every letter
    ("hgfedc", 0.0),            # backwards
    ("CDEFGH", 0.0),            # wrong case is a different letter
])
def test_run_score_hand_made_cases(response, expected):
    assert toy_long.run_score(response, "cdefgh") == pytest.approx(expected)
    # the default reward dispatches to it by data_source, and ground truth is compared as text
    assert compute_score(toy_long.DATA_SOURCE, response, "cdefgh") == pytest.approx(expected)


def test_answers_follow_the_alphabet_across_the_case_boundary():
    assert toy_long.prompt_of((23, 28)) == "x-C=" and toy_long.answer_of((23, 28)) == "xyzABC"
    assert toy_long.answer_of((0, 51)) == toy_long.LETTERS and len(toy_long.LETTERS) == 52
    assert toy_long.MAX_RESPONSE_TOKENS == 53


def test_validation_is_held_out_and_the_tokenizer_has_every_character():
    pool, val = toy_long.split_problems(100, seed=0)
    assert len(val) == len(set(val)) == 100 and not set(val) & set(pool)
    assert len(pool) + len(val) == 52 * 53 // 2
    val_prompts = {toy_long.prompt_of(p) for p in val}
    assert not val_prompts & {p for p, _ in toy_long.sft_examples(2000, seed=0, n_val=100)}
    tok = build_tokenizer()
    unk = tok.unk_token_id
    for text in ("a-Z=", toy_long.LETTERS):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text) and unk not in ids  # char-level, nothing unknown
    with pytest.raises(ValueError, match="n_val"):
        toy_long.split_problems(10_000)


def _padding_ratios(rows, tok, P, R, size):
    """Padding share of each batch of ``size`` rows laid out as the rollout does: prompts left-padded
    to ``P``, answers + EOS right-padded to ``R``."""
    ratios = []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        prompts = [len(tok(r["prompt"][0]["content"], add_special_tokens=False)["input_ids"]) for r in chunk]
        answers = [len(r["reward_model"]["ground_truth"]) + 1 for r in chunk]  # + EOS
        assert max(prompts) <= P and max(answers) <= R
        ratios.append(1.0 - (sum(prompts) + sum(answers)) / (len(chunk) * (P + R)))
    return ratios


def test_dataset_batches_are_mostly_padding(tmp_path):
    """Every training batch of the recipe's size is >= 50% padding; a negative control of
    full-alphabet answers is almost none."""
    config = load_config(RECIPE)
    train_path, val_path = toy_long.write_dataset(tmp_path, n_train=2048, n_val=100, seed=0)
    tok = build_tokenizer()
    rows = read_rows(train_path)
    assert {r["prompt"][0]["content"] for r in read_rows(val_path)}.isdisjoint(r["prompt"][0]["content"] for r in rows)
    lengths = [len(r["reward_model"]["ground_truth"]) for r in rows]
    assert min(lengths) == 1 and max(lengths) >= 45  # from one letter to (nearly) the whole alphabet
    P, R, size = config.data.max_prompt_length, config.data.max_response_length, config.data.train_batch_size
    # the prompts tokenize as the dataset does (chat template = the content)
    data = PromptDataset(train_path, tok, max_prompt_length=P)
    assert int(data.collate(list(range(size)))["attention_mask"].sum()) == 4 * size
    ratios = _padding_ratios(rows, tok, P, R, size)
    assert min(ratios) >= 0.5, ratios
    full = toy_long.make_rows([(0, 51)] * size, "train")
    assert _padding_ratios(full, tok, P, R, size)[0] < 0.05


def test_recipe_loads_and_names_the_embedded_task(tmp_path):
    config = load_config(RECIPE, [f"sft.cache_dir={tmp_path}"])
    assert config.actor_rollout_ref.model.path == "embedded:toy_long"
    assert config.data.max_response_length == toy_long.MAX_RESPONSE_TOKENS
    assert config.data.max_prompt_length == toy_long.MAX_PROMPT_TOKENS
    config.actor_rollout_ref.model.path = "tiny:qwen2"  # resolve the data only (no warm-start here)
    config = resolve_embedded(config)
    train, val = config.data.train_files[0], config.data.val_files[0]
    assert os.path.isfile(train) and os.path.isfile(val) and train.startswith(str(tmp_path))
    assert {r["data_source"] for r in read_rows(val)} == {toy_long.DATA_SOURCE}
    bad = load_config(RECIPE, [f"sft.cache_dir={tmp_path}", "data.val_files=[toy_long:test]"])
    bad.actor_rollout_ref.model.path = "tiny:qwen2"
    with pytest.raises(ValueError, match="toy_long:test"):
        resolve_embedded(bad)
    bad = load_config(RECIPE, ["actor_rollout_ref.model.path=embedded:toy_longer"])
    with pytest.raises(ValueError, match="embedded:toy_longer"):
        resolve_embedded(bad)


def test_task_validation_examples_match_the_dataset():
    cfg = SFTConfig()
    spec = get_task("toy_long")
    examples = spec.val_examples(cfg)
    assert len(examples) == cfg.n_val
    assert all(spec.score(answer, answer) == 1.0 for _, answer in examples)
    with pytest.raises(ValueError, match="unknown embedded task"):
        get_task("toy_short")
