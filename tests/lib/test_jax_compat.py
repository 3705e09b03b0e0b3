"""jaxslices._jax_compat: each private JAX name can go, and nothing turns wrong.

Each entry of the inventory is taken away in turn through its documented
switch (``_jax_compat.AVAILABLE``), and every path it serves is checked
against JAX's own dense gradient (or the one-device step): a top-level
lookup, nested ``vmap``, ``lax.scan``, ``value_and_grad`` inside
``jax.shard_map(check_vma=True)`` with sharded ids on 8 CPU devices, a
data-parallel ``jit`` step, ``all_to_all`` routing on a 2-D mesh, and the
typed indices' eager messages. The expectations say which paths must stay
sparse without the entry, so a fallback that silently changed nothing would
be noticed too.

Each path runs once with everything on, recording the entries it reads, and
then once with each of those taken away (:func:`_each_entry_off`). An entry
the first run never reads cannot change it: a run with that entry off reads
the same entries in the same order up to its first read of it, and there is
none, so it is the same run (the same jit caches hit, the same programs
traced). Each path names the entries it must read (``must_read``), so a
change that stopped exercising a fallback fails here.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tokenize
import warnings
from pathlib import Path

import _mesh
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import registry
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxslices as js
from jaxslices import _jax_compat, _typed_indices
from tools import hlo as _hlo

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = [e.name for e in _jax_compat.ENTRIES]
# Entries no path below uses (the opt-in GPU kernels): taken away in their
# own tests (tests/lib/test_kernels_gpu.py), not in every path here.
NOT_ON_THESE_PATHS = {"pallas_gpu"}
V, D, B, L = 64, 4, 16, 3

# Paths that stay sparse without the entry (the others fall back to dense).
DENSE_WITHOUT = {
    "top": {"varying_axes"},
    "nested_vmap": {"vmap_internals", "varying_axes"},
    "shard_map": {"varying_axes", "pcast_varying"},
}


def _sparse_expected(path: str, off: str | None) -> bool:
    return off not in DENSE_WITHOUT[path]


@contextlib.contextmanager
def _recording_reads():
    """The set of :data:`_jax_compat.AVAILABLE` entries read inside the block."""
    read: set[str] = set()
    flags = type(_jax_compat.AVAILABLE)
    real = flags.__getitem__

    def reading(self, name):
        read.add(name)
        return real(self, name)

    flags.__getitem__ = reading
    try:
        yield read
    finally:
        flags.__getitem__ = real


def _each_entry_off(monkeypatch, body, must_read):
    """``body(None)`` with everything available, then ``body(name)`` with
    each entry that run read taken away (the module's docstring says why the
    others need no run); returns the entries taken away."""
    with _recording_reads() as read:
        body(None)
    assert set(must_read) <= read, f"the path no longer reads {set(must_read) - read}"
    taken = sorted(read - NOT_ON_THESE_PATHS)
    for name in taken:
        with monkeypatch.context() as m:
            m.setitem(_jax_compat.AVAILABLE, name, False)
            try:
                body(name)
            except BaseException as e:
                e.add_note(f"(with the entry {name!r} taken away)")
                raise
    return taken


def _case(seed=0):
    return _mesh.init_params(V, D, seed), *_mesh.batch(V, B, L, seed=seed)


def _summed_over_devices(params, ids, y, n=8):
    """JAX's gradient of a replicated parameter under ``check_vma``: the sum
    over devices of the per-device gradients (each device one slice of ids)."""

    def summed(p):
        parts = jnp.split(ids, n), jnp.split(y, n)
        return sum(_mesh.loss_fn(p, i, t) for i, t in zip(*parts, strict=True))

    return jax.grad(summed)(params)


def _assert_grads_equal(got, ref):
    got = js.to_dense(got)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ the inventory


def test_every_entry_is_available_on_this_jax():
    # Both CI legs (the oldest and the newest supported JAX) run the fast
    # paths: no fallback is exercised by accident. Each flag read as the
    # code reads it (a lazy entry runs its check on its first read).
    got = {name: _jax_compat.AVAILABLE[name] for name in ENTRIES}
    assert got == {name: True for name in ENTRIES}


_IMPORT_ONLY = """
import sys
import jaxslices, jaxslices.kernels
from jaxslices import _jax_compat
late = sorted(m for m in sys.modules
              if m.startswith(("jax.experimental.pallas", "jax._src.pallas.triton",
                               "jaxlib.triton")))
