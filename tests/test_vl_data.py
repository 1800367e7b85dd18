"""Vision-language prompts in verl's format (rlpad/multimodal/, rlpad/data.py): image cells, the processor's
image-pad expansion checked against the vision tower, mixed batches, and every bad input refused in one
line before any compute (issue 53). Fast: tiny images, no engine, no Ray."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from rlpad.core.models import VISION_LOGIT_BIAS, load_causal_lm, load_tokenizer
from rlpad.data import PromptDataset, write_rows
from rlpad.embedded.vl_processor import save_vl_folder
from rlpad.embedded.tiny import build_tokenizer
from rlpad.embedded.tiny_vl import tiny_vl_model
from rlpad.embedded.vl_shapes import shapes_score, split_problems
from rlpad.multimodal.processor import load_vl_processor
from rlpad.multimodal.prompts import PromptImages
from rlpad.recipe.load import load_config
from rlpad.train import prepare

VL, TEXT = "tiny:qwen2_5_vl", "tiny:qwen2"
PAD, START, END = 82, 80, 81  # the tiny VL models' image-pad / vision start / end ids (rlpad.embedded.shapes)


def png(w: int, h: int, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def row(text: str, images=None, **extra) -> dict:
    out = {"prompt": [{"role": "user", "content": text}], "reward_model": {"ground_truth": "1"}, "data_source": "x",
           **extra}
    if images is not None:
        out["images"] = images
    return out


def dataset(tmp_path, rows, model=VL, name="d", limit=None, **kwargs) -> PromptDataset:
    """The rows, each in a parquet file of its own (a parquet column holds one type: bytes, paths or
    mappings), read as one dataset: row i is ``<name>-<i>.parquet: row 0``."""
    paths = [str(tmp_path / f"{name}-{i}.parquet") for i in range(len(rows))]
    for r, path in zip(rows, paths):
        write_rows([r], path)
    tok = load_tokenizer(model)
    images = PromptImages(load_vl_processor(model, tok), image_key="images", video_key="videos", limit_images=limit,
                          model_path=model)
    return PromptDataset(paths, tok, max_prompt_length=kwargs.pop("max_prompt_length", 40), images=images, **kwargs)


# Qwen's resize rule worked by hand for the tiny bounds (min 28*28, max 56*56 pixels; sides multiples of
# 28, each at least 28): (width, height) -> grid (t, h, w) in 14-px patches; image tokens = t*h*w / 2^2.
# 84x56 is over the max: scaled by sqrt(84*56/3136), floored -> 56x28. 20x20 is under the min: scaled up,
# ceiled -> 28x28. 200x30: scaled down the short side floors to 0, clamped to 28; the long side floors
# to 140 -> 140x28 (over the max: the clamp wins, as in transformers).
EXPECTED_GRIDS = {(56, 56): (1, 4, 4), (84, 56): (1, 2, 4), (28, 56): (1, 4, 2), (20, 20): (1, 2, 2),
                  (200, 30): (1, 2, 10)}


def test_expansion_matches_the_grid_and_the_vision_tower(tmp_path):
    """Each image's pad run is t*h*w/merge^2 tokens (grids worked out by hand, not read from the library), and
    the vision tower fills exactly those slots: its features for the row's pixels number the pad tokens."""
    sizes = list(EXPECTED_GRIDS)
    rows = [row(f"a<image>b{'<image>' if i % 2 else ''}?", [png(*sizes[i]), *([png(*sizes[-1 - i])] if i % 2 else [])])
            for i in range(len(sizes))]
    ds = dataset(tmp_path, rows)
    batch = ds.collate(list(range(len(rows))))
    model = load_causal_lm(VL)
    for i, mm in enumerate(batch["multi_modal_inputs"]):
        want = [EXPECTED_GRIDS[sizes[i]], *([EXPECTED_GRIDS[sizes[-1 - i]]] if i % 2 else [])]
        assert mm["image_grid_thw"].tolist() == [list(g) for g in want]
        assert mm["pixel_values"].shape == (sum(t * h * w for t, h, w in want), 3 * 2 * 14 * 14)
        ids = ds.token_ids[i]
        runs = "".join("p" if t == PAD else "s" if t == START else "e" if t == END else "." for t in ids)
        assert runs.count("s") == runs.count("e") == len(want)
        assert [len(r) for r in runs.replace("e", "s").split("s")[1::2]] == [t * h * w // 4 for t, h, w in want]
        with torch.no_grad():
            features = model.model.get_image_features(mm["pixel_values"], mm["image_grid_thw"])
        features = torch.cat(list(getattr(features, "pooler_output", features)))
        assert features.shape[0] == ids.count(PAD)  # what the model scatters into the pad slots
        # Negative control: a run of one pad per patch (no merge) would not match the tower's output.
        assert features.shape[0] != int(mm["image_grid_thw"].prod(-1).sum())


def test_image_cells_bytes_path_and_mappings(tmp_path):
    """verl's cells: raw bytes, a path (relative to the data file's folder), {bytes}, {path}; one image bare."""
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png(56, 56))
    rows = [row("<image>1", [png(56, 56)]), row("<image>2", ["imgs/a.png"]),
            row("<image>3", [{"bytes": png(56, 56), "path": None}]), row("<image>4", [{"path": str(tmp_path / "imgs/a.png")}]),
            row("<image>5", png(56, 56))]
    ds = dataset(tmp_path, rows)
    batch = ds.collate(list(range(5)))
    pixels = [mm["pixel_values"] for mm in batch["multi_modal_inputs"]]
    assert all(torch.equal(p, pixels[0]) for p in pixels)  # the same red square five ways


