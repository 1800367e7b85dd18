"""The padded path never hands sdpa a fully masked query row (issue #28).

A query row that sees no key (a left-padding token; a right-padding token beyond a sliding window)
makes some kernels return NaN in the backward (cuDNN's sdpa in bf16 on an H100), and that NaN
reaches the weights. rlpad_varlen's padded branch gives such rows every key instead
(rlpad.core.attention.unmask_unattended_rows): here every mask reaching sdpa is checked, on the four
tiny architectures (mistral: sliding window 8), with transformers' own sdpa mask as the negative
control (it has such rows for the same batch), and the real tokens' numbers are unchanged.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.core.attention import unmask_unattended_rows
from rlpad.core.forward import compute_log_probs
from rlpad.embedded.synthetic import rollout_batch
from rlpad.embedded.tiny import ARCHITECTURES, tiny_model

pytestmark = pytest.mark.exactness  # also run with AVX2-only kernels (Makefile: test)

PROMPT, RESPONSE, VOCAB = 24, 40, 128


class SdpaMasks(TorchFunctionMode):
    """Records the ``attn_mask`` of every scaled_dot_product_attention call."""

    def __init__(self):
        super().__init__()
        self.masks: list[torch.Tensor | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.masks.append(None if mask is None else mask.detach().clone())
        return func(*args, **kwargs)


def fully_masked_rows(masks: list[torch.Tensor | None]) -> int:
    """Query rows, over all calls, in which no key is allowed (boolean masks: True = attend)."""
    return sum(int((~m.any(dim=-1)).sum()) for m in masks if m is not None)


def padded_run(model, batch):
    with SdpaMasks() as seen:
        lp, ent = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                    RESPONSE, use_remove_padding=False, calculate_entropy=True)  # fmt: skip
        (lp.sum() + ent.sum()).backward()
    return lp.detach(), ent.detach(), seen.masks


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_no_fully_masked_query_row_reaches_sdpa(arch):
    batch = rollout_batch(8, PROMPT, RESPONSE, vocab_size=VOCAB, seed=7)
    assert (batch["attention_mask"][:, 0] == 0).any(), "the batch must have left padding"
    model = tiny_model(arch, vocab_size=VOCAB, seed=1, attn_implementation="rlpad_varlen")
    lp, ent, masks = padded_run(model, batch)
    assert any(m is not None for m in masks), "the padded path ran without a mask"
    assert fully_masked_rows(masks) == 0

    # Negative control: transformers' own sdpa mask for the same batch has rows that see no key.
    control = tiny_model(arch, vocab_size=VOCAB, seed=1, attn_implementation="sdpa")
    lp_ref, ent_ref, control_masks = padded_run(control, batch)
    assert fully_masked_rows(control_masks) > 0
    # Real tokens attend exactly as before: the numbers agree to the last bit of fp32 noise.
    valid = batch["attention_mask"][:, -RESPONSE:].bool()
    torch.testing.assert_close(lp[valid], lp_ref[valid], atol=FP32_LOGPROB_TOL, rtol=0)
    torch.testing.assert_close(ent[valid], ent_ref[valid], atol=FP32_LOGPROB_TOL, rtol=0)
    assert torch.equal(lp[~valid], torch.zeros_like(lp[~valid]))


def test_unmask_unattended_rows_changes_only_empty_rows():
    mask = torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.bool).view(1, 1, 3, 3)
    fixed = unmask_unattended_rows(mask)
    assert fixed[0, 0, 0].all() and torch.equal(fixed[0, 0, 1:], mask[0, 0, 1:])
    assert unmask_unattended_rows(None) is None


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_the_sdpa_choice_is_guarded_too(arch):
    """model.attn_implementation=sdpa (transformers' own sdpa and mask, loaded by rlpad): a
    pre-hook on each decoder layer fixes its mask, so no fully masked row reaches sdpa, forward or
    in the backward; the numbers equal rlpad_varlen's padded path (the unguarded sdpa model of the
    test above is the control)."""
    from rlpad.core.models import load_causal_lm

    guarded = load_causal_lm(f"tiny:{arch}", attn_implementation="sdpa", use_remove_padding=False)
    varlen = load_causal_lm(f"tiny:{arch}", attn_implementation="rlpad_varlen", use_remove_padding=False)
    assert guarded.config._attn_implementation == "sdpa"
    batch = rollout_batch(8, PROMPT, RESPONSE, vocab_size=guarded.config.vocab_size, seed=7)
    guarded.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lp, ent, masks = padded_run(guarded.train(), batch)
    assert any(m is not None for m in masks) and fully_masked_rows(masks) == 0
    lp_ref, ent_ref, _ = padded_run(varlen.train(), batch)
    torch.testing.assert_close(lp, lp_ref, atol=FP32_LOGPROB_TOL, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=FP32_LOGPROB_TOL, rtol=0)
