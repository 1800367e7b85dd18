"""A reward function for tests that stop a run at a chosen point: rlpad's default reward, except that
while the file named by ``$RLPAD_TEST_HOLD_WHILE`` exists it waits (in the driver, where rewards are
scored) until the test interrupts the run. The numbers are the default reward's."""

from __future__ import annotations

import os
import time
from typing import Any

from rlpad.rewards.rules import compute_score

HOLD_WHILE = "RLPAD_TEST_HOLD_WHILE"


def score(**kwargs: Any) -> Any:
    """:func:`rlpad.rewards.rules.compute_score`, held while ``$RLPAD_TEST_HOLD_WHILE`` exists."""
    hold = os.environ.get(HOLD_WHILE)
    while hold and os.path.exists(hold):
        time.sleep(0.05)  # a SIGINT lands here as KeyboardInterrupt, as in any step of a real run
    return compute_score(**kwargs)
