"""Compare two training states: the check behind every "equal to a fault-free run" claim, for users too.

What to expect after a recovery (measured on the demo model, the flax example and MaxText's models):

- A run that ends on the mesh it started on (it may have shrunk and grown back in between, or lost a worker
  whose state came back from a peer) is **bitwise** equal to a fault-free run: the same steps, the same
  batches, the same reduction order.
- A run that trained some steps on a degraded mesh (the data axis shrunk, the global batch kept) sums its
  gradients in another order on those steps. Its **parameters** stay within about ``1e-6`` of a fault-free run,
  relative to each leaf's largest value (``RTOL``, 1e-5, leaves room). **Optimizer moments** drift further:
  Adam's second moment squares the gradients' rounding, and for rows of an embedding that few tokens touch
  (tied embeddings) the relative difference reached ``2.8e-3`` in a qwen3 model while its parameters were
  within ``3e-6``. Compare moments at ``1e-2``, or compare the parameters alone
  (``compare_states(result["params"], reference["params"])``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["RTOL", "compare_states"]

RTOL = 1e-5  # parameters after steps on a shrunk data axis: ~1e-6 apart (the module's docstring)


def compare_states(result: Any, reference: Any, *, bitwise: bool = False, rtol: float = RTOL) -> dict[str, Any]:
    """Compare two state pytrees of the same structure, leaf by leaf.

    Args:
        result: the state to check (arrays anywhere: on devices or in host memory).
        reference: the state it should equal, usually a fault-free run's.
        bitwise: compare the bits (a NaN equals the same NaN, and ``-0.0`` is not ``0.0``); else each leaf's
            largest difference relative to the reference leaf's largest magnitude must be at most ``rtol``.
        rtol: the relative tolerance when not ``bitwise``.

    Returns:
        ``comparison`` (``"bitwise"`` or ``"rtol 1e-05"``), ``match``, ``max_rel_error`` (the largest relative
        difference of any leaf) and ``worst_leaf`` (that leaf's path in ``reference``, as ``jax.tree_util``
        writes it).

    Raises:
        ValueError: the two trees have a different number of leaves.
    """
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(reference)[0]]
    pairs = list(zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True))
    worst, worst_leaf = 0.0, ""
    for path, (got, want) in zip(paths, pairs, strict=True):
        got, want = np.asarray(got), np.asarray(want)
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        error = float(np.max(np.abs(got - want))) / (scale or 1.0) if want.size else 0.0
        if error > worst or not worst_leaf:
            worst, worst_leaf = error, path
    out: dict[str, Any]
    if bitwise:
        same = all(_bits(g) == _bits(w) for g, w in pairs)
        out = {"comparison": "bitwise", "match": same}
    else:
        out = {"comparison": f"rtol {rtol:g}", "match": worst <= rtol}
    return out | {"max_rel_error": worst, "worst_leaf": worst_leaf}


def _bits(leaf: Any) -> tuple[tuple[int, ...], str, bytes]:
    array = np.asarray(leaf)
    return array.shape, array.dtype.str, np.ascontiguousarray(array).tobytes()
