"""Repository tools, not part of the library (the wheel ships ``jaxslices`` only).

* ``tools/render_docs.py``: writes the measured numbers of README.md and docs/
  from ``benchmarks/results/`` (``python tools/render_docs.py``).
* ``tools/hlo.py``: reads the collectives of a compiled step from its HLO text;
  the scale-out tests and ``benchmarks/scale_bench.py`` import it as
  ``from tools import hlo``.
"""
