"""The `shoal` command: argparse front door for serve, run, pull, models, rm, cluster, ps
and diagnose."""

from __future__ import annotations

import argparse
import sys
import traceback

from shoal import __version__
from shoal.cli import cluster, diagnose, models, pull, run, serve
from shoal.cli.errors import EXPECTED_FAILURES, report

_DEBUG_HELP = "show the traceback of an error, not only its message"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="A local LLM inference server.")
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve.add_parser(commands)
    run.add_parser(commands)
    pull.add_parser(commands)
    models.add_parser(commands)  # and rm
    cluster.add_parsers(commands)
    diagnose.add_parser(commands)
    for command in _commands(parser):
        # SUPPRESS: a command's parser leaves the flag alone unless it is given after it.
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help=_DEBUG_HELP)
    return parser


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every command's parser under parser, nested ones (`cluster certs`) included."""
    found = []
    for action in parser._actions:  # argparse offers no public walk of its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                found += [command, *_commands(command)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except ValueError as error:  # a bad flag value or environment variable
        if args.debug:
            traceback.print_exc()
        parser.error(str(error))
    except EXPECTED_FAILURES as error:
        report(error, args.debug)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
