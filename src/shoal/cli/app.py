"""The `shoal` command: argparse front door for serve, run, pull, models, cluster, ps
and diagnose."""

from __future__ import annotations

import argparse
import sys

from shoal import __version__
from shoal.cli import cluster, diagnose, models, pull, run, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="A local LLM inference server.")
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve.add_parser(commands)
    run.add_parser(commands)
    pull.add_parser(commands)
    models.add_parser(commands)
    cluster.add_parsers(commands)
    diagnose.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except ValueError as error:  # a bad flag value or environment variable
        parser.error(str(error))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
