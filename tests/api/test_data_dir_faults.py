"""A node whose data dir is on a read-only or a full disk warns in /health and goes on
serving; the node runs in a user and mount namespace the test makes (tests/namespaces.py),
on a tmpfs of 512 KiB."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from namespaces import run_tests_in_namespace  # noqa: E402


@pytest.mark.slow  # two nodes with a runner each, and a headless browser
def test_read_only_and_full_data_dirs_warn_and_serving_goes_on():
    output = run_tests_in_namespace(Path(__file__).parent / "namespaced_data_dir.py")
    assert "3 passed" in output
