"""The step's metrics as numbers: every scalar the user's step returns, by name, for events, progress and reports."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["scalar_metrics"]


def scalar_metrics(metrics: Any) -> dict[str, float]:
    """Every leaf of ``metrics`` (a mapping, possibly nested, or any pytree) as a float, named by its path:
    nested keys joined with ``/`` (MaxText's ``{"scalar": {"learning/loss": x}}`` gives ``scalar/learning/loss``).

    A leaf of a multi-process group spans every process's devices; each process reads its own copy (the step's
    metrics are replicated). One transfer for all of them: a scalar each, after the step has finished.

    Raises:
        ValueError: a leaf is not one number (the message names it, its shape and what to do).
    """
    named = [(_name(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(metrics)[0]]
    local = [leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf for _, leaf in named]
    out: dict[str, float] = {}
    for (name, _), value in zip(named, jax.device_get(local), strict=True):
        array = np.asarray(value)
        try:
            if array.size != 1:
                raise TypeError
            out[name] = float(array.reshape(()))
        except (TypeError, ValueError):
            raise ValueError(
                f"the step's metric {name!r} is not one number (shape {array.shape}, dtype {array.dtype}): every "
                "metric is kept as a scalar (StepCompleted.metrics); reduce it in the step (its mean, say), or "
                "carry it in the state"
            ) from None
    return out


def _name(path: tuple[Any, ...]) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts) or "metric"
