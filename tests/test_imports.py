"""The house's import rules hold: pyproject.toml's [tool.importlinter] contracts (imports
flow one way from the command line down to the ground floor; the engine imports no asyncio,
HTTP or zenoh; exactly one module imports zenoh), checked by import-linter over src/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(no_cache=True, no_logo=True))")


def test_import_contracts_hold():
    result = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout, result.stdout[-6000:]
