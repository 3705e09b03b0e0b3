"""The package's import graph is the DAG of layers its maintainer map states.

``jaxslices/README.md`` ("Import layers") assigns every module a layer; this
reads that table and the package's import statements (with ``ast``: nothing is
imported, so it takes milliseconds) and checks that the map is complete, that
no import goes to a higher layer, that the graph has no cycle, that the
foundations import nothing of jaxslices (``_coalesce`` imports JAX only), and
that the optional units are imported by nothing else in the package.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from jaxslices._moved import MOVED

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "jaxslices"
MAP = PKG / "README.md"

#: Every public name of the flat layout (commit b939c6b), by the module it was
#: imported from: each must still import from there.
OLD_PUBLIC_NAMES = {
    "jaxslices": (
        "AddDecayedWeightsState FtrlState IndexedSlices MultiSteps MultiStepsState "
        "ScaleByLazyAdamState ScaleByRowwiseRssState ScaleByRssState "
        "ScaleByScheduleState TraceState adagrad add_decayed_weights "
        "apply_if_finite apply_updates check_ids clip clip_by_global_norm "
        "clip_by_row_norm coalesce concatenate densify embedding_bag "
        "embedding_lookup from_dense ftrl global_norm grad is_indexed_slices "
        "lazy_adam lazy_adamw rowwise_adagrad scale scale_by_lazy_adam "
        "scale_by_learning_rate scale_by_rowwise_rss scale_by_rss scale_by_schedule "
        "scatter_add scatter_sub scatter_update sgd shard_rows sharded_init "
        "sharded_lookup sharded_update sharding sparse_mask to_dense trace tree_add "
        "tree_map_values tree_pmean tree_psum tree_scale value_and_grad "
        # and the names of the collections' layout (before issue 29)
        "Buffer EmbeddingCollection JaggedIds KeyedJaggedIds ShardingPlan "
        "TableConfig TablePlan check_jagged jagged_from_lengths jagged_from_lists "
        "jagged_from_padded per_table plan"
    ),
    "jaxslices.transforms": (
        "AddDecayedWeightsState FtrlState ScaleByLazyAdamState "
        "ScaleByRowwiseRssState ScaleByRssState ScaleByScheduleState TraceState "
        "adagrad add_decayed_weights clip clip_by_global_norm clip_by_row_norm "
        "densify ftrl lazy_adam lazy_adamw rowwise_adagrad scale scale_by_lazy_adam "
        "scale_by_learning_rate scale_by_rowwise_rss scale_by_rss scale_by_schedule "
        "sgd trace"
    ),
    "jaxslices.sharding": (
        "Routing replicate_rows shard_rows sharded_init sharded_lookup sharded_update"
    ),
    # Issue 29's layout moved these; each must still import from here.
    "jaxslices.plans": "KINDS ShardingPlan TablePlan plan",
    "jaxslices.per_table": (
        "PerTableState add_decayed_weights_by_table scale_by_table"
    ),
    "jaxslices.collection": "Buffer EmbeddingCollection TableConfig",
    "jaxslices.jagged": (
        "JaggedIds check_jagged jagged_from_lengths jagged_from_lists "
        "jagged_from_padded segment_ids"
    ),
    "jaxslices.native": (
        "NativeBackendError RowSparse RowSparseType SparseTable SparseTableType "
        "is_marked is_row_sparse lookup mark to_indexed_slices"
    ),
    "jaxslices.nnx": "Embed grad value_and_grad",
    "jaxslices.linen": "Embed",
    "jaxslices.equinox": "Embedding apply_updates filter_grad filter_value_and_grad",
    "jaxslices.accumulate": "MultiSteps MultiStepsState",
    "jaxslices.tree": "tree_add tree_map_values tree_pmean tree_psum tree_scale",
    "jaxslices.slices": (
        "IndexedSlices coalesce from_dense global_norm is_indexed_slices "
        "scatter_add scatter_sub scatter_update sparse_mask to_dense valid_mask"
    ),
    "jaxslices.embedding": "check_ids embedding_bag embedding_lookup",
    "jaxslices.autodiff": "grad value_and_grad",
    "jaxslices.updates": "apply_updates",
}


def modules() -> dict[str, Path]:
    """Module names relative to the package (``slices``, ``transforms._alias``)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (every import statement, nested too)."""
    is_pkg = path.name == "__init__.py"
    here = [] if name == "__init__" else name.split(".")
    base = here if is_pkg else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[: len(base) - (node.level - 1)]
                target = ".".join(up + ([node.module] if node.module else []))
            elif (node.module or "").startswith("jaxslices"):
                target = node.module.removeprefix("jaxslices").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else (target or "__init__"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jaxslices"):
                    rest = alias.name.removeprefix("jaxslices").lstrip(".")
                    found.add(rest or "__init__")
    found.discard(name)
    return found


def external_imports(path: Path) -> set[str]:
    """Top-level names of the non-jaxslices modules ``path`` imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add((node.module or "").split(".")[0])
    return out - {"jaxslices"}


