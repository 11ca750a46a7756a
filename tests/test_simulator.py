from tflms import LMSConfig, make_plan
from tflms.graph import GraphModel
from tflms.plan import Swap, SwapIn
from tflms.simulator import simulate

from graphs import chain_model, f32, op

KB4 = 8 * 128 * 4  # one activation of chain_model


def test_peak_of_a_diamond_by_hand():
    ops = [
        op("a", "Relu", outputs=[f32(100)]),
        op("b", "Relu", ["a:0"], [f32(10)]),
        op("c", "Add", ["a:0", "b:0"], [f32(1)]),
    ]
    prof = simulate(GraphModel.from_ops(ops, variable_bytes=1000))
    # step a: 400; step b: 440; step c: 440 + 4 (c's output, read by nobody)
    assert list(prof.timeline) == [400, 440, 444]
    assert prof.peak_bytes == 1444 and prof.peak_op == "c"


def test_aliases_share_buffers_and_host_ops_allocate_nothing():
    ops = [
        op("a", "Relu", outputs=[f32(100)]),
        op("r", "Reshape", ["a:0"], [f32(10, 10)]),
        op("h", "Relu", ["a:0"], [f32(50)], device="/device:CPU:0"),
        op("b", "Relu", ["r:0"], [f32(1)]),
    ]
    prof = simulate(GraphModel.from_ops(ops), host="/device:CPU:0")
    # r aliases a (no new bytes) and keeps a alive until b; h is on the host.
    assert list(prof.timeline) == [400, 400, 400, 404]
    # Without a host, h's 200 bytes count at its own step (a is still live): 400 + 200.
    assert simulate(GraphModel.from_ops(ops)).peak_bytes == 600


def _f0_swap(trigger, trigger_level):
    """Swap f0 of chain_model(n_fwd=3) out, back in for its backward consumer b0 (level 7)."""
    swap_in = SwapIn(consumers=(("gradient_tape/b0", 1),), trigger=trigger, level=7, trigger_level=trigger_level)
    return Swap(
        tensor="f0:0", producer="f0", producer_type="Relu", dtype="float32", shape=(8, 128),
        bytes=KB4, level=1, distance=6, swap_ins=(swap_in,),
    )  # fmt: skip


def test_chain_peak_before_and_after_a_hand_made_swap():
    m = chain_model(n_fwd=3)  # levels: x0 f0:1 f1:2 f2:3 loss4 b2:5 b1:6 b0:7 update8
    before = simulate(m)
    # f0, f1, f2 live until their backward op; peak at b2: f0, f1, f2, loss, b2.
    assert before.peak_bytes == 5 * KB4
    swap = _f0_swap(trigger="gradient_tape/b1", trigger_level=6)
    after = simulate(m, [swap])
    # f0 freed after f1 reads it (step 2); swap-in allocated at b1 (step 6), freed after b0.
    timeline = list(after.timeline)
    assert timeline[4] == 3 * KB4  # at loss: f1, f2, loss (x is dead, f0 is on the host)
    assert timeline[5] == 4 * KB4  # at b2: f1, f2, loss, b2
    assert after.peak_bytes == 4 * KB4
    assert after.swap_out_steps == (1,) and after.swap_in_steps == (6,)


def test_swap_in_without_trigger_counts_from_the_producer():
    m = chain_model(n_fwd=3)
    swap = _f0_swap(trigger=None, trigger_level=None)
    # The device copy is freed early but the swap-in holds the same bytes from step 1: no gain.
    assert simulate(m, [swap]).peak_bytes == simulate(m).peak_bytes


def test_planned_chain_lowers_the_predicted_peak():
    m = chain_model(n_fwd=8, variable_bytes=100)
    plan = make_plan(m, LMSConfig(swapout_threshold=3, swapin_ahead=1, swapin_groupby=0, min_bytes=0))
    assert plan.peak_bytes_after < plan.peak_bytes_before
    assert plan.peak_bytes_before == simulate(m).peak_bytes
    assert plan.peak_bytes_after == simulate(m, plan.swaps).peak_bytes
