"""``rlpad bench stream``: streaming rollouts against the lock-step loops on the long-tail task (issue 60, item 7).

One run per mode of recipes/grpo_tiny_stream.yaml (2 engine replicas, separate layout, token_tis) through
the normal launch path (:func:`rlpad.train.fit`), the same steps, batch and seeds in each, no validation and
no checkpoints, so every mode trains the same number of samples (steps x train_batch_size x n):

- ``sync``: the synchronous loop (``trainer.max_off_policy_steps=0``);
- ``k1``: one step off-policy (``max_off_policy_steps=1``);
- ``stream``: ``async_training.enable=true``, partial rollouts;
- ``stream_regen``: the same with ``partial_rollout=false`` (responses in flight at a load regenerated).

Per mode, over the steps after the first ``skip``: trained samples per second (samples / the steps' wall
seconds) and its ratio to ``sync``, response tokens per second, the engines' idle share and the trainer's
wait share where the loop measures them (streaming: ``stream/*``; the lock-step loops: the trainer's wait
is its generation, ``timing_s/gen``, or ``timing_s/wait_rollout`` at k = 1, over the step). The ideal:
a lock-step batch lasts as long as its longest response, so its engines do the work of the mean length in
the time of the longest; streaming removes that, at most (longest / mean) = 1 / (1 - lockstep idle share)
faster in generation (rlpad.embedded.toy_tail's length distribution). That ideal counts engine slots, as on
a GPU, where a decode step costs about the same with 8 or 64 sequences; on a CPU a step's cost grows with
its sequences, so an idle slot costs nothing and the bound that matters is the cores: each mode's CPU
core-seconds per trained sample (its process tree, :mod:`rlpad.bench.cpu_meter`) and ``cores x wall / CPU``,
the most any overlap of the sync loop's work could give. The load average is reported: on a shared
machine the figures mean little.

``dry_run``: the configs of the four modes loaded and checked (the refusals included), and the summary and
table computed from :func:`dry_history` records (no Ray, no engines; the code path only).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

from rlpad.bench.stream_timeline import complement, draw, stream_lanes, sync_lanes
from rlpad.bench.table import Table, write_json

__all__ = ["MODES", "cpu_figures", "draw_timeline", "dry_cpu", "dry_history", "dry_timeline", "ideal", "run_stream_bench",
           "summarize", "tables"]

RECIPE = "recipes/grpo_tiny_stream.yaml"
COMMON = ("data.val_files=[]", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
          "trainer.resume_mode=disable", "trainer.logger=[jsonl]")
MODES: dict[str, tuple[str, ...]] = {
    "sync": ("trainer.max_off_policy_steps=0",),
    "k1": ("trainer.max_off_policy_steps=1",),
    "stream": ("async_training.enable=true", "async_training.partial_rollout=true"),
    "stream_regen": ("async_training.enable=true", "async_training.partial_rollout=false"),
}


def ideal() -> dict[str, float]:
    """toy_tail's lock-step engine idle share and the generation speed-up streaming could give at most."""
    from rlpad.embedded.toy_tail import lockstep_idle_share

    idle = lockstep_idle_share()
    return {"lockstep_idle_share": idle, "ideal_gen_speedup": 1.0 / (1.0 - idle)}


def _mean(values: Sequence[float]) -> float | None:
    return float(statistics.fmean(values)) if values else None


