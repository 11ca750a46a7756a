"""tflms.plot_memory / SwapPlan.plot on hand-built graphs: the PNG, and that it draws the
simulator's numbers (real traced steps: tests/test_plot.py)."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

import tflms
from tflms import Knobs, LMSConfig, SwapPlan, make_plan, simulate
from tflms.emulate.order import ready_order
from tflms.report.plot import MemoryPlotData, draw_memory, memory_plot_data, plot_plan

from graphs import bn_relu_model, chain_model

pytestmark = pytest.mark.unit

KB4 = 8 * 128 * 4  # one activation of chain_model
CONFIG = {"knobs": Knobs(swapout_threshold=6, swapin_ahead=1, min_bytes=0, swapin_groupby=0)}
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
    assert data.schedule == tuple(ready_order(model)) == plain.schedule
    assert data.variable_bytes == 100
    assert (data.peak_before, data.peak_after) == (plan.peak_bytes_before, plan.peak_bytes_after)
    assert data.peak_after < data.peak_before
    assert data.swap_out_steps == planned.swap_out_steps and data.swap_in_steps == planned.swap_in_steps
    # By hand: the schedule is x, f0..f7, loss, b7..b0, update (one op per level); f_i is swapped
    # (distance 16 - 2i > 6 for i < 5) at its producer and comes back at b_{i+1} (swapin_ahead=1).
    pos = {op: i for i, op in enumerate(data.schedule)}
    assert list(data.swap_out_steps) == [pos[s.producer] for s in plan.swaps] == [1, 2, 3, 4, 5]
    assert list(data.swap_in_steps) == [pos[f"gradient_tape/b{i + 1}"] for i in range(5)] == [16, 15, 14, 13, 12]
    assert data.before[pos["loss"]] == 100 + 10 * KB4  # x (the caller's), f0..f7 and loss all live
    assert data.phases == tuple(model.phase(op) for op in data.schedule)
    assert data.phases[pos["f3"]] == "forward" and data.phases[pos["gradient_tape/b3"]] == "backward"
    assert data.phases[-1] == "update" and data.n_sources == 1  # only x is at level 0
    assert data.shown == tuple(range(1, 19)) and data.stages == data.phases
    assert list(data.drawn([1, 5, 18])) == [0, 4, 17]
    assert data.op_bytes[pos["f3"]] == KB4 and data.op_bytes[pos["x"]] == KB4
    assert (data.unit, data.scale) == ("KiB", 1024)


def test_plot_of_a_plan_with_recomputes_maps_the_clones_onto_the_plain_schedule():
    from tflms.plan.passes.recompute import with_recomputes

    # x, the scale and the offset made in the step, not arguments (held for the whole step): their
    # last reads are clones, so the step's memory drops after the clones ran.
    model = bn_relu_model(scale_type="Const", x_type="RandomStandardNormal", offset_type="Const")
    plan = make_plan(model, LMSConfig(policy=("default", "recompute"), knobs=Knobs(swapout_threshold=2, min_bytes=0)))
    assert plan.recomputes
    data = memory_plot_data(model, plan)
    planned = simulate(with_recomputes(model, plan.recomputes), plan.swaps, plan.options["host"])
    assert data.schedule == tuple(ready_order(model)) and len(data.after) == len(data.before)
    assert len(planned.schedule) == len(data.schedule) + sum(len(r.ops) for r in plan.recomputes)
    # Each original op shows the highest memory since the previous original op ran, so the
    # clones' memory is not lost: the plotted peak is the planned step's peak.
    assert data.peak_after == plan.peak_bytes_after == planned.peak_bytes
    pos = {op: i for i, op in enumerate(planned.schedule)}
    clones = [pos[r.clone(op, 0)] for r in plan.recomputes for op in r.ops]
    first_after = min(pos[c] for c, _ in plan.recomputes[0].groups[0].consumers)
    shown_at = data.schedule.index(planned.schedule[first_after])
    window = planned.timeline[min(clones) : first_after + 1]
    assert data.after[shown_at] == model.variable_bytes + max(window) > model.variable_bytes + window[-1]
    # Swap marks land on ops of the plain schedule.
    assert all(0 <= p < len(data.schedule) for p in (*data.swap_out_steps, *data.swap_in_steps))


def test_phase_spans_cover_the_drawn_ops_in_order():
    model, plan = chain_plan()
    data = memory_plot_data(model, plan)
    spans = data.phase_spans(resolution=len(ready_order(model)))
    # One op per window, x (level 0) not drawn: the spans are the runs of phases of the drawn ops.
    assert spans == [("forward", 0, 9), ("backward", 9, 17), ("update", 17, 18)]


def _hand_data(phases, op_bytes=None, stages=None):
    """MemoryPlotData over ``len(phases)`` drawn ops (one level-0 op in front), for span tests."""
    n = len(phases) + 1
    return MemoryPlotData(
        schedule=tuple(f"op{i}" for i in range(n)),
        before=np.zeros(n, np.int64),
        after=np.zeros(n, np.int64),
        variable_bytes=0,
        budget=None,
        phases=("forward", *phases),
        stages=("forward", *(stages or phases)),
        op_bytes=np.array([0, *(op_bytes or [0] * len(phases))], np.int64),
        n_sources=1,
        shown=tuple(range(1, n)),
        swap_out_steps=(),
        swap_in_steps=(),
        unit="B",
        scale=1,
    )


def test_narrow_stretches_inside_a_phase_are_absorbed():
    # 2 backward ops among 90 forward ones (shape arithmetic of the gradients, run early): an island.
    phases = ["forward"] * 50 + ["backward"] * 2 + ["forward"] * 40 + ["backward"] * 30 + ["update"] * 10
    data = _hand_data(phases)
    assert data.phase_spans(resolution=132, min_fraction=0) == [
        ("forward", 0, 50), ("backward", 50, 52), ("forward", 52, 92), ("backward", 92, 122), ("update", 122, 132),
    ]  # fmt: skip
    assert data.phase_spans(resolution=132) == [("forward", 0, 92), ("backward", 92, 122), ("update", 122, 132)]
    # A stretch of 5% or more, or a narrow one between different phases (not a sliver), stays.
    wide = _hand_data(["forward"] * 50 + ["backward"] * 7 + ["forward"] * 43)
    assert wide.phase_spans(resolution=100) == [("forward", 0, 50), ("backward", 50, 57), ("forward", 57, 100)]
    edge = _hand_data(["forward"] * 60 + ["backward"] * 37 + ["update"] * 3)
    assert edge.phase_spans(resolution=100)[-1] == ("update", 97, 100)
    # A sliver (under 2%) between different phases goes to its wider neighbour.
    sliver = _hand_data(["forward"] * 60 + ["update"] + ["backward"] * 39)
    assert sliver.phase_spans(resolution=100) == [("forward", 0, 61), ("backward", 61, 100)]


def test_windows_are_labelled_by_the_bytes_their_ops_allocate():
    # Each window of 4 ops: one forward op allocating 1 MiB and three backward shape ops of 4 bytes.
    phases = ["forward", "backward", "backward", "backward"] * 25
    data = _hand_data(phases, op_bytes=[2**20, 4, 4, 4] * 25)
    assert data.phase_spans(resolution=25) == [("forward", 0, 100)]
    counted = _hand_data(phases)  # without bytes every op weighs 1: the backward ops are the majority
    assert counted.phase_spans(resolution=25) == [("backward", 0, 100)]
    # The stage, not the phase, decides (an optimizer scalar op tagged forward is shaded as update).
    staged = _hand_data(["forward"] * 100, stages=["forward"] * 60 + ["update"] * 40)
    assert staged.phase_spans(resolution=100) == [("forward", 0, 60), ("update", 60, 100)]


def test_drawn_artists_hold_the_data():
    model, plain_plan = chain_plan()
    budget = (plain_plan.peak_bytes_after + plain_plan.peak_bytes_before) // 2
    model, plan = chain_plan(budget=budget)
    assert plan.options["budget"] == budget and plan.peak_bytes_after <= budget
    data = memory_plot_data(model, plan)
    fig = Figure(layout="constrained")
    artists = draw_memory(data, fig.add_subplot())
    shown = list(data.shown)  # x (level 0) is not drawn
    np.testing.assert_allclose(artists["before"].get_ydata() * data.scale, data.before[shown])
    np.testing.assert_allclose(artists["after"].get_ydata() * data.scale, data.after[shown])
    np.testing.assert_array_equal(artists["after"].get_xdata(), np.arange(len(data.schedule) - 1))
    assert artists["budget"].get_ydata()[0] * data.scale == budget
    rug_out = [seg[0][0] for seg in artists["swap_out"].get_segments()]
    rug_in = [seg[0][0] for seg in artists["swap_in"].get_segments()]
    assert rug_out == [s - 1 for s in data.swap_out_steps] and rug_in == [s - 1 for s in data.swap_in_steps]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert f"swap-out ({len(plan.swaps)})" in labels and f"swap-in ({plan.n_swap_ins})" in labels
    assert any(label.startswith("with plan: peak") for label in labels)
    assert {"forward", "backward", "update"} <= set(labels)  # every shaded phase is named in the legend


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
    assert plot_plan(plan, tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
    bare = dataclasses.replace(plan)  # same fields, no model attached
    assert bare.model is None and plan.model is model
    assert plan.to_json() == bare.to_json() and plan.fingerprint() == bare.fingerprint()
    assert "_model" not in plan.to_json()
    loaded = SwapPlan.from_json(plan.to_json())
    assert loaded == plan and loaded.to_json() == plan.to_json()
    with pytest.raises(ValueError, match=r"model=tflms.GraphModel.from_func_graph"):
        plot_plan(loaded, tmp_path / "l.png")
    assert not (tmp_path / "l.png").exists()
    assert plot_plan(loaded, tmp_path / "l.png", model=model).read_bytes()[:8] == PNG_MAGIC


def test_a_model_that_does_not_match_the_plan_is_refused(tmp_path):
    _, plan = chain_plan(n_fwd=8)
    other = chain_model(n_fwd=4)
    with pytest.raises(ValueError, match="does not match the plan"):
        plot_plan(plan, tmp_path / "x.png", model=other)


def test_empty_plan_plots_the_plain_step(tmp_path):
    model = chain_model(n_fwd=3)
    plan = make_plan(model, LMSConfig(knobs=Knobs(swapout_threshold=1000)))
    assert not plan.swaps
    data = memory_plot_data(model, plan)
    np.testing.assert_array_equal(data.before, data.after)
    assert data.swap_out_steps == () and data.swap_in_steps == ()
    assert imread(plot_plan(plan, tmp_path / "e.png")).shape == (500, 1100, 4)


def test_importing_tflms_does_not_need_matplotlib():
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'matplotlib':\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import tflms\n"
        "from tflms.ir.graph import GraphModel\n"
        "m = GraphModel.from_ops([{'name': 'a', 'type': 'Relu', 'inputs': [], 'outputs': []}])\n"
        "try:\n"
        "    tflms.plot_memory(m, tflms.make_plan(m, tflms.LMSConfig()), 'x.png')\n"
        "except ImportError as err:\n"
        "    print('ImportError:', err)\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ImportError: tflms.plot_memory needs matplotlib: pip install 'tflms[plot]'" in out.stdout
