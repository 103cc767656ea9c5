"""Why a pull failed, as exception types the API maps onto statuses and the CLI prints."""

from __future__ import annotations


class PullError(RuntimeError):
    """A pull failed; the message names the source and the name tried."""


class NotOnSource(PullError):
    """The source answered, and it has no such model (or no file matching the tag)."""


class SourceUnreachable(PullError):
    """The source could not be reached or did not answer in time."""


class CorruptDownload(PullError):
    """A file's bytes do not match the size or hash its source gave (it was discarded)."""


class NotEnoughDisk(PullError):
    """The data dir's disk, or the --models-disk bound, has no room for the model."""
