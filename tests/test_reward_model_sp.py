"""The reward model with shared prompts and sequence parallelism (rlpad.core.reward_model, workers/reward_model.py).

One score per sequence at its last valid token, on a GRPO batch (4 prompt groups of 3 rows, shuffled,
plus a row of its own and a row whose response is empty, whose last valid token is its prompt's):

* shared prompts (each group's prompt once, its responses after it) = the plain packed row = each
  sequence scored alone, fp32 (2e-5), for a sequence- and a token-classification head;
* sequence parallelism: 2 real processes (gloo), the packed row split over them, with and without
  shared prompts, through the core and through the FSDP2 worker (2 ranks sharding the model, sp = 2,
  token budgets and row micro-batches) = the single-process scores;
* negative controls, each missing the bound by 100x: the score read one position early; the
  responses of a group attending to each other (the group run as one causal sequence); the ranks
  attending within their own slice only (no exchange).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlpad.batch import Batch
from rlpad.config.rewards import RewardModelScoringConfig
from rlpad.core.layout import position_ids_from_mask
from rlpad.core.reward_model import compute_scores, load_reward_model, shared_last_slots
from rlpad.core.shared_prompt import pack_shared_prompts, prompt_groups
from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.embedded.synthetic import grpo_batch
from rlpad.embedded.tiny import tiny_reward_model
from spawn_ranks import spawn_ranks
from test_sequence_parallel import LocalOnly
from workers.net import free_port
from workers.reward_model import RewardModelWorker

pytestmark = pytest.mark.exactness

PROMPT, RESPONSE, VOCAB = 14, 10, 128
TOL = FP32_LOGPROB_TOL  # fp32, per sequence (derivation: rlpad/embedded/exactness.py)
FAR = 100 * TOL  # a negative control must miss the bound by this much
EMPTY_ROW = 4  # its response is cut to nothing: its last valid token is its prompt's last
WORKER_LAYOUTS = {  # (share_prompts, use_dynamic_bsz): budgets of P + R per rank = 2 (P + R) per sp row
    "shared-budget": (True, True), "shared-rows": (True, False), "packed-budget": (False, True)}


def make_batch() -> dict[str, torch.Tensor]:
    b = grpo_batch(4, 3, PROMPT, RESPONSE, vocab_size=VOCAB, seed=3, shuffle=True, min_prompt=2)
    single = grpo_batch(2, 1, PROMPT, RESPONSE, vocab_size=VOCAB, seed=8, min_prompt=2)
    out = {k: torch.cat([b[k], single[k][1:]]) for k in ("input_ids", "attention_mask")}
    out["attention_mask"][EMPTY_ROW, PROMPT:] = 0
    out["position_ids"] = position_ids_from_mask(out["attention_mask"])
    out["responses"] = out["input_ids"][:, PROMPT:]
    return out


def model_of(head: str = "sequence", arch: str = "qwen2", **kwargs):
    return tiny_reward_model(arch, head=head, seed=5, vocab_size=VOCAB, **kwargs)


def args_of(b: dict) -> tuple:
    return b["input_ids"], b["attention_mask"], b["position_ids"]


def alone(model, b: dict, offset: int = 1) -> torch.Tensor:
    """(B,): each sequence run by itself, the head read at its last token (``offset`` 2: one early)."""
    backbone = getattr(model, model.base_model_prefix)
    out = []
    with torch.no_grad():
        for ids, mask in zip(b["input_ids"], b["attention_mask"]):
            hidden = backbone(input_ids=ids[mask.bool()][None], use_cache=False).last_hidden_state[0]
            out.append(model.score(hidden[-offset]).float()[0])
    return torch.stack(out)


def responses_see_each_other(b: dict) -> torch.Tensor:
    """Negative control (B,): each group as ONE causal sequence [prompt, r1, r2, ...] (the rows' own
    positions), so a response attends to the responses before it; the head at each row's last token."""
    model = model_of(attn_implementation="sdpa")  # the same weights, a plain causal attention
    ids, mask, pos = args_of(b)
    out = torch.zeros(len(ids))
    with torch.no_grad():
        for rows in prompt_groups(ids, mask, pos, RESPONSE):
            p = mask[rows[0], :PROMPT].bool()
            parts, part_pos, ends = [ids[rows[0], :PROMPT][p]], [pos[rows[0], :PROMPT][p]], []
            for r in rows:
                keep = mask[r, PROMPT:].bool()
                parts.append(ids[r, PROMPT:][keep])
                part_pos.append(pos[r, PROMPT:][keep])
                ends.append(sum(len(x) for x in parts) - 1)
            hidden = model.model(input_ids=torch.cat(parts)[None], position_ids=torch.cat(part_pos)[None],
                                 use_cache=False).last_hidden_state[0]
            out[rows] = model.score(hidden[ends]).float()[:, 0]
    return out


@pytest.fixture(scope="module")
def batch():
    return make_batch()


