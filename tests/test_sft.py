"""rlpad.embedded.sft: the cached supervised warm-start of the embedded tiny model."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlpad.config.schema import SFTConfig
from rlpad.embedded.sft import (
    INFO_FILE, cache_key, check_vllm_shape, encode, main, read_info, sft_loss, train_sft, val_accuracy, warm_start,
)
from rlpad.embedded.tiny import build_tokenizer, tiny_config, tiny_model
from rlpad.embedded.toy import sft_examples, split_pairs

# A smaller model than the default keeps these tests fast; the code path is the same.
DIMS = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run far faster on one thread, especially on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cfg(tmp_path, **kw) -> SFTConfig:
    return replace(SFTConfig(), steps=4, batch_size=16, cache_dir=str(tmp_path / "cache"), **kw)


def entries(tmp_path) -> list[str]:
    root = tmp_path / "cache"
    return sorted(os.listdir(root)) if root.exists() else []


def test_encode_layout():
    tok = build_tokenizer()
    b = encode(tok, [("3+4=", "7"), ("12+19=", "31")])
    assert b["response_length"] == 3  # "31" + EOS
    ids, mask = b["input_ids"], b["attention_mask"]
    assert tok.decode(ids[1, :6]) == "12+19=" and tok.decode(ids[1, 6:8]) == "31" and ids[1, 8] == tok.eos_token_id
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 0]  # prompt left-padded, answer + EOS right-padded
    assert ids[0, 6] == tok.convert_tokens_to_ids("7") and ids[0, 7] == tok.eos_token_id
    assert b["position_ids"][0, 2:8].tolist() == list(range(6))


def test_loss_counts_only_answer_tokens():
    tok = build_tokenizer()
    model = tiny_model("qwen2", seed=0, **DIMS)
    b = encode(tok, [("3+4=", "7"), ("12+19=", "31")])
    ids = b["input_ids"]
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=b["attention_mask"],
                                   position_ids=b["position_ids"]).logits, -1)
    answer_cols = [(0, 6), (0, 7), (1, 6), (1, 7), (1, 8)]  # "7" EOS, "3" "1" EOS
    expected = -sum(logp[r, c - 1, ids[r, c]] for r, c in answer_cols) / len(answer_cols)
    torch.testing.assert_close(sft_loss(model, b), expected, rtol=1e-5, atol=1e-5)


def test_short_sft_lowers_loss():
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = tiny_model("qwen2", seed=0, **DIMS)
    held_out = encode(tok, sft_examples(256, seed=7))
    with torch.no_grad():
        before = sft_loss(model, held_out).item()
    losses = train_sft(model, tok, replace(SFTConfig(), steps=40, batch_size=32))
    with torch.no_grad():
        after = sft_loss(model, held_out).item()
    assert len(losses) == 40
    assert after < before - 1.0, (before, after)  # untrained ~ln(vocab) = 4.4; a little training halves it


def test_target_accuracy_stops_early():
    tok = build_tokenizer()
    model = tiny_model("qwen2", seed=0, **DIMS)
    steps = []
    c = replace(SFTConfig(), steps=50, batch_size=8, target_accuracy=0.0, eval_every=3)
    losses = train_sft(model, tok, c, callback=lambda s, l: steps.append(s))
    assert steps == [0, 1, 2] and len(losses) == 3  # any accuracy reaches 0.0 at the first check
    losses = train_sft(model, tok, replace(c, steps=7, target_accuracy=1.01))
    assert len(losses) == 7  # an unreachable target runs the whole budget


def test_cache_key_tracks_settings(tmp_path):
    base = cfg(tmp_path)
    key = cache_key(base, seed=0, **DIMS)
    assert key == cache_key(base, seed=0, **DIMS)
    assert key == cache_key(replace(base, cache_dir="elsewhere"), seed=0, **DIMS)  # not part of the result
    changed = [
        cache_key(replace(base, steps=5), seed=0, **DIMS),
        cache_key(replace(base, lr=1e-3), seed=0, **DIMS),
        cache_key(replace(base, batch_size=8), seed=0, **DIMS),
        cache_key(replace(base, data_seed=1), seed=0, **DIMS),
        cache_key(replace(base, n_val=50), seed=0, **DIMS),
        cache_key(replace(base, target_accuracy=0.3), seed=0, **DIMS),
        cache_key(replace(base, weight_decay=base.weight_decay + 0.05), seed=0, **DIMS),
        cache_key(base, seed=1, **DIMS),
        cache_key(base, seed=0, **{**DIMS, "num_hidden_layers": 2}),
        cache_key(base, seed=0, **{**DIMS, "intermediate_size": 256}),
    ]
    assert len({key, *changed}) == len(changed) + 1


def test_warm_start_caches_and_reloads(tmp_path):
    calls = []
    c = cfg(tmp_path)
    path = warm_start(c, seed=3, callback=lambda s, l: calls.append(s), **DIMS)
    assert calls == [0, 1, 2, 3]
    assert os.path.basename(path) == f"sft-{cache_key(c, seed=3, **DIMS)}"
    assert entries(tmp_path) == [os.path.basename(path)]  # no temporary folder left behind
    info = read_info(path)
    assert 0.0 <= info["val_accuracy"] <= 1.0 and info["settings"]["seed"] == 3

    again = warm_start(c, seed=3, callback=lambda s, l: calls.append(s), **DIMS)
    assert again == path and calls == [0, 1, 2, 3]  # a cache hit trains nothing

    # The saved folder loads with plain transformers and gives the weights training produced.
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ref_tok = build_tokenizer()
    assert tok("12+7=")["input_ids"] == ref_tok("12+7=")["input_ids"]
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                   tokenize=False) == "1+2="
    torch.manual_seed(3)  # warm_start trains single-threaded, as do these tests (one_thread)
    ref = tiny_model("qwen2", seed=3, **DIMS)
    train_sft(ref, ref_tok, c)
    ids = torch.tensor([ref_tok("12+7=19")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert val_accuracy(model, tok, c) == info["val_accuracy"]


def test_warm_start_is_deterministic_in_seed(tmp_path):
    a = warm_start(cfg(tmp_path / "a"), seed=5, **DIMS)
    b = warm_start(cfg(tmp_path / "b"), seed=5, **DIMS)
    c = warm_start(cfg(tmp_path / "c"), seed=6, **DIMS)
    wa, wb, wc = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_crash_leaves_no_partial_cache(tmp_path):
    def boom(step, loss):
        if step == 2:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        warm_start(cfg(tmp_path), seed=0, callback=boom, **DIMS)
    assert entries(tmp_path) == []  # neither the final folder nor the temporary one


def test_incomplete_cache_folder_is_rebuilt(tmp_path):
    c = cfg(tmp_path)
    stale = tmp_path / "cache" / f"sft-{cache_key(c, seed=0, **DIMS)}"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{")  # e.g. copied in by hand, no completion record
    path = warm_start(c, seed=0, **DIMS)
    assert path == str(stale) and (stale / INFO_FILE).is_file()
    AutoModelForCausalLM.from_pretrained(path)


def test_rejects_shapes_vllm_cannot_run():
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_vllm_shape(tiny_config("qwen2", hidden_size=64, num_attention_heads=4, head_dim=32))
    with pytest.raises(ValueError, match="head size"):
        check_vllm_shape(tiny_config("qwen2", hidden_size=48, num_attention_heads=1, num_key_value_heads=1,
                                     head_dim=48))
    with pytest.raises(ValueError, match="num_attention_heads"):
        warm_start(SFTConfig(cache_dir="/nonexistent/never/created"), hidden_size=64, num_attention_heads=4)


def test_sft_never_sees_validation_problems():
    _, val = split_pairs(SFTConfig().n_val, SFTConfig().data_seed)
    val_prompts = {f"{a}+{b}=" for a, b in val}
    assert not val_prompts & {p for p, _ in sft_examples(2000, seed=SFTConfig().data_seed)}


def test_command_prints_path_and_accuracy(tmp_path, capsys):
    assert main(["--steps", "2", "--batch-size", "8", "--cache-dir", str(tmp_path / "cache")]) == 0
    path, line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert os.path.isfile(os.path.join(path, INFO_FILE))
    assert line.startswith("val_accuracy ")
