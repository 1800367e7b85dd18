"""What the model-based reward parts read of a rollout row (rlpad.rewards.conversation, rlpad.rewards.model_scorer):
one rule for the reward model whatever its tokenizer, verl's rendering, checked against an independent
re-implementation of verl 0.9.1's (``RewardLoopWorker._preprocess_reward_inputs``); the judge and the reward
model reading the same text, multi-turn tool output included; the reward model's limit; an RM-only data set set
up and scored without the rule (issue 51 items 12, 13, 15, 18)."""

import json

import pytest
import torch

from rlpad.batch import Batch
from rlpad.batching.micro_batches import micro_batches
from rlpad.config.rewards import JudgeConfig
from rlpad.core.layout import left_pad
from rlpad.core.reward_model import compute_scores
from rlpad.embedded.tiny import build_tokenizer, tiny_model, tiny_reward_model
from rlpad.recipe.load import load_config
from rlpad.rewards.combine import CombinedReward, part_metrics
from rlpad.rewards.conversation import response_texts
from rlpad.rewards.judge import JudgeScorer
from rlpad.rewards.model_scorer import RewardModelInputs
from rlpad.train import prepare
from bpe_chatml import build_bpe

POLICY = build_bpe()
QUESTION = [{"role": "user", "content": "What is 1+2?"}]
TOOL_TURN = "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def rm_folder(path, tokenizer, **config) -> str:
    """A reward-model folder: a tiny one-output Qwen2's config (+ ``config``) and ``tokenizer``."""
    model = tiny_reward_model("qwen2", seed=5, vocab_size=len(tokenizer), **config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def chat_batch(responses, tokenizer=POLICY, messages=QUESTION) -> Batch:
    """A rollout batch: the prompt as the dataset renders it (left-padded), each response a list of (text,
    generated) segments tokenised by the policy (right-padded; ``response_mask`` 1 on generated segments)."""
    prompt = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    p_ids, p_mask = left_pad([prompt] * len(responses), len(prompt) + 2, tokenizer.pad_token_id)
    rows = [[(t, g) for text, g in segs for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
            for segs in responses]
    width = max(len(r) for r in rows)
    r_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    r_mask, r_gen = torch.zeros_like(r_ids), torch.zeros_like(r_ids)
    for i, row in enumerate(rows):
        r_ids[i, :len(row)] = torch.tensor([t for t, _ in row])
        r_mask[i, :len(row)], r_gen[i, :len(row)] = 1, torch.tensor([g for _, g in row])
    mask = torch.cat([p_mask, r_mask], 1)
    return Batch({"input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": mask, "responses": r_ids,
                  "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "response_mask": r_gen},
                 {"raw_prompt": [messages] * len(rows), "data_source": ["s"] * len(rows),
                  "ground_truth": ["3"] * len(rows)})


def verl_tokens(policy, tokenizer, messages, response_ids) -> list[int]:
    """verl 0.9.1's reward-model input (re-implemented from its rule): the valid response decoded, its EOS text
    removed, appended as the assistant turn, rendered by the reward model's template without a generation
    prompt, a leading BOS text dropped, tokenised whole."""
    text = policy.decode(response_ids).replace(policy.eos_token, "")
    rendered = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": text}],
                                             add_generation_prompt=False, tokenize=False)
    if tokenizer.bos_token is not None and rendered.startswith(tokenizer.bos_token):
        rendered = rendered[len(tokenizer.bos_token):]
    return tokenizer(rendered)["input_ids"]


def valid_rows(inputs: Batch) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(inputs["input_ids"], inputs["attention_mask"])]


def test_one_rule_whatever_the_tokenizer(tmp_path):
    """Issue 51 item 13: a finished response (``3<|im_end|>``) and a truncated one (no EOS) read as verl renders
    them (``3<|im_end|>\\n``; the template's close appended to the truncated one), by a reward model with the
    policy's tokenizer and by one with another vocabulary alike; split at the prompt's end (shared prompts
    work for both), scoring as the whole rows do."""
    batch = chat_batch([[("3<|im_end|>", 1)], [("1 + 2 is", 1)]])
    for tokenizer in (POLICY, build_bpe(added=True)):
        inputs, flags = RewardModelInputs(rm_folder(tmp_path / str(len(tokenizer)), tokenizer), POLICY)(batch)
        expected = [verl_tokens(POLICY, tokenizer, QUESTION, r[m.bool()].tolist())
                    for r, m in zip(batch["responses"], batch["attention_mask"][:, -batch["responses"].shape[1]:])]
        assert valid_rows(inputs) == expected
        assert tokenizer.decode(expected[0]).endswith("<|im_start|>assistant\n3<|im_end|>\n")
        assert tokenizer.decode(expected[1]).endswith("<|im_start|>assistant\n1 + 2 is<|im_end|>\n")
        assert "responses" in inputs and flags["truncated"].tolist() == [0.0, 0.0]
    rm = tiny_reward_model("qwen2", seed=5, vocab_size=len(POLICY))
    with torch.no_grad():
        shared = compute_scores(rm, inputs["input_ids"].repeat(2, 1), inputs["attention_mask"].repeat(2, 1),
                                inputs["position_ids"].repeat(2, 1), response_length=inputs["responses"].shape[1],
                                share_prompts=True)
        alone = [rm.score(rm.model(input_ids=torch.tensor([row])).last_hidden_state[0, -1]).item()
                 for row in valid_rows(inputs)]
    assert (shared - torch.tensor(alone * 2)).abs().max() < 2e-5
    # a template that only joins the contents closes the response with the tokenizer's EOS, as the policy ended it
    toy = build_tokenizer()
    toy_batch = Batch({"responses": torch.tensor([[toy.convert_tokens_to_ids("3"), toy.eos_token_id]]),
                       "attention_mask": torch.ones(1, 2, dtype=torch.long)},
                      {"raw_prompt": [[{"role": "user", "content": "1+2="}]]})
    inputs, _ = RewardModelInputs(rm_folder(tmp_path / "toy", toy), toy)(toy_batch)
    assert valid_rows(inputs) == [toy("1+2=3", add_special_tokens=False)["input_ids"] + [toy.eos_token_id]]


def test_multi_turn_the_judge_and_the_reward_model_read_the_same_text(tmp_path):
    """Issue 51 item 15: a multi-turn response's text is every valid token, the tool's output between the turns
    (before: dropped, the turns glued ``[calc(40+2)]so 42`` for the judge and a re-rendering reward model, while
    the same-tokenizer one read the row with it); the judge's {response} and both reward models' assistant turn
    hold that same text."""
    batch = chat_batch([[("[calc(40+2)]", 1), (TOOL_TURN, 0), ("so 42<|im_end|>", 1)]])
    (text,) = response_texts(POLICY, batch)
    assert text == "[calc(40+2)]\nuser\n<tool_response>\n42\n</tool_response>\nassistant\nso 42"
    judge_dir = tmp_path / "judge"
    tiny_model("qwen2").save_pretrained(judge_dir)
    POLICY.save_pretrained(judge_dir)
    judge = JudgeScorer(JudgeConfig(enable=True, model_path=str(judge_dir), prompt_template="<<{response}>>"), POLICY)
    assert judge.render(batch) == [f"<<{text}>>"]
    for tokenizer in (POLICY, build_bpe(added=True)):
        inputs, _ = RewardModelInputs(rm_folder(tmp_path / str(len(tokenizer)), tokenizer), POLICY)(batch)
        assert tokenizer.decode(valid_rows(inputs)[0]).endswith(f"<|im_start|>assistant\n{text}<|im_end|>\n")


def test_rows_past_the_reward_models_limit_are_cut_and_counted(tmp_path):
    """Issue 51 item 18: a conversation longer than the reward model's max_position_embeddings, or the token
    budget of one forward (use_dynamic_bsz), keeps its last tokens (the prompt's start goes first) and is
    counted, reward/reward_model/truncated; before, the budget failed mid-run (micro_batches' ValueError)."""
    batch = chat_batch([[("3<|im_end|>", 1)], [("1 + 2 is 3 because 1 + 2 = 3<|im_end|>", 1)]])
    folder = rm_folder(tmp_path / "rm", POLICY)
    whole, _ = RewardModelInputs(folder, POLICY)(batch)
    lengths = [len(r) for r in valid_rows(whole)]
    budget = (lengths[0] + lengths[1]) // 2
    with pytest.raises(ValueError, match="more than the micro-batch token budget"):
        micro_batches(whole, None, budget)
    for limits in ({"max_tokens": budget}, {}):
        small = rm_folder(tmp_path / f"rm{len(limits)}", POLICY, **({} if limits else {"max_position_embeddings": budget}))
        inputs, flags = RewardModelInputs(small, POLICY, **limits)(batch)
        assert flags["truncated"].tolist() == [0.0, 1.0]
        assert valid_rows(inputs) == [valid_rows(whole)[0], valid_rows(whole)[1][-budget:]]
        assert micro_batches(inputs, None, budget)  # runs

    class Workers:  # the reward model's worker stack reduced to its scoring call (the flags' path under test)
        rm = tiny_reward_model("qwen2", seed=5, vocab_size=len(POLICY))

        def compute_rm_scores(self, inputs):
            with torch.no_grad():
                return {"rm_scores": compute_scores(self.rm, inputs["input_ids"], inputs["attention_mask"],
                                                    inputs.tensors.get("position_ids"))}

    cfg = load_config(None, ["reward.reward_model.enable=true", f"reward.reward_model.model_path={small}"]).reward
    reward = CombinedReward(cfg, None, model_inputs=RewardModelInputs(small, POLICY))
    reward.attach_workers(Workers())
    reward.score(batch, POLICY)
    assert part_metrics(batch)["reward/reward_model/truncated"] == 0.5


def test_a_reward_model_only_data_set_sets_up_and_scores_without_the_rule(tmp_path):
    """Issue 51 item 12: data whose data_source the default rule does not know, a reward model enabled: set-up
    passes and the rule is never called (before: a ValueError at the first reward stage, after the workers
    and engines started); weighing the rule there is refused in set-up, naming the source."""
    tok = build_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "data_source": "Anthropic/hh-rlhf",
             "reward_model": {"ground_truth": ""}}] * 4
    data = tmp_path / "hh.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rm = rm_folder(tmp_path / "rm", tok)
    base = [f"data.train_files=[{data}]", f"data.val_files=[{data}]", "actor_rollout_ref.model.path=tiny:qwen2",
            "reward_model.enable=true", f"reward_model.model.path={rm}", f"trainer.default_local_dir={tmp_path}/out",
            "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=8"]
    reward = prepare(load_config(None, base)).reward_fn
    reward.attach_model(lambda b: torch.arange(len(b), dtype=torch.float32))
    batch = Batch({"responses": torch.ones(2, 1, dtype=torch.long), "response_mask": torch.ones(2, 1, dtype=torch.long)},
                  {"data_source": ["Anthropic/hh-rlhf"] * 2, "ground_truth": [""] * 2})
    assert reward.score(batch, tok)[1].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"has no reward for data_source 'Anthropic/hh-rlhf', and the rule part "
                                         "weighs it"):
        prepare(load_config(None, base + ["reward.weights={rule: 1.0}"]))