def test_the_batch_exercises_every_case(batch):
    mask = batch["attention_mask"]
    groups = prompt_groups(batch["input_ids"], mask, batch["position_ids"], RESPONSE)
    assert sorted(len(g) for g in groups) == [1, 3, 3, 3, 3]
    assert any(EMPTY_ROW in g and len(g) > 1 for g in groups)  # the empty response shares its prompt
    lengths = mask[:, PROMPT:].sum(1)
    assert int(lengths[EMPTY_ROW]) == 0 and 1 in lengths.tolist() and RESPONSE in lengths.tolist()
    assert int(mask.sum()) % 2  # the packed row needs the sp padding segment
    # at sp = 2 the rows' last tokens fall on both ranks' slices, plain and shared
    plain_last, plain_total = mask.sum(1).cumsum(0) - 1, int(mask.sum()) + 1
    row = pack_shared_prompts(*args_of(batch), RESPONSE, pad_to=2, groups=groups)
    shared_last = shared_last_slots(row.segments, groups, lengths.tolist())
    for last, total in ((plain_last, plain_total), (shared_last, row.input_ids.shape[1])):
        assert total % 2 == 0 and {int(x) < total // 2 for x in last} == {True, False}


@pytest.mark.parametrize("head", ["sequence", "token"])
def test_shared_prompts_equal_packed_and_each_sequence_alone(batch, head):
    model = model_of(head)
    with torch.no_grad():
        packed = compute_scores(model, *args_of(batch))
        shared = compute_scores(model, *args_of(batch), response_length=RESPONSE, share_prompts=True)
    torch.testing.assert_close(shared, packed, atol=TOL, rtol=0)
    torch.testing.assert_close(shared, alone(model, batch), atol=TOL, rtol=0)
    assert shared.std() > FAR  # the rows' scores differ: the comparison can tell them apart


def test_negative_controls_one_early_and_responses_seeing_each_other(batch):
    model = model_of()
    with torch.no_grad():
        shared = compute_scores(model, *args_of(batch), response_length=RESPONSE, share_prompts=True)
    early = alone(model, batch, offset=2)
    assert (early - shared).abs().min() > FAR
    groups = prompt_groups(*args_of(batch), RESPONSE)
    later = [r for g in groups for r in g[1:] if int(batch["attention_mask"][r, PROMPT:].sum())]  # see an earlier one
    seeing = responses_see_each_other(batch)
    assert (seeing[later] - shared[later]).abs().min() > FAR
    firsts = [g[0] for g in groups]  # the first response of a group sees only its prompt: the control itself is right
    torch.testing.assert_close(seeing[firsts], shared[firsts], atol=TOL, rtol=0)


def test_shared_prompts_refused_without_what_they_need(batch):
    model = model_of()
    with pytest.raises(ValueError, match="needs response_length"):
        compute_scores(model, *args_of(batch), share_prompts=True)
    with pytest.raises(ValueError, match="needs use_remove_padding=True"):
        compute_scores(model, *args_of(batch), response_length=RESPONSE, share_prompts=True, use_remove_padding=False)
    with pytest.raises(ValueError, match="last prompt column is padding"):  # not the rollout layout
        compute_scores(model, *args_of(batch), response_length=PROMPT + 2, share_prompts=True)


def _rank_main(rank: int, world: int, port: int, path: str) -> dict:
    """On 2 ranks: the FSDP2 worker (sp = 2) per layout, then the core with its sp group, and the control."""
    b = make_batch()
    full = Batch(dict(b))
    out = {}
    for name, (share, budget) in WORKER_LAYOUTS.items():
        cfg = RewardModelScoringConfig(enable=True, model_path=path, share_prompts=share, use_dynamic_bsz=budget,
                                       forward_max_token_len_per_gpu=PROMPT + RESPONSE, micro_batch_size_per_gpu=4,
                                       ulysses_sequence_parallel_size=2)
        worker = RewardModelWorker(cfg, rank=rank, world_size=world, master_port=port, device="cpu",
                                   share_min_saved=0.0)
        worker.init_model()
        out[name] = worker.compute_rm_scores(full)["rm_scores"]
    sp = worker.sp
    model = load_reward_model(path)
    with torch.no_grad():
        for share in (False, True):
            out[("core", share)] = compute_scores(model, *args_of(b), response_length=RESPONSE, share_prompts=share,
                                                  sp=sp)
        out["control"] = compute_scores(model, *args_of(b), sp=LocalOnly(sp.group))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm") / "model"
    model_of().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, reward_model_dir):
    return spawn_ranks(_rank_main, 2, tmp_path_factory.mktemp("rm_sp"), free_port(), str(reward_model_dir))


@pytest.fixture(scope="module")
def reference(batch, reward_model_dir):
    """The single-process plain packed scores of the saved model, and each sequence alone."""
    model = load_reward_model(str(reward_model_dir))
    with torch.no_grad():
        return compute_scores(model, *args_of(batch)), alone(model, batch)


@pytest.mark.parametrize("case", [("core", False), ("core", True), *WORKER_LAYOUTS],
                         ids=["core-packed", "core-shared", *WORKER_LAYOUTS])
def test_sequence_parallel_equals_one_process_and_each_sequence_alone(ranks, reference, case):
    packed, by_itself = reference
    assert torch.equal(ranks[0][case], ranks[1][case])  # every rank of the group gets every score
    torch.testing.assert_close(ranks[0][case], packed, atol=TOL, rtol=0)
    torch.testing.assert_close(ranks[0][case], by_itself, atol=TOL, rtol=0)


def test_negative_control_without_the_exchange_fails(ranks, reference):
    diff = float((ranks[0]["control"] - reference[0]).abs().max())
    assert diff > FAR, f"attending within each rank's slice only should change the scores, max diff {diff:.2e}"
