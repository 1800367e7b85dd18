"""The embedded multi-turn task (rlpad.embedded.toy_tools): the calculator, the reward, the warm-start traces."""

import pytest

from rlpad.embedded import toy_tools
from rlpad.embedded.sft import encode
from rlpad.embedded.tiny import build_tokenizer
from rlpad.rewards.rules import compute_score


def test_calculator_and_its_errors():
    assert [toy_tools.calc(e) for e in ("34+58", "2*3+1", "5-3", " 7 ")] == ["92", "7", "2", "7"]
    for bad in ("__import__('os')", "1/0", "", "1+"):
        with pytest.raises(ValueError, match="not an arithmetic expression"):
            toy_tools.calc(bad)


def test_reward_reads_the_text_after_the_last_call():
    assert compute_score("rlpad/toy_tools", "[calc(34+58)]92", "92") == 1.0
    assert compute_score("rlpad/toy_tools", "92", "92") == 1.0
    assert compute_score("rlpad/toy_tools", "[calc(34+58)]93", "92") == 0.0
    assert compute_score("rlpad/toy_tools", "[calc(34+58)]", "92") == 0.0


def test_warm_start_traces_keep_the_tool_output_out_of_the_loss():
    tok = build_tokenizer()
    examples = toy_tools.sft_examples(64, seed=0)
    assert 4 < sum(len(a) == 3 for _, a in examples) < 24  # about a fifth call the tool
    trace = next((p, a) for p, a in examples if len(a) == 3)
    batch = encode(tok, [trace])
    call, out, answer = (s for s, _ in trace[1])
    assert out == answer == toy_tools.calc(trace[0][:-1])
    expected = [1] * len(call) + [0] * len(out) + [1] * (len(answer) + 1)  # + EOS
    assert batch["loss_mask"][0, :len(expected)].tolist() == expected
    _, val = toy_tools.split_pairs(100)
    seen = {p for p, _ in toy_tools.sft_examples(2000, seed=0)}
    assert not seen & {f"{a}+{b}=" for a, b in val}
