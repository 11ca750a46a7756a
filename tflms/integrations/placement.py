"""``devices=[...]``: a traced step placed across devices (:mod:`tflms.plan.passes.place`), rewritten.

:func:`placed_function` is what :func:`tflms.optimize`, ``tflms.function`` and ``LMSCallback`` do
with a config whose ``devices`` is set: plan the placement on the step's graph model, set each op's
device on a copy of the graph (:func:`tflms.rewrite.apply.apply_placement`) and rebuild the
function. TensorFlow's partitioner inserts the transfers between the devices when the function is
instantiated; the step is called under ``tf.device(devices[0])``, where its arguments and variables
are expected.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import _tf_internal as tfi
from ..config import LMSConfig
from ..ir.devices import device_key
from ..ir.graph import GraphModel
from ..plan.passes.place import placement_plan
from ..plan.records import SwapPlan
from ..rewrite.apply import apply_placement

__all__ = ["placed_function", "check_devices_exist", "refuse_xla"]

log = logging.getLogger("tflms")


def check_devices_exist(config: LMSConfig) -> None:
    """Raise ``ValueError`` naming the first of ``config.devices`` that TensorFlow does not know here
    (a device of another task appears only after connecting to its cluster)."""
    known = {device_key(d.name) for d in tf.config.list_logical_devices()}
    for d in config.devices or ():
        if device_key(d) not in known:
            names = ", ".join(sorted(x.name for x in tf.config.list_logical_devices()))
            raise ValueError(
                f"devices lists {d!r}, which does not exist here (devices: {names}). Split a CPU or GPU into logical "
                "devices before TensorFlow starts, or connect to the cluster that has it "
                "(tf.config.experimental_connect_to_cluster). "
                f"Received: devices={list(config.devices or ())!r}"
            )


def refuse_xla(config: LMSConfig, compiled: bool, what: str) -> None:
    """Raise ``ValueError`` when a step compiled with XLA (``compiled``) is to be placed: XLA compiles
    the whole step for one device. ``what`` names the function in the message."""
    if config.devices and compiled:
        raise ValueError(
            "devices cannot place a step compiled with XLA: XLA compiles the whole step for one device. Pass the "
            "plain function or tf.function(fn, jit_compile=False). "
            f"Received: devices={list(config.devices)!r} with {what} and jit_compile=True"
        )


def placed_function(
    concrete_function: Any, model: GraphModel, config: LMSConfig, copy: bool, host_ops: Sequence[str] | None = None
) -> tuple[Any, SwapPlan]:
    """``(new concrete function, plan)``: ``concrete_function`` (traced, with graph model ``model``)
    placed on ``config.devices``. ``copy=False`` places the ops of ``concrete_function.graph``
    itself (see :func:`tflms.optimize`). Copy-only ops run on ``config.host`` where the placer
    predicts that this lowers the largest device peak, or, with ``host_ops`` (names of
    :func:`tflms.plan.passes.place.copy_ops`), those ops exactly."""
    check_devices_exist(config)
    plan = placement_plan(model, config, host_ops)
    graph = concrete_function.graph
    new_graph = tfi.copy_graph(concrete_function) if copy else graph
    new_graph.name = f"{graph.name}_tflms"
    placed = apply_placement(new_graph, plan.placement)
    log.info("tflms: %s: %d ops placed on %s", graph.name, placed, ", ".join(config.devices or ()))
    return tfi.rebuild(concrete_function, new_graph), plan
