"""``python -m jaxslices.kernels``: build (or find) the kernels, print their status.

Exits 0 when the kernels are loaded, 1 when they are not (the printed line
says why: no compiler, the compiler's error, ``JAXSLICES_NATIVE=0``). A
module of its own, imported by nothing, so that running it does not import
it twice (runpy's ``RuntimeWarning`` on ``python -m`` of a module that its
package already imported).
"""

from __future__ import annotations

import sys

from . import status


def main() -> int:
    """Build and load the kernels; print :func:`jaxslices.kernels.status`."""
    line = status()  # builds and loads; the line is the message (no warning)
    print(line)
    return 0 if line.startswith("loaded: ") else 1


if __name__ == "__main__":
    sys.exit(main())
