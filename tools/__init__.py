"""Repository tools, not part of the library (the wheel ships ``jaxslices`` only).

* ``tools/render_docs.py``: writes the measured numbers of README.md and docs/
  from ``benchmarks/results/`` (``python tools/render_docs.py``).
* ``tools/hlo.py``: reads the collectives of a compiled step from its HLO text;
  the scale-out tests and ``benchmarks/scale_bench.py`` import it as
  ``from tools import hlo``.
* ``tools/execute_notebooks.py``: runs the notebooks at full size and writes
  their outputs into them (``python tools/execute_notebooks.py``);
  ``tests/repo/test_notebooks.py`` checks that those outputs are current.
* ``tools/public_api.py``: the public names and the ones the API reference
  (``docs/api/``) documents; used by ``docs/conf.py`` and
  ``tests/repo/test_docs_site.py``.
"""
