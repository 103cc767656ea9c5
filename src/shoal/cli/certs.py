"""shoal cluster certs DIR: a cluster CA, the node certificate it signs, a cluster secret."""

from __future__ import annotations

import argparse
from pathlib import Path

from shoal.cli.errors import CommandFailed
from shoal.cluster.certs import CertsExist, make_cluster_certs
from shoal.cluster.tls import CA_KEY


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "certs", help="make a cluster CA, a node certificate and a cluster secret in DIR",
        description="Writes ca.pem and ca-key.pem (the cluster CA), node.pem and node-key.pem "
                    "(one node certificate for every node, signed by the CA) and "
                    "cluster.secret (32 random bytes). Copy DIR to every node and start each "
                    "with --cluster-tls DIR.")
    parser.add_argument("directory", metavar="DIR", help="where to write the files")
    parser.add_argument("--host", action="append", default=[], metavar="NAME",
                        help="a host name or IP address the node certificate also names "
                             "(localhost, 127.0.0.1 and ::1 always); repeat for several")
    parser.add_argument("--force", action="store_true",
                        help="replace a CA already in DIR (every node then needs the new "
                             "files)")
    parser.set_defaults(handler=run_certs)


def run_certs(args: argparse.Namespace) -> int:
    directory = Path(args.directory).expanduser()
    try:
        written = make_cluster_certs(directory, args.host, force=args.force)
    except CertsExist as error:
        raise CommandFailed(str(error)) from error
    except OSError as error:
        raise CommandFailed(f"cannot write to {directory}: {error.strerror or error}") from error
    print(f"wrote in {directory}:")
    for path in written.files:
        print(f"  {path.name:<15} mode {path.stat().st_mode & 0o777:o}")
    print(f"the node certificate names: {', '.join(written.hosts)}")
    print(f"\nCopy {directory} to every node (without {CA_KEY} if you like: only this command "
          "needs it), then on each:\n"
          f"  shoal serve --cluster-tls {directory} --listen tls/0.0.0.0:7447 "
          "[--peers tls/OTHER-NODE:7447]\n"
          "Nodes then talk over mutual TLS under this CA, and the ranks of an instance prove "
          "the secret in cluster.secret to each other. Keep the keys and the secret private.")
    return 0
