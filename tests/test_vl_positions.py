"""rlpad.core.mrope: the multimodal rotary positions vs a reference written here from the grids, vs
transformers' own get_rope_index per sequence alone, and what the language model needs to keep
packed sequences apart (4 rows, row 0 the text position)."""

import pytest
import torch

from rlpad.core.attention import packed_row_mask
from rlpad.core.layout import position_ids_from_mask
from rlpad.core.mrope import lm_positions, mrope_positions
from rlpad.embedded.shapes import VL_TOKEN_IDS
from rlpad.embedded.tiny import tiny_model
from rlpad.embedded.vl_synthetic import vl_rollout_batch

IMAGE = VL_TOKEN_IDS["image_pad"]
MERGE = 2
# 1 and 2 images, non-square grids (h != w both ways), a text-only prompt; left padding on every row but one
GRIDS = [[(1, 4, 4)], [(1, 4, 6), (1, 2, 2)], [], [(1, 8, 4)], [(1, 2, 6), (1, 6, 2)]]


def reference(ids: list[int], grids: list[tuple[int, int, int]]) -> list[list[int]]:
    """Token by token from the processor's grids: text advances one; an image of (t, h, w) patches is
    (h/2)(w/2) tokens numbered row-major, at start + (0, row, col); text resumes at start + max(h/2, w/2)."""
    t_row, h_row, w_row = [], [], []
    pos, i, image = 0, 0, 0
    while i < len(ids):
        if ids[i] != IMAGE:
            t_row.append(pos), h_row.append(pos), w_row.append(pos)
            pos, i = pos + 1, i + 1
            continue
        _, h, w = grids[image]
        for r in range(h // MERGE):
            for c in range(w // MERGE):
                t_row.append(pos), h_row.append(pos + r), w_row.append(pos + c)
        i += (h // MERGE) * (w // MERGE)
        pos += max(h // MERGE, w // MERGE)
        image += 1
    assert image == len(grids)
    return [t_row, h_row, w_row]


@pytest.fixture(scope="module")
def batch():
    tensors, mm = vl_rollout_batch(GRIDS, 5, n=1, seed=2, extra_left_pad=2)
    return tensors, mm


def test_positions_equal_reference_and_transformers_alone(batch):
    tensors, mm = batch
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    grids = [m.get("image_grid_thw") for m in mm]
    got = mrope_positions(ids, mask, grids, image_token_id=IMAGE, merge=MERGE)
    assert (mask[:, 0] == 0).all()  # every row left-padded: the positions must not see it
    model = tiny_model("qwen2_5_vl")
    text_rule = position_ids_from_mask(mask)
    for b in range(ids.shape[0]):
        valid = mask[b].bool()
        seq = ids[b][valid]
        ref = torch.tensor(reference(seq.tolist(), [tuple(g) for g in (grids[b].tolist() if grids[b] is not None else [])]))
        assert torch.equal(got[:, b, valid], ref), b
        assert (got[:, b, ~valid] == 0).all()
        # transformers' own rule on the sequence alone (no padding at all)
        hf, _ = model.model.get_rope_index(seq[None], mm_token_type_ids=(seq == IMAGE).long()[None],
                                           image_grid_thw=grids[b] if grids[b] is not None else None)
        if grids[b] is not None:
            assert torch.equal(hf[:, 0], ref), b
        # the response continues from the prompt's largest position + 1, not from the padded length
        prompt_cols = ids.shape[1] - 5
        n_prompt = int(mask[b, :prompt_cols].sum())
        assert int(got[0, b, prompt_cols]) == int(ref[:, :n_prompt].max()) + 1
        # negative control: the text rule equals mrope on a text-only row only
        assert torch.equal(text_rule[b][valid].expand(3, -1), ref) == (grids[b] is None), b


def test_grids_and_image_tokens_must_agree(batch):
    tensors, mm = batch
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    grids = [m.get("image_grid_thw") for m in mm]
    with pytest.raises(ValueError, match="row 1: more image-pad tokens than its 1 image"):
        mrope_positions(ids, mask, [grids[0], grids[1][:1], *grids[2:]], image_token_id=IMAGE, merge=MERGE)
    with pytest.raises(ValueError, match="row 2: 1 image"):
        mrope_positions(ids, mask, [*grids[:2], torch.tensor([[1, 2, 2]]), *grids[3:]], image_token_id=IMAGE, merge=MERGE)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_language_model_needs_text_row_without_bounds(arch):
    """The fact behind the 4-row choice: rlpad_varlen given cu_seqlens keeps packed sequences apart
    with 3 rows or 4; without bounds (transformers' own packed detection) only row 0's restarts do."""
    lm = tiny_model(arch).model.language_model
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 80, (n,), generator=gen) for n in (9, 7)]
    with torch.no_grad():
        alone = torch.cat([lm(input_ids=s[None], position_ids=torch.arange(len(s)).expand(3, 1, -1),
                              use_cache=False).last_hidden_state[0] for s in seqs])
        ids = torch.cat(seqs)[None]
        text = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        rows3 = text.expand(3, 1, -1)
        four = lm(input_ids=ids, position_ids=lm_positions(text, rows3), attention_mask=packed_row_mask("cpu"),
                  use_cache=False).last_hidden_state[0]
        three = lm(input_ids=ids, position_ids=rows3, attention_mask=packed_row_mask("cpu"),
                   use_cache=False).last_hidden_state[0]
    torch.testing.assert_close(four, alone, atol=1e-5, rtol=0)
    assert (three - alone)[9:].abs().max() > 0.1  # the second sequence attends to the first
