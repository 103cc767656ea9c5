"""shoal models: the catalogue, and which models are available on this machine."""

from __future__ import annotations

import argparse

from shoal.catalog.resolve import DEFAULT_MODEL_ID, list_models
from shoal.cli.table import print_table


def add_parser(commands) -> None:
    parser = commands.add_parser("models", help="list catalogue models and local availability")
    parser.set_defaults(handler=run_models)


def _size(size_bytes: int) -> str:
    return f"{size_bytes / 1e6:.0f} MB" if size_bytes < 1e9 else f"{size_bytes / 1e9:.1f} GB"


def run_models(_args: argparse.Namespace) -> int:
    rows = [("MODEL", "KIND", "FORMAT", "SIZE", "CONTEXT", "LOCAL")]
    for entry in list_models():
        name = entry.id + (" (default)" if entry.id == DEFAULT_MODEL_ID else "")
        local = "yes" if entry.available else (entry.install_hint or "no")
        rows.append((name, entry.kind, entry.format, _size(entry.size_bytes),
                     str(entry.context_length), local))
    print_table(rows)
    return 0
