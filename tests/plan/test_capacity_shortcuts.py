# ruff: noqa: SLF001  (this module tests the private shortcuts themselves)
"""The capacity search's shortcuts (:func:`tflms.max_batch_size`) against the full search, on the
zoo's CNN: each batch size gets the same answer, so the search asks the same sizes and finds the
same largest batch.

The shortcuts: a batch size whose floor (:meth:`Simulator.floor`) exceeds the budget is answered
"does not fit" without a search; the plan of step 5 that fitted at the last batch size is finished
first (``serialized_search(..., first=...)``); the simulator keeps the ordered simulators and
replays that step 5's finished plans ask for again. The slow path here turns all three off.
"""

import pytest

import tflms
from tflms import LMSConfig, Simulator
from tflms.emulate import simulator
from tflms.ir.trace import graph_source
from tflms.plan import autotune, capacity
from tflms.plan.registry import prepare
from tflms.testing.zoo import build

pytestmark = pytest.mark.integration

MIB = 1 << 20
#: The passes these cases were made with: with split sums and dropped tiles the CNN's search meets
#: sizes where a plan of step 5 fitted at the size before (with the default policy alone, none).
POLICY = ("default", "split_sums", "drop_tiles")


@pytest.fixture(scope="module")
def cnn():
    model = build("cnn", batch=1, size=32)[0]
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=False)
    return model


def _searched(model, budget, monkeypatch, shortcuts):
    """``(result, {(batch, "with" | "without"): fits}, shortcuts taken)`` of ``max_batch_size``."""
    answers, taken = {}, {"floor": 0, "first": 0}
    timed = capacity._timed

    def recording(batch, way, fits):
        answers[batch, way] = timed(batch, way, fits)
        return answers[batch, way]

    search, first_fit, floor = autotune.serialized_search, autotune._first_fit, Simulator.floor

    def counted_first_fit(*args):
        fitted = first_fit(*args)
        taken["first"] += fitted is not None
        return fitted

    def counted_floor(sim):
        found = floor(sim)
        taken["floor"] += found[0] > budget
        return found

    with monkeypatch.context() as patch:
        patch.setattr(capacity, "_timed", recording)
        patch.setattr(autotune, "_first_fit", counted_first_fit)
        patch.setattr(Simulator, "floor", counted_floor)
        if not shortcuts:
            patch.setattr(capacity, "serialized_search", lambda *args, first=(), **kw: search(*args, **kw))
            patch.setattr(Simulator, "floor", lambda sim: (0, None))  # never above a budget
            patch.setattr(simulator._Caches, "SIZE", 0)  # nothing kept
        result = tflms.max_batch_size(model, budget, limit=4096, policy=POLICY)
    return result, answers, taken


def test_the_shortcuts_give_the_full_searchs_answers(cnn, monkeypatch):
    """At 10 MiB a plan tried first answers a size that fits; at 40 MiB a size past the floor (128)
    is answered without a search."""
    taken = {"floor": 0, "first": 0}
    for budget_mib in (10, 40):
        budget = budget_mib * MIB
        fast, fast_answers, fast_taken = _searched(cnn, budget, monkeypatch, shortcuts=True)
        slow, slow_answers, slow_taken = _searched(cnn, budget, monkeypatch, shortcuts=False)
        assert fast_answers == slow_answers  # the same sizes asked, the same answers
        assert fast == slow and fast.without_lms < fast.with_lms
        assert slow_taken == {"floor": 0, "first": 0}
        taken = {k: taken[k] + fast_taken[k] for k in taken}
    assert taken["first"] >= 1  # a plan tried first answered a size
    assert taken["floor"] >= 1  # a size past the floor was not searched


@pytest.mark.parametrize("batch", [13, 14])
def test_a_plan_tried_first_answers_as_the_search_does(cnn, batch):
    """At a size where the search fits in step 5 (13 at 8 MiB) and one where nothing fits (14), the
    answer with each plan of step 5 tried first, and with a threshold that has none, is the search's."""
    budget, config, graph_of = 8 * MIB, LMSConfig(policy=POLICY), graph_source(cnn)

    def prepared():  # the step max_batch_size searches, with a simulator of its own
        model = graph_of(batch)
        return prepare(model, config, Simulator(model, config.host))[:2]

    model, sim = prepared()
    full = autotune.serialized_search(model, config, sim, budget, exists_only=True)[0] is not None
    thresholds = [t for t, _ in autotune._other_plans(model, config, budget)]
    assert len(thresholds) >= 2
    answers = set()
    for threshold in [*thresholds, max(autotune.THRESHOLDS) + 1]:
        model, sim = prepared()
        first = autotune.serialized_search(model, config, sim, budget, exists_only=True, first=(threshold,))
        answers.add(first[0] is not None)
    assert answers == {full}
    assert full == (batch == 13)
