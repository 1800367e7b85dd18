"""``compile_decoder_layers`` (rlpad/core/fused_modules.py, hook ``compile``) on the CPU: the tiny
model's decoder layers under ``torch.compile(dynamic=True)`` score every response token of ragged
packed rows as the plain forward does, per token within the fp32 bound, and give the same gradients;
new packed lengths after the first two micro-batches compile nothing more; the negative control (the
boundary leak of rlpad/embedded/exactness.py run through the compiled layers) is far outside the bound.

Inductor compiles one micro-batch (forward and backward: the backend the option uses on a GPU);
the several-lengths test uses ``aot_eager`` (the same dynamo graphs and autograd split, no code
generation), which keeps compile time small."""

import copy

import pytest
import torch

from rlpad.core.fused_modules import apply_fused_modules, compile_counts, compile_decoder_layers
from rlpad.embedded.exactness import FP32_GRAD_REL, FP32_LOGPROB_TOL, errors, leaky_packed, scored
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import tiny_model

pytestmark = pytest.mark.exactness
PROMPT, RESPONSE, VOCAB = 8, 10, 64
KEY = "actor_rollout_ref.model.compile_decoder_layers"


@pytest.fixture(autouse=True)
def own_inductor_cache(tmp_path, monkeypatch):
    """Inductor's on-disk caches in this test's own folder: `make test` runs these tests again with
    ATen / MKL / oneDNN held to AVX2, and a kernel cached by the first pass, reused there, gave NaN
    log-probs (seen 2026-11-27; a fresh cache under the same settings is exact)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


def _pair(backend: str):
    plain = tiny_model("qwen2", vocab_size=VOCAB, seed=1, attn_implementation="rlpad_varlen")
    compiled = copy.deepcopy(plain)
    names = compile_decoder_layers(compiled, backend)
    assert names == [f"model.layers.{i}" for i in range(plain.config.num_hidden_layers)]
    return plain, compiled


def _assert_same(plain, compiled, batch):
    """Per-token log-probs and entropies within FP32_LOGPROB_TOL, each parameter's gradient within FP32_GRAD_REL."""
    ref = scored(plain, batch, RESPONSE, rmpad=True)
    got = scored(compiled, batch, RESPONSE, rmpad=True)
    valid = batch["attention_mask"][:, -RESPONSE:]
    errs = errors(got, ref, valid)
    assert errs["lp_max"] <= FP32_LOGPROB_TOL and errs["ent_max"] <= FP32_LOGPROB_TOL, errs
    assert sorted(got.grads) == sorted(ref.grads)
    for name, g in ref.grads.items():
        assert (got.grads[name] - g).norm() <= FP32_GRAD_REL * g.norm(), name
    return errs


def test_inductor_compiled_layers_equal_the_plain_forward():
    plain, compiled = _pair("inductor")
    batch = rollout_batch(4, PROMPT, RESPONSE, vocab_size=VOCAB, seed=3)
    before = compile_counts()["graphs"]
    _assert_same(plain, compiled, batch)
    assert compile_counts()["graphs"] > before  # it did compile


def test_ragged_lengths_exact_recompiles_bounded_and_the_leak_fails():
    plain, compiled = _pair("aot_eager")
    batches = [rollout_batch(rows, PROMPT, RESPONSE, vocab_size=VOCAB, seed=seed)
               for rows, seed in ((4, 3), (3, 5), (5, 7), (2, 11))]
    lengths = {int(b["attention_mask"].sum()) for b in batches}
    assert len(lengths) == len(batches)  # a new packed length each micro-batch
    counts = []
    for batch in batches:
        _assert_same(plain, compiled, batch)
        counts.append(compile_counts()["graphs"])
    assert counts[2] == counts[1] == counts[3], counts  # after two lengths: no more graphs
    # negative control: the one-segment row (attention across the sequences) through the compiled layers
    batch = batches[0]
    leak = errors(leaky_packed(compiled, batch, RESPONSE), scored(plain, batch, RESPONSE, rmpad=True),
                  batch["attention_mask"][:, -RESPONSE:])
    assert leak["lp_max"] > 100 * FP32_LOGPROB_TOL and leak["grad_rel"] > 100 * FP32_GRAD_REL, leak


