"""model.attn_implementation: what auto picks, and clear errors for a choice that cannot run here."""

import sys

import pytest
import torch

from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.recipe.load import load_config
from rlpad.core import attn_choice, attn_dispatch
from rlpad.core.attn_choice import ATTN_CHOICES, resolve_attn_implementation
from rlpad.core.attn_dispatch import torch_varlen_missing, varlen_api_missing
from rlpad.core.forward import compute_log_probs
from rlpad.core.models import load_causal_lm
from rlpad.embedded.synthetic import rollout_batch

HAS_FLASH = attn_dispatch.flash_attn_installed()


@pytest.fixture
def fake_flash_attn(tmp_path, monkeypatch):
    """An importable package named flash_attn, to check the choice logic on a machine without it.

    Only the selection reads it (``importlib.util.find_spec``); nothing runs flash-attn here.
    """
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("flash_attn", None)


def test_choices():
    assert ATTN_CHOICES == ("auto", "flash_attention_2", "rlpad_varlen", "sdpa")


@pytest.mark.skipif(HAS_FLASH, reason="checks the machine without flash-attn")
def test_auto_without_flash_attn_is_rlpad_varlen_on_cpu_and_cuda():
    assert resolve_attn_implementation("auto", "cpu") == "rlpad_varlen"
    assert resolve_attn_implementation("auto", "cuda") == "rlpad_varlen"


def test_auto_with_flash_attn_is_flash_attention_2_on_cuda_only(fake_flash_attn):
    assert resolve_attn_implementation("auto", "cuda") == "flash_attention_2"
    assert resolve_attn_implementation("auto", torch.device("cuda", 0)) == "flash_attention_2"
    assert resolve_attn_implementation("auto", "cpu") == "rlpad_varlen"


@pytest.mark.skipif(HAS_FLASH, reason="checks the machine without flash-attn")
def test_flash_attention_2_without_flash_attn_names_the_package():
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match=r"flash_attention_2 needs the flash-attn package.*rlpad\[flash\]"):
            resolve_attn_implementation("flash_attention_2", device)


def test_flash_attention_2_off_cuda_names_cuda(fake_flash_attn):
    with pytest.raises(ValueError, match="flash_attention_2 needs a CUDA device, the model is on cpu"):
        resolve_attn_implementation("flash_attention_2", "cpu")
    assert resolve_attn_implementation("flash_attention_2", "cuda") == "flash_attention_2"


def test_rlpad_varlen_runs_on_cpu_and_needs_the_torch_kernel_on_cuda(monkeypatch):
    assert resolve_attn_implementation("rlpad_varlen", "cpu") == "rlpad_varlen"
    # This torch (2.13) has the kernel with the arguments rlpad passes.
    from torch.nn.attention.varlen import varlen_attn

    assert varlen_api_missing(varlen_attn) is None
    if torch.backends.cuda.is_flash_attention_available():
        assert torch_varlen_missing() is None
        assert resolve_attn_implementation("rlpad_varlen", "cuda") == "rlpad_varlen"

    def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        """torch 2.10's signature: causal as a flag, no window, no GQA."""

    missing = varlen_api_missing(old_varlen_attn)
    assert "window_size argument" in missing and "too old" in missing
    monkeypatch.setattr(attn_choice, "torch_varlen_missing", lambda: missing)
    if not HAS_FLASH:
        with pytest.raises(ValueError, match="rlpad_varlen on CUDA needs the window_size argument.*or install flash-attn"):
            resolve_attn_implementation("rlpad_varlen", "cuda")
    assert resolve_attn_implementation("rlpad_varlen", "cpu") == "rlpad_varlen"  # CPU never needs it


def test_rlpad_varlen_on_cuda_runs_on_flash_attn_without_the_torch_kernel(fake_flash_attn, monkeypatch):
    monkeypatch.setattr(attn_choice, "torch_varlen_missing", lambda: "the window_size argument")
    assert resolve_attn_implementation("rlpad_varlen", "cuda") == "rlpad_varlen"


def test_sdpa_is_padded_only():
    assert resolve_attn_implementation("sdpa", "cpu", use_remove_padding=False) == "sdpa"
    with pytest.raises(ValueError, match="sdpa runs the padded path only"):
        resolve_attn_implementation("sdpa", "cpu", use_remove_padding=True)


def test_unknown_choice_is_named():
    with pytest.raises(ValueError, match="attn_implementation='flash' is not valid; choose one of auto"):
        resolve_attn_implementation("flash", "cpu")


@pytest.mark.skipif(HAS_FLASH, reason="checks the machine without flash-attn")
def test_errors_come_at_model_load_before_any_weights():
    with pytest.raises(ValueError, match="flash-attn package"):
        load_causal_lm("/nonexistent/model", attn_implementation="flash_attention_2")  # not even the path is read
    with pytest.raises(ValueError, match="padded path only"):
        load_causal_lm("tiny:qwen2", attn_implementation="sdpa")


def test_models_load_with_the_choice_and_paths_agree():
    batch = rollout_batch(4, 6, 5, vocab_size=128, seed=0)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], 5)
    sdpa = load_causal_lm("tiny:qwen2", attn_implementation="sdpa", use_remove_padding=False)
    auto = load_causal_lm("tiny:qwen2")
    assert sdpa.config._attn_implementation == "sdpa" and auto.config._attn_implementation == "rlpad_varlen"
    with torch.no_grad():
        padded, _ = compute_log_probs(sdpa, *args, use_remove_padding=False)
        packed, _ = compute_log_probs(auto, *args, use_remove_padding=True)
        torch.testing.assert_close(packed, padded, atol=FP32_LOGPROB_TOL, rtol=0)
        with pytest.raises(ValueError, match="needs a varlen attention"):
            compute_log_probs(sdpa, *args, use_remove_padding=True)


def test_config_rejects_sdpa_with_remove_padding_for_actor_and_critic():
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.attn_implementation=sdpa runs the padded path only"):
        load_config(None, ["actor_rollout_ref.model.attn_implementation=sdpa"])
    load_config(None, ["actor_rollout_ref.model.attn_implementation=sdpa", "actor_rollout_ref.model.use_remove_padding=false"])
    with pytest.raises(ValueError, match=r"critic.model.attn_implementation=sdpa runs the padded path only"):
        load_config(None, ["algorithm.adv_estimator=gae", "critic.model.attn_implementation=sdpa"])
    with pytest.raises(ValueError, match=r"critic.model.attn_implementation='xformers' is not valid"):
        load_config(None, ["algorithm.adv_estimator=gae", "critic.model.attn_implementation=xformers"])