def test_mixed_batch_text_rows_and_a_text_model(tmp_path):
    ds = dataset(tmp_path, [row("<image>x", [png(56, 56)]), row("plain"), row("<image><image>y", [png(56, 56)] * 2)])
    batch = ds.collate([0, 1, 2])
    mm = batch["multi_modal_inputs"]
    assert mm[1] == {} and [m["image_grid_thw"].shape[0] for m in (mm[0], mm[2])] == [1, 2]
    assert batch["input_ids"].shape == (3, 40) and int((batch["input_ids"][1] == PAD).sum()) == 0
    text = dataset(tmp_path, [row("plain")], model=TEXT, name="t")  # a text model: no image key at all
    assert "multi_modal_inputs" not in text.collate([0])


@pytest.mark.parametrize("rows, match", [
    ([row("<image><image>two?", [png(56, 56)])], r"d-0.parquet: row 0: 2 <image> placeholder\(s\) in the prompt but 1 image\(s\)"),
    ([row("none?", [png(56, 56)])], r"row 0: 0 <image> placeholder\(s\) in the prompt but 1 image"),
    ([row("ok"), row("<image>bad", [b"not an image"])], r"d-1.parquet: row 0: column 'images' image 0: unreadable image"),
    ([row("<image>gone", ["nowhere.png"])], r"row 0: column 'images' image 0: image file not found: '.*nowhere.png'"),
    ([row("<image>odd", [{"size": 3}])], r"an image mapping needs 'bytes' or 'path'"),
    ([row("<image>num", [7])], r"an image must be bytes, a path or a \{'bytes'\|'path'\} mapping, got int"),
    ([row("<image><image><image>many", [png(56, 56)] * 3)], r"3 images, more than actor_rollout_ref.rollout.limit_images=2"),
    ([row("<video>v", videos=["clip.mp4"])], r"column 'videos' \(data.video_key\) holds a video; rlpad does not build"),
    ([row("typed <|image_pad|> pad")], r"the prompt holds an image-pad token but the row gives no image"),
])
def test_bad_rows_are_one_line(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match) as e:
        dataset(tmp_path, rows, limit=2)
    assert "\n" not in str(e.value) and ".parquet: row 0: " in str(e.value)


def test_images_on_a_text_model_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"row 0: the row has images but model 'tiny:qwen2' is text-only"):
        dataset(tmp_path, [row("<image>x", [png(56, 56)])], model=TEXT)


def test_truncation_never_cuts_an_image(tmp_path):
    """A prompt too long for max_prompt_length: refused (truncation=error), dropped and counted (left/right
    would cut an image run), or cut where only text goes; never cut inside an image's tokens."""
    long_text = "q" * 8
    rows = [row(f"<image>{long_text}", [png(56, 56)]), row(f"{long_text}<image>", [png(56, 56)]), row("<image>k", [png(56, 56)])]
    with pytest.raises(ValueError, match=r"row 0: the prompt is 14 tokens .* longer than data.max_prompt_length=10"):
        dataset(tmp_path, rows, max_prompt_length=10)
    left = dataset(tmp_path, rows, max_prompt_length=10, truncation="left")
    assert left.num_cut_images == 1 and len(left) == 2  # row 0's start (the image) would go; row 1 cut in text
    assert left.token_ids[0][-6:] == [START, PAD, PAD, PAD, PAD, END] and len(left.token_ids[0]) == 10
    right = dataset(tmp_path, rows, max_prompt_length=10, truncation="right")
    assert right.num_cut_images == 1 and right.token_ids[0][:6] == [START, PAD, PAD, PAD, PAD, END]
    for ds in (left, right):
        for ids, mm in zip(ds.token_ids, ds.collate(list(range(len(ds))))["multi_modal_inputs"]):
            assert ids.count(PAD) == int(mm["image_grid_thw"].prod(-1).sum()) // 4


