"""CUDA, bf16, images on the packed row: the tiny Qwen2.5-VL / Qwen2-VL, packed (the varlen kernel), padded
and shared prompts with their vision tower on the GPU, against the fp32 oracle (each sequence alone
through transformers' own VL forward on the CPU, the same bf16-rounded weights), within BF16_BOUNDS."""

import pytest
import torch

from rlpad.core.forward import compute_log_probs
from rlpad.embedded.exactness import BF16_BOUNDS, violations
from rlpad.embedded.shapes import VL_TOKEN_IDS
from rlpad.embedded.tiny import tiny_model
from rlpad.embedded.vl_synthetic import vl_rollout_batch

R = 24
GRIDS = [[(1, 8, 8)], [], [(1, 4, 8), (1, 4, 4)]]  # 3 prompts x 3 responses: 0, 1 and 2 images


def oracle(model32, tensors, mm):
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    lp = torch.zeros(ids.shape[0], R, dtype=torch.float64)
    ent = torch.zeros_like(lp)
    with torch.no_grad():
        for b in range(ids.shape[0]):
            seq = ids[b][mask[b].bool()]
            n_resp = int(mask[b, -R:].sum())
            n_prompt = len(seq) - n_resp
            images = {}
            if mm[b]:
                images = dict(pixel_values=mm[b]["pixel_values"], image_grid_thw=mm[b]["image_grid_thw"],
                              mm_token_type_ids=(seq == VL_TOKEN_IDS["image_pad"]).long()[None])
            model32.model.rope_deltas = None
            logp = model32(input_ids=seq[None], use_cache=False, **images).logits[0].double().log_softmax(-1)
            pos = torch.arange(n_prompt - 1, n_prompt - 1 + n_resp)
            lp[b, :n_resp] = logp[pos, seq[pos + 1]]
            ent[b, :n_resp] = -(logp[pos].exp() * logp[pos]).sum(-1)
    return lp, ent


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_vl_bf16_paths_within_bounds(arch, record):
    model = tiny_model(arch, seed=1, dtype=torch.bfloat16, device="cuda")
    model32 = tiny_model(arch, seed=1)
    model32.load_state_dict({k: v.float().cpu() for k, v in model.state_dict().items()})
    tensors, mm = vl_rollout_batch(GRIDS, R, n=3, seed=4)
    ref_lp, ref_ent = oracle(model32, tensors, mm)
    mask = tensors["response_mask"].bool()
    cuda = {k: v.cuda() for k, v in tensors.items()}
    table = {}
    for name, kw in {"rmpad": dict(use_remove_padding=True), "padded": dict(use_remove_padding=False),
                     "shared": dict(use_remove_padding=True, share_prompts=True)}.items():
        with torch.no_grad():
            lp, ent = compute_log_probs(model, cuda["input_ids"], cuda["attention_mask"], cuda["position_ids"], R,
                                        calculate_entropy=True, multi_modal_inputs=mm, **kw)
        dl, de = (lp.double().cpu() - ref_lp).abs()[mask], (ent.double().cpu() - ref_ent).abs()[mask]
        table[name] = {"lp_max": float(dl.max()), "lp_mean": float(dl.mean()), "ent_max": float(de.max()),
                       "ent_mean": float(de.mean())}
    record(arch=arch, errors=table, bounds=BF16_BOUNDS)
    for name, errs in table.items():
        assert not violations(errs), (name, violations(errs))