def summarize(history: Sequence[dict[str, Any]], samples_per_step: int, skip: int) -> dict[str, Any]:
    """Samples and response tokens per second over the steps after ``skip``; the idle and wait shares."""
    steps = [r for r in history if "timing_s/step_wall" in r][skip:]
    if not steps:
        raise ValueError(f"{len(history)} steps recorded; need more than the {skip} skipped at the start")
    wall = sum(r["timing_s/step_wall"] for r in steps)
    tokens = sum(r["response_length/mean"] * samples_per_step for r in steps)
    if "stream/trainer_wait_share" in steps[0]:
        wait = _mean([r["stream/trainer_wait_share"] for r in steps])
        idle = _mean([r["stream/engine_idle_share"] for r in steps])
    else:  # lock-step: the trainer waits for the whole generation (k = 0) or for what is left of it (k = 1)
        key = "timing_s/wait_rollout" if "timing_s/wait_rollout" in steps[0] else "timing_s/gen"
        wait, idle = _mean([r.get(key, 0.0) / r["timing_s/step_wall"] for r in steps]), None
    return {"steps": len(steps), "wall_s": wall, "samples_per_s": samples_per_step * len(steps) / wall,
            "tokens_per_s": tokens / wall, "trainer_wait_share": wait, "engine_idle_share": idle}


def dry_history(mode: str, steps: int) -> list[dict[str, Any]]:
    """Records shaped as the trainer writes them (the dry run's input; numbers with no timing meaning)."""
    record: dict[str, Any] = {"timing_s/step_wall": 2.0, "response_length/mean": 8.5, "timing_s/gen": 1.0}
    if mode == "k1":
        record = record | {"timing_s/wait_rollout": 0.5}
    if mode.startswith("stream"):
        record = {"timing_s/step_wall": 1.0, "response_length/mean": 8.5, "stream/trainer_wait_share": 0.25,
                  "stream/engine_idle_share": 0.1}
    return [{"step": s + 1, **record} for s in range(steps)]


def dry_cpu(steps: int) -> tuple[int, float, float]:
    """A :class:`~rlpad.bench.cpu_meter.StepCPU` window shaped as a real one (the dry run's input)."""
    return steps, 1.0 * steps, 1.5 * steps


def cpu_figures(window: tuple[int, float, float], samples_per_step: int) -> dict[str, float]:
    """The run's CPU core-seconds per trained sample, its cores' busy share, and the most any overlap of the same
    work could speed it up on this machine: ``cores x wall / cpu`` (1.0: every core already busy)."""
    from rlpad.bench.cpu_meter import usable_cores

    steps, wall, cpu = window
    cores = usable_cores()
    return {"cpu_s_per_sample": cpu / (steps * samples_per_step), "cpu_busy_share": cpu / (cores * wall),
            "overlap_bound": cores * wall / cpu, "cores": cores}


def run_stream_bench(steps: int = 8, skip: int = 2, modes: Sequence[str] = tuple(MODES), overrides: Sequence[str] = (),
                     out: str | None = None, dry_run: bool = False) -> dict[str, Any]:
    """One run per mode (``sync`` first: the reference); writes JSON to ``out`` (:func:`tables` formats it)."""
    from rlpad.recipe.load import load_config

    modes = list(modes)
    if not modes or modes[0] != "sync" or any(m not in MODES for m in modes):
        raise ValueError(f"modes {modes}: give sync first (the reference), then any of {', '.join(MODES)}")
    if steps <= skip:
        raise ValueError(f"steps={steps}: need more than the {skip} steps skipped at the start")
    results: dict[str, Any] = {}
    histories: dict[str, list[dict[str, Any]]] = {}
    timeline: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="rlpad-bench-stream-") as tmp:
        configs = {m: load_config(RECIPE, [*COMMON, *MODES[m], *overrides, f"trainer.total_training_steps={steps}",
                                           f"trainer.default_local_dir={os.path.join(tmp, m)}"])
                   for m in modes}  # every mode's config checked before any compute
        for m, config in configs.items():
            samples = config.data.train_batch_size * config.actor_rollout_ref.rollout.n
            if dry_run:
                history, cpu = dry_history(m, steps), dry_cpu(steps - skip)
            else:
                from rlpad.bench.cpu_meter import StepCPU
                from rlpad.train import fit

                with StepCPU(os.path.join(config.trainer.default_local_dir, "metrics.jsonl")) as meter:
                    history = fit(config)
                cpu = meter.window(skip)
                if m == "stream":
                    with open(os.path.join(config.trainer.default_local_dir, "stream_timeline.json")) as f:
                        timeline = json.load(f)
            histories[m] = history
            results[m] = summarize(history, samples, skip) | cpu_figures(cpu, samples)
    if dry_run and "stream" in modes:
        timeline = dry_timeline(steps)
    for m in modes:
        results[m]["vs_sync"] = results[m]["samples_per_s"] / results["sync"]["samples_per_s"]
    result = {"recipe": RECIPE, "steps": steps, "skip": skip, "dry_run": dry_run, "overrides": list(overrides),
              "load_avg": list(os.getloadavg()), "ideal": ideal(), "modes": results}
    if out:
        if timeline is not None:
            result["timeline"] = draw_timeline(os.path.splitext(out)[0] + "_timeline.png", histories["sync"], timeline,
                                               configs["sync"].actor_rollout_ref.rollout.num_replicas, skip)
        write_json(result, out)
    return result