print("BEFORE", late)
assert _jax_compat.AVAILABLE["pallas_gpu"] and _jax_compat.pallas is not None
print("AFTER", "jax.experimental.pallas.triton" in sys.modules)
"""


def _python(code: str) -> str:
    """The stdout of ``code`` in a fresh CPU-only Python that imports this tree."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()


def test_import_jaxslices_imports_no_pallas_or_triton_module():
    """Pallas and its Triton backend load when a GPU lowering reads them
    (``_jax_compat.pallas``, ``AVAILABLE["pallas_gpu"]``), not at import."""
    out = _python(_IMPORT_ONLY)
    assert "BEFORE []" in out and "AFTER True" in out, out


def test_inventory_is_copied_into_the_design_doc():
    design = (ROOT / "docs" / "design.md").read_text()
    assert _jax_compat.inventory_table() in design
    assert _jax_compat.inventory_table() in _jax_compat.__doc__
    assert set(_jax_compat.AVAILABLE) == set(ENTRIES)


def test_one_version_parse():
    assert _jax_compat.JAX_VERSION == _jax_compat.parse_version(jax.__version__)
    assert _jax_compat.parse_version("0.12.0.1") == (0, 12, 0)
    assert _jax_compat.parse_version("0.13.0rc1") == (0, 13, 0)
    assert _jax_compat.parse_version("0.10.2.dev20260101+cuda") == (0, 10, 2)
    assert _jax_compat.parse_version("1") == (1, 0, 0)
    assert _jax_compat.parse_version("") == (0, 0, 0)


# Names that only _jax_compat (and, for the opt-in native backend, _hijax) may
# use: private modules, internal attributes of JAX's objects, version checks.
_PRIVATE = [
    r"jax\._src",
    r"jax\.__version__",
    r"get_opaque_trace_state",
    r"trace_ctx",
    r"BatchTrace",
    r"manual_axis_type",
    r"\.vma\b",
    r"\.mat\b",
    r"lax\.pcast",
    r"lax\.pvary",
    r"invarying",
    r"axis_types",
    r"\.sharding\.mesh",
    r"jax\.shard_map",
    r"experimental\.shard_map",
    r"getattr_static",
]


def _code_only(path: Path) -> str:
    """The module's source without strings and comments (docstrings, messages)."""
    with path.open("rb") as f:
        tokens = tokenize.tokenize(f.readline)
        kept = [
            t.string
            for t in tokens
            if t.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.ENCODING)
        ]
    return " ".join(kept).replace(" . ", ".")


_PACKAGE = ROOT / "jaxslices"


@pytest.mark.parametrize(
    "module",
    sorted(_PACKAGE.rglob("*.py")),
    ids=lambda p: str(p.relative_to(_PACKAGE)),
)
def test_private_jax_names_only_in_the_compat_module(module):
    name = str(module.relative_to(_PACKAGE))
    if name in ("_jax_compat.py", "native/_hijax.py"):
        return
    code = _code_only(module)
    if name.startswith("native/"):  # hi types define `mat` for lax.cond
        code = code.replace("def mat", "").replace("_hijax.EMPTY_MAT", "")
    found = [p for p in _PRIVATE if re.search(p, code)]
    assert not found, f"{name} uses {found}: go through jaxslices/_jax_compat"


# ------------------------------------------------- each entry taken away


def test_top_level_nested_vmap_and_scan(monkeypatch):
    params, ids, y = _case(1)
    ids3 = jnp.stack([ids, ids[::-1]])
    must = ("trace_state", "vmap_internals", "varying_axes")
    _each_entry_off(
        monkeypatch, lambda off: _nested_and_scan(params, ids, ids3, y, off), must
    )


