"""The repository's other folders (``tools/``, ``examples/``), for the scripts.

``python benchmarks/<script>.py`` puts ``benchmarks/`` on ``sys.path`` and
nothing else of the repository. A script that needs ``tools/`` (the HLO
parser the tests use too) or ``examples/`` (the DLRM model, its synthetic
Criteo-shaped data) imports it with :func:`load`, which registers that
folder as a package by its location, as ``import`` would from the
repository's root, and leaves ``sys.path`` alone. Standard library only:
the TorchRec worker (another Python, without JAX) uses it too.

Example: ``hlo = _repo.load("tools.hlo")``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> ModuleType:
    """The module ``name`` (``"tools.hlo"``, ``"examples.dlrm"``) of this repository.

    Its folder becomes the package of that name unless it is one already
    (the tests import ``tools`` from the repository's root): a package of
    that name from anywhere else raises ``ImportError``.
    """
    folder = name.partition(".")[0]
    where = ROOT / folder
    package = sys.modules.get(folder)
    if package is None:
        init = where / "__init__.py"
        if init.exists():
            spec = importlib.util.spec_from_file_location(
                folder, init, submodule_search_locations=[str(where)]
            )
        else:  # a folder of modules without __init__.py: a namespace package
            spec = importlib.machinery.ModuleSpec(folder, None, is_package=True)
            spec.submodule_search_locations = [str(where)]
        package = importlib.util.module_from_spec(spec)
        sys.modules[folder] = package
        if spec.loader is not None:
            spec.loader.exec_module(package)
    elif str(where) not in [str(Path(p).resolve()) for p in package.__path__]:
        raise ImportError(
            f"benchmarks need this repository's {folder}/ ({where}) as the "
            f"package {folder!r}, but {folder!r} is already imported from "
            f"{list(package.__path__)}"
        )
    return importlib.import_module(name)
