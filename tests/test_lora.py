"""LoRA on the FSDP2 actor (real peft, real FSDP2): exactness against the merged model, the reference for
free, what trains, the adapter folder, resume, and the config checks (docs/lora.md)."""

import dataclasses

import pytest
import torch
from peft import PeftModel

from rlpad.batch import WORKER_SECONDS, Batch
from rlpad.config.schema import ActorRolloutRefConfig
from rlpad.recipe.load import config_from_dict
from rlpad.core.forward import compute_log_probs
from rlpad.core.models import load_causal_lm
from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.embedded.synthetic import grpo_batch, ppo_batch
from rlpad.lora.rules import LoraSpec, engine_max_lora_rank, lora_key, select_targets
from rlpad.cli import main as cli_main
from rlpad.lora.adapters import apply_lora, check_lora, decoder_linear_names, save_adapter
from rlpad.train import check_inputs
from spawn_ranks import spawn_ranks
from workers.actor import ActorWorker
from workers.fsdp_checkpoint import LORA_ADAPTER_DIR
from workers.net import free_port

P, R, VOCAB, RANK, ALPHA = 8, 10, 128, 4, 8
TOL = FP32_LOGPROB_TOL  # fp32, per token (derivation: rlpad/embedded/exactness.py)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_config(adapter: str | None = None, **actor) -> ActorRolloutRefConfig:
    cfg = ActorRolloutRefConfig()
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu = 8, 3
    cfg.actor.optim.lr, cfg.rollout.n, cfg.rollout.log_prob_micro_batch_size_per_gpu = 1e-2, 1, 3
    cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_adapter_path = RANK, ALPHA, adapter
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return cfg


def make_adapter(path, arch: str = "qwen2", seed: int = 5, noise: float = 0.0) -> str:
    """A non-trivial adapter (lora_B random, so it moves the model) saved in peft's format by rlpad."""
    model = load_causal_lm(f"tiny:{arch}")
    spec = LoraSpec(RANK, ALPHA, ("all-linear",))
    peft_model = apply_lora(model, spec, seed=seed)
    g = torch.Generator().manual_seed(seed)
    adapters = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            b = torch.randn(b.shape, generator=g) * 0.3
            a = a.detach() + noise * torch.randn(a.shape, generator=g)
            adapters[name] = (a.detach().clone(), b)
    assert len(adapters) == 2 * len(LINEARS) and peft_model is not None
    save_adapter(str(path), adapters, spec, base_model=f"tiny:{arch}")
    return str(path)


def merged_reference(adapter: str) -> torch.nn.Module:
    """The plain model with the adapter merged in by peft itself (independent of rlpad's merge)."""
    return PeftModel.from_pretrained(load_causal_lm("tiny:qwen2"), adapter).merge_and_unload().eval()


def reference_log_probs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], R,
                                  use_remove_padding=True)
    return lp


@pytest.fixture(scope="module")
def batch():
    return ppo_batch(8, P, R, vocab_size=VOCAB, seed=1)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("adapter") / "a")


@pytest.fixture(scope="module")
def actor(adapter):
    w = ActorWorker(lora_config(adapter), device="cpu")
    w.init_model()
    return w


def test_log_probs_equal_the_merged_model_and_a_wrong_adapter_differs(actor, adapter, batch, tmp_path):
    mask = batch["response_mask"].bool()
    lora = actor.compute_log_prob(batch)["old_log_probs"]
    merged = reference_log_probs(merged_reference(adapter), batch)
    assert (lora - merged)[mask].abs().max() <= TOL
    # negative controls: the base model (an engine that never got the adapter), a perturbed adapter
    base = reference_log_probs(load_causal_lm("tiny:qwen2").eval(), batch)
    other = reference_log_probs(merged_reference(make_adapter(tmp_path / "b", noise=0.05)), batch)
    assert (lora - base)[mask].abs().max() > 100 * TOL
    assert (lora - other)[mask].abs().max() > 100 * TOL
    # rlpad's own merge (the weight export) is the model peft merges
    fresh = load_causal_lm("tiny:qwen2")
    state = actor.full_state_dict()
    fresh.load_state_dict(state)
    assert (reference_log_probs(fresh.eval(), batch) - merged)[mask].abs().max() <= TOL
    # the Ray push's buckets (small ones: several per sync) carry the same merged tensors
    buckets = list(actor.iter_weight_buckets(64 * 1024))
    assert len(buckets) > 2
    pushed = dict(pair for bucket in buckets for pair in bucket)
    assert set(pushed) == set(state) and all(torch.equal(pushed[k], state[k]) for k in state)
    actor.save_hf(str(tmp_path / "hf"))  # an HF folder of the merged model
    saved = load_causal_lm(str(tmp_path / "hf")).state_dict()
    assert set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in state)


