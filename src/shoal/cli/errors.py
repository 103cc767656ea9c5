"""How the command line reports a failure it expects.

A model that cannot load, a node that does not answer, a request the node refuses: one line
on stderr, `shoal: error: MESSAGE`, and exit status 1; --debug adds the traceback. A bad flag
is argparse's usage and status 2. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
import traceback

import httpx

from shoal.catalog.resolve import ModelNotFound
from shoal.node import NodeStartError


class CommandFailed(Exception):
    """An expected failure of a command; its message is the line the user reads."""


# What a command raises for a cause outside shoal (a missing model, a node that does not
# answer, a --url that is no URL), never for a bug.
EXPECTED_FAILURES = (CommandFailed, NodeStartError, ModelNotFound, httpx.HTTPError,
                     httpx.InvalidURL)


def node_failed(base: str, error: httpx.HTTPError) -> CommandFailed:
    """What a failed exchange with the node at base means to the user."""
    if isinstance(error, httpx.TimeoutException):
        return CommandFailed(f"{base} did not answer in time ({type(error).__name__})")
    return CommandFailed(f"no shoal node answers at {base} ({error})")


def report(error: BaseException, debug: bool) -> None:
    """The error as one line on stderr (a message of several lines is joined), after its
    traceback when debugging."""
    if debug:
        traceback.print_exception(error)
    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    print(f"shoal: error: {message}", file=sys.stderr)
