"""shoal models: the catalogue and the pulled models, with what is on this machine;
shoal rm MODEL: delete a pulled model from the store."""

from __future__ import annotations

import argparse

from shoal.catalog.pull.puller import Puller
from shoal.catalog.resolve import DEFAULT_MODEL_ID, data_dir_or_default, list_models
from shoal.cli.table import print_table

_DATA_DIR_HELP = "the data dir whose model store to use (SHOAL_DATA_DIR)"


def add_parser(commands) -> None:
    parser = commands.add_parser("models", help="list catalogue and pulled models, and what "
                                                "is on disk")
    parser.add_argument("--data-dir", default=None, help=_DATA_DIR_HELP)
    parser.set_defaults(handler=run_models)
    remove = commands.add_parser("rm", help="delete a pulled model from the model store")
    remove.add_argument("model", nargs="+", help="a name the model was pulled under")
    remove.add_argument("--data-dir", default=None, help=_DATA_DIR_HELP)
    remove.set_defaults(handler=run_rm)


def _size(size_bytes: int) -> str:
    return f"{size_bytes / 1e6:.0f} MB" if size_bytes < 1e9 else f"{size_bytes / 1e9:.1f} GB"


def run_models(args: argparse.Namespace) -> int:
    rows = [("MODEL", "KIND", "FORMAT", "SIZE", "CONTEXT", "LOCAL")]
    for entry in list_models(data_dir=data_dir_or_default(args.data_dir)):
        name = entry.id + (" (default)" if entry.id == DEFAULT_MODEL_ID else "")
        if entry.source == "store":
            local = f"pulled ({entry.description.removeprefix('pulled from ')})"
        else:
            local = "yes" if entry.available else (entry.install_hint or "no")
        context = str(entry.context_length) if entry.context_length else "-"
        rows.append((name, entry.kind, entry.format, _size(entry.size_bytes), context, local))
    print_table(rows)
    return 0


def run_rm(args: argparse.Namespace) -> int:
    puller = Puller(data_dir_or_default(args.data_dir), catalog=())
    for name in args.model:
        removed = puller.remove(name)  # ModelNotFound: reported as an expected failure
        print(f"deleted {removed.name} ({_size(removed.size)})")
    return 0
