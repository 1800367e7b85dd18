"""Ray's share of :class:`rlpad.run_log.RunLog`: the driver's ``ray`` logger and the workers' output.

Ray forwards what every worker prints (``log_to_driver``) to the driver, where one handler prints
it with a ``(ActorWorker pid=...)`` prefix. :func:`route_worker_output` puts a handler in its place
that writes every line to run.log and passes to Ray's printer only the lines at or above the
console level (tracebacks whole), so a worker's error still reaches the console. It uses Ray's
log dispatcher (``ray._private.ray_logging.global_worker_stdstream_dispatcher``, Ray 2.x); when
that is missing, Ray prints as usual and nothing is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rlpad.run_log import RunLog

__all__ = ["quiet_ray_logger", "route_worker_output"]

RAY_HANDLER = "ray_print_logs"  # the name Ray registers its printing handler under
OUR_HANDLER = "rlpad_run_log"


def quiet_ray_logger(run_log: RunLog) -> None:
    """The driver's ``ray`` logger (its own handler, no propagation): to run.log, console at the level.
    Call before ``ray.init`` (it logs the start-up lines)."""
    run_log.attach(logging.getLogger("ray"))


def _source(data: dict[str, Any]) -> str:
    name = data.get("actor_name") or data.get("task_name") or ""
    ip = data.get("ip")
    where = f", ip={ip}" if ip and ip != data.get("localhost") else ""
    return f"{name} pid={data.get('pid')}{where}".strip()


def route_worker_output(run_log: RunLog) -> Callable[[], None] | None:
    """Send the workers' lines through ``run_log`` (call after ``ray.init``); returns the undo (None:
    Ray's dispatcher or printer was not found, Ray prints as before)."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return None
    with dispatcher._lock:
        printers = [h for name, h in dispatcher.handlers if name == RAY_HANDLER]
    if not printers:  # log_to_driver=False, or a Ray that names it differently
        return None
    ray_print = printers[0]

    def handle(data: dict[str, Any]) -> None:
        if data.get("pid") == "autoscaler":  # its status every 5 s: Ray prints only the events in it, so do we
            ray_print(data)
            return
        lines = list(data.get("lines", []))
        shown = run_log.worker_lines(_source(data), lines)
        if data.get("pid") == "raylet":  # Ray's own notices (a worker killed, out of memory): always
            shown = lines
        if shown:
            ray_print({**data, "lines": shown})

    dispatcher.remove_handler(RAY_HANDLER)
    dispatcher.add_handler(OUR_HANDLER, handle)

    def undo() -> None:
        import ray

        dispatcher.remove_handler(OUR_HANDLER)
        if ray.is_initialized():  # after ray.shutdown Ray has dropped its printer; init adds it again
            dispatcher.add_handler(RAY_HANDLER, ray_print)

    return undo
