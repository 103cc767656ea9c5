"""A runner process that serves a fake engine, for tests that spawn runners:

    python tests/fake_runner.py --fake-engine text|kv|grant|embedding --socket PATH --parent-pid PID

It is shoal's runner (shoal.runner.entrypoint.main) given a fake engine factory in place of
shoal's engines; fakes.fake_supervisor_options points a supervisor's runner_command here.
"""

from __future__ import annotations

import argparse
import sys

from fake_embedding import make_engine as make_fake_embedding_engine
from fakes import make_fake_engine, make_fake_grant_engine, make_fake_kv_engine

from shoal.runner.entrypoint import main

FAKE_ENGINES = {"text": make_fake_engine, "kv": make_fake_kv_engine,
                "grant": make_fake_grant_engine, "embedding": make_fake_embedding_engine}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="fake-runner")
    parser.add_argument("--fake-engine", choices=sorted(FAKE_ENGINES), required=True)
    known, runner_argv = parser.parse_known_args()
    sys.exit(main(runner_argv, FAKE_ENGINES[known.fake_engine]))
