"""`python -m shoal.engine.kernels`: build the compiled kernels now (make install runs this).

Exits 0 even when the build fails: shoal then loads weights dequantized and decodes on the
Python path, and says so.
"""

from __future__ import annotations

import logging
import sys
import time

from shoal.engine.kernels.build import KERNEL, build_dir


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    module = KERNEL.load()
    if module is None:
        state = "unavailable (weights will load dequantized)"
    else:
        state = f"ready, packed weights on {module.quant_default_backend()}"
    print(f"kernels: {state} in {build_dir()} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
