"""KerasHub tasks through ``model.fit`` with ``tflms.LMSCallback(device=DEVICE)`` and no other option.

Four tasks of the ecosystem, built from configs with random weights (:mod:`tflms.testing.keras_hub`):
GPT-2 (causal LM), BERT (text classifier), ViT (image classifier) and BART (encoder-decoder). Each
trains 3 Adam steps of batch 8 (sequences of 128 tokens) plain and with the callback, from the same
state on the same model object (``Case.reset``: weights as built, a fresh optimizer's state), op
determinism on (``conftest``), ``shuffle=False``. Asserted: the per-step losses and every variable,
the optimizer's included, equal bit for bit (the default policy swaps only: a swap is a copy); the
plan swaps, and was made for the real batch (KerasHub's tasks feed ``fit`` batches of unknown
dimensions; the callback traces the step with them, as Keras does, and sizes it from the batches it
is fed); and, after Grappler, the rewritten step runs the kernels of the plain step traced with the
same signature, the swap ops aside. Where that does not hold (``FIT_DIFFERS``, ``KERNELS_DIFFER``:
why, measured) the test is a strict xfail.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms import _tf_internal as tfi
from tflms.rewrite.apply import SWAP_ATTR
from tflms.testing.keras_hub import BATCH, MODELS, STEPS, Case

from conftest import DEVICE
from helpers import check_survives_grappler

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: Models whose fit with the callback is not bit-identical to the plain fit, and why (strict xfail:
#: the test fails once they are). None: the callback traces the step as Keras's own train function
#: does (KerasHub's batches have unknown dimensions, and Grappler's arithmetic optimizer sums
#: otherwise where they are known), and no Transpose that Grappler folds into a MatMul is swapped.
FIT_DIFFERS: dict[str, str] = {}

#: Models whose rewritten step, after Grappler, has other kernels than the plain one (strict xfail).
#: BERT: Grappler's graph of the rewritten step has 26 ``MatMul`` nodes against the plain step's 28,
#: with the same set of ``MatMul`` node names (measured 2026-11-28, AMD EPYC); its fit is
#: bit-identical all the same. Not understood yet.
KERNELS_DIFFER: dict[str, str] = {
    "bert": "after Grappler the rewritten step has 26 MatMul nodes against the plain step's 28 (same names); "
    "its fit is bit-identical"
}


class StepLosses(keras.callbacks.Callback):
    """The loss Keras logs at the end of each training step (the epoch's running mean so far)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[np.ndarray] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.losses.append(np.asarray((logs or {})["loss"]))


def _fit(case: Case, callbacks: tuple = ()) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``STEPS`` steps of ``fit`` from the case's initial state: (per-step losses, every variable)."""
    case.reset()
    losses = StepLosses()
    with tf.device(DEVICE):
        case.model.fit(**case.fit_kwargs(), verbose=0, callbacks=[*callbacks, losses])
    assert len(losses.losses) == STEPS
    return losses.losses, [np.array(v.numpy()) for v in case.state()]


@functools.cache
def _trained(name: str) -> tuple[Case, tflms.LMSCallback, tuple, tuple]:
    """The model built once per process, its plain fit and its fit with the callback (no option but
    the device): for both tests of a model."""
    case = MODELS[name]()
    plain = _fit(case)
    cb = tflms.LMSCallback(device=DEVICE)
    lms = _fit(case, (cb,))
    return case, cb, plain, lms


def _first_batch(case: Case) -> tuple:
    """The first batch as ``fit`` hands it to the step: ``(x, y)`` or ``(x, y, sample_weight)``."""
    kwargs = case.fit_kwargs()
    items = [kwargs["x"], kwargs["y"]] + ([kwargs["sample_weight"]] if "sample_weight" in kwargs else [])
    return tuple(tf.nest.map_structure(lambda a: tf.constant(a[:BATCH]), items))


def _kernels(optimized: Any) -> collections.Counter:
    """The op types of a graph Grappler made, its swap ops (``_tflms_swap``) and constants (which
    Grappler's folding and deduplication make otherwise where the graph differs) left out."""
    return collections.Counter(n.op for n in optimized.node if SWAP_ATTR not in n.attr and n.op != "Const")


def _param(name: str, differs: dict[str, str]) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=differs[name])] if name in differs else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_callback_plans_swaps_for_the_real_batch(name: str) -> None:
    _, cb, _, _ = _trained(name)
    # One plan (one batch shape), with swaps, every swapped tensor's shape known.
    assert len(cb.plans) == 1 and cb.plan.swaps, cb.plans
    shapes = {s.shape for s in cb.plan.swaps}
    assert all(shape is not None and None not in shape for shape in shapes), shapes
    # Batch 8, never the batch of one a plan for unknown dimensions would assume: every activation
    # leads with it, or with a multiple of it where a Reshape folded the sequence or the patches
    # into it (8 x 128 tokens, 8 x 65 patches).
    assert {shape[0] for shape in shapes if len(shape) >= 3} == {BATCH}, shapes
    assert all(shape[0] % BATCH == 0 for shape in shapes), shapes


@pytest.mark.parametrize("name", [_param(n, FIT_DIFFERS) for n in MODELS])
def test_fit_with_the_callback_is_bit_identical(name: str) -> None:
    case, _, plain, lms = _trained(name)
    # Training moved every trainable weight.
    case.reset()
    assert all(not np.array_equal(a, v.numpy()) for a, v in zip(plain[1], case.state()) if v.trainable)
    # Bit for bit: the per-step losses, then the model's variables and the optimizer's.
    for k, (a, b) in enumerate(zip(plain[0], lms[0])):
        assert np.array_equal(a, b), f"step {k}: plain loss {a!r}, with LMSCallback {b!r}"
    differ = [
        (v.path, float(np.max(np.abs(a.astype("float64") - b.astype("float64")))))
        for v, a, b in zip(case.state(), plain[1], lms[1])
        if not np.array_equal(a, b)
    ]
    assert not differ, f"{len(differ)} of {len(plain[1])} variables differ, e.g. {differ[:4]}"


@pytest.mark.parametrize("name", [_param(n, KERNELS_DIFFER) for n in MODELS])
def test_the_rewritten_step_runs_the_plain_steps_kernels_after_grappler(name: str) -> None:
    """Grappler's graph of the rewritten step against its graph of the plain step traced with the
    same signature (the trace tflms rewrote): the same multiset of op types once the swap ops and
    constants are left out, and every swap op survives (``helpers.check_survives_grappler``)."""
    case, cb, _, _ = _trained(name)
    data = _first_batch(case)
    rewritten = cb.step.get_concrete_function(data)
    assert len(cb.plans) == 1  # the trace fit made: same signature
    step = tf.autograph.experimental.do_not_convert(case.model.train_step)  # as the callback traces it
    args, kwargs = rewritten.structured_input_signature
    plain = tf.function(step).get_concrete_function(*args, **kwargs)
    optimized = tfi.grappler_optimize(rewritten, DEVICE)
    check_survives_grappler(rewritten, DEVICE, optimized)
    got, want = _kernels(optimized), _kernels(tfi.grappler_optimize(plain, DEVICE))
    assert got == want, f"rewritten step runs more: {dict(got - want)}; fewer: {dict(want - got)}"
