"""The names of code scoring, torch-free: verl's code data sources, the outcomes a response can have, the
batch keys its outcomes ride under."""

from __future__ import annotations

__all__ = ["CODE_SOURCES", "CONTINUOUS_CASES", "FLAG_KEY_PREFIX", "OUTCOMES", "SCORED_SOURCES", "TOY_CODE_SOURCE"]

# the data sources verl 0.9.1's default_compute_score scores by running code (prime_code / sandbox_fusion)
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
# rlpad's own code task (rlpad.embedded.toy_code): scored the same way
TOY_CODE_SOURCE = "rlpad/toy_code"
SCORED_SOURCES = (*CODE_SOURCES, TOY_CODE_SOURCE)  # every data source scored by running code
# verl's continuous score reads the first 10 cases of a problem ("some problems have enormous test cases")
CONTINUOUS_CASES = 10
# Each response gets exactly one: pass (every case run passed), else no_code (no ```python block) or the
# outcome of its first case that did not pass.
OUTCOMES = ("pass", "wrong", "error", "timeout", "oom", "no_code", "output_limit", "sandbox_error")
# a scored batch's per-response 0/1 outcome flags: reward_flags/code/<outcome> (rlpad.rewards.combine.FLAG_PREFIX
# + the part "code"), logged by the trainer as reward/code/<outcome>, the share of the batch's responses
FLAG_KEY_PREFIX = "reward_flags/code/"
