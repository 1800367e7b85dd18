"""Saved adapters in and out (rlpad.lora, docs/lora.md), real peft and the real FSDP2 actor (world 1, fp32):

- an adapter trained with ``exclude_modules`` saves what peft needs to rebuild exactly its modules:
  save -> ``lora_adapter_path`` gives the same log-probs, and peft loads the folder to the same model;
- a saved adapter's ``use_rslora`` is honoured (scale alpha / sqrt(r)) by the actor, the merged export and
  the adapter folder the engines load; every other option that changes what an adapter computes
  (``use_dora``, ``bias``, ``modules_to_save``, ``alpha_pattern``, ``rank_pattern``, ...) is refused with
  one line naming it, before any worker starts."""

import json
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from rlpad.core.models import load_causal_lm
from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.embedded.synthetic import ppo_batch
from rlpad.lora.adapters import check_lora, save_adapter
from rlpad.recipe.load import config_from_dict
from test_lora import P, VOCAB, lora_config, reference_log_probs
from workers.actor import ActorWorker

TOL = FP32_LOGPROB_TOL


@pytest.fixture(scope="module")
def batch():
    return ppo_batch(8, P, 10, vocab_size=VOCAB, seed=11)


def actor_log_probs(cfg, batch) -> tuple[ActorWorker, torch.Tensor]:
    w = ActorWorker(cfg, device="cpu")
    w.init_model()
    return w, w.compute_log_prob(batch)["old_log_probs"]


def peft_merged(folder: str) -> torch.nn.Module:
    """The plain model with the adapter folder merged in by peft itself (independent of rlpad)."""
    return PeftModel.from_pretrained(load_causal_lm("tiny:qwen2"), folder).merge_and_unload().eval()


@pytest.mark.exactness
def test_an_adapter_trained_with_exclusions_loads_back_exactly(batch, tmp_path):
    mask = batch["response_mask"].bool()
    cfg = lora_config(None)
    cfg.model.exclude_modules = ["self_attn.k_proj", "layers.0.mlp.down_proj"]
    trained = ActorWorker(cfg, device="cpu")
    trained.init_model()
    base_lp = trained.compute_log_prob(batch)["old_log_probs"]  # lora_B = 0: the base model
    b = batch.index(torch.arange(8))
    for _ in range(3):  # lora_B moves off zero
        b["old_log_probs"] = trained.compute_log_prob(b)["old_log_probs"]
        trained.update_actor(b)
    want = trained.compute_log_prob(batch)["old_log_probs"]
    modules = set(trained.lora_adapters())
    assert not any(m.endswith("k_proj") or m == "model.layers.0.mlp.down_proj" for m in modules)
    folder = str(tmp_path / "adapter")
    trained.save_lora_adapter(folder)

    reloaded, got = actor_log_probs(lora_config(folder), batch)
    assert set(reloaded.lora_adapters()) == modules  # exactly the trained modules, no excluded one
    diff = (got - want)[mask].abs().max().item()
    by_peft = (reference_log_probs(peft_merged(folder), batch) - want)[mask].abs().max().item()
    moved = (base_lp - want)[mask].abs().max().item()
    print(f"reloaded vs trained: {diff:.2e}; peft's own load: {by_peft:.2e}; untrained adapter: {moved:.2e}")
    assert diff <= TOL and by_peft <= TOL
    assert moved > 100 * TOL  # negative control: the training moved the log-probs far past the bound
    # negative control: the old export (target suffixes, exclusions dropped) selects the excluded modules too
    with open(f"{folder}/adapter_config.json") as f:
        old = json.load(f)
    old["target_modules"] = sorted({m.rsplit(".", 1)[-1] for m in modules})
    suffixes = str(tmp_path / "suffixes")
    shutil.copytree(folder, suffixes)
    with open(f"{suffixes}/adapter_config.json", "w") as f:
        json.dump(old, f)
    with pytest.raises(ValueError, match="does not fit"):
        check_lora(config_from_dict({}, [f"actor_rollout_ref.model.lora_adapter_path={suffixes}",
                                         "actor_rollout_ref.model.path=tiny:qwen2"]))


