"""One name per pass (issue 64, item 3): the registry's pass names are the policy's, and the pass
names are no options of their own (an old option raises, saying which policy to write)."""

import json

import pytest

import tflms
from tflms.config import DEFAULT_POLICY, POLICIES, LMSConfig
from tflms.plan import registry
from tflms.plan.records import SwapPlan


@pytest.mark.unit
def test_a_policy_names_the_registry_passes():
    assert registry.POLICY_PASSES == ("split_sums", "drop_tiles", "recompute", "order_updates")
    assert set(POLICIES) == {*registry.POLICY_PASSES, "swap_gradients"}
    fields = {f.name for f in SwapPlan.__dataclass_fields__.values()}
    assert {p.field for p in registry.PASSES} <= fields


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"recompute": True}, "recompute=True is not an option: a pass runs where policy names it. "
         "Write policy=('recompute', 'swap_gradients') instead."),
        ({"policy": ("default", "split_sums"), "split_sums": False}, "split_sums=False is not an option: a pass "
         "runs where policy names it. Write policy=('swap_gradients',) instead: without 'split_sums'."),
        ({"policy": "none", "swap_gradients": False}, "Write policy='none' instead: without 'swap_gradients'."),
        ({"order_updates": "yes"}, "order_updates='yes' is not an option: a pass runs where policy names it. "
         "Name 'order_updates' in policy to run it, e.g. policy=('default', 'order_updates'). "
         "Received: order_updates='yes'"),
    ],
)  # fmt: skip
@pytest.mark.unit
def test_a_pass_name_as_an_option_raises_with_the_policy_to_write(options, message):
    with pytest.raises(TypeError) as err:
        LMSConfig(**options)
    assert message in str(err.value)
    with pytest.raises(TypeError, match="is not an option: a pass runs where policy names it"):
        LMSConfig().replace(**options)


@pytest.mark.integration
def test_the_callback_refuses_a_pass_option():
    with pytest.raises(
        TypeError, match=r"split_sums=True is not an option: .*policy=\('split_sums', 'swap_gradients'\)"
    ):
        tflms.LMSCallback(split_sums=True)


@pytest.mark.unit
def test_the_config_has_no_pass_properties():
    cfg = LMSConfig(policy=("default", "split_sums", "drop_tiles", "order_updates", "recompute"))
    assert cfg.policy == frozenset(POLICIES)
    for name in POLICIES:
        assert not hasattr(cfg, name)


@pytest.mark.unit
def test_an_older_plan_with_the_passes_as_booleans_is_read_with_its_policy():
    assert LMSConfig.from_dict({"split_sums": True, "recompute": False}).policy == {"split_sums"}
    # split_sums off alone takes drop_tiles off too; a policy and booleans together: the booleans win
    assert LMSConfig.from_dict({"policy": ["split_sums", "drop_tiles"], "split_sums": False}).policy == frozenset()
    assert LMSConfig.from_dict({"policy": ["default"], "order_updates": True}).policy == {
        *DEFAULT_POLICY,
        "order_updates",
    }
    plan = tflms.make_plan(
        tflms.GraphModel.from_ops([{"name": "x", "type": "Const", "inputs": [], "outputs": []}]), LMSConfig(budget=None)
    )
    data = json.loads(plan.to_json())
    old = {**data, "options": {k: v for k, v in data["options"].items() if k != "policy"}}
    old["options"].update(swap_gradients=True, split_sums=True, drop_tiles=False, order_updates=False)
    again = SwapPlan.from_json(json.dumps(old))
    assert LMSConfig.from_dict(again.options).policy == {"swap_gradients", "split_sums"}
