"""The reward-model worker group on a real local Ray with real FSDP2 over gloo: per-row scores equal the
single-process scoring (rlpad.core.reward_model) by row micro-batches and by token budget, the rows
split over 2 ranks and returned in the caller's order; with shared prompts on a GRPO batch (whole prompt
groups per rank) and with sequence parallelism (2 ranks sharing each packed row, shared prompts too)."""

import pytest
import torch

ray = pytest.importorskip("ray")

from rlpad.batch import Batch  # noqa: E402
from rlpad.config.rewards import RewardModelScoringConfig
from rlpad.core.layout import position_ids_from_mask  # noqa: E402
from rlpad.core.reward_model import compute_scores, load_reward_model  # noqa: E402
from rlpad.embedded.exactness import FP32_LOGPROB_TOL  # noqa: E402
from rlpad.embedded.synthetic import grpo_batch, rollout_batch  # noqa: E402
from rlpad.embedded.tiny import tiny_reward_model  # noqa: E402
from workers.group import WorkerGroup  # noqa: E402
from workers.reward_model import RewardModelWorker  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.exactness]

P, R, VOCAB = 8, 12, 128


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("layout", ["rows", "budget", "shared", "sp2-shared"])
def test_group_scores_equal_the_single_process_scores(ray_session, tmp_path, layout):
    path = tmp_path / "rm"
    tiny_reward_model("llama", seed=7, vocab_size=VOCAB).save_pretrained(path)
    shared = layout.endswith("shared")
    cfg = RewardModelScoringConfig(enable=True, model_path=str(path), micro_batch_size_per_gpu=2,
                                   use_dynamic_bsz=layout != "rows", forward_max_token_len_per_gpu=P + R,
                                   share_prompts=shared, ulysses_sequence_parallel_size=2 if "sp2" in layout else 1)
    group = WorkerGroup(RewardModelWorker, cfg, role="reward_model", world_size=2, device="cpu", share_min_saved=0.0)
    try:
        if shared:  # 4 prompt groups of 3 rows, interleaved; the policy's own rows (with responses)
            rows = grpo_batch(4, 3, P, R, vocab_size=VOCAB, seed=5, shuffle=True)
            rows["position_ids"] = position_ids_from_mask(rows["attention_mask"])
            rows["responses"] = rows["input_ids"][:, P:]
            parts = group.split(Batch({k: rows[k] for k in ("input_ids", "attention_mask", "responses")}))
            groups = rows["group"].tolist()
            assert len(parts) == (1 if "sp2" in layout else 2)  # data-parallel groups
            assert all(3 * len({groups[i] for i in part}) == len(part) for part in parts)  # whole prompt groups each
        else:
            rows = rollout_batch(11, P, R, vocab_size=VOCAB, seed=5)
        keys = ("input_ids", "attention_mask", "position_ids") + (("responses",) if shared else ())
        batch = Batch({k: rows[k] for k in keys})
        out = group.call_batch("compute_rm_scores", batch)["rm_scores"]
        info = group.rank_info()
    finally:
        group.shutdown()
    assert [r["world_size"] for r in info] == [2, 2]
    model = load_reward_model(str(path))
    with torch.no_grad():
        ref = compute_scores(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        # negative control: the rows' scores in another order (a merge that lost the caller's order)
        shuffled = ref[torch.roll(torch.arange(len(ref)), 1)]
    assert out.shape == (len(batch),)
    torch.testing.assert_close(out, ref, atol=FP32_LOGPROB_TOL, rtol=0)
    assert (shuffled - out).abs().max() > 100 * FP32_LOGPROB_TOL
