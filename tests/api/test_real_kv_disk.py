"""The SSD tier in a real `shoal serve` (float32 SmolLM2): prefixes outlive a node restart,
a corrupt block file is ignored, and a read-only directory only turns the tier off (slow)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from serve_process import start_serve

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT = " ".join(["The harbour master wrote the tides, the winds and the ships in his log."] * 14)
ARGS = ["--standalone", "--model", "smollm2", "--threads", "2", "--dtype", "float32",
        "--kv-cache-memory", "64MiB", "--kv-disk", "64MiB"]


def complete(url: str) -> tuple[str, int, int]:
    """(text, prompt tokens, cached prompt tokens) of a greedy completion of PROMPT."""
    body = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "smollm2", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    usage = body["usage"]
    return (body["choices"][0]["text"], usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"])


def block_files(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "kv").glob("*/*.kv"))


def wait_for_files(data_dir: Path, count: int, timeout_s: float = 30.0) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while len(files := block_files(data_dir)) < count:
        assert time.monotonic() < deadline, f"{len(files)} block files, not {count}"
        time.sleep(0.2)
    return files


def serve_once(data_dir: Path) -> tuple[str, int, int, str]:
    """Start a node on data_dir, complete PROMPT once, stop it: (text, prompt tokens, cached
    tokens, the node's log)."""
    node = start_serve(ARGS, data_dir)
    try:
        text, prompt_tokens, cached = complete(node.url)
    finally:
        code = node.stop()
    assert code == 0, node.log_tail()
    return text, prompt_tokens, cached, node.log_path.read_text(errors="replace")


def test_a_prompt_after_a_restart_is_served_from_disk_and_a_corrupt_file_is_ignored(tmp_path):
    data_dir = tmp_path / "node"
    cold_text, prompt_tokens, cached, _ = serve_once(data_dir)
    assert cached == 0
    full = (prompt_tokens - 1) // BLOCK * BLOCK  # the last prompt token is always computed
    assert full >= 8 * BLOCK
    files = wait_for_files(data_dir, full // BLOCK)

    warm_text, _, cached, _ = serve_once(data_dir)
    assert cached == full  # a restarted node's RAM is empty: these came from disk
    assert warm_text == cold_text

    damaged = files[len(files) // 2]
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0x5A
    damaged.write_bytes(bytes(data))
    text, _, cached, log = serve_once(data_dir)
    assert text == cold_text
    assert cached < full  # the chain stops at the damaged block; the rest is computed
    assert "unusable" in log
    # The damaged file was removed, and the block computed again is stored afresh.
    assert not damaged.exists() or damaged.read_bytes() != bytes(data)
    _, _, cached, _ = serve_once(data_dir)
    assert cached == full


@contextlib.contextmanager
def read_only(directory: Path):
    """The directory made unwritable even for root (chattr +i) or by its mode; skips only
    where this machine offers neither."""
    directory.mkdir(parents=True)
    immutable = os.geteuid() == 0 and shutil.which("chattr") and subprocess.run(
        ["chattr", "+i", str(directory)], capture_output=True).returncode == 0
    if not immutable:
        directory.chmod(0o555)
    try:
        probe = directory / "probe"
        try:
            probe.mkdir()
        except OSError:
            pass
        else:
            probe.rmdir()
            pytest.skip("this machine cannot make a directory read-only here")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        directory.chmod(0o755)


def test_a_read_only_directory_turns_the_tier_off_and_serving_goes_on(tmp_path):
    data_dir = tmp_path / "node"
    with read_only(data_dir / "kv"):
        text, _, cached, log = serve_once(data_dir)
    assert text and cached == 0
    assert "KV disk tier" in log and "is off" in log
    assert not block_files(data_dir)
