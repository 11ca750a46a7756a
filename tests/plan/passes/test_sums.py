"""Sums added as their terms arrive (``split_sums``) on hand-built graphs: which AddNs, the chain, the plan."""

import json
import warnings

import pytest

from tflms import BudgetError, Knobs, LMSConfig, LMSWarning, SwapPlan, make_plan
from tflms.emulate.simulator import Simulator
from tflms.ir.decisions import Sum
from tflms.ir.graph import GraphModel
from tflms.plan.passes.sums import chain_ops, kernel_groups, splittable_sums, with_split_sums

from graphs import f32, op

pytestmark = pytest.mark.unit

BIG = f32(256, 256)  # 256 KiB


def sum_model(n_terms=4, control=False, dtype="float32", reader=None):
    """x -> f -> loss, then a backward chain g0 -> g1 -> ... whose step k also makes a term
    t_k = g_k * f; ``AddN`` sums the terms (made one after the other) and an update reads it.
    ``control``: the AddN waits for g0 by a control edge. ``reader``: an ``AddN`` of three
    inputs that reads the sum, ``'split'`` (no control input) or ``'kept'`` (one)."""
    out = BIG if dtype == "float32" else (dtype, BIG[1], BIG[2], False)
    ops = [op("x", "Placeholder", outputs=[BIG]), op("f", "Relu", ["x:0"], [BIG]), op("loss", "Sum", ["f:0"], [BIG])]
    grad = "loss:0"
    for k in range(n_terms):
        ops.append(op(f"gradient_tape/g{k}", "ReluGrad", [grad, "f:0"], [BIG]))
        grad = f"gradient_tape/g{k}:0"
        ops.append(op(f"gradient_tape/t{k}", "Mul", [grad, "f:0"], [out]))
    terms = [f"gradient_tape/t{k}:0" for k in reversed(range(n_terms))]  # graph order: not the sorted one
    ops.append(op("AddN", "AddN", terms, [out], control=["gradient_tape/g0"] if control else ()))
    total = "AddN:0"
    if reader:
        ops.append(op("gradient_tape/r0", "Relu", [grad], [out]))
        ops.append(op("gradient_tape/r1", "Relu", ["gradient_tape/r0:0"], [out]))
        control = ["gradient_tape/g0"] if reader == "kept" else ()
        ops.append(op("AddN_1", "AddN", [total, "gradient_tape/r0:0", "gradient_tape/r1:0"], [out], control=control))
        total = "AddN_1:0"
    ops.append(op("gradient_tape/h", "ReluGrad", [total, "f:0"], [out]))
    ops.append(op("update", "AssignSubVariableOp", ["gradient_tape/h:0"], []))
    return GraphModel.from_ops(ops, name="sums")


def test_kernel_groups_follow_the_addn_kernel():
    assert kernel_groups(2) == [[0, 1]]
    assert kernel_groups(9) == [list(range(9))]
    assert kernel_groups(10) == [[0, 1], list(range(2, 10))]
    assert kernel_groups(16) == [list(range(8)), list(range(8, 16))]
    assert [len(g) for g in kernel_groups(26)] == [2, 8, 8, 8]
    with pytest.raises(ValueError, match="n=1"):
        kernel_groups(1)


def test_a_gradient_sum_becomes_a_chain_in_grapplers_order_and_frees_its_terms():
    model = sum_model()
    [s] = splittable_sums(model)
    assert s == Sum("AddN", tuple(f"gradient_tape/t{k}:0" for k in range(4)))  # sorted by name
    split, sums = with_split_sums(model)
    assert sums == [s] and "AddN" not in split.dag
    names = chain_ops(s)
    assert names == ["AddN/tflms_sum_0", "AddN/tflms_sum_1", "AddN/tflms_sum_2"]
    assert [split.inputs_of[n] for n in names] == [
        ["gradient_tape/t0:0", "gradient_tape/t1:0"],
        ["AddN/tflms_sum_0:0", "gradient_tape/t2:0"],
        ["AddN/tflms_sum_1:0", "gradient_tape/t3:0"],
    ]
    assert all(split.dag.nodes[n]["type"] == "AddV2" and split.phase(n) == "backward" for n in names)
    assert split.inputs_of["gradient_tape/h"] == ["AddN/tflms_sum_2:0", "f:0"]
    # The AddN held its four terms at once; the chain holds two and a sum.
    assert Simulator(split).peak() < Simulator(model).peak()
    assert with_split_sums(split) == (split, [])  # nothing left to split


def test_a_sum_of_eleven_terms_follows_the_kernels_groups():
    split, [s] = with_split_sums(sum_model(n_terms=11))
    t = list(s.terms)
    steps = [split.inputs_of[n] for n in chain_ops(s)]
    # ((t0 + t1) + t2), then (t3 + ... + t10) summed apart and added: 2 + 7 + 1 additions.
    assert len(steps) == 10
    assert steps[:2] == [[t[0], t[1]], ["AddN/tflms_sum_0:0", t[2]]]
    assert steps[2] == [t[3], t[4]] and steps[8] == ["AddN/tflms_sum_7:0", t[10]]
    assert steps[9] == ["AddN/tflms_sum_1:0", "AddN/tflms_sum_8:0"]


