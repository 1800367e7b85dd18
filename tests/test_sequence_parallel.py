"""Sequence parallelism (rlpad.core.sequence_parallel) in real gloo process groups, no Ray.

The module spawns 4 ranks once; every rank scores every case and returns its results, and the
tests compare them with sp = 1 and with each sequence run alone (fp32, 2e-5): 2 ranks sharing each
row (sp = 2, as a 2-rank job; both pairs of ranks run it), 2 data-parallel groups of 2 ranks, and
one group of 4. Cases: the four tiny architectures (qwen2 / qwen3 / mistral: one key/value head,
fewer than sp, so K/V heads are repeated; llama: MHA; mistral: sliding window 8; qwen3: q/k-norm),
with and without shared prompts; a GQA model with 4 query / 2 key-value heads at sp = 2 and one
with 8 / 2 at sp = 4 (the query -> key/value head mapping across ranks). Gradients of the
token-mean PPO loss, summed over the ranks, equal sp = 1, and every rank of a group computes the
same loss (the gradient rule's assumption). A negative control without the exchange
(each rank attends within its own slice) must fail. The rows are multi-turn: tool spans inside the
responses (attended, response_mask 0), so only generated tokens are scored and tool entries are 0.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL
from rlpad.algorithms.losses import compute_policy_loss
from rlpad.core.attention import BOUNDS_KWARG, PackedBounds
from rlpad.core.forward import compute_log_probs
from rlpad.core.layout import position_ids_from_mask
from rlpad.core.sequence_parallel import RowShard, SequenceParallel
from rlpad.core.value import ValueModel
from rlpad.embedded.synthetic import grpo_batch, with_tool_spans
from rlpad.embedded.tiny import ARCHITECTURES, tiny_model
from spawn_ranks import spawn_ranks

pytestmark = pytest.mark.exactness  # also run with AVX2-only kernels (Makefile: test)

PROMPT, RESPONSE, VOCAB = 14, 10, 128
TOL, GRAD_TOL = FP32_LOGPROB_TOL, FP32_GRAD_REL  # derivations: rlpad/embedded/exactness.py
ARCHS = sorted(ARCHITECTURES)  # llama (MHA), mistral (window 8), qwen2 (GQA, tied), qwen3 (q/k-norm): 2 heads
WIDE = {"gqa4x2": dict(arch="qwen2", hidden_size=128, num_key_value_heads=2),  # 4 query heads, 2 key/value
        "gqa8x2": dict(arch="qwen2", hidden_size=256, num_key_value_heads=2)}  # 8 query heads, 2 key/value


def make_batch() -> dict[str, torch.Tensor]:
    """4 prompt groups of 3 rows (shuffled: groups interleave) + a row of its own; prompts longer
    than mistral's window; PPO inputs (old log-probs near a random model's, random advantages)."""
    b = grpo_batch(4, 3, PROMPT, RESPONSE, vocab_size=VOCAB, seed=3, shuffle=True, min_prompt=2)
    single = grpo_batch(2, 1, PROMPT, RESPONSE, vocab_size=VOCAB, seed=8, min_prompt=2)
    out = {k: torch.cat([b[k], single[k][1:]]) for k in ("input_ids", "attention_mask")}
    out["position_ids"] = position_ids_from_mask(out["attention_mask"])
    mask = with_tool_spans(out["attention_mask"][:, PROMPT:], seed=4).float()  # multi-turn rows
    gen = torch.Generator().manual_seed(0)
    out["response_mask"] = mask
    out["advantages"] = torch.randn(mask.shape, generator=gen) * mask
    out["old_noise"] = torch.randn(mask.shape, generator=gen) * 0.1 * mask
    return out


def model_of(name: str, seed: int = 1):
    if name in WIDE:
        spec = dict(WIDE[name])
        return tiny_model(spec.pop("arch"), vocab_size=VOCAB, seed=seed, **spec)
    return tiny_model(name, vocab_size=VOCAB, seed=seed)


def rows_of(b: dict, rows: torch.Tensor) -> dict:
    return {k: v[rows] for k, v in b.items()}


def score(name: str, b: dict, share: bool, sp=None, *, grads: bool = False, global_tokens: float | None = None):
    """Log-probs, entropies, critic values (and gradients of the token-mean PPO loss) of ``b``."""
    model = model_of(name)
    args = (b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE)
    out = {}
    scored = b["response_mask"]
    with torch.no_grad():
        out["lp"], out["ent"] = compute_log_probs(model, *args, use_remove_padding=True, share_prompts=share,
                                                  calculate_entropy=True, sp=sp, response_mask=scored)  # fmt: skip
        critic = ValueModel(model_of(name), seed=5)
        out["values"] = critic(*args, use_remove_padding=True, share_prompts=share, sp=sp, response_mask=scored)
    if grads:
        lp, _ = compute_log_probs(model, *args, use_remove_padding=True, share_prompts=share, sp=sp,
                                  response_mask=scored)
        old = (out["lp"] + b["old_noise"]).detach()
        loss, _ = compute_policy_loss(old, lp, b["advantages"], b["response_mask"], global_tokens=global_tokens)
        loss.backward()
        out["loss"] = loss.detach()
        out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


class LocalOnlyShard(RowShard):
    """Negative control: no exchange; each rank attends only within its own slice of the row."""

    def __init__(self, sp, input_ids, position_ids, attention_kwargs):
        super().__init__(sp, input_ids, position_ids, attention_kwargs)
        n = self.end - self.start
        cu = attention_kwargs["cu_seq_lens_q"].long().clamp(self.start, self.end) - self.start
        cu = torch.unique(torch.cat([cu, cu.new_tensor([0, n])])).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        self.attention_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest,
                                     **{BOUNDS_KWARG: PackedBounds(cu, n)})  # fmt: skip

    def to_heads(self, query, key, value):
        return query, key, value

    def to_tokens(self, out):
        return out


class LocalOnly(SequenceParallel):
    def shard(self, input_ids, position_ids, attention_kwargs):
        return LocalOnlyShard(self, input_ids, position_ids, attention_kwargs)


def _groups(world: int, sp: int):
    """This rank's group of sp consecutive ranks; every rank creates every group."""
    mine = None
    for g in range(world // sp):
        group = dist.new_group(list(range(g * sp, (g + 1) * sp)))
        if dist.get_rank() // sp == g:
            mine = group
    return mine


def _rank_main(rank: int, world: int, init_file: str) -> dict:
    """Every case on 4 ranks: ``sp2`` (each pair of ranks runs the whole batch, as a 2-rank job
    would), ``dp2xsp2`` (the pairs split the rows), ``sp4`` (one group of 4); the control on a pair."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    b = make_batch()
    every = torch.arange(len(b["input_ids"]))
    total_tokens = float(b["response_mask"].sum())
    pair, quad = SequenceParallel(_groups(world, 2)), SequenceParallel(_groups(world, 4))
    layouts = [("sp2", pair, every, ARCHS + ["gqa4x2"]),
               ("dp2xsp2", pair, every[rank // 2 :: 2], ARCHS + ["gqa4x2"]),
               ("sp4", quad, every, ["gqa8x2"])]
    results = {}
    for layout, sp, rows, names in layouts:
        for name in names:
            for share in (False, True):
                out = score(name, rows_of(b, rows), share, sp, grads=name in ARCHS, global_tokens=total_tokens)
                if "grads" in out:  # the ranks' gradients sum to the gradient of the rows they ran
                    for g in out["grads"].values():
                        dist.all_reduce(g, group=sp.group if layout == "sp2" else None)
                results[(name, share, layout)] = out | {"rows": rows}
    results[("control", False, "sp2")] = score("llama", b, False, LocalOnly(pair.group)) | {"rows": every}
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def batch():
    return make_batch()


@pytest.fixture(scope="module")
def references(batch):
    """sp = 1 on the whole batch, per case (log-probs, entropies, values, gradients)."""
    names = ARCHS + list(WIDE)
    return {(n, s): score(n, batch, s, grads=n in ARCHS, global_tokens=float(batch["response_mask"].sum()))
            for n in names for s in (False, True)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    return spawn_ranks(_rank_main, 4, out, str(out / "init"))


@pytest.fixture(scope="module")
def alone(batch):
    """Each sequence run by itself (no packing, no padding): log-probs, entropies, values per case name."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    out = {}
    for name in ARCHS + list(WIDE):
        model, critic = model_of(name), ValueModel(model_of(name), seed=5)
        lp, ent, values = (torch.zeros(ids.shape[0], RESPONSE) for _ in range(3))
        with torch.no_grad():
            for row in range(ids.shape[0]):
                seq = ids[row][mask[row].bool()][None]
                logp = model(seq, use_cache=False).logits[0].double().log_softmax(-1)
                v = critic.value_head(critic.backbone(seq, use_cache=False).last_hidden_state[0]).squeeze(-1)
                start = int(mask[row, :PROMPT].sum()) - 1  # the state scoring response token 0
                for t in batch["response_mask"][row].nonzero().flatten().tolist():  # generated tokens only
                    lp[row, t] = logp[start + t, seq[0, start + t + 1]]
                    ent[row, t] = -(logp[start + t].exp() * logp[start + t]).sum()
                    values[row, t] = v[start + t]
        out[name] = {"lp": lp, "ent": ent, "values": values}
    return out


def _check_case(ranks: list[dict], key: tuple, sp: int, reference: dict, alone: dict) -> float:
    """Every rank of each sp group returns the same numbers, equal to sp = 1 and to each sequence
    alone on its rows; returns the largest difference to sp = 1."""
    worst = 0.0
    for r, results in enumerate(ranks):
        got = results[key]
        first = ranks[r - r % sp][key]  # the group's first rank
        rows = got["rows"]
        for k in ("lp", "ent", "values"):
            assert torch.equal(got[k], first[k]), f"rank {r} and rank {r - r % sp} disagree on {k}"
            torch.testing.assert_close(got[k], reference[k][rows], atol=TOL, rtol=0)
            torch.testing.assert_close(got[k], alone[k][rows], atol=TOL, rtol=0)
            worst = max(worst, float((got[k] - reference[k][rows]).abs().max()))
    return worst


def _check_grads(ranks: list[dict], key: tuple, sp: int, reference: dict) -> None:
    """The ranks' summed gradients equal sp = 1's. That sum is the loss's gradient only while every
    rank of a group computes the same loss from the gathered scores (rlpad.core.sequence_parallel's
    _SumScored): checked bit for bit, so a rank-local term (an auxiliary loss) fails here."""
    for r, results in enumerate(ranks):
        first = ranks[r - r % sp][key]["loss"]
        assert torch.equal(results[key]["loss"], first), f"rank {r} {key}: loss {results[key]['loss']} vs {first}"
        for name, g in reference["grads"].items():
            rel = float((results[key]["grads"][name] - g).abs().max() / g.abs().max().clamp(min=1e-30))
            assert rel <= GRAD_TOL, f"rank {r} {key} {name}: relative gradient difference {rel:.2e}"


def test_rows_need_padding(batch):
    """The packed rows are not multiples of sp, so the pad segment is exercised (2 and 4 ranks)."""
    mask = batch["attention_mask"]
    total = int(mask.sum())
    halves = [int(mask[r::2].sum()) for r in range(2)]
    assert total % 4 and any(n % 2 for n in halves), (total, halves)


@pytest.mark.parametrize("layout, sp", [("sp2", 2), ("dp2xsp2", 2)])
@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared"])
@pytest.mark.parametrize("name", ARCHS + ["gqa4x2"])
def test_sequence_parallel_equals_sp1_and_each_sequence_alone(ranks, references, alone, name, share, layout, sp):
    """sp2: 2 ranks share every row; dp2xsp2: 2 data-parallel groups of 2 ranks."""
    _check_case(ranks, (name, share, layout), sp, references[(name, share)], alone[name])
    if name in ARCHS:
        _check_grads(ranks, (name, share, layout), sp, references[(name, share)])


@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared"])
def test_sp4_splits_kv_heads_across_ranks(ranks, references, alone, share):
    """8 query / 2 key-value heads over 4 ranks: each key/value head is repeated once so every rank
    gets a whole one, and rank j's query heads 2j, 2j+1 must meet key/value head j // 2."""
    _check_case(ranks, ("gqa8x2", share, "sp4"), 4, references[("gqa8x2", share)], alone["gqa8x2"])


def test_negative_control_without_the_exchange_fails(ranks, references):
    got = ranks[0][("control", False, "sp2")]["lp"]
    diff = float((got - references[("llama", False)]["lp"]).abs().max())
    assert diff > 100 * TOL, f"attending within each rank's slice only should change log-probs, max diff {diff:.2e}"


@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared"])
def test_sp1_is_todays_path(batch, share):
    """A group of one is no group: the same numbers bit for bit, and no collective is touched (the
    group here is None)."""
    one = SequenceParallel(None, size=1, rank=0)
    model, critic = model_of("qwen2"), ValueModel(model_of("qwen2"), seed=5)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE)
    with torch.no_grad():
        for sp in (None, one):
            lp, ent = compute_log_probs(model, *args, use_remove_padding=True, share_prompts=share,
                                        calculate_entropy=True, sp=sp)  # fmt: skip
            values = critic(*args, use_remove_padding=True, share_prompts=share, sp=sp)
            if sp is None:
                today = (lp, ent, values)
    assert all(torch.equal(a, b) for a, b in zip(today, (lp, ent, values)))


def test_errors_before_compute(batch):
    model = model_of("qwen2")
    args = (model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE)
    two = SequenceParallel(None, size=2, rank=0)  # never reaches a collective: the checks come first
    with pytest.raises(ValueError, match="sequence parallelism needs use_remove_padding=True"):
        compute_log_probs(*args, use_remove_padding=False, sp=two)
    with pytest.raises(ValueError, match="sequence parallel size 4 needs query heads \\(2\\) divisible"):
        compute_log_probs(*args, use_remove_padding=True, sp=SequenceParallel(None, size=4, rank=0))
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="sequence parallelism needs the 'rlpad_varlen' attention"):
        compute_log_probs(*args, use_remove_padding=True, sp=two)