def _nested_and_scan(params, ids, ids3, y, off):

    def nested(p, ids3, y):
        one = lambda p, i: _mesh.loss_fn(p, i, y)  # noqa: E731
        return jnp.sum(jax.vmap(jax.vmap(one, (None, 0)), (None, 0))(p, ids3[:, None]))

    def in_scan(p, ids3, y):
        body = lambda c, i: (c + _mesh.loss_fn(p, i, y), None)  # noqa: E731
        return jax.lax.scan(body, 0.0, ids3)[0]

    for name, loss, args, sparse in (
        ("top", _mesh.loss_fn, (ids, y), _sparse_expected("top", off)),
        ("nested_vmap", nested, (ids3, y), _sparse_expected("nested_vmap", off)),
        ("scan", in_scan, (ids3, y), False),
    ):
        ref = jax.grad(loss)(params, *args)
        for f in (js.grad(loss), jax.jit(js.grad(loss))):
            g = f(params, *args)
            assert js.is_indexed_slices(g["emb"]) == sparse, (name, off)
            _assert_grads_equal(g, ref)


def test_without_trace_state_and_vmap_internals_everything_is_dense(monkeypatch):
    monkeypatch.setitem(_jax_compat.AVAILABLE, "trace_state", False)
    monkeypatch.setitem(_jax_compat.AVAILABLE, "vmap_internals", False)
    params, ids, y = _case(2)
    g = js.grad(_mesh.loss_fn)(params, ids, y)
    assert not js.is_indexed_slices(g["emb"])
    _assert_grads_equal(g, jax.grad(_mesh.loss_fn)(params, ids, y))


def _shard_map_grads(params, ids, y):
    """``js.grad`` per device inside ``shard_map(check_vma=True)``, ids sharded.

    Returns every device's dense gradient (stacked), so that a device holding
    a wrong one cannot hide behind a replicated output.
    """
    m = _mesh.mesh()
    kinds = []

    def per_device(params, ids, y):
        g = js.grad(_mesh.loss_fn)(params, ids, y)
        kinds.append(js.is_indexed_slices(g["emb"]))
        return jax.tree.map(lambda x: x[None], js.to_dense(g))

    f = jax.jit(
        jax.shard_map(
            per_device,
            mesh=m,
            in_specs=(P(), P("data"), P("data")),
            out_specs=P("data"),
        )
    )
    return f(params, ids, y), kinds, f.lower(params, ids, y).compile()


def _assert_every_device_equal(got, ref):
    for k in range(8):
        _assert_grads_equal(jax.tree.map(lambda x: x[k], got), ref)


def test_value_and_grad_inside_shard_map_check_vma(monkeypatch):
    must = ("trace_state", "varying_axes", "pcast_varying", "all_gather_invariant")
    _each_entry_off(monkeypatch, _grad_inside_shard_map, must)


def _grad_inside_shard_map(off):
    params, ids, y = _case(3)
    got, kinds, compiled = _shard_map_grads(params, ids, y)
    assert kinds == [_sparse_expected("shard_map", off)]
    _assert_every_device_equal(got, _summed_over_devices(params, ids, y))
    kinds_of = {c.kind for c in _hlo.collectives(compiled)}
    if kinds[0] and off == "all_gather_invariant":  # the psum fallback ran
        assert "all-gather" not in kinds_of and "all-reduce" in kinds_of
    elif kinds[0]:
        assert "all-gather" in kinds_of


def test_plain_jax_grad_inside_shard_map_check_vma():
    """The dense path every fallback lands on: JAX's gradient, summed over devices."""
    m = _mesh.mesh()
    params, ids, y = _case(7)
    f = jax.jit(
        jax.shard_map(
            jax.grad(_mesh.loss_fn),
            mesh=m,
            in_specs=(P(), P("data"), P("data")),
            out_specs=P(),
        )
    )
    _assert_grads_equal(f(params, ids, y), _summed_over_devices(params, ids, y))


def test_unknown_aval_layout_is_dense_never_no_axes(monkeypatch):
    """An aval type this module does not know: the table is dense, not wrong.

    Answering "no varying axes" here would tap every device's rows as if they
    were the same and return one device's gradient under ``check_vma``.
    """
    real = jax.typeof

    class Unknown:  # an aval of some future layout: no mat/manual_axis_type/vma
        def __init__(self, aval):
            self._aval = aval

        def __getattr__(self, name):
            if name in ("mat", "manual_axis_type", "vma"):
                raise AttributeError(name)
            return getattr(self._aval, name)

    monkeypatch.setattr(jax, "typeof", lambda x: Unknown(real(x)))
    assert _jax_compat.varying_axes(jnp.zeros(2)) is None
    params, ids, y = _case(4)
    got, kinds, _ = _shard_map_grads(params, ids, y)
    assert kinds == [False]
    _assert_every_device_equal(got, _summed_over_devices(params, ids, y))


