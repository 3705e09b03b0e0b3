"""Write the measured numbers quoted in README.md and docs/ from benchmarks/results/.

Every number that README.md or a page in docs/ quotes from a measurement lives in
a generated block::

    <!-- BEGIN GENERATED: name -->
    ...text made by the function registered as ``name`` below...
    <!-- END GENERATED: name -->

``python tools/render_docs.py`` rewrites every block from the JSON files in
``benchmarks/results/`` (one dated folder per run, ``<yyyy-mm>-<backend>``);
``--check`` only reports blocks that are out of date (exit status 1).
``tests/repo/test_docs.py`` runs the check, so a results file and the prose
quoting it cannot drift apart, and it refuses measured quantities (``12 ms``,
``3.4x``, ``5 MB``) written by hand outside such blocks.

Which results file each block quotes is :data:`SOURCES`, the one place to
change when a new run replaces an old one; ``benchmarks/results/README.md``
lists it in a generated block of its own (``results-sources``).

To quote a new number: add a function here that reads it from a results file,
register it in ``BLOCKS`` and its files in ``SOURCES``, put an empty block
with its name in the page and run this script.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_README = "benchmarks/results/README.md"
PAGES = [
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md")),
    RESULTS_README,
]

#: The results files (under ``benchmarks/results/``) each generated block quotes.
SOURCES: dict[str, tuple[str, ...]] = {
    "readme-benchmarks": (
        "2026-11-cpu-rerun/step_bench_cpu.json",
        "2026-11-gpu/step_bench_gpu.json",
    ),
    "readme-demo": (
        "2026-11-cpu-demo/movielens.json",
        "2026-11-cpu-demo/movielens_xla.json",
    ),
    "examples-movielens": ("2026-11-cpu/movielens.json",),
    "design-coalesce": (
        "2026-11-cpu/coalesce_bench_cpu.json",
        "2026-11-gpu/coalesce_bench_gpu.json",
    ),
    "densify-crossover": ("2026-11-cpu/step_bench_crossover_cpu.json",),
    "design-typed-cost": ("2026-11-cpu/typed_indices_cost_cpu.json",),
    "design-checks-cost": ("2026-11-cpu/checks_cost_cpu.json",),
    "design-check-dispatch": ("2026-11-cpu-checks/check_dispatch_cpu.json",),
    "optimizer-floor": ("2026-11-cpu-floor-quiet/optimizer_floor_bench_cpu.json",),
    "optimizer-floor-gpu": (
        "2026-11-gpu-h200/optimizer_floor_bench_gpu.json",
        "2026-11-gpu-h200/optimizer_floor_bench_cpu_xeon16.json",
    ),
    "collections-gpu": (
        "2026-11-gpu-h200/dlrm_bench_gpu.json",
        "2026-11-gpu-h200/dlrm_bench_gpu_run2.json",
        "2026-11-gpu-h200/dlrm_bench_gpu_linear.json",
        "2026-11-gpu-h200/dlrm_bench_gpu_linear_b512.json",
    ),
    "collections-dlrm": (
        "2026-11-cpu-dlrm-quiet/dlrm_bench_cpu.json",
        "2026-11-cpu-dlrm-quiet/dlrm_bench_cpu_run2.json",
        "2026-11-cpu-dlrm-quiet/dlrm_bench_cpu_linear.json",
        "2026-11-cpu-dlrm-quiet/dlrm_bench_cpu_freed.json",
        "2026-11-cpu-dlrm-quiet/dlrm_bench_cpu_freed_threads.json",
        "2026-11-cpu-dlrm-quiet/dlrm_bench_cpu_freed_threads_run2.json",
        "2026-11-cpu-dlrm-quiet/dlrm_bench_cpu_linear_freed.json",
    ),
    "collections-batch": (
        "2026-11-cpu-dlrm-quiet/dlrm_bench_cpu_linear_b128.json",
        "2026-11-cpu-dlrm-quiet/dlrm_bench_cpu_linear_b512.json",
        "2026-11-cpu-dlrm-quiet/dlrm_bench_cpu_linear.json",
    ),
    "kernels-peers": ("2026-12-cpu-peers/peers_bench_cpu.json",),
    "readme-kernels": ("2026-11-cpu-threads/peers_bench_cpu.json",),
    "kernels-floor": (
        "2026-11-cpu-native/optimizer_floor_bench_cpu_bag.json",
        "2026-11-h100-host-cpu/optimizer_floor_bench_cpu_bag_xeon16.json",
    ),
    "kernels-dlrm": (
        "2026-11-cpu-threads/dlrm_bench_cpu.json",
        "2026-11-cpu-threads/dlrm_bench_cpu_xla.json",
    ),
    "kernels-soak": ("2026-11-cpu-threads/soak_bench_cpu.json",),
    "kernels-lowp": ("2026-12-cpu-lowp/lowp_bench_cpu.json",),
    "kernels-threads": (
        "2026-11-cpu-threads/peers_bench_cpu.json",
        "2026-11-cpu-threads/threads_bench_cpu.json",
    ),
    "kernels-sgd-duplicates": ("2026-11-cpu-native/sgd_duplicates_bench_cpu.json",),
    "donation": (
        "2026-11-cpu-donation/step_bench_cpu.json",
        "2026-11-cpu-donation-rerun/step_bench_cpu.json",
    ),
    "scale-out-plans": ("2026-11-cpu-plans/plan_scale_bench_cpu.json",),
    "optax-low-precision": ("2026-11-cpu-lowp-movielens/low_precision.json",),
    "managed-cost": ("2026-12-cpu-managed/managed_bench_cpu.json",),
    "managed-ids": ("2026-12-cpu-managed/managed_ids.json",),
}

_BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)"
    r"(<!-- END GENERATED: (?P=name) -->)",
    re.S,
)


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _median_ms(rows: list[dict], num_rows: int, optimizer: str, path: str) -> float:
    for r in rows:
        if (r["num_rows"], r["optimizer"], r["path"]) == (num_rows, optimizer, path):
            return r["median_ms"]
    raise KeyError(f"no row V={num_rows} optimizer={optimizer} path={path}")


def _rows_label(v: int) -> str:
    if v % (1 << 20) == 0:
        return f"{v >> 20}M"
    if v % (1 << 10) == 0:
        return f"{v >> 10}K"
    return str(v)


def readme_benchmarks() -> str:
    """The README's summary of the step benchmark (CPU and GPU runs)."""
    cpu_file, gpu_file = SOURCES["readme-benchmarks"]
    cpu = load(cpu_file)  # the newest CPU run
    rows = cpu["rows"]
    big = max(r["num_rows"] for r in rows)

    def ratio(opt, a, b):
        return _median_ms(rows, big, opt, a) / _median_ms(rows, big, opt, b)

    sgd_speedup = ratio("sgd", "dense", "jaxslices")
    sgd_floor = ratio("sgd", "jaxslices", "floor")
    adam_speedup = ratio("adam", "dense", "jaxslices")
    text = (
        f"A training step (1024 x 16 Zipf ids, `V x 64` table) with jaxslices costs\n"
        f"what the batch touches. On a {cpu.get('nproc', 2)}-core CPU "
        f"(`{cpu_file}`), at V = {_rows_label(big)}\n"
        f"SGD is {sgd_speedup:.0f}x faster than the dense Optax path and "
        f"{sgd_floor:.2f}x the time of a\n"
        f"hand-written sparse step; lazy Adam is {adam_speedup:.0f}x faster than "
        f"dense Adam (a shared, loaded machine: the dense\n"
        f"times are the noisiest; see `benchmarks/RESULTS.md`)."
    )
    if (RESULTS / gpu_file).exists():
        gpu = load(gpu_file)
        js = [r for r in gpu["rows"] if r["path"] == "jaxslices"]
        vs = sorted({r["num_rows"] for r in js})
        lo = min(r["median_ms"] for r in js)
        hi = max(r["median_ms"] for r in js)
        text += (
            f"\nOn an {gpu.get('device', 'GPU')} (`{gpu_file}`, an earlier "
            f"version of the library) every "
            f"jaxslices optimizer takes\n"
            f"{lo:.2f}-{hi:.2f} ms per step from V = {_rows_label(vs[0])} to "
            f"{_rows_label(vs[-1])}."
        )
    return text + "\n"


