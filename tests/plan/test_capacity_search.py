"""The capacity search's probe placement (:func:`tflms.plan.capacity._largest_within`): the same
answer as a search of every size, on monotone functions of several shapes, in fewer probes than
bisection (:func:`tflms.plan.capacity.largest_fitting`) where the function is close to a line."""

import math
import random

import pytest

from tflms.plan.capacity import _largest_within, largest_fitting

pytestmark = pytest.mark.unit


def _shapes(rng: random.Random, limit: int):
    """Non-decreasing functions of the batch size: lines, a line with a bumpy slope, steps, a parabola."""
    a, c = rng.uniform(0.5, 50), rng.uniform(0, 1000)
    steps = sorted(rng.sample(range(1, limit + 1), 12))
    yield "line", lambda b: a * b + c
    yield "rounded line", lambda b: a * (b + 64 - b % 64) + c  # sizes rounded up to 64 rows
    yield "steps", lambda b: c + a * 10 * sum(s <= b for s in steps)
    yield "parabola", lambda b: a * b * b / 100 + c


@pytest.mark.parametrize("limit", [1, 7, 300, 2000])
def test_the_answer_is_the_largest_size_within_the_budget(limit):
    rng = random.Random(limit)
    for _ in range(40):
        for name, value in _shapes(rng, max(limit, 12)):
            budget = rng.uniform(0, value(limit) * 1.3)
            start = rng.choice([1, 32, max(1, limit // 3), limit])
            expected = max((b for b in range(1, limit + 1) if value(b) <= budget), default=0)
            assert _largest_within(value, budget, limit, start=start) == expected, (name, budget, start)


def test_rel_tol_answers_a_size_that_fits_within_the_tolerance():
    value = lambda b: 3.0 * b + 11  # noqa: E731
    found = _largest_within(value, 30_000, 1 << 16, rel_tol=0.01)
    exact = (30_000 - 11) // 3
    assert value(found) <= 30_000 and found >= exact * 0.99


def test_a_near_line_takes_fewer_probes_than_bisection():
    """A peak that grows linearly with the batch (plus rounding): the search needs a handful of
    probes where bisection from the same start needs about twice log2 of the answer."""

    def value(b: int) -> int:
        return 997 * (b + 7 - b % 8) + 50_000

    for budget in (1_234_567, 3_000_000, 20_000_000):
        probes: list[int] = []
        halving: list[int] = []
        found = _largest_within(lambda b, seen=probes: seen.append(b) or value(b), budget, 1 << 16, start=32)
        fits = lambda b, seen=halving, budget=budget: seen.append(b) or value(b) <= budget  # noqa: E731
        assert found == largest_fitting(fits, 1 << 16, start=32)
        assert len(probes) <= 8 < len(halving), (budget, probes, halving)


def test_nothing_fits():
    assert _largest_within(lambda b: 10.0, 5, 100) == 0
    assert _largest_within(lambda b: math.inf, 5, 100, start=50) == 0
