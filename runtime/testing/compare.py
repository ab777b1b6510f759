"""Compare two training states: the check behind every "equal to a fault-free run" claim."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["RTOL", "compare_states"]

RTOL = 1e-5  # runs that trained on a shrunk data axis sum gradients in another order: ~1e-6 apart


def compare_states(result: Any, reference: Any, *, bitwise: bool, rtol: float = RTOL) -> dict[str, Any]:
    """Compare two state pytrees: exactly when ``bitwise``, else by the largest error relative to the leaf."""
    pairs = list(zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True))
    worst = 0.0
    for got, want in pairs:
        got, want = np.asarray(got), np.asarray(want)
        scale = float(np.max(np.abs(want))) or 1.0
        worst = max(worst, float(np.max(np.abs(got - want))) / scale)
    if bitwise:  # the bits: a NaN equals the same NaN, and -0.0 is not 0.0
        same = all(_bits(g) == _bits(w) for g, w in pairs)
        return {"comparison": "bitwise", "match": same, "max_rel_error": worst}
    return {"comparison": f"rtol {rtol:g}", "match": worst <= rtol, "max_rel_error": worst}


def _bits(leaf: Any) -> tuple[tuple[int, ...], str, bytes]:
    array = np.asarray(leaf)
    return array.shape, array.dtype.str, np.ascontiguousarray(array).tobytes()