def _peft_adapter(folder, seed: int = 0, **options) -> str:
    """An adapter saved by peft itself (r 16, alpha 8, q/v/down), lora_B random so it moves the model."""
    torch.manual_seed(seed)
    model = get_peft_model(load_causal_lm("tiny:qwen2"), LoraConfig(
        r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0, task_type="CAUSAL_LM",
        **options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))
    return str(folder)


@pytest.mark.exactness
def test_an_rslora_adapter_keeps_its_scale_in_the_actor_the_merge_and_the_engine_folder(batch, tmp_path):
    mask = batch["response_mask"].bool()
    folder = _peft_adapter(tmp_path / "rslora", use_rslora=True)
    want = reference_log_probs(peft_merged(folder), batch)  # peft: alpha / sqrt(16) = 2
    actor, got = actor_log_probs(lora_config(folder), batch)
    assert actor.lora.scale == 8 / 4
    merged = load_causal_lm("tiny:qwen2")
    merged.load_state_dict(actor.full_state_dict())  # lora_sync=merged: rlpad's own merge
    engine_folder = str(tmp_path / "engine")
    save_adapter(engine_folder, actor.lora_adapters(), actor.lora)  # lora_sync=adapter: what vLLM loads
    with open(f"{engine_folder}/adapter_config.json") as f:
        assert json.load(f)["use_rslora"] is True  # vLLM scales by alpha / sqrt(r) when it reads this
    plain = str(tmp_path / "plain")  # negative control: the option dropped (alpha / r = 0.5, 4x smaller)
    shutil.copytree(folder, plain)
    with open(f"{plain}/adapter_config.json") as f:
        cfg = json.load(f)
    cfg["use_rslora"] = False
    with open(f"{plain}/adapter_config.json", "w") as f:
        json.dump(cfg, f)
    errors = {"actor": (got - want)[mask].abs().max().item(),
              "merged export": (reference_log_probs(merged.eval(), batch) - want)[mask].abs().max().item(),
              "engine folder": (reference_log_probs(peft_merged(engine_folder), batch) - want)[mask].abs().max().item(),
              "alpha / r (control)": (reference_log_probs(peft_merged(plain), batch) - want)[mask].abs().max().item()}
    print("rsLoRA, max |log-prob - peft's|:", {k: f"{v:.2e}" for k, v in errors.items()})
    control = errors.pop("alpha / r (control)")
    assert all(v <= TOL for v in errors.values()), errors
    assert control > 100 * TOL


REFUSED = {  # option -> a value that changes what the adapter computes
    "use_dora": True, "bias": "lora_only", "modules_to_save": ["lm_head"], "alpha_pattern": {"q_proj": 32},
    "rank_pattern": {"q_proj": 4}, "layers_to_transform": [0], "init_lora_weights": "pissa", "lora_bias": True,
    "fan_in_fan_out": True, "peft_type": "IA3", "target_modules": ".*q_proj",
}


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_an_adapter_option_rlpad_cannot_honour_is_refused_in_one_line(option, tmp_path):
    folder = _peft_adapter(tmp_path / "a")
    with open(f"{folder}/adapter_config.json") as f:
        cfg = json.load(f)
    cfg[option] = REFUSED[option]
    with open(f"{folder}/adapter_config.json", "w") as f:
        json.dump(cfg, f)
    config = config_from_dict({}, [f"actor_rollout_ref.model.lora_adapter_path={folder}",
                                   "actor_rollout_ref.model.path=tiny:qwen2"])
    with pytest.raises(ValueError) as e:
        check_lora(config)  # before any worker starts (rlpad.train.check_inputs)
    message = str(e.value)
    assert "\n" not in message and f"sets {option}=" in message and "lora_adapter_path" in message, message
