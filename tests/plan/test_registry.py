"""The pass registry (issue 64, item 2): one object a pass, each pass's needs checked, and every
list of passes in the package read from the registry."""

import pytest

from tflms.config import POLICIES, POLICY_NEEDS, LMSConfig
from tflms.ir.graph import GraphModel
from tflms.plan import registry
from tflms.plan.passes.base import Pass
from tflms.plan.passes.sums import SplitSums
from tflms.plan.passes.swaps import Fences, Swaps
from tflms.plan.passes.tiles import DropTiles
from tflms.plan.planner import empty_plan

NAMES = ["split_sums", "drop_tiles", "recompute", "swaps", "fences", "order_updates"]


def _model():
    out = [("float32", (4,), 16, False)]
    return GraphModel.from_ops([{"name": "x", "type": "Const", "inputs": [], "outputs": out}])


@pytest.mark.unit
def test_the_registry_is_one_object_a_pass_in_order():
    assert [p.name for p in registry.PASSES] == NAMES
    assert all(isinstance(p, Pass) for p in registry.PASSES)
    assert [p.field for p in registry.PASSES] == ["sums", "tiles", "recomputes", "swaps", "fences", "orders"]
    assert registry.POLICY_PASSES == tuple(p.name for p in registry.PASSES if p.policy)
    assert set(POLICIES) == {*registry.POLICY_PASSES, "swap_gradients"}


@pytest.mark.unit
def test_the_registry_refuses_a_pass_whose_need_is_missing_or_after_it():
    with pytest.raises(ValueError, match=r"pass 'drop_tiles' needs 'split_sums', which is no pass of the registry"):
        registry.check([DropTiles(), Swaps()])
    with pytest.raises(ValueError, match=r"pass 'drop_tiles' needs 'split_sums' before it; it comes after"):
        registry.check([DropTiles(), SplitSums()])
    with pytest.raises(ValueError, match=r"pass 'fences' needs 'swaps' before it"):
        registry.check([Fences(), Swaps()])
    with pytest.raises(ValueError, match=r"two passes are named 'swaps'"):
        registry.check([Swaps(), Swaps()])
    assert registry.check([SplitSums(), DropTiles(), Swaps(), Fences()])[-1].name == "fences"


@pytest.mark.unit
def test_a_policy_without_a_pass_it_needs_raises_the_same_error():
    declared = {(name, need) for name, need, _ in POLICY_NEEDS}
    assert declared == registry.NEEDS_IN_POLICY == {("drop_tiles", "split_sums")}
    with pytest.raises(ValueError) as err:
        LMSConfig(policy=("default", "drop_tiles"))
    assert str(err.value).startswith(
        "policy 'drop_tiles' needs 'split_sums': a BatchNorm's or LayerNorm's input gradient is an AddN that reads "
        "a left-out Tile's per-channel value, and only the AddV2 chains of split_sums broadcast it. Add "
        "'split_sums' to the policy. Received: policy="
    )
    assert LMSConfig(policy=("split_sums", "drop_tiles")).policy == {"split_sums", "drop_tiles"}


def _record(monkeypatch, method, calls, result):
    for p in registry.PASSES:
        monkeypatch.setattr(type(p), method, lambda self, *a, **k: calls.append(self.name) or result(self, *a))


@pytest.mark.unit
def test_the_planner_and_the_replay_run_the_registry_passes_in_order(monkeypatch):
    model = _model()
    plan = empty_plan(model, LMSConfig(), 0, "nothing")
    replayed = []
    _record(monkeypatch, "replay", replayed, lambda self, m, d: m)
    assert registry.replay(model, plan) is model
    assert replayed == NAMES
    prepared = []
    _record(monkeypatch, "prepare", prepared, lambda self, m, c, s: (m, (), s))
    registry.prepare(model, LMSConfig(policy=POLICIES), None)
    assert prepared == list(registry.POLICY_PASSES)


@pytest.mark.integration
def test_the_rewrite_applies_exactly_the_registry_passes_in_order(monkeypatch):
    import tensorflow as tf

    from tflms.rewrite.apply import apply_plan

    graph = tf.Graph()
    with graph.as_default():
        tf.constant(1.0, name="x")
    plan = empty_plan(_model(), LMSConfig(), 0, "nothing")
    rewritten, asked = [], []
    _record(monkeypatch, "rewrite", rewritten, lambda self, edit: {self.name: 0})
    _record(monkeypatch, "edges", asked, lambda self, edit: {})
    assert list(apply_plan(graph, plan, "/device:CPU:0", "/device:CPU:0")) == NAMES
    assert rewritten == NAMES
    assert asked == [p.name for p in registry.PASSES if p.adds_edges]  # before the first of them edits
