"""A stand-in C++ compiler for the tests of the kernels' build machinery.

The tests of how the kernels are built (a fresh cache filled once by racing
processes, a wheel's package building its own library) test jaxslices'
build logic: finding the compiler, the cache key, the lock, the atomic
rename, loading the result. They do not need g++ to compile the same
sources again (about 80 s on 2 cores each time): this script stands in for
the compiler. It checks that every source it is given (and every header
beside them) is byte for byte the checkout's, which this test session's own
library was compiled from, then writes a copy of that library where the
command asks (``-o``). Anything else fails, as a compiler would.

Used as ``JAXSLICES_CXX`` through :func:`install`, which writes a small
executable wrapper (the variable names one command, without arguments).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

CHECKOUT_SOURCES = (
    Path(__file__).resolve().parents[1] / "jaxslices" / "kernels" / "csrc"
)
LIBRARY_VARIABLE = "JAXSLICES_TEST_REUSED_LIBRARY"


def install(directory: Path, library: Path) -> dict:
    """Write the wrapper into ``directory``; the environment that selects it."""
    wrapper = directory / "reused-cxx"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{__file__}" "$@"\n')
    wrapper.chmod(0o755)
    return {"JAXSLICES_CXX": str(wrapper), LIBRARY_VARIABLE: str(library)}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(args: list[str]) -> int:
    if "--version" in args:
        print("jaxslices test stand-in (copies the test session's library) 1.0")
        return 0
    if "-o" not in args:
        print("reused-cxx: no -o OUTPUT given", file=sys.stderr)
        return 1
    out = Path(args[args.index("-o") + 1])
    sources = [Path(a) for a in args if a.endswith(".cc")]
    if not sources:
        print("reused-cxx: no .cc sources given", file=sys.stderr)
        return 1
    given = {
        p for s in sources for p in s.parent.iterdir() if p.suffix in (".cc", ".h")
    }
    for path in sorted(given):
        mine = CHECKOUT_SOURCES / path.name
        if not mine.exists() or _digest(mine) != _digest(path):
            print(f"reused-cxx: {path} is not the checkout's {mine}", file=sys.stderr)
            return 1
    library = Path(os.environ[LIBRARY_VARIABLE])
    time.sleep(0.5)  # long enough for racing builds to meet at the lock
    shutil.copyfile(library, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
