"""FSDP2 workers in this process (world 1, gloo): critic, bad input, weight export, resume, batch contracts."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from run_compare import RUN_ABS, RUN_REL
from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL
from rlpad.batch import WORKER_SECONDS, Batch
from rlpad.config.schema import ActorRolloutRefConfig, CriticConfig
from rlpad.core.forward import compute_log_probs
from rlpad.core.models import load_causal_lm
from workers.actor import ActorWorker, update_contract
from rlpad.embedded.synthetic import ppo_batch
from workers.contract import FORWARD, Contract, batch_method, contract_of
from workers.critic import CriticWorker

pytestmark = pytest.mark.exactness  # also run with AVX2-only kernels (Makefile: test)

P, R, VOCAB = 8, 10, 128  # tiny:qwen2 has vocab 128, hidden 64, 2 layers


def actor_config(**actor) -> ActorRolloutRefConfig:
    cfg = ActorRolloutRefConfig()
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu = 8, 2
    cfg.actor.optim.lr, cfg.rollout.n = 1e-2, 1
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return cfg


@pytest.fixture(scope="module")
def actor():
    w = ActorWorker(actor_config(use_kl_loss=True, entropy_coeff=0.01), device="cpu")
    w.init_model()
    return w


@pytest.fixture
def batch():
    return ppo_batch(8, P, R, vocab_size=VOCAB, seed=1)


# ---------------------------------------------------------------- critic


def critic_config(use_remove_padding: bool = True) -> CriticConfig:
    cfg = CriticConfig()
    cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu, cfg.optim.lr = 8, 3, 1e-3
    cfg.model.use_remove_padding = use_remove_padding
    return cfg


def test_critic_rmpad_matches_padded_and_update_lowers_loss(batch):
    critic, padded_critic = CriticWorker(critic_config(), device="cpu"), CriticWorker(critic_config(use_remove_padding=False), device="cpu")
    critic.init_model()
    padded_critic.init_model()  # the same seed: the same value head
    rmpad = critic.compute_values(batch)["values"]
    padded = padded_critic.compute_values(batch)["values"]
    assert rmpad.shape == (8, R)
    assert (rmpad - padded).abs().max() <= FP32_LOGPROB_TOL
    assert rmpad.abs().sum() > 0 and (rmpad[batch["response_mask"] == 0] == 0).all()

    batch["values"] = rmpad
    losses = [critic.update_critic(batch)["critic/vf_loss"] for _ in range(4)]
    assert losses[-1] < losses[0] * 0.9, losses
    metrics = critic.update_critic(batch)
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr"} <= set(metrics)


# ---------------------------------------------------------------- bad input


def test_missing_key_is_named(actor, batch):
    del batch.tensors["advantages"]
    with pytest.raises(ValueError, match="advantages"):
        actor.update_actor(batch)
    with pytest.raises(ValueError, match="responses"):
        actor.compute_log_prob(Batch({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}))


def test_mismatched_rows_are_named(actor, batch):
    with pytest.raises(ValueError, match="mismatched row counts"):
        Batch({"input_ids": batch["input_ids"], "advantages": batch["advantages"][:5]})
    batch.tensors["advantages"] = batch["advantages"][:5]  # bypass Batch's own check
    with pytest.raises(ValueError, match=r"advantages has shape \(5, "):
        actor.update_actor(batch)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("key", ["advantages", "old_log_probs", "ref_log_probs"])
def test_non_finite_inputs_are_named(actor, batch, key, bad):
    batch[key][3, 0] = bad
    with pytest.raises(ValueError, match=rf"{key} contains NaN or inf \(rows \[3\]\)"):
        actor.update_actor(batch)


def test_wrong_shapes_and_roles(actor, batch):
    batch.tensors["advantages"] = batch["advantages"][:, :-1]
    with pytest.raises(ValueError, match="advantages has shape"):
        actor.update_actor(batch)
    ref = ActorWorker(ActorRolloutRefConfig(), role="ref", device="cpu")
    ref.init_model()
    with pytest.raises(RuntimeError, match="update_actor called on a 'ref' worker"):
        ref.update_actor(batch)
    assert ref.optimizer is None
    with pytest.raises(ValueError, match="role must be one of"):
        ActorWorker(ActorRolloutRefConfig(), role="critic", device="cpu")


def test_mini_batch_must_divide(batch):
    w = ActorWorker(actor_config(ppo_mini_batch_size=3), device="cpu")
    w.init_model()
    with pytest.raises(ValueError, match="per-rank mini-batch 3"):
        w.update_actor(batch)


# ---------------------------------------------------------------- weights out, resume


def test_full_state_dict_and_save_hf(tmp_path, batch):
    w = ActorWorker(actor_config(), device="cpu")
    w.init_model()
    w.update_actor(batch)  # move away from the seed-0 weights
    state = w.full_state_dict()
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state  # tied in qwen2: both present
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    fresh = load_causal_lm("tiny:qwen2")
    assert set(state) == set(fresh.state_dict())
    fresh.load_state_dict(state)
    lp_worker = w.compute_log_prob(batch)["old_log_probs"]
    lp_ref, _ = compute_log_probs(fresh, batch["input_ids"], batch["attention_mask"], batch["position_ids"], R,
                                  use_remove_padding=True)  # fmt: skip
    assert (lp_worker - lp_ref).abs().max() <= FP32_LOGPROB_TOL

    w.save_hf(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, state[name]), name
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_resume_in_a_fresh_worker_equals_uninterrupted(tmp_path):
    b1, b2 = (ppo_batch(8, P, R, vocab_size=VOCAB, seed=s) for s in (2, 3))
    kw = dict(ppo_mini_batch_size=4, ppo_epochs=2, shuffle=True, use_kl_loss=True)
    first = ActorWorker(actor_config(**kw), seed=7, device="cpu")
    first.config.actor.optim.lr_warmup_steps = 3
    first.init_model()
    first.update_actor(b1)
    first.save_checkpoint(str(tmp_path / "ck"))
    torch.manual_seed(123)  # the checkpoint must restore the RNG, not rely on it
    m_uninterrupted = first.update_actor(b2)
    s_uninterrupted = first.full_state_dict()

    second = ActorWorker(actor_config(**kw), seed=7, device="cpu")
    second.config.actor.optim.lr_warmup_steps = 3
    second.init_model()
    second.load_checkpoint(str(tmp_path / "ck"))
    assert second.update_steps == 1 and torch.equal(torch.get_rng_state(), torch.load(
        tmp_path / "ck" / "extra_rank0.pt", weights_only=False)["rng"]["torch"])  # fmt: skip
    m_resumed = second.update_actor(b2)
    assert m_resumed.pop(WORKER_SECONDS) > 0 and m_uninterrupted.pop(WORKER_SECONDS) > 0  # timing, not a result
    assert m_resumed == m_uninterrupted
    assert m_resumed["actor/lr"] == pytest.approx(1e-2 * 2 / 3)  # warm-up step 2 of 3
    for name, t in second.full_state_dict().items():
        assert torch.equal(t, s_uninterrupted[name]), name


def test_checkpointing_chunking_and_budget_keep_results(batch):
    """Gradient checkpointing, a chunked LM head and token-budget log-prob micro-batches change
    memory and scheduling, never the numbers."""
    results = []
    for ckpt, chunk, budget in ((False, None, False), (True, 3, True)):
        cfg = actor_config(use_kl_loss=True, entropy_coeff=0.01)
        cfg.model.enable_gradient_checkpointing, cfg.model.logits_chunk_size = ckpt, chunk
        cfg.rollout.log_prob_use_dynamic_bsz, cfg.rollout.log_prob_max_token_len_per_gpu = budget, 30
        w = ActorWorker(cfg, device="cpu")
        w.init_model()
        results.append((w.compute_log_prob(batch), w.update_actor(batch, return_grads=True)))
    (out_a, m_a), (out_b, m_b) = results
    for key in ("old_log_probs", "entropy"):
        assert (out_a[key] - out_b[key]).abs().max() <= FP32_LOGPROB_TOL  # derivations: rlpad/embedded/exactness.py
    grads_a, grads_b = m_a.pop("grads"), m_b.pop("grads")
    assert m_a.pop(WORKER_SECONDS) > 0 and m_b.pop(WORKER_SECONDS) > 0
    for k, g in grads_a.items():
        assert float((grads_b[k] - g).norm() / g.norm()) <= FP32_GRAD_REL, k
    assert m_b == pytest.approx(m_a, rel=RUN_REL, abs=RUN_ABS)  # tests/run_compare.py


# ---------------------------------------------------------------- batch contracts


def test_method_body_reads_only_declared_keys(actor, batch):
    """The body of a @batch_method sees its declared keys only, through every way of reading a key and
    in its micro-batches; an absent optional key reads as absent."""
    seen = {}

    def peek(self, declared_batch):
        piece = declared_batch.index([0, 1]).to("cpu")
        seen["keys"] = sorted(piece.keys())
        seen["optional_absent"] = piece.tensors.get("rollout_is_weights")
        for read in (lambda b: b["uid"], lambda b: b.tensors.get("token_level_scores"), lambda b: "values" in b,
                     lambda b: b.non_tensors.get("uid")):
            with pytest.raises(KeyError, match="peek reads batch key '(uid|token_level_scores|values)', which its "
                                               "@batch_method contract does not declare"):
                read(piece)
        return True

    batch["uid"] = list(range(len(batch)))  # a non-tensor the trainer's batch carries
    batch["token_level_scores"] = batch["advantages"].clone()
    assert batch_method(update_contract)(peek)(actor, batch)
    assert seen["keys"] == sorted(["input_ids", "attention_mask", "position_ids", "responses", "response_mask",
                                   "old_log_probs", "advantages", "ref_log_probs"])
    assert seen["optional_absent"] is None


def test_contracts_derive_from_the_config():
    with_kl, without = actor_config(use_kl_loss=True), actor_config(use_kl_loss=False)
    assert "ref_log_probs" in contract_of(ActorWorker, "update_actor", with_kl).required
    assert "ref_log_probs" not in contract_of(ActorWorker, "update_actor", without).keys
    update = contract_of(ActorWorker, "update_actor", without)
    assert "rollout_is_weights" in update.optional and "rollout_is_weights" in update.finite
    assert contract_of(ActorWorker, "compute_log_prob", without) == FORWARD
    assert set(contract_of(CriticWorker, "update_critic", CriticConfig()).finite) == {"values", "returns"}
    with pytest.raises(ValueError, match="ActorWorker.save_hf is not a @batch_method"):
        contract_of(ActorWorker, "save_hf", without)
    with pytest.raises(ValueError, match="finite key"):
        Contract(required=("a",), finite=("b",))


def test_rollout_is_weights_scale_the_policy_loss(batch):
    """One mini-batch, one step: weights of 1/2 on every token halve pg_loss exactly (the loss is
    linear in them); NaN weights are named before any compute."""
    losses = []
    for weights in (None, 0.5):
        w = ActorWorker(actor_config(), device="cpu")
        w.init_model()
        b = Batch(dict(batch.tensors))
        if weights is not None:
            b["rollout_is_weights"] = torch.full_like(b["advantages"], weights)
        losses.append(w.update_actor(b)["actor/pg_loss"])
    assert losses[0] != 0 and losses[1] == losses[0] / 2
    b["rollout_is_weights"][2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"rollout_is_weights contains NaN or inf \(rows \[2\]\)"):
        w.update_actor(b)


# ---------------------------------------------------------------- the micro-batch's host copy


def test_the_forward_reads_its_index_plans_from_the_micro_batch_host_copy(actor, batch):
    """Each micro-batch carries its host copy (workers.fsdp.HOST_COPY, taken before the move to the
    device); the actor's and the critic's forwards build their plans from it (on CUDA: no device read
    per micro-batch). Shown by a host copy whose response_mask scores only the first two response
    columns: the scores follow it, the rest is exactly 0; the piece's own copy gives the plain numbers."""
    from rlpad.core.host_plan import HostBatch
    from workers.fsdp import HOST_COPY

    critic = CriticWorker(critic_config(), device="cpu")
    critic.init_model()
    for worker, score in ((actor, lambda p: actor._log_probs(p, 1.0, False)[0]), (critic, critic._values)):
        piece = worker._on_device(batch)
        host = piece.meta[HOST_COPY]
        assert torch.equal(host.input_ids, batch["input_ids"]) and torch.equal(host.response_mask, batch["response_mask"])
        with torch.no_grad():
            plain = score(piece)
            first_two = batch["response_mask"].clone()
            first_two[:, 2:] = 0
            piece.meta[HOST_COPY] = HostBatch(host.input_ids, host.attention_mask, host.position_ids, first_two)
            steered = score(piece)
        assert (steered[:, 2:] == 0).all() and (plain[:, 2:] != 0).any()
        torch.testing.assert_close(steered[:, :2], plain[:, :2], atol=1e-5, rtol=0)
