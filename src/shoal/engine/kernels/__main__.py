"""`python -m shoal.engine.kernels`: build the decode kernel now (make install runs this).

Exits 0 even when the build fails: shoal then decodes on the Python path, and says so.
"""

from __future__ import annotations

import logging
import sys
import time

from shoal.engine.kernels.build import KERNEL, build_dir, enabled


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not enabled():
        print("decode kernel: off (SHOAL_FUSED_DECODE=0)")
        return 0
    start = time.monotonic()
    module = KERNEL.load()
    state = "ready" if module is not None else "unavailable (the Python path will be used)"
    print(f"decode kernel: {state} in {build_dir()} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