def test_vl_model_folder_loads_in_transformers_and_rlpad(tmp_path):
    """The saved tiny VL folder: transformers loads the model, tokenizer and image processor from it; rlpad's
    processor loads it with the vision ids checked against the model's config; the logits mask comes with it."""
    from transformers import AutoConfig, AutoTokenizer

    folder = save_vl_folder(tiny_vl_model("qwen2_vl"), build_tokenizer(vision=True), tmp_path / "m")
    assert AutoConfig.from_pretrained(folder).model_type == "qwen2_vl"
    tok = AutoTokenizer.from_pretrained(folder)
    processor = load_vl_processor(folder, tok, {"max_pixels": 28 * 28})
    ids, mm = processor.encode([{"role": "user", "content": "<image>?"}], [Image.new("RGB", (56, 56))])
    assert mm["image_grid_thw"].tolist() == [[1, 2, 2]] and ids.count(PAD) == 1  # max_pixels took effect
    model = load_causal_lm(folder)
    assert model.lm_head.bias.tolist() == [VISION_LOGIT_BIAS if i in range(80, 84) else 0.0 for i in range(128)]
    assert "lm_head.bias" not in model.state_dict()  # never saved, never synced
    with pytest.raises(ValueError, match=r"data.mm_processor_kwargs: unknown key\(s\) \['fps'\]"):
        load_vl_processor(folder, tok, {"fps": 2})


def test_vision_tokens_are_never_sampled():
    """The masked head: even a model pushed to emit image-pad tokens samples none; the control without the
    mask samples them."""
    model = load_causal_lm(VL)
    with torch.no_grad():
        model.model.language_model.norm.weight.zero_()  # logits = the head's bias alone
    ids = torch.tensor([[10, 11, 12]])

    def sample() -> list[int]:
        torch.manual_seed(0)
        with torch.no_grad():
            head_bias_pad = model.lm_head.bias.clone()
            model.lm_head.bias.copy_(head_bias_pad + torch.nn.functional.one_hot(torch.tensor(PAD), 128) * 50)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=32,
                                 pad_token_id=0, eos_token_id=1)
            model.lm_head.bias.copy_(head_bias_pad)
        return out[0, 3:].tolist()

    assert not set(sample()) & set(range(80, 84))
    model.lm_head.bias.zero_()  # control: no mask -> the +50 on image-pad wins
    assert PAD in sample()


def test_vl_recipe_checks_before_any_compute(tmp_path, monkeypatch):
    def check(*overrides):
        with pytest.raises(ValueError) as e:
            prepare(load_config(None, [f"trainer.default_local_dir={tmp_path}", "data.train_files=[x.jsonl]", *overrides]))
        return str(e.value)

    write_rows([row("hi")], tmp_path / "x.jsonl")
    monkeypatch.chdir(tmp_path)  # data.train_files=[x.jsonl]
    assert check(f"actor_rollout_ref.model.path={TEXT}", "actor_rollout_ref.rollout.limit_images=2") == (
        "actor_rollout_ref.rollout.limit_images is set but model 'tiny:qwen2' is text-only (a vision-language key)")
    assert "data.return_multi_modal_inputs=false" in check(f"actor_rollout_ref.model.path={VL}", "actor_rollout_ref.rollout.name=hf",
                                                           "data.return_multi_modal_inputs=false")
    message = check(f"actor_rollout_ref.model.path={VL}", "actor_rollout_ref.rollout.name=vllm")
    assert message.startswith("actor_rollout_ref.rollout.name=vllm: ") and "rollout.name=hf" in message and "\n" not in message


def test_task_is_deterministic_and_scored_exactly():
    train, val = split_problems(20, seed=0, n_train=50)
    again_train, again_val = split_problems(20, seed=0, n_train=50)
    assert train == again_train and val == again_val and not {p.seed for p in train} & {p.seed for p in val}
    assert {p.kind for p in train + val} == {"colour", "red", "count", "count2", "sum"}
    assert shapes_score("3", "3") == 1.0 and shapes_score("3 ", "3") == 0.0 and shapes_score("2", "3") == 0.0
