"""tflms.plot_memory / SwapPlan.plot: the PNG, and that it draws the simulator's numbers."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from matplotlib.figure import Figure
from matplotlib.image import imread

import tflms
from tflms import LMSConfig, SwapPlan, make_plan, simulate
from tflms.graph import GraphModel
from tflms.plot import draw_memory, memory_plot_data

import zoo
from conftest import DEVICE
from graphs import chain_model

KB4 = 8 * 128 * 4  # one activation of chain_model
CONFIG = {"swapout_threshold": 6, "swapin_ahead": 1, "min_bytes": 0, "swapin_groupby": 0}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def chain_plan(n_fwd=8, **options):
    model = chain_model(n_fwd=n_fwd, variable_bytes=100)
    return model, make_plan(model, LMSConfig(**{**CONFIG, **options}))


def test_plot_data_is_the_simulators_timeline_plus_variables():
    model, plan = chain_plan()
    assert len(plan.swaps) >= 2
    data = memory_plot_data(model, plan)
    plain, planned = simulate(model, host=plan.options["host"]), simulate(model, plan.swaps, plan.options["host"])
    np.testing.assert_array_equal(data.before, plain.timeline + 100)
    np.testing.assert_array_equal(data.after, planned.timeline + 100)
    assert data.schedule == tuple(model.schedule()) == plain.schedule
    assert data.variable_bytes == 100
    assert (data.peak_before, data.peak_after) == (plan.peak_bytes_before, plan.peak_bytes_after)
    assert data.peak_after < data.peak_before
    assert data.swap_out_steps == planned.swap_out_steps and data.swap_in_steps == planned.swap_in_steps
    # By hand: the schedule is x, f0..f7, loss, b7..b0, update (one op per level); f_i is swapped
    # (distance 16 - 2i > 6 for i < 5) at its producer and comes back at b_{i+1} (swapin_ahead=1).
    pos = {op: i for i, op in enumerate(data.schedule)}
    assert list(data.swap_out_steps) == [pos[s.producer] for s in plan.swaps] == [1, 2, 3, 4, 5]
    assert list(data.swap_in_steps) == [pos[f"gradient_tape/b{i + 1}"] for i in range(5)] == [16, 15, 14, 13, 12]
    assert data.before[pos["loss"]] == 100 + 9 * KB4  # f0..f7 and loss all live
    assert data.phases == tuple(model.phase(op) for op in data.schedule)
    assert data.phases[pos["f3"]] == "forward" and data.phases[pos["gradient_tape/b3"]] == "backward"
    assert data.phases[-1] == "update" and data.n_sources == 1  # only x is at level 0
    assert (data.unit, data.scale) == ("KiB", 1024)


def test_phase_spans_cover_the_schedule_in_order():
    model, plan = chain_plan()
    spans = memory_plot_data(model, plan).phase_spans(resolution=len(model.schedule()))
    # One op per window: the spans are exactly the runs of phases after level 0.
    assert spans == [("level 0", 0, 1), ("forward", 1, 10), ("backward", 10, 18), ("update", 18, 19)]


def test_drawn_artists_hold_the_data():
    model, plain_plan = chain_plan()
    budget = (plain_plan.peak_bytes_after + plain_plan.peak_bytes_before) // 2
    model, plan = chain_plan(budget=budget)
    assert plan.options["budget"] == budget and plan.peak_bytes_after <= budget
    data = memory_plot_data(model, plan)
    fig = Figure(layout="constrained")
    artists = draw_memory(data, fig.add_subplot())
    np.testing.assert_allclose(artists["before"].get_ydata() * data.scale, data.before)
    np.testing.assert_allclose(artists["after"].get_ydata() * data.scale, data.after)
    np.testing.assert_array_equal(artists["after"].get_xdata(), np.arange(len(data.schedule)))
    assert artists["budget"].get_ydata()[0] * data.scale == budget
    rug_out = [seg[0][0] for seg in artists["swap_out"].get_segments()]
    rug_in = [seg[0][0] for seg in artists["swap_in"].get_segments()]
    assert rug_out == list(data.swap_out_steps) and rug_in == list(data.swap_in_steps)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert f"swap-out ({len(plan.swaps)})" in labels and f"swap-in ({plan.n_swap_ins})" in labels
    assert any(label.startswith("with plan: peak") for label in labels)


def test_plot_memory_writes_a_png_of_the_requested_size(tmp_path):
    model, plan = chain_plan()
    path = tflms.plot_memory(model, plan, tmp_path / "m.png", figsize=(6, 3), dpi=80, title="chain")
    assert path == tmp_path / "m.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = imread(path)
    assert image.shape == (240, 480, 4)
    # The planned curve (tab:blue, #1f77b4) is really drawn.
    blue = np.all(np.abs(image[..., :3] - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.02, axis=-1)
    assert blue.sum() > 50


def test_plan_plot_uses_its_model_and_json_ignores_it(tmp_path):
    model, plan = chain_plan()
    assert plan.plot(tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
    bare = dataclasses.replace(plan)  # same fields, no model attached
    assert getattr(bare, "_model", None) is None and plan._model is model
    assert plan.to_json() == bare.to_json() and plan.fingerprint() == bare.fingerprint()
    assert "_model" not in plan.to_json()
    loaded = SwapPlan.from_json(plan.to_json())
    assert loaded == plan and loaded.to_json() == plan.to_json()
    with pytest.raises(ValueError, match=r"model=tflms.GraphModel.from_func_graph"):
        loaded.plot(tmp_path / "l.png")
    assert not (tmp_path / "l.png").exists()
    assert loaded.plot(tmp_path / "l.png", model=model).read_bytes()[:8] == PNG_MAGIC


def test_a_model_that_does_not_match_the_plan_is_refused(tmp_path):
    _, plan = chain_plan(n_fwd=8)
    other = chain_model(n_fwd=4)
    with pytest.raises(ValueError, match="does not match the plan"):
        plan.plot(tmp_path / "x.png", model=other)


def test_empty_plan_plots_the_plain_step(tmp_path):
    model = chain_model(n_fwd=3)
    plan = make_plan(model, LMSConfig(swapout_threshold=1000))
    assert not plan.swaps
    data = memory_plot_data(model, plan)
    np.testing.assert_array_equal(data.before, data.after)
    assert data.swap_out_steps == () and data.swap_in_steps == ()
    assert imread(plan.plot(tmp_path / "e.png")).shape == (500, 1100, 4)


def test_real_model_plans_from_optimize_and_tflms_function_plot(tmp_path):
    setup = zoo.cnn()
    cf = tf.function(setup.step_fn()).get_concrete_function(setup.x, setup.y)
    _, plan = tflms.optimize(cf, device=DEVICE)
    assert plan.swaps
    data = memory_plot_data(plan._model, plan)
    assert (data.peak_before, data.peak_after) == (plan.peak_bytes_before, plan.peak_bytes_after)
    assert len(data.swap_out_steps) == len(plan.swaps) and len(data.swap_in_steps) == plan.n_swap_ins
    assert set(data.phases) == {"forward", "backward", "update"}
    assert plan.plot(tmp_path / "cnn.png").read_bytes()[:8] == PNG_MAGIC
    # A plan from JSON plots with the graph model of the (unchanged) traced step.
    loaded = SwapPlan.from_json(plan.to_json())
    np.testing.assert_array_equal(memory_plot_data(GraphModel.from_func_graph(cf.graph), loaded).after, data.after)

    lms = tflms.function(setup.step_fn(), device=DEVICE)
    lms_plan = lms.get_plan(setup.x, setup.y)
    assert lms_plan.plot(tmp_path / "fn.png").read_bytes()[:8] == PNG_MAGIC
    # tflms.function rewrote its own trace in place: that graph is not the one the plan was made from.
    rewritten = GraphModel.from_func_graph(lms.get_concrete_function(setup.x, setup.y).graph)
    with pytest.raises(ValueError, match="before tflms rewrote it"):
        SwapPlan.from_json(lms_plan.to_json()).plot(tmp_path / "bad.png", model=rewritten)


def test_importing_tflms_does_not_need_matplotlib():
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'matplotlib':\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import tflms\n"
        "from tflms.graph import GraphModel\n"
        "m = GraphModel.from_ops([{'name': 'a', 'type': 'Relu', 'inputs': [], 'outputs': []}])\n"
        "try:\n"
        "    tflms.plot_memory(m, tflms.make_plan(m, tflms.LMSConfig()), 'x.png')\n"
        "except ImportError as err:\n"
        "    print('ImportError:', err)\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ImportError: tflms.plot_memory needs matplotlib: pip install 'tflms[plot]'" in out.stdout
