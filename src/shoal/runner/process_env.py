"""The environment of runner processes: OpenMP waits that leave idle cores to neighbours.

After each parallel op, libgomp's worker threads spin (300,000 rounds by default) before
they sleep. A runner alone on a machine loses nothing to that. Runners that share cores and
take turns (the ranks of a pipeline instance on one machine, two models on one node) do:
the idle runner's spinning workers hold cores the computing one needs. A 2-rank SmolLM2
pipeline on this 2-core machine decoded at 32.6 ms per token with the default spin (one
runner alone: 13.3 ms) and at 14.5 ms with 10,000 rounds; one runner alone decodes as fast
with either (A/B runs within noise). A value the user set is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RUNNER_ENV_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}


def runner_environment(extra: Mapping[str, str] = ()) -> dict[str, str]:
    """os.environ with the defaults above where unset, then `extra` on top."""
    env = dict(os.environ)
    for name, value in RUNNER_ENV_DEFAULTS.items():
        env.setdefault(name, value)
    env.update(extra)
    return env