def dry_timeline(steps: int) -> dict[str, Any]:
    """A streaming timeline shaped as the trainer writes it (the dry run's input): 1 s steps, engines busy but
    for each load's 0.1 s, the trainer waiting 0.25 s of each step."""
    ends = [float(s + 1) for s in range(steps)]
    loads = [[e - 0.1, e] for e in ends[:-1]]
    engines = [complement(loads, 0.0, ends[-1]) for _ in range(2)]
    return {"engines": engines, "trainer_wait": [[e - 1.0, e - 0.75] for e in ends], "loads": loads, "step_ends": ends}


def draw_timeline(path: str, sync_history: list[dict[str, Any]], timeline: dict[str, Any], engines: int,
                  skip: int) -> str | None:
    """The sync loop's and streaming's lanes after ``skip`` steps, on the shorter run's span (a PNG at ``path``)."""
    sync, sync_span = sync_lanes(sync_history, engines, skip)
    stream, stream_span, loads = stream_lanes(timeline, skip)
    return draw(path, [("sync: each step's generation (every engine), then the trainer", sync, sync_span, []),
                       ("streaming, partial rollouts", stream, stream_span, loads)], min(sync_span, stream_span))


def tables(result: dict[str, Any]) -> list[Table]:
    """One row per mode: samples/s and its ratio to sync (and to k1), tokens/s, idle and wait shares."""
    modes = result["modes"]

    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    rows = [[m, f"{r['samples_per_s']:.2f}", f"{r['vs_sync']:.2f}x",
             f"{r['samples_per_s'] / modes['k1']['samples_per_s']:.2f}x" if "k1" in modes else "-",
             f"{r['tokens_per_s']:.1f}", share(r["engine_idle_share"]), share(r["trainer_wait_share"]),
             f"{1000 * r['cpu_s_per_sample']:.1f}", share(r["cpu_busy_share"]), f"{r['overlap_bound']:.2f}x"]
            for m, r in modes.items()]
    i, load = result["ideal"], result["load_avg"]
    notes = [f"ideal: a lock-step batch leaves {i['lockstep_idle_share']:.0%} of engine slot-steps idle on toy_tail; "
             f"streaming generates at most {i['ideal_gen_speedup']:.2f}x faster",
             f"CPU: core-ms per trained sample of the run's processes (driver and descendants), the busy share of "
             f"its {modes['sync']['cores']} cores, and the most any overlap of the same work could give "
             f"(cores x wall / CPU s)",
             f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
             + (" (dry run: no timing meaning)" if result["dry_run"] else "")]
    title = f"{result['recipe']}: {result['steps']} steps per mode, the first {result['skip']} not counted"
    return [Table(["mode", "samples/s", "vs sync", "vs k1", "tokens/s", "engine idle", "trainer wait", "CPU ms/sample",
                   "CPU busy", "overlap bound"], rows,
                  title=title, notes=notes)]
