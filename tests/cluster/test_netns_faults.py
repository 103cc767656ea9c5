"""Network faults between real nodes, each in a network namespace of its own on a bridge
the test makes inside a user namespace (tests/namespaces.py, netns.py): no privilege is
needed outside, and no address beyond the namespaces is ever reached."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from namespaces import run_tests_in_namespace  # noqa: E402

pytestmark = [pytest.mark.multinode, pytest.mark.slow]


def test_lossy_links_a_partition_under_load_and_a_rate_limited_link():
    """namespaced_partition.py: a cluster forms and serves over links with latency and loss;
    a 2|1 partition under a steady load of chat streams heals to one master and one state; a
    peer copy over a tc-tbf-limited link completes while the other nodes serve on; a prefix
    fetch works over the impaired links."""
    output = run_tests_in_namespace(Path(__file__).parent / "namespaced_partition.py",
                                    net=True, timeout_s=300, args=("-s",))
    assert "4 passed" in output
    print(output[-3000:])
