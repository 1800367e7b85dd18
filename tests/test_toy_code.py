"""The embedded code task (rlpad.embedded.toy_code): its programs pass their hidden cases in the sandbox, the
guessed ones fail, its rows are verl's call-based format, its split holds out the validation problems,
and its tokenizer writes every program character back."""

import json

from rlpad.data import read_rows
from rlpad.embedded import toy_code
from rlpad.embedded.tiny import CODE_CHARSET, build_tokenizer
from rlpad.rewards.verl_default import compute_score


def test_both_forms_pass_the_hidden_cases_and_a_guessed_slope_fails():
    pool, _ = toy_code.split_problems(64)
    for p in pool[:3]:
        truth = toy_code.ground_truth(p)
        assert compute_score(toy_code.DATA_SOURCE, toy_code.canonical(p), truth) == 1.0
        assert compute_score(toy_code.DATA_SOURCE, toy_code.copied(p), truth) == 1.0
        assert compute_score(toy_code.DATA_SOURCE, toy_code.canonical((p[0] + 1, p[1])), truth) == 0.0


def test_rows_are_verls_call_based_format_and_validation_is_held_out(tmp_path):
    train, val = toy_code.write_dataset(tmp_path, n_train=50, n_val=64)
    rows = read_rows(train) + read_rows(val)
    truth = json.loads(rows[0]["reward_model"]["ground_truth"])
    assert truth["fn_name"] == "f" and truth["inputs"] == [str(x) for x in toy_code.HIDDEN_X]
    _, held = toy_code.split_problems(64)
    seen = {prompt for prompt, _ in toy_code.sft_examples(3000, n_val=64)}
    assert not seen & {toy_code.prompt_of(p) for p in held}
    assert len(read_rows(val)) == 64 and {r["data_source"] for r in rows} == {toy_code.DATA_SOURCE}


def test_the_code_tokenizer_writes_programs_back_exactly():
    tok = build_tokenizer(charset=CODE_CHARSET)
    text = "```python\nimport sys\n\nprint({'a': [1, 2]}[\"a\"], end='~')\t# `x` <y> ^ | & @ $ % ! ?\n```"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text