def design_coalesce() -> str:
    """docs/design.md: the coalescing timings behind the default methods."""
    out = []
    labels = {"cpu": "2 CPU cores", "gpu": "an H100"}
    for name in SOURCES["design-coalesce"]:
        if not (RESULTS / name).exists():
            continue
        data = load(name)
        label, res = labels[data["backend"]], data["results"]
        t = {k: [] for k in res[0]["timings"]}
        for r in res:
            for k, v in r["timings"].items():
                t.setdefault(k, []).append(v["median_ms"])
        med = {k: statistics.median(v) for k, v in t.items() if v}
        parts = ", ".join(
            f"{k} {med[k]:.2f} ms"
            for k in ("library", "pair_sort", "unique", "hash")
            if k in med
        )
        n = res[0]["n"]
        dim = res[0]["dim"]
        out.append(
            f"* {label} (`{name}`, {n} x {dim} Zipf ids, "
            f"median over table sizes): {parts}."
        )
    return "\n".join(out) + "\n"


def densify_crossover() -> str:
    """Where `densify()` stops paying off (the crossover run of step_bench)."""
    (name,) = SOURCES["densify-crossover"]
    d = load(name)
    med: dict[tuple[int, str], dict[str, float]] = {}
    for r in d["rows"]:
        med.setdefault((r["num_rows"], r["optimizer"]), {})[r["path"]] = r["median_ms"]
    sizes = sorted({v for v, _ in med})
    opts = sorted({o for _, o in med})
    wins = {
        v: [o for o in opts if med[(v, o)]["densify"] < med[(v, o)]["jaxslices"]]
        for v in sizes
    }
    all_win = [v for v in sizes if len(wins[v]) == len(opts)]
    none_win = [v for v in sizes if not wins[v]]
    lines = [
        f"Measured on {d.get('nproc', 2)} CPU cores for {d['workload']['dim']}-wide "
        f"float32 rows (`{name}`, "
        f"{', '.join(o.replace('_', ' + ') for o in opts)}):"
    ]
    for v in sizes:
        ratios = ", ".join(
            f"{o} {med[(v, o)]['jaxslices'] / med[(v, o)]['densify']:.2f}x"
            for o in opts
        )
        lines.append(f"* V = {_rows_label(v)}: densify speed-up {ratios}")
    if all_win and none_win:
        lines.append(
            f"\nSo `densify` pays off up to about {_rows_label(max(all_win))} rows "
            f"and loses from {_rows_label(min(none_win))} rows on; use it "
            f"(`max_rows={max(all_win)}`) for tables of at most that many rows."
        )
    return "\n".join(lines) + "\n"


def _load(env: dict) -> str:
    load = env.get("load_average_1min")
    return "" if load is None else f"; load average {load:.1f} at the start"


def examples_movielens() -> str:
    """docs/examples.md: the demo's run (``python examples/demo.py --out ...``)."""
    (name,) = SOURCES["examples-movielens"]
    r = load(name)
    st, env, big = r["settings"], r["environment"], r["large"]
    s, d = r["sparse"], r["dense"]
    return (
        f"{r['dataset']}, {r['num_ratings']} ratings ({r['num_users']} users, "
        f"{r['num_items']} items), {s['steps']} steps of {st['batch_size']} "
        f"ratings ({st['epochs']} epochs), dimension {st['dim']}, L2 {st['reg']} "
        f"on the looked-up rows, {r['optimizer']}; jax {env['jax']} on "
        f"{env['cpus']} CPU cores (`benchmarks/results/{name}`, "
        f"{r['seconds']:.0f} s of training and timing{_load(env)}):\n\n"
        "| model | test RMSE |\n|---|---|\n"
        f"| global mean | {r['global_mean_rmse']:.4f} |\n"
        f"| per-item mean (shrunk) | {r['item_mean_rmse']:.4f} |\n"
        f"| MF, jaxslices (sparse) | **{s['test_rmse']:.4f}** |\n"
        f"| MF, Optax (dense) | **{d['test_rmse']:.4f}** |\n\n"
        f"The two loss curves differ by at most {r['max_loss_gap']:.1e} over "
        f"{s['steps']} steps.\n\n"
        "| median ms per step | jaxslices | dense Optax | speed-up |\n"
        "|---|---|---|---|\n"
        f"| MovieLens tables ({r['num_items']} item rows) | "
        f"{s['median_step_ms']:.2f} | {d['median_step_ms']:.2f} | "
        f"{d['median_step_ms'] / s['median_step_ms']:.1f}x |\n"
        f"| item tables grown to {big['item_rows']:,} rows ({big['steps']} steps) "
        f"| {big['sparse']['median_step_ms']:.2f} | "
        f"{big['dense']['median_step_ms']:.2f} | {big['speedup']:.0f}x |\n"
    )


