"""``rlpad bench e2e`` arithmetic: trainer overhead, medians after the warm-up step, phase ratios."""

import pytest
import torch

from rlpad.batch import WORKER_SECONDS, Batch
from rlpad.bench.e2e import FlopRecorder, overhead, phase_table, summarize_mode
from rlpad.embedded.tiny import tiny_config
from rlpad.training.stage_clock import pop_worker_seconds


def record(scale: float = 1.0) -> dict[str, float]:
    """A step: driver phases sum to 9.5 s of a 10 s wall; the workers measured 8 s of their own."""
    r = {"timing_s/gen": 4.0, "timing_s/reward": 0.2, "timing_s/old_log_prob": 1.5, "timing_s/adv": 0.3,
         "timing_s/update_actor": 3.0, "timing_s/sync": 0.5, "timing_s/step_wall": 10.0,
         "worker_s/gen": 3.5, "worker_s/old_log_prob": 1.0, "worker_s/update_actor": 3.2, "worker_s/sync": 0.3,
         "padding_ratio": 0.6}
    return {k: v * scale if k != "padding_ratio" else v for k, v in r.items()}


def test_overhead_is_wall_minus_worker_seconds_with_its_parts():
    o = overhead(record())
    assert o["overhead_s"] == pytest.approx(10.0 - (3.5 + 1.0 + 3.2 + 0.3))
    assert o["overhead_pct"] == pytest.approx(20.0)
    assert o["transfer/gen"] == pytest.approx(0.5) and o["transfer/old_log_prob"] == pytest.approx(0.5)
    assert o["transfer/update_actor"] == pytest.approx(-0.2)  # a worker clock may exceed the driver's span
    assert o["driver/reward"] == pytest.approx(0.2) and o["driver/adv"] == pytest.approx(0.3)
    assert o["untimed"] == pytest.approx(0.5)
    parts = sum(v for k, v in o.items() if k.startswith(("transfer/", "driver/")) or k == "untimed")
    assert parts == pytest.approx(o["overhead_s"])  # the parts add up to the overhead
    with pytest.raises(ValueError, match="worker_s"):
        overhead({"timing_s/step_wall": 1.0, "timing_s/gen": 1.0})
    with pytest.raises(ValueError, match="step_wall"):
        overhead({**record(), "timing_s/step_wall": 0.0})


def test_summary_skips_the_warm_up_step_and_takes_medians():
    history = [{"step": 0, "val/reward": 0.5}, record(100.0), record(1.0), record(2.0), record(3.0)]
    flops = [(99.0, 1.0), (3.0, 1.0), (2.0, 1.0), (4.0, 2.0)]
    s = summarize_mode(history, flops)
    assert s["steps"] == 3 and s["step_s"] == pytest.approx(20.0) and s["gen_s"] == pytest.approx(8.0)
    assert s["update_actor_worker_s"] == pytest.approx(6.4)
    assert s["overhead_pct"] == pytest.approx(20.0) and s["padding_ratio"] == pytest.approx(0.6)
    assert s["flop_ideal"] == pytest.approx(2.0)  # median of 3, 2, 2; the warm-up's 99 is skipped
    with pytest.raises(ValueError, match="warm-up"):
        summarize_mode(history[:2], flops)


def test_phase_table_ratio_is_padded_over_rmpad():
    rm = summarize_mode([record(), record(), record()], [(3.0, 2.0)] * 3)
    pad = summarize_mode([record(), record(2.0), record(2.0)], [(3.0, 2.0)] * 3)
    rows = {r["phase"]: r for r in phase_table(rm, pad)}
    assert rows["gen"]["ratio"] == pytest.approx(2.0) and rows["step"]["ratio"] == pytest.approx(2.0)
    assert rows["old_log_prob"]["ideal"] == pytest.approx(1.5) and rows["gen"]["ideal"] is None
    assert "ref" not in rows  # a phase that did not run is not reported


def test_trainer_takes_worker_seconds_out_of_results():
    seconds: dict[str, float] = {}
    batch = Batch({"x": torch.zeros(2)}, meta={WORKER_SECONDS: 1.25, "temperature": 1.0})
    pop_worker_seconds(batch, seconds, "old_log_prob")
    metrics = {"actor/pg_loss": 0.1, WORKER_SECONDS: 2.0}
    pop_worker_seconds(metrics, seconds, "update_actor")
    pop_worker_seconds({"actor/pg_loss": 0.1}, seconds, "ref")  # a worker that reports nothing
    assert seconds == {"old_log_prob": 1.25, "update_actor": 2.0}
    assert batch.meta == {"temperature": 1.0} and metrics == {"actor/pg_loss": 0.1}


class _Workers:
    def compute_log_prob(self, batch):
        return "called"

    def sync_weights(self):
        return 0.5


def test_flop_recorder_passes_calls_through_and_counts_padding():
    config = tiny_config("qwen2")
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    rec = FlopRecorder(_Workers(), config)
    assert rec.compute_log_prob({"attention_mask": mask, "responses": torch.zeros(2, 3)}) == "called"
    assert rec.sync_weights() == 0.5
    (padded, packed), = rec.flops
    assert padded > packed > 0  # 9 of 12 slots valid
    full = FlopRecorder(_Workers(), config)
    full.compute_log_prob({"attention_mask": torch.ones(2, 6, dtype=torch.long), "responses": torch.zeros(2, 3)})
    assert full.flops[0][0] == pytest.approx(full.flops[0][1])  # negative control: no padding, ratio 1
