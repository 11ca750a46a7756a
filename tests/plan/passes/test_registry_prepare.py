"""``registry.prepare`` without a simulator (``sim=None``): the same step, decisions and predictions
as with one, and a single simulator made (of the last step) instead of one per pass."""

import pytest
from test_tiles import bn_gradient

from tflms import Knobs, LMSConfig
from tflms.emulate.simulator import Simulator
from tflms.plan import registry

pytestmark = pytest.mark.unit

CONFIG = LMSConfig(policy=("default", "split_sums", "drop_tiles"), knobs=Knobs(min_bytes=0, swapout_threshold=2))


@pytest.mark.parametrize("only", [None, ("split_sums", "drop_tiles")])
def test_prepare_without_a_simulator_makes_one_of_the_last_step_only(monkeypatch, only):
    model = bn_gradient()
    with_sim, sim, decided = registry.prepare(model, CONFIG, Simulator(model, CONFIG.host), only=only)
    assert decided["sums"] and decided["tiles"]  # both passes change the step
    made = []
    monkeypatch.setattr(registry, "Simulator", lambda m, host: made.append(m) or Simulator(m, host))
    without, lazy, lazy_decided = registry.prepare(model, CONFIG, None, only=only)
    assert made == [without]  # one, of the step the passes made
    assert lazy_decided == decided and lazy.model is without
    assert sorted(without.dag.edges) == sorted(with_sim.dag.edges)
    assert (lazy.peak(), lazy.requested_peak(), lazy.floor()) == (sim.peak(), sim.requested_peak(), sim.floor())


def test_prepare_without_a_simulator_and_no_pass_to_run_makes_one_of_the_step():
    model = bn_gradient()
    same, sim, decided = registry.prepare(model, LMSConfig(policy="none"), None)
    assert same is model and sim.model is model and decided == {}