def test_the_hook_is_registered_and_per_instance():
    plain = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    other = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    replaced = apply_fused_modules(plain, "compile", key=KEY, device_type="cpu")
    assert replaced == [f"model.layers.{i}" for i in range(plain.config.num_hidden_layers)]
    assert all("forward" in vars(layer) for layer in plain.model.layers)
    assert not any("forward" in vars(m) for m in other.modules())  # the class is untouched


def test_actor_worker_option_scores_and_updates_as_without(monkeypatch):
    """``actor_rollout_ref.model.compile_decoder_layers=true`` in a real actor (FSDP2, one CPU rank): the
    layers of the sharded model compiled, old log-probs within the fp32 bound and one update's
    metrics and new weights as the plain actor's. Backend aot_eager (inductor under FSDP: 4 minutes
    of compilation on a shared CPU, passed once by hand)."""
    monkeypatch.setattr("rlpad.core.fused_modules.COMPILE_BACKEND", "aot_eager")
    from rlpad.batch import WORKER_SECONDS
    from rlpad.config.schema import ActorRolloutRefConfig
    from rlpad.embedded.synthetic import ppo_batch
    from workers.actor import ActorWorker

    def actor(compiled: bool) -> ActorWorker:
        cfg = ActorRolloutRefConfig()
        cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu = 8, 4
        cfg.actor.optim.lr, cfg.rollout.n = 1e-3, 1
        cfg.model.compile_decoder_layers = compiled
        w = ActorWorker(cfg, device="cpu")
        w.init_model()
        return w

    plain, compiled = actor(False), actor(True)
    assert all("forward" in vars(layer) for layer in compiled.model.model.layers)
    batch = ppo_batch(8, PROMPT, RESPONSE, vocab_size=compiled.model.config.vocab_size, seed=1)
    a, b = plain.compute_log_prob(batch), compiled.compute_log_prob(batch)
    for key in ("old_log_probs", "entropy"):
        assert (a[key] - b[key]).abs().max() <= FP32_LOGPROB_TOL, key
    m1, m2 = plain.update_actor(batch), compiled.update_actor(batch)
    m1.pop(WORKER_SECONDS), m2.pop(WORKER_SECONDS)
    assert m1.keys() == m2.keys()
    for k in m1:
        assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), k
    for (name, p), q in zip(plain.root.named_parameters(), compiled.root.parameters()):
        assert (p.full_tensor() - q.full_tensor()).abs().max() <= 1e-5, name


def test_critic_worker_option_compiles_its_backbone(monkeypatch):
    """``critic.model.compile_decoder_layers=true``: the critic holds the backbone without the LM head;
    its layers are compiled and its values equal the plain critic's within the fp32 bound."""
    monkeypatch.setattr("rlpad.core.fused_modules.COMPILE_BACKEND", "aot_eager")
    from rlpad.config.schema import CriticConfig
    from rlpad.embedded.synthetic import ppo_batch
    from workers.critic import CriticWorker

    def critic(compiled: bool) -> CriticWorker:
        cfg = CriticConfig()
        cfg.ppo_micro_batch_size_per_gpu = 4
        cfg.model.compile_decoder_layers = compiled
        w = CriticWorker(cfg, device="cpu")
        w.init_model()
        return w

    plain, compiled = critic(False), critic(True)
    assert all("forward" in vars(layer) for layer in compiled.model.layers)
    assert not any("forward" in vars(layer) for layer in plain.model.layers)
    batch = ppo_batch(8, PROMPT, RESPONSE, vocab_size=compiled.model.config.vocab_size, seed=1)
    a, b = plain.compute_values(batch)["values"], compiled.compute_values(batch)["values"]
    assert (a - b).abs().max() <= FP32_LOGPROB_TOL
