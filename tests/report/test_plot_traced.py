"""The memory plot of real traced training steps (the plot's data and drawing on hand-built
graphs are tested without TensorFlow in tests/unit/test_plot.py)."""

import numpy as np
import pytest
import tensorflow as tf
from matplotlib.figure import Figure

import tflms
from tflms import SwapPlan
from tflms.ir.graph import GraphModel
from tflms.report.plot import draw_memory, memory_plot_data, plot_plan

import zoo
from conftest import DEVICE

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_real_step_without_level_0_ops_and_without_slivers():
    """The CNN's training step: a third of its ops are at level 0 (constants, inputs, variable handles)."""
    setup = zoo.cnn()
    cf = tf.function(setup.step_fn()).get_concrete_function(setup.x, setup.y)
    _, plan = tflms.optimize(cf, device=DEVICE)
    model = plan.model
    data = memory_plot_data(model, plan)
    level0 = [i for i, op in enumerate(data.schedule) if model.level(op) == 0]
    assert data.n_sources == len(level0) > 0.25 * len(data.schedule)
    assert set(data.shown) == set(range(len(data.schedule))) - set(level0)
    fig = Figure(layout="constrained")
    ax = fig.add_subplot()
    artists = draw_memory(data, ax)
    n = len(data.schedule) - len(level0)
    assert len(artists["before"].get_xdata()) == n and ax.get_xlim() == (-0.5, n - 0.5)
    assert f"its {len(level0)} level-0 ops" in ax.get_xlabel()
    # The peaks are drawn (no level-0 op holds them) and the rug marks land on the drawn ops.
    assert artists["peak_before"].get_ydata()[0] * data.scale == data.peak_before
    assert artists["peak_after"].get_ydata()[0] * data.scale == data.peak_after
    rug = [int(seg[0][0]) for seg in artists["swap_out"].get_segments()]
    assert [data.shown[k] for k in rug] == list(data.swap_out_steps)
    # Shading: contiguous, covering the axis, every phase present, no narrow island and no sliver,
    # although the raw windows have some (gradient shape arithmetic or optimizer scalars among the forward ops).
    raw, spans = data.phase_spans(min_fraction=0), data.phase_spans()
    assert len(raw) > len(spans)
    assert [a for _, a, _ in spans] == [0] + [b for _, _, b in spans[:-1]] and spans[-1][2] == n
    assert {label for label, _, _ in spans} == {"forward", "backward", "update"}
    widths = [b - a for _, a, b in spans]
    assert min(widths) >= 0.02 * n
    assert not any(spans[i - 1][0] == spans[i + 1][0] and widths[i] < 0.05 * n for i in range(1, len(spans) - 1))
    labels = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"forward", "backward", "update"} <= labels


def test_real_model_plans_from_optimize_and_tflms_function_plot(tmp_path):
    setup = zoo.cnn()
    cf = tf.function(setup.step_fn()).get_concrete_function(setup.x, setup.y)
    _, plan = tflms.optimize(cf, device=DEVICE)
    assert plan.swaps
    data = memory_plot_data(plan.model, plan)
    assert (data.peak_before, data.peak_after) == (plan.peak_bytes_before, plan.peak_bytes_after)
    assert len(data.swap_out_steps) == len(plan.swaps) and len(data.swap_in_steps) == plan.n_swap_ins
    assert set(data.phases) == {"forward", "backward", "update"}
    assert plot_plan(plan, tmp_path / "cnn.png").read_bytes()[:8] == PNG_MAGIC
    # A plan from JSON plots with the graph model of the (unchanged) traced step.
    loaded = SwapPlan.from_json(plan.to_json())
    np.testing.assert_array_equal(memory_plot_data(GraphModel.from_func_graph(cf.graph), loaded).after, data.after)

    lms = tflms.function(setup.step_fn(), device=DEVICE)
    lms_plan = lms.get_plan(setup.x, setup.y)
    assert plot_plan(lms_plan, tmp_path / "fn.png").read_bytes()[:8] == PNG_MAGIC
    # tflms.function rewrote its own trace in place: that graph is not the one the plan was made from.
    rewritten = GraphModel.from_func_graph(lms.get_concrete_function(setup.x, setup.y).graph)
    with pytest.raises(ValueError, match="before tflms rewrote it"):
        plot_plan(SwapPlan.from_json(lms_plan.to_json()), tmp_path / "bad.png", model=rewritten)
