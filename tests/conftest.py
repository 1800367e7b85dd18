"""Test-session set-up: Ray clusters the tests start stay on the loopback.

Test modules import ray before workers, so the switch workers/__init__.py sets for local runs
is set here, before any test module is imported (tests/ray_cluster.py explains the switch).
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Tests load ``tiny:<arch>`` models through rlpad.core.models directly: register the embedded source
# as an entry point does (rlpad.train, rlpad.rollout.hf and workers/fsdp.py import it).
import rlpad.embedded.tiny  # noqa: E402,F401