def optax_low_precision() -> str:
    """docs/optax.md: ``python examples/low_precision.py --out ...``."""
    (name,) = SOURCES["optax-low-precision"]
    r = load(name)
    st = r["settings"]
    ref = r["variants"]["float32"]["test_rmse"]
    lines = [
        f"{r['dataset']}, the model of `examples/movielens.py` (dimension "
        f"{st['dim']}, {st['epochs']} epochs of {st['batch_size']} ratings, "
        f"`jaxslices.adagrad({st['lr']})`), the same batches for every variant "
        f"(`python examples/low_precision.py --out ...`, "
        f"`benchmarks/results/{name}`):",
        "",
        "| variant | tables | Adagrad state | rounding | test RMSE | minus float32 "
        "| table bytes | state bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, v in r["variants"].items():
        rounding = "stochastic" if v["stochastic_rounding"] else "to nearest"
        if key == "float32":
            rounding = "-"
        lines.append(
            f"| `{key}` | {v['table_dtype']} | {v['state_dtype']} | {rounding} | "
            f"{v['test_rmse']:.4f} | {v['test_rmse'] - ref:+.4f} | "
            f"{sum(v['table_bytes'].values()):,} | {v['optimizer_state_bytes']:,} |"
        )
    runs = r.get("dlrm")
    if runs:
        d = next(iter(runs.values()))["settings"]
        ref = runs["float32"]["final_eval"]
        lines += [
            "",
            f"The DLRM of `examples/dlrm.py` ({next(iter(runs.values()))['rows']:,} "
            f"rows x {d['dim']} in one buffer, {d['steps']} steps of {d['batch']}, "
            f"row-wise Adagrad({d['lr']}), whose state is float32 always; label "
            f"entropy {runs['float32']['label_entropy']:.4f}), the same run:",
            "",
            "| variant | held-out log loss | minus float32 | table bytes |",
            "|---|---|---|---|",
        ]
        for key, v in runs.items():
            lines.append(
                f"| `{key}` | {v['final_eval']:.4f} | {v['final_eval'] - ref:+.4f} | "
                f"{v['table_bytes']:,} |"
            )
    return "\n".join(lines) + "\n"


def readme_demo() -> str:
    """README: what the demo prints, on the native kernels and on the XLA path.

    Two runs of ``python examples/demo.py`` one after the other on one machine:
    as it comes (the native kernels) and with ``JAXSLICES_NATIVE=0`` (the XLA
    path, as without a compiler); each file records its path (``kernels``).
    """
    native_name, xla_name = SOURCES["readme-demo"]
    r, x = load(native_name), load(xla_name)
    for name, d, native in ((native_name, r, True), (xla_name, x, False)):
        if d["environment"]["kernels"].startswith("loaded") != native:
            raise ValueError(
                f"{name}: expected a run on the {'native' if native else 'XLA'} "
                f"path, it says {d['environment']['kernels']!r}"
            )
    s, big, xbig = r["sparse"], r["large"], x["large"]
    return (
        f"It prints (`benchmarks/results/{native_name}`, "
        f"{r['environment']['cpus']} CPU cores{_load(r['environment'])}): "
        f"test RMSE {s['test_rmse']:.4f} "
        f"for jaxslices and {r['dense']['test_rmse']:.4f} for dense Optax (item-mean "
        f"baseline {r['item_mean_rmse']:.4f}); with {big['item_rows']:,}-row item "
        f"tables a jaxslices step takes {big['sparse']['median_step_ms']:.2f} ms "
        "on its native CPU kernels, "
        f"a dense Optax step {big['dense']['median_step_ms']:.1f} ms "
        f"({big['speedup']:.0f}x). On the XLA path (without a C++ compiler, or "
        f"with `JAXSLICES_NATIVE=0`; `{Path(xla_name).name}`, run right after"
        f"{_load(x['environment'])}) a jaxslices step takes "
        f"{xbig['sparse']['median_step_ms']:.2f} ms, a dense Optax step "
        f"{xbig['dense']['median_step_ms']:.1f} ms ({xbig['speedup']:.0f}x). "
        "Details: [docs/examples.md](docs/examples.md).\n"
    )


def design_typed_cost() -> str:
    """docs/design.md: step time with plain vs typed indices (typed_indices_cost)."""
    d = load(SOURCES["design-typed-cost"][0])
    lines = [
        "| run | code | SGD jaxslices | SGD floor | ratio | clip+SGD jaxslices "
        "| clip+SGD floor | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios: dict[str, dict[str, list[float]]] = {}
    for r in d["runs"]:
        sgd = r["sgd_jaxslices_ms"] / r["sgd_floor_ms"]
        clip = r["clip_sgd_jaxslices_ms"] / r["clip_sgd_floor_ms"]
        ratios.setdefault(r["code"], {"sgd": [], "clip": []})
        ratios[r["code"]]["sgd"].append(sgd)
        ratios[r["code"]]["clip"].append(clip)
        lines.append(
            f"| {r['run']} | {r['code']} | {r['sgd_jaxslices_ms']:.2f} | "
            f"{r['sgd_floor_ms']:.2f} | {sgd:.2f}x | {r['clip_sgd_jaxslices_ms']:.2f} "
            f"| {r['clip_sgd_floor_ms']:.2f} | {clip:.2f}x |"
        )
    med = {
        code: {k: statistics.median(v) for k, v in rs.items()}
        for code, rs in ratios.items()
    }
    lines.append("")
    lines.append(
        "Median ratio over the runs: SGD "
        + ", ".join(f"{med[c]['sgd']:.2f}x ({c})" for c in med)
        + "; clip+SGD "
        + ", ".join(f"{med[c]['clip']:.2f}x ({c})" for c in med)
        + "."
    )
    return "\n".join(lines) + "\n"


#: The optimizer floor's goal on a GPU: every optimizer within this of its SGD.
GPU_FLOOR_GOAL = 1.2


def optimizer_floor_gpu() -> str:
    """docs/optax.md: the optimizer-floor benchmark on a GPU (and its host CPU)."""
    gpu_name, cpu_name = SOURCES["optimizer-floor-gpu"]
    g, c = load(gpu_name), load(cpu_name)
    env = g["environment"]
    big = max(g["summary"]["vs"])
    lines = [
        f"Measured on one {env['device']} (jax {env['jax']}, the newest JAX that "
        "machine holds), `benchmarks/results/"
        f"{gpu_name}`: `python benchmarks/optimizer_floor_bench.py --trees . "
        f"--labels new --repeats {g['repeats']} --out <folder>`, {g['repeats']} "
        "runs; each cell the median over the runs of (median step time / the "
        "floor's SGD step time), in one process.",
        "",
        g["table"],
        "",
        f"Goal on a GPU: every optimizer within {GPU_FLOOR_GOAL}x of the floor's "
        f"SGD at V = {_rows_label(int(big))} (the better of the two jaxslices "
        "columns):",
        "",
    ]
    for row in g["summary"]["rows"]:
        if row["num_rows"] != big or row["optimizer"] == "sgd":
            continue
        best = min(
            x
            for x in (row.get("new/bounded"), row.get("new/jaxslices"))
            if x is not None
        )
        met = "met" if best <= GPU_FLOOR_GOAL else "missed"
        lines.append(f"- {row['optimizer']}: {best:.2f}x, {met}")
    cenv = c["environment"]
    lines += [
        "",
        f"The same benchmark on that machine's CPU ({cenv['nproc']} cores, "
        f"{cenv['cpu']}, jax {cenv['jax']}, one run, `benchmarks/results/"
        f"{cpu_name}`):",
        "",
        c["table"],
    ]
    return "\n".join(lines) + "\n"


def collections_gpu() -> str:
    """docs/collections.md: the DLRM benchmark on a GPU."""
    files = SOURCES["collections-gpu"]
    runs = [(f, load(f)) for f in files]
    env = runs[0][1]["environment"]
    lines = [
        f"Measured on one {env['device']}, jax {env['jax']} (no TorchRec there). "
        "Each cell: median ms per step, and its ratio to the collection "
        "(`KeyedJaggedIds`) of the same run; 26 tables, "
        f"{runs[0][1]['rows']:,} rows x {runs[0][1]['settings']['dim']}, "
        "row-wise Adagrad. Columns:",
        "",
    ]
    for i, (f, d) in enumerate(runs):
        s = d["settings"]
        what = "DLRM step" if s["head"] == "dlrm" else "sparse part (linear head)"
        lines.append(f"{i + 1}. {what}, batch {s['batch']} (`{Path(f).name}`)")
    lines += ["", "| path | " + " | ".join(str(i + 1) for i in range(len(runs))) + " |"]
    lines.append("| --- |" + " --- |" * len(runs))
    for p, label in _DLRM_PATHS.items():
        cells = []
        for _, d in runs:
            m, base = d["paths"].get(p), d["paths"]["collection"]["median_ms"]
            cells.append(
                "-"
                if m is None
                else f"{m['median_ms']:.2f} ({m['median_ms'] / base:.2f}x)"
            )
        if any(c != "-" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def design_check_dispatch() -> str:
    """docs/design.md: a check as a pure callback vs as an effect (dispatch)."""
    (name,) = SOURCES["design-check-dispatch"]
    d = load(name)
    env, w = d["environment"], d["workload"]
    lines = [
        f"Measured on {env['nproc']} shared CPU cores ({env['cpu']}), jax "
        f"{env['jax']}, `benchmarks/results/{name}` (`{d['command']}`): median "
        f"of {w['steps'] * w['passes']} calls per variant, variants taking turns "
        "in one process. `scatter`: a 64-row scatter-add into a donated "
        f"(1024, 8) table; `clip_sgd`: `clip_by_global_norm(max_distinct="
        f"{w['clip_sgd']['max_distinct']})` + `sgd`, a lookup model with "
        f"V = {w['clip_sgd']['num_rows']:,}, D = {w['clip_sgd']['dim']}, "
        f"{w['clip_sgd']['batch']} x {w['clip_sgd']['bag']} ids, donated.",
        "",
        "| step | check | median per call | vs pure | extra per call |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in d["rows"]:
        lines.append(
            f"| `{r['step']}` | `{r['check']}` | {r['median_ms'] * 1e3:.1f} us | "
            f"{r['ratio_to_pure']:.2f}x | {r['extra_us']:+.1f} us |"
        )
    return "\n".join(lines) + "\n"


def design_checks_cost() -> str:
    """docs/design.md: HLO and step time of the run-time checks (checks_cost)."""
    d = load(SOURCES["design-checks-cost"][0])
    runs = d["runs"]
    codes = list(dict.fromkeys(r["code"] for r in runs))
    base, new = codes[0], codes[-1]
    hlo = {c: next(r["hlo"] for r in runs if r["code"] == c) for c in codes}
    same = [k for k in hlo[base] if hlo[base][k]["sha256"] == hlo[new][k]["sha256"]]
    changed = []
    for k in hlo[base]:
        if k in same:
            continue
        delta = [
            f"{hlo[new][k][op] - hlo[base][k][op]:+d} {op}"
            for op in ("all-reduce", "all-gather", "all-to-all", "conditional")
            if hlo[new][k][op] != hlo[base][k][op]
        ]
        changed.append(f"`{k}` ({', '.join(delta) or 'same op counts'})")
    steps = list(runs[0]["median_ms"])
    lines = [
        f"Compiled HLO identical in `{base}` and `{new}`: "
        + ", ".join(f"`{k}`" for k in same)
        + ". Changed: "
        + ", ".join(changed)
        + ".",
        "",
        "| run | code | " + " | ".join(steps) + " |",
        "| --- | --- |" + " --- |" * len(steps),
    ]
    for r in runs:
        cells = " | ".join(f"{r['median_ms'][k]:.2f}" for k in steps)
        lines.append(f"| {r['run']} | {r['code']} | {cells} |")
    med = {
        c: {
            k: statistics.median(r["median_ms"][k] for r in runs if r["code"] == c)
            for k in steps
        }
        for c in codes
    }
    lines.append("")
    lines.append(
        "Median over the runs: "
        + "; ".join(
            f"`{k}` " + ", ".join(f"{med[c][k]:.2f} ({c})" for c in codes)
            for k in steps
        )
        + "."
    )
    return "\n".join(lines) + "\n"


def optimizer_floor() -> str:
    """docs/optax.md: every optimizer against the floor's SGD step."""
    (name,) = SOURCES["optimizer-floor"]
    d = load(name)
    env, labels = d["environment"], d["labels"]
    loads = [x for pairs in d["loads"].values() for pair in pairs for x in pair]
    big = str(max(d["summary"]["vs"]))
    run = d["runs"][labels[0]][0]
    k, lo, hi = run["max_distinct"], run["min_distinct_seen"], run["max_distinct_seen"]
    spread = max(
        max(v) / min(v)
        for row in d["summary"]["rows"]
        for key, v in row.items()
        if key.endswith("/each") and all(x is not None for x in v)
    )
    lines = [
        f"Measured on {env['nproc']} shared CPU cores ({env['cpu']}), jax "
        f"{env['jax']}, `benchmarks/results/{name}`: {d['repeats']} runs of each "
        f"code tree ({', '.join(f'`{x}`' for x in labels)}), turn about; load "
        f"average (1 min) {min(loads):.1f} to {max(loads):.1f} during the runs. "
        "Each cell is the median over the runs of (median step time / the "
        "floor's SGD step time), both measured in one process; each run's "
        f"ratio is in the JSON (`summary`): on this shared machine the runs of "
        f"one cell differ by up to {spread:.1f}x. "
        f"`max_distinct` at V = {_rows_label(int(big))}: {k[big]} "
        f"(`estimate_max_distinct` over the workload's {d['workload']['num_batches']}"
        f" batches, which touch {lo[big]} to {hi[big]} distinct rows of "
        f"{d['workload']['batch'] * d['workload']['bag']} lookups each).",
        "",
        d["table"],
        "",
    ]
    for g in d["goals"]:
        verdict = "met" if g["met"] else "**missed**"
        lines.append(f"* {g['goal']}: {g['value']:.2f} ({verdict})")
    lines += ["", f"Command: `{d['command']}`."]
    return "\n".join(lines) + "\n"


_DLRM_PATHS = {
    "collection": "collection (`KeyedJaggedIds`)",
    "collection_padded": "collection (padded ids)",
    "separate": "26 separate tables",
    "dense": "dense Optax",
    "torchrec": "TorchRec/FBGEMM (torch's threads)",
    "torchrec_1thread": "TorchRec/FBGEMM (1 thread)",
}


def _dlrm_command(d: dict) -> str:
    s = d["settings"]
    cmd = f"python benchmarks/dlrm_bench.py --head {s['head']}"
    if s["batch"] != 2048:
        cmd += f" --batch {s['batch']}"
    if list(s["paths"]) != ["collection", "collection_padded", "separate", "dense"]:
        cmd += " --paths " + " ".join(s["paths"])
    if s.get("keep_freed_memory"):
        cmd += " --keep-freed-memory"
    if any(k.startswith("torchrec") for k in d["paths"]):
        threads = " ".join(str(t) for t in s["torch_threads"])
        cmd += f" --torch-threads {threads} --torchrec-python PATH"
    if s.get("tag"):
        cmd += f" --tag {s['tag']}"
    return cmd


def collections_dlrm() -> str:
    """docs/collections.md: the DLRM step four ways (dlrm_bench.py runs)."""
    files = SOURCES["collections-dlrm"]
    runs = [(f, load(f)) for f in files]
    cols = []
    for f, d in runs:
        s = d["settings"]
        what = "DLRM step" if s["head"] == "dlrm" else "sparse part (linear head)"
        malloc = ", freed memory kept" if s.get("keep_freed_memory") else ""
        load_ = d["load_avg_1m"]
        cols.append(
            f"{what}{malloc} (`{Path(f).name}`, load {load_['min']:.0f}-"
            f"{load_['max']:.0f})"
        )
    lines = [
        "Each cell: median wall ms per step / CPU ms per step (user + system, "
        "all threads of the process); batch 2048, 26 tables, "
        f"{runs[0][1]['rows']:,} rows x {runs[0][1]['settings']['dim']} "
        "(row-wise Adagrad on the embeddings, SGD on the MLPs). Columns:",
        "",
    ]
    lines += [f"{i + 1}. {c}" for i, c in enumerate(cols)]
    lines += ["", "| path | " + " | ".join(str(i + 1) for i in range(len(runs))) + " |"]
    lines.append("| --- |" + " --- |" * len(runs))
    for p, label in _DLRM_PATHS.items():
        cells = []
        for _, d in runs:
            m = d["paths"].get(p)
            cells.append(
                "-" if m is None else f"{m['median_ms']:.0f} / {m['cpu_ms']:.0f}"
            )
        if any(c != "-" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    d0 = runs[0][1]
    gap = max(max(v for v in d["check_max_abs_diff"].values()) for _, d in runs)
    comp = d0["paths"]
    lines += [
        "",
        f"The first {d0['settings']['check_steps']} losses of every path agree "
        f"within {gap:.1e} (the same model and data, computed six ways). "
        "Compile time of the DLRM step: collection "
        f"{comp['collection']['compile_s']:.0f} s, 26 separate tables "
        f"{comp['separate']['compile_s']:.0f} s; temporary "
        f"memory (XLA's memory analysis): collection "
        f"{comp['collection']['temp_mb']:.0f} MB, 26 tables "
        f"{comp['separate']['temp_mb']:.0f} MB, dense Optax "
        f"{comp['dense']['temp_mb']:.0f} MB (a table-sized gradient).",
        "",
        "Ratios of CPU time per step, collection (jagged) over the others:",
        "",
    ]
    groups: dict[tuple, list[dict]] = {}
    for _, d in runs:
        s_ = d["settings"]
        groups.setdefault((s_["head"], bool(s_.get("keep_freed_memory"))), []).append(d)
    for (head, freed), ds in groups.items():
        what = "DLRM step" if head == "dlrm" else "sparse part"
        what += ", freed memory kept" if freed else ", glibc defaults"
        parts = []
        for other in ("separate", "torchrec_1thread", "torchrec"):
            r = [
                d["paths"]["collection"]["cpu_ms"] / d["paths"][other]["cpu_ms"]
                for d in ds
                if other in d["paths"]
            ]
            if r:
                rng = f"{min(r):.2f}" if len(r) == 1 else f"{min(r):.2f}-{max(r):.2f}"
                parts.append(f"{rng} of {_DLRM_PATHS[other]}")
        lines.append(f"* {what}: " + ", ".join(parts) + ".")
    lines += [
        "",
        "Commands (results in "
        + ", ".join(sorted({f"`benchmarks/results/{Path(f).parent}/`" for f in files}))
        + "):",
        "",
    ]
    lines += [f"    {_dlrm_command(d)}" for _, d in runs]
    return "\n".join(lines) + "\n"


def collections_batch() -> str:
    """docs/collections.md: collection vs 26 tables as the batch grows."""
    rows = []
    for f in SOURCES["collections-batch"]:
        d = load(f)
        p = d["paths"]
        c, s = p["collection"], p["separate"]
        pad = p.get("collection_padded")
        rows.append(
            f"| {d['settings']['batch']} | {c['median_ms']:.1f} / {c['cpu_ms']:.1f} | "
            + (f"{pad['median_ms']:.1f} / {pad['cpu_ms']:.1f} | " if pad else "- | ")
            + f"{s['median_ms']:.1f} / {s['cpu_ms']:.1f} | "
            f"{s['median_ms'] / c['median_ms']:.2f}x | "
            f"{s['cpu_ms'] / c['cpu_ms']:.2f}x | `{Path(f).name}` |"
        )
    head = (
        "| batch | collection (jagged) ms / CPU ms | collection (padded) | "
        "26 tables | 26 tables / collection, wall | CPU | file |\n"
        "| --- | --- | --- | --- | --- | --- | --- |\n"
    )
    return head + "\n".join(rows) + "\n"


def donation() -> str:
    """docs/sparse_gradients.md: step times with and without donation (step_bench)."""
    paths = ("jaxslices", "js_nodonate", "dense", "dense_nodonate")
    head = [
        "run",
        "optimizer",
        "V",
        "jaxslices, donated",
        "jaxslices, not donated",
        "dense Optax, donated",
        "dense Optax, not donated",
        "copied per step, not donated",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    summary = []
    for run, name in enumerate(SOURCES["donation"], 1):
        rep = load(name)
        rows = rep["rows"]
        vs = sorted({r["num_rows"] for r in rows})
        for opt in ("sgd", "adam"):
            for v in vs:
                ms = [_median_ms(rows, v, opt, p) for p in paths]
                copied = next(
                    r["copied_bytes"]
                    for r in rows
                    if (r["num_rows"], r["optimizer"], r["path"])
                    == (v, opt, "js_nodonate")
                )
                cells = [str(run), opt, _rows_label(v)]
                cells += [f"{m:.2f} ms" for m in ms]
                cells.append(f"{copied / 2**20:.0f} MB")
                lines.append("| " + " | ".join(cells) + " |")
        big = vs[-1]
        ms = {p: _median_ms(rows, big, "sgd", p) for p in paths}
        summary.append(
            f"run {run} (`{name}`, load average {rep['load_avg_1m']:.1f} at the "
            "start): "
            f"{ms['js_nodonate'] / ms['jaxslices']:.0f}x slower without donation, "
            f"{ms['js_nodonate'] / ms['dense']:.2f}x the donated dense step"
        )
    return (
        "\n".join(lines)
        + f"\n\nSGD at V = {_rows_label(big)}, jaxslices not donated vs donated: "
        + "; ".join(summary)
        + ". Medians of 60 steps on 2 shared CPU cores (JAX "
        + f"{rep['jax']}), the paths of one configuration interleaved.\n"
    )


def scale_out_plans() -> str:
    """docs/scale_out.md: per-device rows and bytes of every plan, 2 to n devices."""
    (name,) = SOURCES["scale-out-plans"]
    d = load(name)
    w, devices = d["workload"], d["devices"]
    lo, hi = devices[0], devices[-1]
    shown = "rowwise_adagrad"
    rows = [r for r in d["rows"] if r["optimizer"] == shown]
    out = [
        f"Measured on {d['nproc']} CPU cores ({d['cpu']}) standing in for "
        f"{', '.join(map(str, devices))} devices, jax {d['jax']}: "
        f"{w['batch_per_device']} examples per device; 8 tables of "
        f"{w['rows'] // 8:,} x {w['dim']} (one id per example and table) or one "
        f"table of {w['rows']:,} x {w['dim']} (bags of 8 ids); {w['ids']} ids; "
        f"all-to-all capacities {w['capacity']}. Row-wise Adagrad (every "
        "optimizer below). Per device and step: table and optimizer-state rows "
        "read, and KB moved by collectives.",
        "",
    ]
    head = ["plan", "routing"]
    head += [f"rows, {n} dev." for n in devices] + [f"KB, {n} dev." for n in devices]
    head += [f"{hi} / {lo} dev. (rows, KB)"]
    out += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    keys = []
    for r in rows:
        if (r["plan"], r["routing"]) not in keys:
            keys.append((r["plan"], r["routing"]))
    for plan, routing in keys:
        by_n = {
            r["devices"]: r
            for r in rows
            if (r["plan"], r["routing"]) == (plan, routing)
        }
        cells = [plan.replace("_", "-"), routing.replace("_", "-")]
        cells += [f"{by_n[n]['gathered_rows']:,}" for n in devices]
        cells += [f"{by_n[n]['comm_bytes'] / 1024:,.0f}" for n in devices]
        g = by_n[hi]["gathered_rows"] / by_n[lo]["gathered_rows"]
        c = by_n[hi]["comm_bytes"] / by_n[lo]["comm_bytes"]
        cells.append(f"{g:.2f}x, {c:.2f}x")
        out.append("| " + " | ".join(cells) + " |")
    goal = {k: v for k, v in d["goal"].items()}
    worst_g = max(v["gathered_rows"] for v in goal.values())
    worst_c = max(v["comm_bytes"] for v in goal.values())
    met = all(v["met"] for v in goal.values())
    optimizers = sorted({k.split(" / ")[1] for k in goal})
    kinds = sorted({k.split(" / ")[0] for k in goal})
    out += [
        "",
        f"Every optimizer ({', '.join(optimizers)}), all-to-all routing, 8 over 2 "
        "devices (rows, KB):",
        "",
        "| plan | " + " | ".join(optimizers) + " |",
        "|" + " --- |" * (len(optimizers) + 1),
    ]
    for kind in kinds:
        cells = [kind.replace("_", "-")]
        for opt in optimizers:
            v = goal[f"{kind} / {opt}"]
            cells.append(f"{v['gathered_rows']:.2f}x, {v['comm_bytes']:.2f}x")
        out.append("| " + " | ".join(cells) + " |")
    verdict = "met" if met else "missed"
    out += [
        "",
        "Goal of the scaling plans: per-device rows and bytes at 8 devices within "
        f"1.25x of 2 devices for row-wise and table-wise plans: **{verdict}** for "
        f"every optimizer (the largest ratios: {worst_g:.2f}x rows, "
        f"{worst_c:.2f}x bytes; masked routing: the global batch's 4x).",
        "",
        f"Command (results in `benchmarks/results/{name.split('/')[0]}/`):",
        "",
        "    XLA_FLAGS=--xla_force_host_platform_device_count="
        f"{max(devices)} python benchmarks/plan_scale_bench.py --devices "
        f"{' '.join(map(str, devices))} --out benchmarks/results/{name.split('/')[0]}",
    ]
    return "\n".join(out) + "\n"


_PEERS_CONFIGS = {
    "fbgemm_1thread": "FBGEMM, 1 thread",
    "fbgemm_2threads": "FBGEMM, 2 threads",
    "xla": "jaxslices, XLA path",
    "native": "jaxslices, native kernels",
}
#: The peers goal: native <= 0.9x FBGEMM's 1-thread step (SGD, row-wise
#: Adagrad, Adagrad; both V).
PEERS_GOAL = 0.9


def _peers_table(d: dict) -> list[str]:
    rows = {(r["optimizer"], r["num_rows"], r["config"]): r for r in d["rows"]}
    configs = [c for c in _PEERS_CONFIGS if any(k[2] == c for k in rows)]
    keys = sorted({(o, v) for o, v, _ in rows}, key=lambda k: (k[1], k[0]))
    head = ["optimizer", "V", *[_PEERS_CONFIGS[c] for c in configs]]
    head += ["native / FBGEMM 1 thread", f"goal (<= {PEERS_GOAL}x)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for opt, v in keys:
        cells = [opt.replace("_", " "), _rows_label(v)]
        for c in configs:
            r = rows.get((opt, v, c))
            cells.append(
                "-" if r is None else f"{r['median_ms']:.2f} ({r['cpu_ms']:.2f})"
            )
        nat = rows.get((opt, v, "native"))
        if nat is None:
            cells += ["-", "-"]
        else:
            wall, cpu = (
                nat["ratio_to_fbgemm_1thread"],
                nat["cpu_ratio_to_fbgemm_1thread"],
            )
            cells.append(f"{wall:.2f}x ({cpu:.2f}x)")
            cells.append("met" if wall <= PEERS_GOAL else "**missed**")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def kernels_peers() -> str:
    """docs/kernels.md: the native path against FBGEMM (peers_bench runs)."""
    out = []
    for name in SOURCES["kernels-peers"]:
        d = load(name)
        env, load_ = d["environment"], d["load_avg_1m"]
        st = d["settings"]
        out += [
            f"`benchmarks/results/{name}`: {env['nproc']} shared CPU cores "
            f"({env['cpu']}), jax {env['jax']}, load average (1 min) "
            f"{load_['min']:.1f} to {load_['max']:.1f}; {st.get('batch')} bags x "
            f"{st.get('bag')} Zipf ids per step, mean pooling, a linear head; each "
            "configuration in its own process, taking turns; cells: median wall "
            "ms per step (CPU ms per step), medians over the sweeps; first losses "
            f"agree across all: {d['losses_agree']}.",
            "",
            *_peers_table(d),
            "",
            f"Command: `{d['command']}`.",
            "",
        ]
    return "\n".join(out)


def kernels_floor() -> str:
    """docs/kernels.md: every optimizer on the native path (optimizer floor)."""
    out = []
    for name in SOURCES["kernels-floor"]:
        d = load(name)
        env = d["environment"]
        loads = [x for pairs in d["loads"].values() for pair in pairs for x in pair]
        out += [
            f"`benchmarks/results/{name}`: {env['nproc']} CPU cores ({env['cpu']}), "
            f"jax {env['jax']}, load average (1 min) {min(loads):.1f} to "
            f"{max(loads):.1f}; `embedding_bag` lookups, {d['repeats']} run(s); "
            "every ratio is of medians measured in one process.",
            "",
            d["native_table"],
            "",
        ]
        for g in d["goals"]:
            if "native" not in g["goal"]:
                continue
            verdict = "met" if g["met"] else "**missed**"
            out.append(f"* {g['goal']}: {g['value']:.2f} ({verdict})")
        out += ["", f"Command: `{d['command']}`.", ""]
    return "\n".join(out)


def readme_kernels() -> str:
    """README: the native path against FBGEMM and the XLA path (peers_bench)."""
    (name,) = SOURCES["kernels-peers"]
    d = load(name)
    rows = {(r["optimizer"], r["num_rows"], r["config"]): r for r in d["rows"]}
    v = max(r["num_rows"] for r in d["rows"])
    parts = []
    for opt in ("sgd", "rowwise_adagrad", "adagrad"):
        nat, fb = rows.get((opt, v, "native")), rows.get((opt, v, "fbgemm_1thread"))
        xla = rows.get((opt, v, "xla"))
        if nat is None or fb is None or xla is None:
            continue
        parts.append(
            f"{opt.replace('_', ' ')} {nat['median_ms']:.2f} ms "
            f"({nat['ratio_to_fbgemm_1thread']:.2f}x FBGEMM's 1-thread step, "
            f"{nat['median_ms'] / xla['median_ms']:.2f}x the XLA path's)"
        )
    env = d["environment"]
    return (
        f"Measured (`benchmarks/results/{name}`, {env['nproc']} shared CPU cores, "
        f"jax {env['jax']}): a training step with a {_rows_label(v)} x "
        f"{d['settings']['dim']} table, {d['settings']['batch']} bags x "
        f"{d['settings']['bag']} ids, takes " + "; ".join(parts) + ". "
        f"Command: `{d['command']}`.\n"
    )


def kernels_dlrm() -> str:
    """docs/kernels.md: the DLRM step, native path vs XLA path vs TorchRec."""
    native_f, xla_f = SOURCES["kernels-dlrm"]
    nat, xla = load(native_f), load(xla_f)
    lines = [
        "Median wall ms / CPU ms per step, glibc's default allocator, "
        f"`benchmarks/results/{Path(native_f).parent}/` ({nat['environment']['nproc']} "
        f"shared cores, {nat['environment']['cpu']}, jax {nat['environment']['jax']}; "
        f"load average {nat['load_avg_1m']['min']:.1f} to "
        f"{nat['load_avg_1m']['max']:.1f}, then {xla['load_avg_1m']['min']:.1f} to "
        f"{xla['load_avg_1m']['max']:.1f} for the XLA path's run):",
        "",
        "| path | wall ms | CPU ms |",
        "| --- | --- | --- |",
    ]
    rows = []
    for key, label in _DLRM_PATHS.items():
        m = nat["paths"].get(key)
        if m is not None:
            native = "collection" in key or key == "separate"
            rows.append((f"{label}, native kernels" if native else label, m))
    for key in ("collection", "collection_padded"):
        m = xla["paths"].get(key)
        if m is not None:
            rows.append((f"{_DLRM_PATHS[key]}, XLA path", m))
    for label, m in rows:
        lines.append(f"| {label} | {m['median_ms']:.1f} | {m['cpu_ms']:.1f} |")
    col = nat["paths"]["collection"]
    lines.append("")
    for other in ("torchrec", "torchrec_1thread"):
        t = nat["paths"].get(other)
        if t is None:
            continue
        wall, cpu = col["median_ms"] / t["median_ms"], col["cpu_ms"] / t["cpu_ms"]
        verdict = "faster" if wall < 1 else "**not faster**"
        lines.append(
            f"* collection (native) / {_DLRM_PATHS[other]}: {wall:.2f}x wall, "
            f"{cpu:.2f}x CPU time ({verdict})."
        )
    gap = max(v for v in nat["check_max_abs_diff"].values())
    lines += [
        f"* The first {nat['settings']['check_steps']} losses of every path agree "
        f"within {gap:.1e}.",
        "",
        f"Commands: `{_dlrm_command(nat)}`; the XLA path: "
        f"`JAXSLICES_NATIVE=0 {_dlrm_command(xla)}`.",
    ]
    return "\n".join(lines) + "\n"


def kernels_soak() -> str:
    """docs/kernels.md: thousands of native steps, memory flat (soak_bench)."""
    (name,) = SOURCES["kernels-soak"]
    d = load(name)
    st, env = d["settings"], d["environment"]
    verdict = "flat" if d["no_steady_growth"] else "**growing**"
    return (
        f"{st['steps']:,} donated steps at V = {st['num_rows']:,} per optimizer, "
        f"the process's resident memory sampled every {st['every']} steps "
        f"(`benchmarks/results/{name}`, {env['cpu']}, jax {env['jax']}): "
        f"{verdict} within {st['tolerance_mb']} MB from step "
        f"{st['baseline_step']} on.\n\n" + d["table"] + "\n\n"
        f"Command: `{d['command']}`.\n"
    )


def kernels_sgd_duplicates() -> str:
    """docs/kernels.md: SGD's update, duplicates added in turn or summed first."""
    (name,) = SOURCES["kernels-sgd-duplicates"]
    d = load(name)
    env, w, ms = d["environment"], d["workload"], d["ms"]
    acc = d["accuracy_1000_duplicates_of_minus_1e-8_on_1"]
    turn, summed = ms["in_turn"]["median_ms"], ms["summed_first"]["median_ms"]
    return (
        f"`benchmarks/results/{name}`: {env['nproc']} CPU cores ({env['cpu']}), "
        f"jax {env['jax']}, load average (1 min) {env['load_avg_1m']:.1f} to "
        f"{env['load_avg_1m_end']:.1f}; V = {w['num_rows']:,} x {w['dim']} float32 "
        f"(donated), {w['batch']} bags x {w['bag']} zipf({w['zipf']}) ids per "
        f"update ({w['mean_distinct_ids']:,.0f} distinct on average); medians of "
        f"{ms['in_turn']['steps_timed']} updates each, interleaved.\n\n"
        "| the apply kernel | median ms per update | 1.0 after 1,000 duplicates "
        "of -1e-8 (exact: 0.99999) |\n| --- | --- | --- |\n"
        f"| each id's row added in turn | {turn:.3f} | {acc['in_turn']:.6f} |\n"
        f"| duplicates summed first | {summed:.3f} | {acc['summed_first']:.6f} |\n\n"
        f"Summing first takes {summed / turn:.2f}x the time of adding in turn. "
        "Command: `python benchmarks/sgd_duplicates_bench.py --passes "
        f"{w['passes']} --out benchmarks/results/2026-11-cpu-native`.\n"
    )


#: The threads goals (V = 1M and 128K; peers workload): one core, native <=
#: 0.8x FBGEMM's step (both pinned); both cores, native <= 0.65x its own
#: one-core step (V = 1M) and faster than FBGEMM with 2 threads.
THREADS_GOALS = {"one_core": 0.8, "two_cores": 0.65}
_THREAD_CONFIGS = {
    "native": "native, 2 cores (default threads)",
    "native_1thread": "native, kernels on 1 thread",
    "native_1core": "native, pinned to 1 core",
    "fbgemm_1core": "FBGEMM, pinned to 1 core",
    "fbgemm_2threads": "FBGEMM, 2 threads",
}


def _repeat_ratio(rows: dict, key: tuple, a: str, b: str) -> float | None:
    """Median over repeats of a/b, each measured within one repeat."""
    ra, rb = rows.get((*key, a)), rows.get((*key, b))
    if ra is None or rb is None:
        return None
    pairs = zip(ra["repeats"], rb["repeats"], strict=True)
    return statistics.median(x["median_ms"] / y["median_ms"] for x, y in pairs)


def kernels_threads() -> str:
    """docs/kernels.md: the kernels on 1 and 2 cores, and FBGEMM (peers_bench)."""
    peers, micro = SOURCES["kernels-threads"]
    d = load(peers)
    env, load_, st = d["environment"], d["load_avg_1m"], d["settings"]
    rows = {(r["optimizer"], r["num_rows"], r["config"]): r for r in d["rows"]}
    keys = sorted({(o, v) for o, v, _ in rows}, key=lambda k: (k[1], k[0]))
    configs = [c for c in _THREAD_CONFIGS if any(k[2] == c for k in rows)]
    head = ["optimizer", "V", *[_THREAD_CONFIGS[c] for c in configs]]
    head += ["2 cores / 1 core", "1 core: native / FBGEMM", "2 cores: native / FBGEMM"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    goals = []
    for opt, v in keys:
        cells = [opt.replace("_", " "), _rows_label(v)]
        for c in configs:
            r = rows.get((opt, v, c))
            cells.append("-" if r is None else f"{r['median_ms']:.2f}")
        two = _repeat_ratio(rows, (opt, v), "native", "native_1core")
        one = _repeat_ratio(rows, (opt, v), "native_1core", "fbgemm_1core")
        vs2 = _repeat_ratio(rows, (opt, v), "native", "fbgemm_2threads")
        for x in (two, one, vs2):
            cells.append("-" if x is None else f"{x:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
        name = f"{opt.replace('_', ' ')}, {_rows_label(v)}"
        if one is not None:
            ok = one <= THREADS_GOALS["one_core"]
            goals.append(
                f"{name}: one core, native / FBGEMM {one:.2f}x (goal <= "
                f"{THREADS_GOALS['one_core']}x: {'met' if ok else '**missed**'})"
            )
        if two is not None and v >= 1 << 20:
            ok = two <= THREADS_GOALS["two_cores"]
            goals.append(
                f"{name}: 2 cores / 1 core {two:.2f}x (goal <= "
                f"{THREADS_GOALS['two_cores']}x: {'met' if ok else '**missed**'})"
            )
        if vs2 is not None:
            goals.append(
                f"{name}: 2 cores, native / FBGEMM 2 threads {vs2:.2f}x "
                f"({'faster' if vs2 < 1 else '**not faster**'})"
            )
    m = load(micro)
    ms = m["settings"]
    crossings = []
    for kernel in ("bag_forward", "rowwise_adagrad", "sgd_apply"):
        res = [r for r in m["results"] if r["workload"]["kernel"] == kernel]
        cells = ", ".join(
            f"{r['workload']['ids']:,}: {r['ratio_to_1_thread']['2']:.2f}x" for r in res
        )
        crossings.append(f"* {kernel.replace('_', ' ')}: {cells}")
    return "\n".join(
        [
            f"`benchmarks/results/{peers}`: {env['nproc']} shared CPU cores "
            f"({env['cpu']}), jax {env['jax']}, load average (1 min) "
            f"{load_['min']:.1f} to {load_['max']:.1f}; the peers workload "
            f"({st.get('batch')} bags x {st.get('bag')} Zipf ids, mean pooling, "
            "a linear head, donated); each configuration in its own process, "
            "taking turns; cells: median wall ms per step, medians over the "
            "sweeps; ratios: medians of ratios measured within one sweep.",
            "",
            *lines,
            "",
            *[f"* {g}" for g in goals],
            "",
            f"Command: `{d['command']}`.",
            "",
            "Each kernel call alone, 2 threads / 1 thread (median times, "
            f"interleaved; V = {ms['num_rows']:,} x {ms['dim']}; ids per call: "
            f"ratio; `benchmarks/results/{micro}`, load average "
            f"{m['environment']['load_avg_1m']:.1f} to "
            f"{m['environment']['load_avg_1m_end']:.1f}):",
            "",
            *crossings,
            "",
            f"Command: `{m['command']}`.",
            "",
        ]
    )


def kernels_lowp() -> str:
    """docs/kernels.md: the native step on a bfloat16 table vs float32 (lowp_bench)."""
    (name,) = SOURCES["kernels-lowp"]
    d = load(name)
    env, st = d["environment"], d["settings"]
    configs = list(d["results"][0]["ms"])
    head = ["optimizer", *configs, "bfloat16 / float32"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    goals = []
    for r in d["results"]:
        opt = r["workload"]["optimizer"].replace("_", " ")
        cells = [opt, *[f"{r['ms'][c]['median_ms']:.2f}" for c in configs]]
        ratio = r["ratio_bf16_to_f32"]
        cells.append(f"{ratio:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
        ok = ratio <= st["goal_ratio"]
        goals.append(
            f"{opt}: bfloat16 / float32 {ratio:.2f}x (goal <= {st['goal_ratio']}x: "
            f"{'met' if ok else '**missed**'}); every operation native: "
            f"{all(r['native'].values())}"
        )
    return "\n".join(
        [
            f"`benchmarks/results/{name}`: {env['nproc']} shared CPU cores "
            f"({env['cpu']}), jax {env['jax']}, load average (1 min) "
            f"{env['load_avg_1m']:.1f} to {env['load_avg_1m_end']:.1f}; V = "
            f"{st['num_rows']:,} x {st['dim']}, {st['bags']} bags x {st['bag']} "
            "Zipf ids, mean pooling, a linear head, donated; cells: median wall "
            "ms per step, the configurations taking turns.",
            "",
            *lines,
            "",
            *[f"* {g}" for g in goals],
            "",
            f"Command: `{d['command']}`.",
            "",
        ]
    )


def results_sources() -> str:
    """benchmarks/results/README.md: which run each generated block quotes."""
    lines = ["| block | quoted in | results files |", "| --- | --- | --- |"]
    for name, files in SOURCES.items():
        tag = f"<!-- BEGIN GENERATED: {name} -->"
        pages = [p for p in PAGES if tag in (ROOT / p).read_text()]
        where = ", ".join(f"`{p}`" for p in pages) or "(no page)"
        lines.append(f"| `{name}` | {where} | {', '.join(f'`{f}`' for f in files)} |")
    return "\n".join(lines) + "\n"


def managed_cost() -> str:
    (name,) = SOURCES["managed-cost"]
    d = load(name)
    w, ms = d["workload"], {k: v["median_ms"] for k, v in d["ms"].items()}
    env = d["environment"]
    pre, remap = ms["pre_remapped"], ms["with_remap"]
    evicting = ms["with_remap_evicting"]
    rows = [
        ("the step on pre-remapped ids", pre, "1.00x"),
        ("the step with the remap", remap, f"{remap / pre:.2f}x"),
        ("the step with the remap, evicting every step", evicting,
         f"{evicting / pre:.2f}x"),
        ("an on-demand eviction, then a remap (no step)", ms["evict_then_refill"],
         f"{ms['evict_then_refill'] / pre:.2f}x"),
    ]  # fmt: skip
    extra = (  # the policies' configurations, where the run has them
        ("with_remap_filtered", "the step with the remap, an admission filter "
         "(`min_count=2`)"),
        ("with_remap_evicting_decayed", "the step with the remap, evicting every "
         "step, a decayed LFU (`half_life=5`)"),
    )  # fmt: skip
    rows += [(label, ms[k], f"{ms[k] / pre:.2f}x") for k, label in extra if k in ms]
    lines = [
        f"Native path, `S = {_rows_label(w['num_rows'])}` slots (full), "
        f"{w['batch']} bags of {w['bag']} ids of dimension {w['dim']}, Adagrad, "
        f"Zipf {w['zipf']} over {_rows_label(w['distinct_ids'])} distinct ids; "
        f"medians of {d['ms']['pre_remapped']['steps_timed']} interleaved steps "
        f"(`{name}`, {env.get('cpu', 'CPU')}, load {env['load_avg_1m']:.1f} at "
        "start):",
        "",
        "| configuration | median | vs pre-remapped |",
        "| --- | --- | --- |",
        *(f"| {a} | {b:.2f} ms | {c} |" for a, b, c in rows),
        "",
        f"Goal (the step with the remap within 1.3x): "
        f"**{'met' if remap <= 1.3 * pre else 'missed'}** ({remap / pre:.2f}x). "
        "Goal (an eviction never stalls a step for more than one step's time): "
        f"with fresh ids in every batch (about {w['evictions_per_step']:.0f} ids "
        f"evicted per step), the median eviction adds {evicting - remap:.2f} ms "
        f"to the step with the remap ({remap:.2f} ms, "
        f"{(evicting - remap) / remap:.1f} steps' time), and the slowest "
        f"evicting step took {d['ms']['with_remap_evicting']['max_ms']:.1f} ms "
        f"(the slowest step without eviction "
        f"{d['ms']['with_remap']['max_ms']:.1f} ms): **"
        + ("met" if d["ms"]["with_remap_evicting"]["max_ms"] <= 2 * remap else "missed")
        + "** (judged by the slowest step, a shared machine's noise included).",
    ]
    return "\n".join(lines) + "\n"


def managed_ids() -> str:
    (name,) = SOURCES["managed-ids"]
    d = load(name)
    s = d["summary"]
    lines = [
        f"`{name}`: `S = {d['slots']}`, {d['distinct_ids']} distinct ids, "
        f"{d['steps']} steps of {d['batch']} ids; progressive log loss over the "
        "second half and the share of lookups without a row of their own:",
        "",
        "| table | log loss | collision rate | gap closed |",
        "| --- | --- | --- | --- |",
    ]
    managed = sorted(k for k in s if k.startswith("managed_"))
    for key in ("modulo", *managed, "unbounded"):
        r = s[key]
        gap = f"{r['gap_closed']:.2f}" if "gap_closed" in r else ""
        lines.append(
            f"| {key} | {r['log_loss_second_half']:.4f} | "
            f"{r['collision_rate_second_half']:.3f} | {gap} |"
        )
    return "\n".join(lines) + "\n"


BLOCKS: dict[str, Callable[[], str]] = {
    "managed-cost": managed_cost,
    "managed-ids": managed_ids,
    "readme-kernels": readme_kernels,
    "kernels-dlrm": kernels_dlrm,
    "kernels-soak": kernels_soak,
    "kernels-threads": kernels_threads,
    "kernels-lowp": kernels_lowp,
    "kernels-sgd-duplicates": kernels_sgd_duplicates,
    "kernels-peers": kernels_peers,
    "kernels-floor": kernels_floor,
    "collections-dlrm": collections_dlrm,
    "collections-batch": collections_batch,
    "results-sources": results_sources,
    "design-checks-cost": design_checks_cost,
    "design-check-dispatch": design_check_dispatch,
    "optimizer-floor-gpu": optimizer_floor_gpu,
    "collections-gpu": collections_gpu,
    "readme-demo": readme_demo,
    "examples-movielens": examples_movielens,
    "design-typed-cost": design_typed_cost,
    "densify-crossover": densify_crossover,
    "readme-benchmarks": readme_benchmarks,
    "design-coalesce": design_coalesce,
    "optimizer-floor": optimizer_floor,
    "donation": donation,
    "scale-out-plans": scale_out_plans,
    "optax-low-precision": optax_low_precision,
}


def render(text: str, page: str) -> str:
    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise KeyError(
                f"{page}: generated block {name!r} has no renderer in "
                f"tools/render_docs.py (known: {sorted(BLOCKS)})"
            )
        return m.group(1) + BLOCKS[name]() + m.group(4)

    return _BLOCK.sub(sub, text)


def stale_pages() -> list[str]:
    """Pages whose generated blocks differ from what the results files give."""
    stale = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        if render(text, page) != text:
            stale.append(page)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="report stale blocks, write nothing"
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for page in stale:
            print(f"{page}: generated blocks are out of date", file=sys.stderr)
        return 1 if stale else 0
    for page in PAGES:
        path = ROOT / page
        text = path.read_text()
        new = render(text, page)
        if new != text:
            path.write_text(new)
            print(f"rewrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
