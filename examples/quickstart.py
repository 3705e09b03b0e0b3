"""Quickstart: build IndexedSlices, densify them, coalesce, clip and scatter.

Run: ``python examples/quickstart.py``. Needs only jaxslices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxslices as js


def main(num_rows: int = 10, dim: int = 4, seed: int = 0) -> dict:
    key = jax.random.PRNGKey(seed)
    ids = jnp.array([6, 1, 1, 4, 8])  # the classic TF example: id 1 repeats
    rows = jax.random.normal(key, (ids.shape[0], dim))
    grad = js.IndexedSlices(rows, ids, (num_rows, dim))
    print("gradient:", grad)
    dense = grad.to_dense()
    print("dense equivalent shape:", dense.shape)
    unique = js.coalesce(grad)
    print("coalesced indices:", unique.indices, "(padding index =", num_rows, ")")
    naive = float(jnp.sqrt(jnp.sum(rows**2)))
    exact = float(js.global_norm(grad))
    print(f"naive norm of raw values (TF): {naive:.4f}  exact norm: {exact:.4f}")
    table = jnp.zeros((num_rows, dim))
    table = jax.jit(js.scatter_sub)(table, grad * 0.1)
    print("rows changed by the update:", jnp.nonzero(jnp.any(table != 0, axis=1))[0])
    return {"exact_norm": exact, "naive_norm": naive}


if __name__ == "__main__":
    main()