def test_shared_prompts_token_budgets_and_checkpointing_stay_exact(adapter):
    """The scoring core sees ordinary modules: shared prompts, token-budget micro-batches and gradient
    checkpointing give the merged model's log-probs and plain remove-padding's gradients."""
    d = grpo_batch(4, 3, P, R, vocab_size=VOCAB, seed=2, min_prompt=2)
    d.pop("group")
    gen = torch.Generator().manual_seed(3)
    d["responses"] = d["input_ids"][:, P:]
    d["advantages"] = torch.randn(d["response_mask"].shape, generator=gen) * d["response_mask"]
    b = Batch(d)
    mask = b["response_mask"].bool()
    merged = reference_log_probs(merged_reference(adapter), b)
    grads = {}
    for shared in (False, True):
        cfg = lora_config(adapter, ppo_mini_batch_size=4, use_dynamic_bsz=shared, ppo_max_token_len_per_gpu=24)
        cfg.rollout.n, cfg.model.share_prompts, cfg.model.enable_gradient_checkpointing = 3, shared, shared
        cfg.model.share_prompts_min_saved_fraction = 0.0  # share every micro-batch
        w = ActorWorker(cfg, device="cpu")
        w.init_model()
        lp = w.compute_log_prob(b, update_layout=True)["old_log_probs"]
        assert (lp - merged)[mask].abs().max() <= TOL, shared
        b["old_log_probs"] = lp
        grads[shared] = w.update_actor(b, return_grads=True)["grads"]
    assert set(grads[True]) == set(grads[False]) and all(".lora_" in k for k in grads[True])
    for k, g in grads[False].items():
        assert (grads[True][k] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-9, k


def test_reference_is_the_base_model_bitwise(actor, batch):
    ref = ActorWorker(lora_config(None), role="ref", device="cpu")  # a plain reference model (the ref role has no LoRA)
    ref.init_model()
    assert ref.peft is None and ref.lora is None
    base = ref.compute_ref_log_prob(batch)["ref_log_probs"]
    assert torch.equal(actor.compute_ref_log_prob(batch)["ref_log_probs"], base)
    assert not torch.equal(actor.compute_log_prob(batch)["old_log_probs"], base)  # the adapter is back on after it


def test_only_the_adapter_trains_and_the_optimizer_holds_only_it(adapter, batch):
    w = ActorWorker(lora_config(adapter, use_kl_loss=True, entropy_coeff=0.01), device="cpu")
    w.init_model()
    params = dict(w.root.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all(lora_key(n) and lora_key(n)[1] in ("lora_A", "lora_B") for n in trainable)
    held = {id(p) for g in w.optimizer.param_groups for p in g["params"]}
    assert held == {id(params[n]) for n in trainable}
    before = {n: p.full_tensor().clone() for n, p in params.items()}
    b = batch.index(torch.arange(8))
    b["old_log_probs"] = w.compute_log_prob(b)["old_log_probs"]
    b["ref_log_probs"] = w.compute_ref_log_prob(b)["ref_log_probs"]
    metrics = w.update_actor(b)
    assert metrics["actor/kl_loss"] > 1e-3  # the adapter moves the policy away from its reference, the base
    moved = {n for n, p in params.items() if not torch.equal(p.full_tensor(), before[n])}
    assert moved == trainable
    state = sum(t.numel() for s in w.optimizer.state.values() for t in s.values() if t.dim() > 0)
    assert state == 2 * sum(params[n].numel() for n in trainable)  # AdamW moments of the adapter only


def test_checkpoint_resume_is_bitwise_and_holds_a_peft_adapter(adapter, tmp_path):
    b1, b2 = (ppo_batch(8, P, R, vocab_size=VOCAB, seed=s) for s in (2, 3))
    kw = dict(ppo_mini_batch_size=4, shuffle=True)
    first = ActorWorker(lora_config(adapter, **kw), seed=7, device="cpu")
    first.init_model()
    first.update_actor(b1)
    first.save_checkpoint(str(tmp_path / "ck"))
    saved = sum(f.stat().st_size for f in (tmp_path / "ck").glob("*.distcp"))
    adapter_bytes = sum(p.numel() * 4 for p in first.root.parameters() if p.requires_grad)
    assert adapter_bytes * 3 <= saved < adapter_bytes * 3 + 200_000  # adapters + 2 AdamW moments, not the base
    m1 = first.update_actor(b2)
    second = ActorWorker(lora_config(None, **kw), seed=7, device="cpu")  # a fresh adapter: the checkpoint restores it
    second.init_model()
    second.load_checkpoint(str(tmp_path / "ck"))
    m2 = second.update_actor(b2)
    assert m1.pop(WORKER_SECONDS) > 0 and m2.pop(WORKER_SECONDS) > 0  # timing, not a result
    assert m1 == m2
    for (n, a), (_, b) in zip(first.root.named_parameters(), second.root.named_parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), n
    # the checkpoint's adapter folder is peft's: loaded by PeftModel, merged by `rlpad merge-lora`
    folder = tmp_path / "ck" / LORA_ADAPTER_DIR
    out = str(tmp_path / "merged")
    assert cli_main(["merge-lora", "tiny:qwen2", str(folder), out]) == 0
    merged = load_causal_lm(out)
    assert cli_main(["merge-lora", "tiny:qwen2", str(tmp_path / "nowhere"), out]) == 2  # one line on stderr
    b = ppo_batch(4, P, R, vocab_size=VOCAB, seed=4)
    fresh = ActorWorker(lora_config(str(folder)), device="cpu")
    fresh.init_model()
    lp = fresh.compute_log_prob(b)["old_log_probs"]
    assert (lp - reference_log_probs(merged.eval(), b))[b["response_mask"].bool()].abs().max() <= TOL


SP = 2  # both ranks in one sequence-parallel group: each scores half of every packed row


def _two_ranks(rank: int, world: int, port: int, adapter: str) -> dict:
    cfg = lora_config(adapter, ppo_mini_batch_size=8, ulysses_sequence_parallel_size=SP)
    w = ActorWorker(cfg, rank=rank, world_size=world, master_port=port, device="cpu", seed=3)
    w.init_model()
    b = ppo_batch(8, P, R, vocab_size=VOCAB, seed=1)
    # the ranks of a sequence-parallel group hold the same rows
    b["old_log_probs"] = w.compute_log_prob(b)["old_log_probs"]
    metrics = w.update_actor(b)
    out = {"state": w.full_state_dict(), "grad_norm": metrics["actor/grad_norm"], "old": b["old_log_probs"]}
    w.shutdown()
    return out


def test_two_fsdp2_ranks_with_sequence_parallelism_train_the_adapter_as_one(adapter, tmp_path):
    """Adapters sharded over 2 ranks of one sequence-parallel group (rank 1 built on the meta device, filled
    from rank 0; each rank scores half of every packed row): log-probs, the update and the merged export
    equal one process's."""
    ranks = spawn_ranks(_two_ranks, 2, tmp_path, free_port(), adapter)
    one = ActorWorker(lora_config(adapter, ppo_mini_batch_size=8), device="cpu", seed=3)
    one.init_model()
    b = ppo_batch(8, P, R, vocab_size=VOCAB, seed=1)
    b["old_log_probs"] = one.compute_log_prob(b)["old_log_probs"]
    mask = b["response_mask"].bool()
    for r in ranks:
        assert (r["old"] - b["old_log_probs"])[mask].abs().max() <= TOL
    metrics = one.update_actor(b)
    assert ranks[0]["grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    state = one.full_state_dict()
    assert all(r["state"] is None for r in ranks[1:]) and set(ranks[0]["state"]) == set(state)
    for name, t in state.items():
        assert (ranks[0]["state"][name] - t).abs().max() <= 1e-6, name


# ---------------------------------------------------------------- bad input, before anything starts


@pytest.mark.parametrize("overrides, match", [
    (["actor_rollout_ref.model.lora_rank=-1"], r"lora_rank=-1 must be >= 0"),
    (["actor_rollout_ref.model.lora_rank=600"], r"lora_rank=600 is above vLLM's largest max_lora_rank 512"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=0"], r"lora_alpha=0 must be > 0"),
    (["critic.model.lora_rank=8"], r"LoRA on the critic is not supported"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
      "actor_rollout_ref.model.exclude_modules=[q_proj,v_proj]"], r"exclude_modules=.* excludes every module"),
    (["actor_rollout_ref.rollout.lora_sync=pushed"], r"lora_sync='pushed' is not valid"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.name=hf"],
     r"lora_sync=adapter needs a rollout backend that serves LoRA adapters; actor_rollout_ref.rollout.name=hf does not"),
])
def test_config_loader_refuses_bad_lora_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({}, overrides)


def test_engine_rank_rounds_up_to_what_vllm_accepts():
    assert [engine_max_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="above vLLM's largest max_lora_rank 512"):
        engine_max_lora_rank(513)


def test_targets_against_the_model(tmp_path):
    names = decoder_linear_names(load_causal_lm("tiny:qwen2"))
    assert sorted({n.rsplit(".", 1)[-1] for n in names}) == sorted(LINEARS)  # never lm_head / embed_tokens
    assert select_targets(names, ["self_attn.q_proj"]) == [n for n in names if n.endswith("q_proj")]
    with pytest.raises(ValueError, match=r"target_modules=\['qkv_proj'\] matches no linear module.*down_proj, gate_proj"):
        select_targets(names, ["qkv_proj"])
    with pytest.raises(ValueError, match=r"target_modules=\['lm_head'\] matches no linear module"):
        select_targets(names, ["lm_head"])
    with pytest.raises(ValueError, match=r"exclude_modules=\['q_proj', .*\] excludes every module"):
        select_targets(names, ["all-linear"], [*LINEARS])
    # the same checks where a run starts (rlpad.train.prepare), and a saved adapter of another architecture
    cfg = config_from_dict({}, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[qkv]"])
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.target_modules=\['qkv'\] matches no linear"):
        check_lora(cfg)
    llama = make_adapter(tmp_path / "llama", arch="llama")  # tiny:llama has 2 key/value heads, tiny:qwen2 one
    cfg = config_from_dict({}, ["actor_rollout_ref.model.lora_rank=8", f"actor_rollout_ref.model.lora_adapter_path={llama}"])
    with pytest.raises(ValueError, match=r"lora_adapter_path=.* does not fit 'tiny:qwen2'.*k_proj.*another architecture"):
        check_lora(cfg)
    check_lora(dataclasses.replace(cfg, actor_rollout_ref=dataclasses.replace(
        cfg.actor_rollout_ref, model=dataclasses.replace(cfg.actor_rollout_ref.model, lora_adapter_path=make_adapter(
            tmp_path / "qwen2")))))  # the right architecture passes
    missing = config_from_dict({}, ["actor_rollout_ref.model.lora_rank=8",
                                    f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'none'}"])
    with pytest.raises(ValueError, match=r"lora_adapter_path=.* does not exist"):
        check_inputs(missing)


def test_reference_model_is_not_built_with_lora():
    on = config_from_dict({}, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.use_kl_loss=true"])
    off = config_from_dict({}, ["actor_rollout_ref.actor.use_kl_loss=true"])
    assert on.ref_in_actor and not on.builds_ref
    assert off.builds_ref and not off.ref_in_actor
