"""The ``reward.code`` section of the schema: how the policy's programs run against their test cases for
verl's code data sources (rlpad.code, docs/code.md). verl's names where it has them
(``memory_limit_mb``, ``max_concurrent``: its sandbox_fusion keys; ``continuous``: prime_code's argument).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CodeConfig", "code_problems"]


@dataclass
class CodeConfig:
    """The sandbox every program runs in (bubblewrap; one process tree per test case) and the score."""

    # true: the score is the share of the first 10 cases passed (verl's default_compute_score passes
    # continuous=True for its code sources); false: 1.0 when every case passes, else 0.0
    continuous: bool = True
    timeout_s: float = 10.0  # wall-clock seconds of one case (verl's per-case alarm); also each process's CPU limit
    memory_limit_mb: int = 1024  # address space of each process in the sandbox (RLIMIT_AS), MiB
    max_processes: int = 16  # processes and threads of one case, the program included (holds for root too)
    max_output_bytes: int = 8 << 20  # stdout (or the return value) of one case; more stops the case: output_limit
    scratch_mb: int = 64  # the case's private writable /tmp (a tmpfs), MiB
    max_concurrent: int | None = None  # cases run at once (sandbox workers); null: the CPUs this process may use
    # consecutive cases the sandbox itself fails (not the program: it never started) before the run stops
    max_sandbox_errors: int = 8


def code_problems(cfg: CodeConfig) -> list[str]:
    """Every problem of ``reward.code``, one line each naming the key."""
    bounds = (("timeout_s", cfg.timeout_s, 0.01), ("memory_limit_mb", cfg.memory_limit_mb, 32),
              ("max_processes", cfg.max_processes, 1), ("max_output_bytes", cfg.max_output_bytes, 1),
              ("scratch_mb", cfg.scratch_mb, 1), ("max_sandbox_errors", cfg.max_sandbox_errors, 1))
    problems = [f"reward.code.{key}={value} must be >= {low}" for key, value, low in bounds if not value >= low]
    if cfg.max_concurrent is not None and not cfg.max_concurrent >= 1:
        problems.append(f"reward.code.max_concurrent={cfg.max_concurrent} must be >= 1 (or null: the CPUs)")
    return problems
