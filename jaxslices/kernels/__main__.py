"""``python -m jaxslices.kernels``: build (or find) the kernels, say what they use.

Prints the status line (:func:`jaxslices.kernels.status`: ``loaded: <library>``
or why not) first, then the compiler, the flags, the threads a kernel call
uses and the cache; ``--help`` says what it does. Exits 0 when the kernels
are loaded, 1 when they are not (the first line says why: no compiler, the
compiler's error, ``JAXSLICES_NATIVE=0``). A module of its own, imported by
nothing, so that running it does not import it twice (runpy's
``RuntimeWarning`` on ``python -m`` of a module that its package already
imported).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import _build, _threads, status

DESCRIPTION = """\
Build the native CPU kernels of jaxslices now (the first build compiles
C++ against the installed jaxlib's headers: about a minute, once per jaxlib,
compiler and CPU; later processes load the cached library), then print their
status, the compiler, the flags, the threads a kernel call uses and the
cache. Exit status 0 when the kernels are loaded, 1 when they are not.
"""

EPILOG = """\
environment: JAXSLICES_CXX or CXX (the compiler), JAXSLICES_CXXFLAGS (extra
flags), JAXSLICES_CACHE_DIR (the cache), JAXSLICES_THREADS (threads per
kernel call), JAXSLICES_NATIVE=0 (no kernels: the XLA path). See
docs/kernels.md.
"""


def lines() -> list[str]:
    """The report: the status line, then one line per setting."""
    first = status()  # builds and loads; the line is the message (no warning)
    if not _build.enabled_by_env():
        return [first]
    info = _build.build_info()
    cxx = info["compiler"] or "none found"
    version = f" ({info['version']})" if info["version"] else ""
    built = info["seconds"]
    when = f"built now in {built:.0f} s" if built is not None else "cached"
    cache = f"{info['cache']}" + (
        " ($JAXSLICES_CACHE_DIR)" if os.environ.get("JAXSLICES_CACHE_DIR") else ""
    )
    out = [
        first,
        f"compiler: {cxx}{version}",
        f"flags: {' '.join(info['flags'])}",
        f"threads: {_threads.describe()}",
        f"cache: {cache}",
    ]
    if first.startswith("loaded: "):
        out.append(f"library: {when}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Build and load the kernels; print the report; 0 when they are loaded."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxslices.kernels",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(argv)
    report = lines()
    print("\n".join(report))
    return 0 if report[0].startswith("loaded: ") else 1


if __name__ == "__main__":
    sys.exit(main())