def _layer_rows() -> list[tuple[str, str, str]]:
    """``(layer, name, modules cell)`` of the maintainer map's "Import layers"."""
    text = MAP.read_text().split("## Import layers", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| (\d+) \| ([^|]+) \| (.+) \|$", text, flags=re.M)


def layers() -> dict[str, int]:
    """Module -> layer, from the maintainer map's "Import layers" table."""
    rows = [(layer, cell) for layer, _, cell in _layer_rows()]
    assert rows, "jaxslices/README.md has no 'Import layers' table"
    known = modules()
    out: dict[str, int] = {}
    for layer, cell in rows:
        for entry in re.findall(r"`([^`]+)`", cell):
            if entry.endswith("/"):
                pkg = entry[:-1]
                names = [m for m in known if m == pkg or m.startswith(pkg + ".")]
            else:
                names = [entry]
            assert names, f"the map names {entry!r}, which is not in the package"
            for m in names:
                assert m not in out, f"{m} is in two layers of the map"
                out[m] = int(layer)
    return out


GRAPH = {name: imports(name, path, set(modules())) for name, path in modules().items()}


def test_every_module_is_in_exactly_one_layer_of_the_map():
    mapped = layers()
    assert set(mapped) == set(GRAPH), (
        f"not in the map: {sorted(set(GRAPH) - set(mapped))}; "
        f"in the map but not in the package: {sorted(set(mapped) - set(GRAPH))}"
    )


def test_every_module_has_its_line_in_the_map():
    text = MAP.read_text()
    missing = [
        str(path.relative_to(PKG))
        for path in modules().values()
        if f"| `{path.relative_to(PKG)}` |" not in text
    ]
    assert not missing, f"jaxslices/README.md has no line for {missing}"


def test_no_import_goes_up_a_layer():
    mapped = layers()
    up = [
        f"{m} (layer {mapped[m]}) imports {d} (layer {mapped[d]})"
        for m, deps in GRAPH.items()
        for d in deps
        if mapped[d] > mapped[m]
    ]
    assert not up, up


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH))


def test_the_cycle_finder_finds_a_cycle():
    # The check above must be able to fail.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", ["_coalesce", "_jax_compat"])
def test_foundations_import_jax_only(module):
    """Nothing of jaxslices, no third-party library but JAX (the stdlib is fine)."""
    assert GRAPH[module] == set(), GRAPH[module]
    others = external_imports(modules()[module]) - set(sys.stdlib_module_names)
    assert others <= {"jax"}, others


def test_optional_units_are_imported_by_nothing_else():
    mapped = layers()
    (optional,) = [int(n) for n, name, _ in _layer_rows() if "optional" in name]
    units = {m for m, layer in mapped.items() if layer == optional}
    assert units >= {"nnx", "linen", "equinox", "native"}

    def unit(m: str) -> str:
        return m.split(".")[0]

    bad = [
        f"{m} imports {d}"
        for m, deps in GRAPH.items()
        for d in deps
        if d in units and unit(m) != unit(d)
    ]
    assert not bad, bad


def test_the_graph_reader_sees_relative_and_nested_imports():
    assert {"_ids", "_lookup_handlers", "_tape"} <= GRAPH["embedding"]
    assert "slices" in GRAPH["transforms._rowwise"]  # from .. import slices
    assert "transforms._rowwise" in GRAPH["transforms._alias"]
    assert "slices" in GRAPH["_checkpoint"]  # also imported inside a function


@pytest.mark.parametrize("module", sorted(OLD_PUBLIC_NAMES))
def test_every_public_name_of_the_old_layout_still_imports(module):
    mod = importlib.import_module(module)
    missing = [n for n in OLD_PUBLIC_NAMES[module].split() if not hasattr(mod, n)]
    assert not missing, f"{module} lost {missing}"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_imports_under_its_old_path(old):
    assert old.removeprefix("jaxslices.") not in modules(), f"{old} exists"
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_the_old_paths_hook_never_hides_a_module():
    # Last on sys.meta_path, and only for the names it maps.
    import jaxslices._moved as moved

    finders = [f for f in sys.meta_path if isinstance(f, moved._MovedFinder)]
    assert len(finders) == 1 and sys.meta_path[-1] is finders[0]
    assert finders[0].find_spec("jaxslices.slices") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("jaxslices._no_such_module")


def test_old_top_level_names_import_but_are_not_exported():
    """The export rule's moved names (jaxslices/README.md): rule 4."""
    import jaxslices
    from jaxslices._moved import OLD_NAMES

    for name, (module, attr) in OLD_NAMES.items():
        assert name not in jaxslices.__all__, name
        mod = importlib.import_module(module)
        assert getattr(jaxslices, name) is (mod if attr is None else getattr(mod, attr))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        jaxslices.no_such_name  # noqa: B018


def test_the_top_level_repeats_no_namespace_but_the_transforms():
    """Rule 2: a namespace's names are not repeated at the top level (the
    transforms are rule 1's exception, as in Optax)."""
    import jaxslices

    top = {id(getattr(jaxslices, n)) for n in jaxslices.__all__}
    for ns in ("jaxslices.sharding", "jaxslices.capacity", "jaxslices.kernels"):
        mod = importlib.import_module(ns)
        shared = [n for n in mod.__all__ if id(getattr(mod, n)) in top]
        assert not shared, (ns, shared)
