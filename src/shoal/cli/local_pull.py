"""Pull a model in this process, into this machine's data dir, with a progress bar: what
`shoal pull` does when no node answers, and `shoal run` before it starts its own node."""

from __future__ import annotations

from typing import TextIO

from shoal.catalog.cards import load_builtin_catalog
from shoal.catalog.pull import errors as pull_errors
from shoal.catalog.pull.names import parse_pull_name
from shoal.catalog.pull.puller import Pulled, Puller
from shoal.catalog.pull.settings import PullSettings
from shoal.catalog.resolve import ModelNotFound, data_dir_or_default, find_card, resolve_model
from shoal.cli.errors import CommandFailed
from shoal.cli.progress_bar import ProgressBar


def pull_here(model: str, data_dir: str | None, out: TextIO | None = None) -> Pulled:
    """Pull model into data_dir's store (SHOAL_DATA_DIR, else the default), drawing its
    progress on out (stdout); CommandFailed says why it failed."""
    bar = ProgressBar(out)
    try:
        return Puller(data_dir_or_default(data_dir), PullSettings()).pull(
            model, lambda event: bar.show(event.to_json()))
    except (pull_errors.PullError, ValueError) as error:
        raise CommandFailed(str(error)) from error
    finally:
        bar.close()


def pull_if_missing(model: str, data_dir: str | None, out: TextIO | None = None) -> None:
    """Pull model unless it is on this machine already, as `ollama run` does; a name that
    is neither on disk nor pullable is left for the node to refuse in its own words."""
    try:
        resolve_model(model, data_dir=data_dir_or_default(data_dir))
        return
    except (ModelNotFound, ValueError):
        pass
    if find_card(model, load_builtin_catalog()) is None:
        try:
            parse_pull_name(model)
        except ValueError:
            return
    pull_here(model, data_dir, out)
