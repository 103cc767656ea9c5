"""Fetch one file over HTTP: resumed with a Range request from what an interrupted pull left
(<name>.partial), checked against the size and the hashes its source gave, fsynced and only
then renamed to its final name.

A connection that drops mid-file is resumed at once a few times; anything else leaves the
.partial file for the next pull to resume.
"""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import httpx

from shoal.catalog.pull.errors import CorruptDownload, NotEnoughDisk, PullError, SourceUnreachable
from shoal.catalog.pull.progress import Progress, PullEvent

CHUNK_BYTES = 1024 * 1024  # per read while hashing
REPORT_BYTES = 1024 * 1024  # a progress event at least this far apart
RESUME_ATTEMPTS = 3  # immediate resumes after a dropped connection, per file
PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a model: where it comes from and what its bytes must be."""

    url: str
    path: str  # relative to the model's directory
    size: int
    digest: str  # what progress lines name it by: Ollama's "sha256:..." or a content id
    sha256: str | None = None
    git_sha1: str | None = None  # a Hugging Face file kept in git (not LFS): its blob id


class _Hashes:
    """The hashes a file is checked against, fed as its bytes arrive."""

    def __init__(self, remote: RemoteFile) -> None:
        self.remote = remote
        self.sha256 = hashlib.sha256() if remote.sha256 else None
        self.git_sha1 = None
        if remote.git_sha1:
            self.git_sha1 = hashlib.sha1(usedforsecurity=False)
            self.git_sha1.update(f"blob {remote.size}\0".encode())

    def update(self, data: bytes) -> None:
        if self.sha256 is not None:
            self.sha256.update(data)
        if self.git_sha1 is not None:
            self.git_sha1.update(data)

    def mismatch(self) -> str | None:
        remote = self.remote
        if self.sha256 is not None and self.sha256.hexdigest() != remote.sha256:
            return f"sha256 {self.sha256.hexdigest()}, expected {remote.sha256}"
        if self.git_sha1 is not None and self.git_sha1.hexdigest() != remote.git_sha1:
            return f"git blob id {self.git_sha1.hexdigest()}, expected {remote.git_sha1}"
        return None


def fetch_file(client: httpx.Client, remote: RemoteFile, target: Path,
               headers: dict[str, str], report: Progress, label: str,
               source: str) -> None:
    """target holds remote's verified bytes afterwards; label names the pull in errors."""
    if target.is_file() and target.stat().st_size == remote.size:
        report(PullEvent(f"pulling {_short(remote.digest)}", remote.digest, remote.size,
                         remote.size, source=source))
        return  # verified before it was renamed, by an earlier pull
    partial = target.with_name(target.name + PARTIAL_SUFFIX)
    target.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(RESUME_ATTEMPTS + 1):
        before = _size(partial)
        try:
            _download(client, remote, partial, headers, report, label, source)
            break
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout) as error:
            if attempt == RESUME_ATTEMPTS or _size(partial) == before:
                raise SourceUnreachable(f"{label}: the download of {remote.path} from "
                                        f"{_host(remote.url)} broke off ({error}); pull again "
                                        f"to resume it") from error
    report(PullEvent("verifying sha256 digest", source=source))
    verify_file(remote, partial, label)
    os.replace(partial, target)


def _download(client: httpx.Client, remote: RemoteFile, partial: Path,
              headers: dict[str, str], report: Progress, label: str, source: str) -> None:
    have = _size(partial)
    if have > remote.size:
        partial.unlink()
        have = 0
    if have == remote.size:
        return
    # The file's own bytes: a compressed answer would not match its size, hash or ranges.
    request_headers = {**headers, "Accept-Encoding": "identity"}
    if have:
        request_headers["Range"] = f"bytes={have}-"
    status = f"pulling {_short(remote.digest)}"
    try:
        with client.stream("GET", remote.url, headers=request_headers) as response:
            if response.status_code == 200:
                have = 0  # the server ignored the range: start over
            elif response.status_code != 206:
                _raise_for_status(response, remote, label, source)
            with partial.open("r+b" if have else "wb") as out:
                out.seek(have)
                out.truncate()
                reported = have
                # Chunks as they arrive: a connection that drops loses nothing received.
                for chunk in response.iter_bytes():
                    have += len(chunk)
                    if have > remote.size:
                        raise CorruptDownload(f"{label}: {remote.path} is longer than the "
                                              f"{remote.size:,} bytes its source announced")
                    out.write(chunk)
                    if have - reported >= REPORT_BYTES or have == remote.size:
                        report(PullEvent(status, remote.digest, remote.size, have,
                                         new_bytes=have - reported, source=source))
                        reported = have
                out.flush()
                os.fsync(out.fileno())
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as error:
        raise SourceUnreachable(f"{label}: cannot reach {_host(remote.url)} ({error})") from error
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise NotEnoughDisk(f"{label}: the disk filled up while writing "
                                f"{partial.parent}") from error
        raise


def verify_file(remote: RemoteFile, partial: Path, label: str) -> None:
    """partial holds exactly remote's bytes (size, hashes); else it is deleted and
    CorruptDownload says why."""
    size = _size(partial)
    problem = None
    if size != remote.size:
        problem = f"{size:,} bytes, expected {remote.size:,}"
    elif remote.sha256 or remote.git_sha1:
        hashes = _Hashes(remote)
        with partial.open("rb") as file:
            while data := file.read(CHUNK_BYTES):
                hashes.update(data)
        problem = hashes.mismatch()
    if problem is not None:
        partial.unlink(missing_ok=True)  # nothing of it can be trusted for a resume
        raise CorruptDownload(f"{label}: {remote.path} from {_host(remote.url)} is corrupt "
                              f"({problem}); it was discarded")


def _raise_for_status(response: httpx.Response, remote: RemoteFile, label: str,
                      source: str) -> None:
    if response.status_code in (401, 403, 404):
        hint = "; a gated or private repository needs HF_TOKEN" if source == "huggingface" else ""
        raise PullError(f"{label}: {_host(remote.url)} refused {remote.path} "
                        f"(HTTP {response.status_code}{hint})")
    raise SourceUnreachable(f"{label}: {_host(remote.url)} answered HTTP "
                            f"{response.status_code} for {remote.path}")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _short(digest: str) -> str:
    """The digest as Ollama's progress lines show it: 12 hex digits."""
    return digest.removeprefix("sha256:")[:12]


def _host(url: str) -> str:
    return httpx.URL(url).host or url
