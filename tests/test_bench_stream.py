"""``rlpad bench stream`` (rlpad/bench/stream.py): its dry run through the CLI (every mode's config loaded and
checked, the summary and table from trainer-shaped records) and its one-line refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from rlpad.bench.cpu_meter import StepCPU, tree_cpu_seconds
from rlpad.bench.stream import dry_history, dry_timeline, summarize, tables
from rlpad.bench.stream_timeline import complement, stream_lanes, sync_lanes
from rlpad.bench.table import format_text
from rlpad.cli import main
from rlpad.embedded.toy_tail import lockstep_idle_share


def test_dry_run(tmp_path, capsys):
    out = tmp_path / "stream.json"
    assert main(["bench", "stream", "--dry-run", "--steps", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    modes = result["modes"]
    assert list(modes) == ["sync", "k1", "stream", "stream_regen"] and result["dry_run"]
    samples = 16 * 8  # the recipe's train_batch_size x n, each step of every mode
    assert modes["sync"]["samples_per_s"] == pytest.approx(samples / 2.0)  # 2 counted steps of 2 s
    assert modes["stream"]["vs_sync"] == pytest.approx(2.0) and modes["sync"]["vs_sync"] == 1.0
    assert modes["sync"]["trainer_wait_share"] == pytest.approx(0.5)  # lock-step: the generation's share
    assert modes["k1"]["trainer_wait_share"] == pytest.approx(0.25)  # k = 1: what was left to wait for
    assert modes["stream"]["engine_idle_share"] == pytest.approx(0.1) and modes["sync"]["engine_idle_share"] is None
    assert modes["sync"]["tokens_per_s"] == pytest.approx(8.5 * samples / 2.0)
    assert result["ideal"]["ideal_gen_speedup"] == pytest.approx(1 / (1 - lockstep_idle_share()))
    text = format_text(tables(result))
    assert "stream_regen" in text and "load average" in text and "4.82x faster" in text
    cores = modes["sync"]["cores"]  # dry_cpu: 1.5 CPU s per 1 s of wall, each counted step
    assert modes["sync"]["cpu_s_per_sample"] == pytest.approx(1.5 / samples)
    assert modes["sync"]["overlap_bound"] == pytest.approx(cores / 1.5) and "overlap bound" in text
    assert result["timeline"] == str(tmp_path / "stream_timeline.png") and (tmp_path / "stream_timeline.png").stat().st_size


def test_timeline_lanes():
    """The trainer's lane is the complement of its waits; the sync loop's lanes come from the stage seconds."""
    assert complement([[1, 2], [3, 4]], 0, 5) == [(0, 1), (2, 3), (4, 5)]
    assert complement([[0, 2]], 1, 3) == [(2, 3)]
    lanes, span, loads = stream_lanes(dry_timeline(4), skip=1)
    assert span == 3.0 and loads[0] == pytest.approx((0.9, 1.0)) and len(loads) == 2
    assert lanes["trainer"][0] == pytest.approx((0.25, 1.0)) and lanes["engine 1"][0] == pytest.approx((0.0, 0.9))
    lanes, span = sync_lanes(dry_history("sync", 3), 2, skip=1)  # 2 s steps, 1 s of generation each
    assert span == 4.0 and lanes["engine 0"] == [(0.0, 1.0), (2.0, 3.0)] and lanes["trainer"][1] == (3.0, 4.0)


def test_step_cpu_counts_the_process_tree_at_each_step_end(tmp_path):
    """Two child processes burn CPU while "steps" end (lines appended to metrics.jsonl): the meter's window sees
    their CPU seconds (not the parent's sleep), and a step it has not seen yet is refused."""
    path = tmp_path / "metrics.jsonl"
    burn = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"
    with StepCPU(str(path), period_s=0.01) as meter:
        path.write_text("{}\n")
        time.sleep(0.2)
        before = tree_cpu_seconds()
        children = [subprocess.Popen([sys.executable, "-c", burn + "print(flush=True)\ntime.sleep(60)"],
                                     stdout=subprocess.PIPE) for _ in range(2)]
        for child in children:  # each burnt its 0.6 CPU s and sleeps, still alive (its time counts as the tree's)
            child.stdout.readline()
        with path.open("a") as f:
            f.write("{}\n{}\n")
        time.sleep(0.3)
        during = tree_cpu_seconds() - before
        for child in children:
            child.kill()
            child.wait()
            child.stdout.close()
    steps, wall, cpu = meter.window(1)
    assert steps == 2 and wall >= 0.3
    assert 1.2 <= cpu <= 1.2 + 0.5 and 1.2 <= during  # 2 x 0.6 s burnt, plus the interpreters' start-up
    with pytest.raises(ValueError, match="none after step 3"):
        meter.window(3)


def test_refusals(capsys):
    assert main(["bench", "stream", "--dry-run", "--modes", "stream", "sync"]) == 2
    assert "give sync first" in capsys.readouterr().err
    with pytest.raises(ValueError, match="need more than the 2 skipped"):
        summarize(dry_history("sync", 2), 128, 2)
    assert main(["bench", "stream", "--dry-run", "--set", "async_training.staleness_threshold=-1"]) == 2
    assert "staleness_threshold=-1" in capsys.readouterr().err
