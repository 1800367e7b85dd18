"""The Ray side of rlpad: FSDP2 actor/reference and critic workers, worker groups, the rollout worker.

``workers.actor``, ``workers.critic`` and ``workers.fsdp`` run without Ray (one process, world 1);
``workers.group`` starts them as Ray actors in one torch.distributed group.
"""

import os as _os
import sys as _sys

# Ray 2.60 turns 127.0.0.1 into the machine's external address (and its gRPC servers then
# listen on every interface) unless it runs as a single-node cluster, a switch it reads once,
# when ray is first imported. A local run (no RAY_ADDRESS) is single-node: keep it on the
# loopback. Ray worker processes have ray imported already and are left alone.
if "ray" not in _sys.modules and not _os.environ.get("RAY_ADDRESS"):
    _os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
