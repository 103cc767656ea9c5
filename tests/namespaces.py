"""Running tests inside Linux namespaces. A user namespace makes the test root inside it with
no privilege outside (`unshare --user --map-root-user`), so it may mount a tmpfs of a tiny
size, remount it read-only, or, with a network namespace of its own, make veth pairs, cut
links and shape them. Nothing outside the namespaces is touched.

A test that needs them reruns a module of in-namespace tests (named so pytest does not
collect it by itself) through `run_tests_in_namespace`; where user namespaces are not
available that test fails, saying so and how to enable them."""

from __future__ import annotations

import os
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

IN_NAMESPACE = "SHOAL_TEST_IN_NAMESPACE"
REPOSITORY = Path(__file__).resolve().parent.parent


def unshare_command(net: bool = False) -> list[str]:
    return ["unshare", "--user", "--map-root-user", "--mount", *(["--net"] if net else [])]


def require_user_namespaces(net: bool = False) -> None:
    """Fail the test with a clear message when this host cannot make the namespaces."""
    if shutil.which("unshare") is None:
        pytest.fail("this test needs util-linux's `unshare` (apt-get install util-linux)")
    probe = subprocess.run([*unshare_command(net), "true"], capture_output=True, text=True,
                           timeout=30)
    if probe.returncode != 0:
        pytest.fail("this test needs Linux user namespaces (`unshare --user --map-root-user "
                    f"--mount{' --net' if net else ''}` failed: {probe.stderr.strip()}); "
                    "enable them with `sysctl kernel.unprivileged_userns_clone=1` and "
                    "`sysctl user.max_user_namespaces=15000`, or run the tests as root")


def in_namespace() -> bool:
    return os.environ.get(IN_NAMESPACE) == "1"


def run_tests_in_namespace(module: Path, net: bool = False, timeout_s: float = 120.0,
                           args: tuple[str, ...] = ()) -> str:
    """Run the tests of module with pytest inside fresh namespaces; their output, or a
    failure of the calling test with its tail."""
    require_user_namespaces(net)
    command = [*unshare_command(net), sys.executable, "-m", "pytest", "-q", "-x",
               "-p", "no:cacheprovider", "-o", "addopts=", str(module), *args]
    # A session of its own: whatever the tests inside start (nodes, runners, the processes
    # that hold namespaces open) goes with it, even when a timeout cuts their cleanup short.
    process = subprocess.Popen(command, env={**os.environ, IN_NAMESPACE: "1"},
                               cwd=REPOSITORY, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        stdout, _ = process.communicate()
        pytest.fail(f"{module.name} in namespaces ran past {timeout_s:.0f} s:\n"
                    f"{stdout[-6000:]}")
    _kill_group(process.pid)  # anything left behind
    if process.returncode != 0:
        pytest.fail(f"{module.name} failed in namespaces:\n{(stdout + stderr)[-8000:]}")
    return stdout


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def require_namespace() -> None:
    """For the in-namespace modules: refuse to run (and mount anything) outside one."""
    if not in_namespace():
        pytest.fail("this module runs only inside the namespaces a test makes for it "
                    "(tests/namespaces.py run_tests_in_namespace)")


def mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)


def remount_read_only(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