def test_data_parallel_jit_step(monkeypatch):
    must = ("abstract_mesh", "axis_types", "varying_axes", "ffi_primitive")
    _each_entry_off(monkeypatch, _data_parallel_step, must)


def _data_parallel_step(off):
    m = _mesh.mesh()
    num_rows = 2048  # well above the global batch, so table-sized is telling
    tx = registry.optimizer("sgd")
    params = _mesh.init_params(num_rows, D, 5)
    ids, y = _mesh.batch(num_rows, B, L, seed=5)
    # Traced afresh, under the entry taken away (the session's cached
    # reference step would keep the switch of its first trace).
    ref = jax.jit(_mesh.make_step(tx))(params, tx.init(params), ids, y)
    rep, bat = NamedSharding(m, P()), NamedSharding(m, P("data"))
    args = (
        jax.device_put(params, rep),
        jax.device_put(tx.init(params), rep),
        jax.device_put(ids, bat),
        jax.device_put(y, bat),
    )
    compiled = jax.jit(_mesh.make_step(tx)).lower(*args).compile()
    _mesh.assert_trees_close(compiled(*args), ref)
    # The cost of the fallbacks, as documented: without the mesh (or its axis
    # kinds) XLA lays out the SGD scatter itself and all-reduces the table;
    # without varying_axes the gradient itself is dense.
    big = _hlo.table_sized(compiled, num_rows, D)
    slower = ("abstract_mesh", "axis_types", "varying_axes")
    assert bool(big) == (off in slower), big


def test_all_to_all_routing_on_a_2d_mesh(monkeypatch):
    must = ("abstract_mesh", "shard_map", "manual_axes", "manual_axis_avals",
            "lowering_context", "callback_logs", "all_gather_invariant")  # fmt: skip
    _each_entry_off(monkeypatch, _routed_on_a_2d_mesh, must)


def _routed_on_a_2d_mesh(off):
    del off  # every entry: the same numbers as one device
    # "model" x "data": the update all-gathers rows over the table's replicas.
    m = _mesh.mesh((4, 2), ("model", "data"))
    tx = registry.optimizer("adagrad")
    params, ids, y = _case(6)
    # Traced afresh, under the entry taken away (the session's cached
    # reference step would keep the switch of its first trace).
    ref = jax.jit(_mesh.make_step(tx))(params, tx.init(params), ids, y)
    route = dict(axis="model", routing="all_to_all", mesh=m)

    def step(params, state, ids, y):
        lookup = lambda t, i: js.sharding.sharded_lookup(t, i, **route)  # noqa: E731
        loss, grads = js.value_and_grad(_mesh.loss_fn)(params, ids, y, lookup)
        params, state = js.sharding.sharded_update(tx, grads, state, params, **route)
        return params, state, loss

    sharded = {
        "emb": js.sharding.shard_rows(params["emb"], m, "model"),
        "w": jax.device_put(params["w"], NamedSharding(m, P())),
    }
    bat = NamedSharding(m, P(("model", "data")))
    out = jax.jit(step)(
        sharded, js.sharding.sharded_init(tx, sharded), *jax.device_put((ids, y), bat)
    )
    _mesh.assert_trees_close(out, ref)


def test_all_to_all_without_a_mesh_and_without_abstract_mesh_asks_for_one(
    monkeypatch,
):
    monkeypatch.setitem(_jax_compat.AVAILABLE, "abstract_mesh", False)
    m = _mesh.mesh((8,), ("model",))
    table = js.sharding.shard_rows(jnp.ones((V, D)), m, "model")
    ids = jax.device_put(jnp.zeros((8, 2), jnp.int32), NamedSharding(m, P("model")))
    route = dict(axis="model", routing="all_to_all")
    f = jax.jit(lambda t, i: js.sharding.sharded_lookup(t, i, **route))
    with pytest.raises(ValueError, match="pass `mesh=`"):
        f(table, ids)


def test_typed_index_messages(monkeypatch):
    _each_entry_off(monkeypatch, _typed_index_messages, ("key_array_class",))


