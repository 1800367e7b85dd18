"""Peak Ray object-store bytes of an asynchronous run: ``python -m rlpad.bench.object_store [k] [steps] [overrides]``.

Runs the tiny GRPO recipe (recipes/grpo_tiny.yaml) with ``trainer.max_off_policy_steps=k``; from the first
weight sync on (start-up's objects left out) a thread polls the raylet's store stats
(``object_store_bytes_used``) every 10 ms. Prints the peak, the median and the model's weight bytes (the
size of one exported version). The poll is coarse (one raylet round trip per sample) and counts every
object (batches included), not only the weights. Ray frees released objects in batches (by default
up to 1 s late); here every 10 ms (``free_objects_period_milliseconds``), so the bytes polled are the
objects alive, not the ones released and not yet freed (which the store can evict whenever it needs
room). The measured figures: docs/rollout_correction.md (asynchronous training).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time

from rlpad.recipe.load import load_config
from rlpad.train import fit
from workers.launcher import QUIET_ENV, local_ray, object_store_bytes_used as store_bytes_used

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Poller(threading.Thread):
    """Samples :func:`store_bytes_used` every ``period_s`` until stopped."""

    def __init__(self, period_s: float = 0.01):
        super().__init__(daemon=True)
        self.period_s, self.samples, self.stopped = period_s, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.samples.append(store_bytes_used())
            time.sleep(self.period_s)


def weight_bytes(workers) -> int:
    return sum(t.numel() * t.element_size() for t in workers.actor.call("full_state_dict")[0].values())


def main(argv: list[str]) -> None:
    k = int(argv[0]) if argv else 2
    steps = int(argv[1]) if len(argv) > 1 else 6
    out = tempfile.mkdtemp(prefix="rlpad-store-")
    config = load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), [
        f"trainer.default_local_dir={out}", "trainer.logger=[jsonl]", f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "algorithm.rollout_correction.mode=token_tis",
        f"trainer.max_off_policy_steps={k}", *argv[2:]])
    poller, size = Poller(), {}

    class StartAtFirstSync:
        """The workers, passed through; polling starts at the first weight sync (after start-up and step 1)."""

        def __init__(self, workers):
            self.workers = workers
            size["weights"] = weight_bytes(workers)

        def __getattr__(self, name):
            return getattr(self.workers, name)

        def submit_weight_sync(self, version):
            if not poller.is_alive():
                poller.start()
            return self.workers.submit_weight_sync(version)

    with local_ray(8, runtime_env={"env_vars": QUIET_ENV}, _system_config={"free_objects_period_milliseconds": 10}):
        fit(config, wrap_workers=StartAtFirstSync)
    poller.stopped.set()
    poller.join()
    s = poller.samples
    print(f"k={k} steps={steps}: object store peak {max(s)} B, median {statistics.median(s):.0f} B, "
          f"{len(s)} samples; one version of the weights {size['weights']} B; peak / weights "
          f"{max(s) / size['weights']:.2f}; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
