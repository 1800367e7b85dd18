"""``rlpad bench e2e --max-off-policy-steps``: medians after the skipped steps, the ideal speed-up, the report;
pinning a process's threads to a core."""

import os
import subprocess
import sys

import pytest

from rlpad.bench.e2e_async import curve_tables, ideal_speedup, run_async_e2e, summarize_async, tables
from rlpad.bench.table import format_markdown, format_text


def step(gen: float, wall: float, **extra) -> dict:
    return {"timing_s/step_wall": wall, "timing_s/update_actor": wall - gen, **extra,
            **({"timing_s/gen": gen} if "async/gen_s" not in extra else {})}


def test_summary_skips_the_pipeline_fill_and_reads_the_engine_seconds_when_ahead():
    sync = summarize_async([step(9.0, 99.0), step(9.0, 99.0), step(3.0, 5.0), step(3.0, 5.0), step(4.0, 7.0)])
    assert sync["steps"] == 3 and sync["step_s"] == 5.0 and sync["gen_s"] == 3.0 and sync["update_actor_s"] == 2.0
    ahead = [step(0.0, 9.0, **{"async/gen_s": 3.0, "timing_s/wait_rollout": w, "async/staleness_mean": 1.0,
                               "async/overlap": 1 - w / 3}) for w in (3.0, 3.0, 0.0, 1.0, 0.5)]
    s = summarize_async(ahead)
    assert s["gen_s"] == 3.0 and s["wait_rollout_s"] == 0.5 and s["staleness_mean"] == 1.0
    assert s["overlap"] == pytest.approx(1 - 0.5 / 3)
    with pytest.raises(ValueError, match="need more than the 2"):
        summarize_async(ahead[:2])


def test_ideal_is_the_sum_over_the_longer_part():
    assert ideal_speedup({"gen_s": 3.0, "step_s": 5.0}) == {"gen_s": 3.0, "train_s": 2.0, "ideal": 5.0 / 3.0}
    assert ideal_speedup({"gen_s": 2.0, "step_s": 4.0})["ideal"] == 2.0  # equal halves: at best twice as fast
    with pytest.raises(ValueError, match="train > 0"):
        ideal_speedup({"gen_s": 3.0, "step_s": 3.0})


def test_report_names_the_ratio_and_its_share_of_the_ideal():
    modes = {"0": {"step_s": 5.0, "gen_s": 3.0, "update_actor_s": 2.0},
             "1": {"step_s": 3.5, "gen_s": 3.1, "wait_rollout_s": 0.4, "update_actor_s": 2.0, "staleness_mean": 1.0,
                   "overlap": 0.87, "speedup": 5.0 / 3.5, "of_ideal": (5.0 / 3.5) / (5.0 / 3.0)}}
    result = {"recipe": "r.yaml", "steps": 8, "skip": 2, "load_avg": [1.5, 1, 1],
              "pinned": {"rollout replica 0": [1], "actor rank 0": [0]}, "ideal": ideal_speedup(modes["0"]),
              "modes": modes}
    text = format_text(tables(result))
    assert "k=1: sync / async step time 1.43x = 0.86 of the ideal" in text
    assert "(gen 3.000 s + train 2.000 s) / max = 1.67x" in text
    assert "rollout replica 0 on core 1, actor rank 0 on core 0" in text
    assert "| wait_rollout |  | 0.400 |" in format_markdown(tables(result))
    curves = {"recipe": "r.yaml", "png": "c.png", "runs": {"0": {"val_initial": 0.36, "val_final": 0.667,
                                                                  "train_s": 115.2}}}
    assert "| 0 | 0.360 | 0.667 | 115 |" in format_markdown(curve_tables(curves))


@pytest.mark.parametrize("ks, steps", [([1, 0], 8), ([0, 1, 1], 8), ([0, -1], 8), ([0, 1], 2)])
def test_bad_arguments_fail_before_any_run(ks, steps):
    with pytest.raises(ValueError):
        run_async_e2e("recipes/grpo_tiny_long.yaml", ks, steps=steps)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_pin_process_pins_every_thread():
    from workers.cpu_pin import pin_process

    code = ("import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
            "print(1, flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # both threads exist
        core = max(os.sched_getaffinity(0))
        assert pin_process(child.pid, {core}) == 2
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert [os.sched_getaffinity(int(t)) for t in tids] == [{core}] * 2
    finally:
        child.kill()
        child.wait()