def _typed_index_messages(off):
    g = js.IndexedSlices(jnp.ones((3, 2)), jnp.array([0, 4, 4]), (4, 2))
    child = jax.tree.leaves(g)[1]
    named = rf"IndexedSlices(.|\n)*{re.escape('jaxslices.global_norm')}"
    if off == "key_array_class":  # JAX's own error: still an error, no number
        with pytest.raises((NotImplementedError, TypeError)) as info:
            child.real  # noqa: B018
        assert "IndexedSlices" not in str(info.value)
    else:
        with pytest.raises(TypeError, match=named):
            child.real  # noqa: B018
        with pytest.raises(TypeError, match=named):
            child.astype(jnp.float32)
    # Under jit JAX's own error names the fix, with or without the patch.
    with pytest.raises(TypeError, match=named):
        jax.jit(lambda g: jax.tree.map(lambda x: 2 * x, g))(g)
    # Other keys are never touched.
    with pytest.raises(NotImplementedError, match="abstract method"):
        jax.random.key(0).real  # noqa: B018


# ------------------------------------------------------------- version gates


@pytest.fixture
def fresh_warning(monkeypatch):
    """The once-per-process warning, not yet given."""
    monkeypatch.setattr(_jax_compat, "_warned_untested", False)


def test_a_newer_jax_warns_once_naming_the_tested_range(monkeypatch, fresh_warning):
    monkeypatch.setattr(_jax_compat, "JAX_VERSION", (0, 13, 0))
    monkeypatch.setattr(jax, "__version__", "0.13.0")
    with pytest.warns(_jax_compat.UntestedJaxWarning) as record:
        assert _jax_compat.warn_if_untested()
        assert not _jax_compat.warn_if_untested()  # once
    (w,) = record
    assert str(w.message).startswith(
        "jaxslices is tested with JAX 0.10.2 to 0.12.x (newest tested: 0.12.1); "
        "JAX 0.13.0 is installed, a newer line that has not been tested."
    )
    assert 'pip install "jax<0.13"' in str(w.message)
    assert issubclass(_jax_compat.UntestedJaxWarning, UserWarning)


