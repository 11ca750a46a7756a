"""Agreement across ranks: logs, scalars and the swap plan (:func:`assert_same_plan`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from ...plan.records import SwapPlan
from . import runtime

__all__ = ["PlanMismatchError", "allgather_scalar", "assert_same_plan", "average_logs"]


class PlanMismatchError(RuntimeError):
    """Ranks made different swap plans for the same step (raised on every rank)."""


def average_logs(logs: Mapping[str, Any] | None, name: str = "tflms_average_logs") -> dict[str, Any]:
    """Average the numeric scalar entries of a Keras ``logs`` dict over all ranks.

    One allreduce (float64) of the numeric entries in sorted-key order; other
    entries are returned unchanged. Call it eagerly (e.g. in a callback's
    ``on_epoch_end``) on every rank, with the same numeric keys on every rank.
    With one rank the values are only converted to ``float``.

    Example (in one process; on 2 ranks logging losses 0.5 and 1.5, both get 1.0):
        >>> import numpy as np, tflms.integrations.horovod as lms_hvd
        >>> lms_hvd.average_logs({"loss": np.float32(0.5), "lr": 0.1, "note": "warmup"})
        {'loss': 0.5, 'lr': 0.1, 'note': 'warmup'}
    """
    hvd = runtime.active("average_logs")
    logs = dict(logs or {})
    keys = sorted(k for k, v in logs.items() if _is_scalar_number(v))
    if not keys:
        return logs
    values = np.array([float(np.asarray(logs[k])) for k in keys], dtype=np.float64)
    if hvd is not None and hvd.size() > 1:
        values = hvd.allreduce(tf.constant(values), op=hvd.Average, name=name).numpy()
    logs.update({k: float(v) for k, v in zip(keys, values)})
    return logs


def allgather_scalar(value: float, name: str = "tflms_allgather_scalar") -> list[float]:
    """``value`` from every rank, in rank order (call eagerly, on every rank).

    With one rank (or without Horovod outside ``horovodrun``) returns ``[value]``.

    Example (in one process; on 2 ranks, e.g. ``[25.1, 24.8]``):
        >>> import tflms.integrations.horovod as lms_hvd
        >>> lms_hvd.allgather_scalar(25.1)
        [25.1]
    """
    hvd = runtime.active("allgather_scalar")
    if hvd is None or hvd.size() == 1:
        return [float(value)]
    gathered = hvd.allgather(tf.constant([float(value)], dtype=tf.float64), name=name).numpy()
    return [float(v) for v in gathered]


def _is_scalar_number(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float, np.number)):
        return True
    if isinstance(v, (np.ndarray, tf.Tensor)) and v.shape == () and not isinstance(v, tf.Variable):
        try:
            return np.issubdtype(np.asarray(v).dtype, np.number)
        except Exception:  # noqa: BLE001 - a symbolic tensor: not a logged number
            return False
    return False


def assert_same_plan(plan: SwapPlan, name: str = "tflms_plan_fingerprint") -> str:
    """Check that every rank made this same plan; return its fingerprint.

    Allgathers :meth:`SwapPlan.fingerprint` (SHA-256 of the plan JSON). Every rank
    receives all fingerprints, so on a mismatch every rank raises
    :class:`PlanMismatchError` (no rank is left waiting in a collective). Call it
    on every rank after tracing, e.g. with ``step.get_plan(x, y)``. With one rank
    (or without Horovod) it only returns the fingerprint.

    Example (in one process it only fingerprints the plan; ``step.get_plan(x, y)``
    gives the plan of a ``tflms.function`` step):
        >>> import tflms, tflms.integrations.horovod as lms_hvd
        >>> cf = tf.function(lambda x: tf.reduce_sum(tf.exp(x))).get_concrete_function(tf.TensorSpec((4, 4)))
        >>> plan = tflms.make_plan(tflms.GraphModel.from_func_graph(cf.graph), tflms.LMSConfig())
        >>> lms_hvd.assert_same_plan(plan) == plan.fingerprint()
        True
    """
    if not isinstance(plan, SwapPlan):
        raise TypeError(f"assert_same_plan expects a tflms.SwapPlan. Received: plan={plan!r}")
    fingerprint = plan.fingerprint()
    hvd = runtime.active("assert_same_plan")
    if hvd is None or hvd.size() == 1:
        return fingerprint
    mine = np.frombuffer(fingerprint.encode("ascii"), dtype=np.uint8)[None, :]
    gathered = hvd.allgather(tf.constant(mine), name=name).numpy()
    fingerprints = [row.tobytes().decode("ascii") for row in gathered]
    if len(set(fingerprints)) > 1:
        by_rank = ", ".join(f"rank {r}: {fp[:12]}" for r, fp in enumerate(fingerprints))
        raise PlanMismatchError(
            f"tflms plans differ across Horovod ranks ({by_rank}). Every rank must trace the same step "
            "with the same LMS options, model and per-rank input shapes. "
            f"Received: plan {plan.function!r} with {len(plan.swaps)} swaps on rank {hvd.rank()}"
        )
    return fingerprint