@pytest.mark.parametrize(
    "kwargs",
    [{"control": True}, {"dtype": "int32"}, {"n_terms": 2}, {"reader": "kept"}],
    ids=["control-input", "int32", "two-terms", "read-by-a-kept-addn"],
)
def test_sums_that_are_not_split(kwargs):
    assert "AddN" not in {s.op for s in splittable_sums(sum_model(**kwargs))}


def test_a_sum_read_by_a_split_sum_is_split_and_the_reader_sums_its_chain():
    model = sum_model(reader="split")
    split, sums = with_split_sums(model)
    assert [s.op for s in sums] == ["AddN", "AddN_1"]
    assert sums[1].terms == ("AddN:0", "gradient_tape/r0:0", "gradient_tape/r1:0")  # the original names
    assert split.inputs_of[chain_ops(sums[1])[0]] == ["AddN/tflms_sum_2:0", "gradient_tape/r0:0"]
    # The reader's split given first: its chain is rewired to the chain of the sum it reads.
    reversed_split, _ = with_split_sums(model, sums[::-1])
    assert reversed_split.inputs_of == split.inputs_of


def test_a_forward_sum_is_not_split():
    ops = [op("x", "Placeholder", outputs=[BIG])]
    ops += [op(f"f{k}", "Relu", ["x:0"], [BIG]) for k in range(3)]
    ops += [op("AddN", "AddN", ["f0:0", "f1:0", "f2:0"], [BIG]), op("loss", "Sum", ["AddN:0"], [BIG])]
    ops += [
        op("gradient_tape/g", "ReluGrad", ["loss:0", "f0:0"], [BIG]),
        op("update", "AssignSubVariableOp", ["gradient_tape/g:0"], []),
    ]
    assert splittable_sums(GraphModel.from_ops(ops)) == []


def test_a_budget_error_quotes_the_plain_peak_of_the_step_as_given():
    """The peak "without LMS" of a :class:`BudgetError` is the step's as given, the plan's
    ``peak_bytes_before``, not that of the step with its sums split (lower here)."""
    model = sum_model()
    plain, split = Simulator(model).peak(), Simulator(with_split_sums(model)[0]).peak()
    assert split < plain
    config = LMSConfig(budget=1, knobs=Knobs(min_bytes=0), policy="split_sums")
    with pytest.raises(BudgetError) as err:
        make_plan(model, config)
    assert err.value.plain_peak_bytes == plain
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LMSWarning)
        assert make_plan(model, config.replace(on_budget_miss="best")).peak_bytes_before == plain


def test_the_plan_records_its_sums_and_reads_older_formats():
    model = sum_model()
    plan = make_plan(
        model,
        LMSConfig(policy=("default", "split_sums"), knobs=Knobs(min_bytes=0, swapout_threshold=2, serialize=False)),
    )
    assert plan.sums == (splittable_sums(model)[0],)
    assert plan.peak_bytes_after < plan.peak_bytes_before
    assert "sums added as their terms arrive: 1 AddN ops (4 terms)" in plan.summary()
    data = json.loads(plan.to_json())
    assert data["format_version"] == 7 and data["sums"] == [{"op": "AddN", "terms": list(plan.sums[0].terms)}]
    assert SwapPlan.from_json(plan.to_json()) == plan
    old = {k: v for k, v in data.items() if k != "sums"}
    assert SwapPlan.from_json(json.dumps({**old, "format_version": 4})).sums == ()
    assert (
        make_plan(
            model, LMSConfig(knobs=Knobs(min_bytes=0, swapout_threshold=2, serialize=False), policy="default")
        ).sums
        == ()
    )


def test_a_sum_that_does_not_fit_the_model_is_refused():
    with pytest.raises(ValueError, match="'AddN_9'.*does not fit this model"):
        with_split_sums(sum_model(), [Sum("AddN_9", ("a:0", "b:0", "c:0"))])
    with pytest.raises(TypeError, match="split_sums='yes' is not an option: .* Received: split_sums='yes'"):
        LMSConfig(split_sums="yes")


def test_the_memory_plot_of_a_plan_with_sums_shows_the_chains():
    from tflms.report.plot import memory_plot_data

    model = sum_model()
    plan = make_plan(
        model,
        LMSConfig(policy=("default", "split_sums"), knobs=Knobs(min_bytes=0, swapout_threshold=2, serialize=False)),
    )
    data = memory_plot_data(model, plan)
    assert int(data.before.max()) == plan.peak_bytes_before
    assert int(data.after.max()) == plan.peak_bytes_after < plan.peak_bytes_before