@pytest.mark.parametrize("version", [(0, 10, 2), (0, 11, 0), (0, 12, 0), (0, 12, 7)])
def test_the_tested_lines_do_not_warn(monkeypatch, fresh_warning, version):
    monkeypatch.setattr(_jax_compat, "JAX_VERSION", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _jax_compat.warn_if_untested()


def test_newest_tested_moves_every_gate():
    # One place: the warning, the key-array gate and the native gate all end
    # at the line after NEWEST_TESTED.
    from jaxslices.native import _hijax

    newest = _jax_compat.parse_version(_jax_compat.NEWEST_TESTED)
    assert _jax_compat.UNTESTED_FROM == (newest[0], newest[1] + 1, 0) == (0, 13, 0)
    assert _jax_compat.KEY_ARRAY_CLASS_VERSIONS[1] == _jax_compat.UNTESTED_FROM
    assert _hijax.SUPPORTED_RANGE[1] == _jax_compat.UNTESTED_FROM
    assert _hijax.SUPPORTED_RANGE[0] == _jax_compat.parse_version(
        _jax_compat.OLDEST_TESTED
    )


_IMPORT_ON = """
import warnings, jax
jax.__version__ = {version!r}
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as got:
    import jaxslices
    import jaxslices.transforms, jaxslices.sharding  # more imports: no more
print("WARNINGS", len(got))
for w in got:
    print(w.category.__name__, str(w.message))
try:
    import jaxslices.native
    print("NATIVE ok")
except ImportError as e:
    print("NATIVE", type(e).__name__, e)
"""


@pytest.mark.parametrize("version", ["0.13.0", jax.__version__])
def test_import_on_a_newer_jax_warns_once(version):
    """``import jaxslices`` with JAX reporting a newer line (in a subprocess)."""
    out = _python(_IMPORT_ON.format(version=version))
    if version == jax.__version__:  # a tested JAX: nothing
        assert "WARNINGS 0" in out and "NATIVE ok" in out, out
        return
    assert "WARNINGS 1" in out, out
    assert "UntestedJaxWarning jaxslices is tested with JAX 0.10.2 to 0.12.x" in out
    native = "NATIVE UnsupportedJaxError jaxslices.native needs JAX >= 0.10.2 and <"
    assert native + " 0.13.0" in out, out
    assert "run on every JAX >= 0.10.2 (on a line newer than the newest" in out


def test_key_array_patch_gate(monkeypatch):
    """A class with the layout of JAX's key arrays, patched only where tested."""
    calls = []

    class Keys:
        def __array__(self, dtype=None):
            return np.zeros(1)

        @property
        def real(self):
            raise NotImplementedError("Cannot call abstract method real")

        real.fget.__isabstractmethod__ = True

    def wrap(name, original):
        def method(self, *a, **k):
            calls.append(name)
            return original(self, *a, **k)

        return method

    monkeypatch.setattr(_jax_compat, "JAX_VERSION", (0, 13, 0))  # untested
    assert not _jax_compat.patch_key_array_class(Keys, wrap)
    monkeypatch.setattr(_jax_compat, "JAX_VERSION", (0, 12, 0))
    assert _jax_compat.patch_key_array_class(Keys, wrap)
    np.asarray(Keys())
    with pytest.raises(NotImplementedError):
        Keys().real  # noqa: B018
    assert calls == ["__array__", "real"]

    class NotKeys:  # no abstract methods: not the layout, left alone
        def __array__(self, dtype=None):
            return np.zeros(1)

    assert not _jax_compat.patch_key_array_class(NotKeys, wrap)
    assert _typed_indices.MESSAGES_INSTALLED in (None, True)


# ------------------------------------ entries added for checkpoints and checks


def test_key_impl_names_resolve_to_the_typed_indices():
    assert _typed_indices.NAMES_REGISTERED
    for dtype, name in _typed_indices.NAMES.items():
        words = 1 if dtype == _typed_indices.DTYPE32 else 2
        got = jax.eval_shape(
            lambda n=name, w=words: jax.random.wrap_key_data(
                jnp.zeros((3, w), jnp.uint32), impl=n
            )
        )
        assert got.dtype == dtype
    # Registering again (a module reload) is accepted; a foreign tag is not.
    assert _jax_compat.register_key_impl_names(_typed_indices.NAMES, _typed_indices.TAG)
    assert not _jax_compat.register_key_impl_names(_typed_indices.NAMES, "other")


def test_key_impl_names_off_registers_nothing(monkeypatch):
    monkeypatch.setitem(_jax_compat.AVAILABLE, "key_impl_names", False)
    assert not _jax_compat.register_key_impl_names(
        _typed_indices.NAMES, _typed_indices.TAG
    )


@pytest.mark.parametrize("off", [False, True])
def test_key_full_rule(monkeypatch, off):
    """On: ones_like of typed ids raises, zeros_like touches no row. Off: JAX's
    own rule runs (the ids become the fill value: what the entry prevents)."""
    assert _typed_indices.FULL_RULE_INSTALLED
    if off:
        monkeypatch.setitem(_jax_compat.AVAILABLE, "key_full_rule", False)
    s = js.IndexedSlices(jnp.ones((3, 2)), jnp.array([4, 2, 4]), (5, 2))
    ones = jax.jit(lambda t: jax.tree.map(jnp.ones_like, t))
    zeros = jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t))
    if off:
        np.testing.assert_array_equal(ones(s).indices, [1, 1, 1])
        np.testing.assert_array_equal(zeros(s).indices, [0, 0, 0])
    else:
        with pytest.raises(TypeError, match=r"IndexedSlices(.|\n)*tree_map_values"):
            ones(s)
        np.testing.assert_array_equal(zeros(s).indices, [-1, -1, -1])
    other = jax.random.key(0)  # every other key dtype: JAX's rule
    assert jax.random.key_data(jnp.zeros_like(other)).tolist() == [0, 0]


def test_manual_axes_inside_and_outside_shard_map(monkeypatch):
    m = _mesh.mesh((2, 4), ("a", "b"))
    seen = []

    def f(x):
        seen.append(_jax_compat.manual_axes())
        return x

    jax.jit(jax.shard_map(f, mesh=m, in_specs=P(("a", "b")), out_specs=P(("a", "b"))))(
        jnp.zeros(8)
    )
    assert seen == [("a", "b")]
    assert _jax_compat.manual_axes() == ()
    monkeypatch.setitem(_jax_compat.AVAILABLE, "manual_axes", False)
    seen.clear()
    jax.jit(jax.shard_map(f, mesh=m, in_specs=P(("a", "b")), out_specs=P(("a", "b"))))(
        jnp.zeros(8) + 1
    )
    assert seen == [()]
