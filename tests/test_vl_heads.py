"""Every other scoring path takes images: the critic's values, a reward model's scores and a teacher's
top-k on a VL batch, padded = packed = shared prompts = each sequence alone through transformers'
own VL backbone (pixel_values, image_grid_thw, mm_token_type_ids)."""

import pytest
import torch

from rlpad.core.distill_scoring import compute_teacher_topk
from rlpad.core.reward_model import compute_scores
from rlpad.core.value import ValueModel
from rlpad.embedded.exactness import FP32_LOGPROB_TOL
from rlpad.embedded.shapes import VL_TOKEN_IDS
from rlpad.embedded.tiny import tiny_model
from rlpad.embedded.tiny_vl import tiny_vl_reward_model
from rlpad.embedded.vl_synthetic import vl_rollout_batch

pytestmark = pytest.mark.exactness

R = 5
IMAGE = VL_TOKEN_IDS["image_pad"]
PATHS = {"padded": dict(use_remove_padding=False), "packed": dict(use_remove_padding=True),
         "shared": dict(use_remove_padding=True, share_prompts=True)}


@pytest.fixture(scope="module")
def batch():
    return vl_rollout_batch([[(1, 4, 6)], [], [(1, 2, 2), (1, 4, 4)]], R, n=2, seed=7)


@pytest.fixture(scope="module")
def causal():
    return tiny_model("qwen2_5_vl", seed=2)


def alone_hidden(model, tensors, mm):
    """[(hidden (L, H) of row b alone through transformers' backbone, prompt length, response length)]."""
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    out = []
    with torch.no_grad():
        for b in range(ids.shape[0]):
            seq = ids[b][mask[b].bool()]
            images = {}
            if mm[b]:
                images = dict(pixel_values=mm[b]["pixel_values"], image_grid_thw=mm[b]["image_grid_thw"],
                              mm_token_type_ids=(seq == IMAGE).long()[None])
            model.model.rope_deltas = None
            hidden = model.model(input_ids=seq[None], use_cache=False, **images).last_hidden_state[0]
            n_resp = int(mask[b, -R:].sum())
            out.append((hidden, len(seq) - n_resp, n_resp))
    return out


def args(tensors):
    return tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"]


def test_critic_values_with_images(batch, causal):
    tensors, mm = batch
    critic = ValueModel(causal, seed=3)
    ref = torch.zeros(len(mm), R)
    for b, (hidden, n_prompt, n_resp) in enumerate(alone_hidden(causal, tensors, mm)):
        with torch.no_grad():
            ref[b, :n_resp] = critic.value_head(hidden[n_prompt - 1 : n_prompt - 1 + n_resp]).squeeze(-1)
    for name, kw in PATHS.items():
        with torch.no_grad():
            values = critic(*args(tensors), R, multi_modal_inputs=mm, **kw)
        torch.testing.assert_close(values, ref, atol=FP32_LOGPROB_TOL, rtol=0, msg=name)


def test_reward_model_scores_with_images(batch):
    tensors, mm = batch
    rm = tiny_vl_reward_model(seed=4)
    ref = torch.stack([rm.score(h[-1]).squeeze(-1) for h, _, _ in alone_hidden(rm, tensors, mm)])
    for name, kw in PATHS.items():
        with torch.no_grad():
            scores = compute_scores(rm, *args(tensors), response_length=R, multi_modal_inputs=mm, **kw)
        torch.testing.assert_close(scores, ref, atol=FP32_LOGPROB_TOL, rtol=0, msg=name)
    with torch.no_grad():  # control: the images matter to the score
        blind = compute_scores(rm, *args(tensors), response_length=R, multi_modal_inputs=[
            {**m, "pixel_values": m["pixel_values"] * 0} if m else m for m in mm])
    assert (blind - ref)[[0, 1, 4, 5]].abs().min() > 100 * FP32_LOGPROB_TOL


def test_teacher_topk_with_images(batch, causal):
    """The teacher's top-k in the jagged layout (the scored positions in row order, k log-probs + the tail)."""
    tensors, mm = batch
    teacher = causal
    k = 4
    refs = []
    for hidden, n_prompt, n_resp in alone_hidden(teacher, tensors, mm):
        logp = teacher.lm_head(hidden[n_prompt - 1 : n_prompt - 1 + n_resp]).double().log_softmax(-1)
        top = logp.topk(k, -1)
        rest = logp.scatter(-1, top.indices, float("-inf")).logsumexp(-1, keepdim=True)
        refs.append(torch.cat([top.values, rest], -1))
    ref_lp = torch.cat(refs)
    for name, kw in PATHS.items():
        ids, lp = compute_teacher_topk(teacher, *args(tensors), R, topk=k, multi_modal_inputs=mm, **kw)
        torch.testing.assert_close(lp.double(), ref_lp, atol=FP32_LOGPROB_TOL, rtol=0, msg=name)
