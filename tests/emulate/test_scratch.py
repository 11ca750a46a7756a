"""An op's measured temporary buffer (its ``scratch``) in the simulator, worked out by hand."""

import json

import pytest

from tflms import LMSConfig, make_plan
from tflms.emulate.costs import OpProfile, with_scratch
from tflms.emulate.simulator import Simulator, simulate
from tflms.ir.graph import GraphModel

from graphs import f32, op

pytestmark = pytest.mark.unit


def _chain() -> GraphModel:
    return GraphModel.from_ops(
        [
            op("a", "Relu", outputs=[f32(100)]),
            op("b", "Conv2DBackpropFilter", ["a:0"], [f32(10)]),
            op("c", "Relu", ["b:0"], [f32(10)]),
            op("d", "Relu", ["c:0"], [f32(10)]),
        ]
    )


def test_scratch_is_held_while_its_op_runs_and_freed_after():
    plain = simulate(_chain())
    scratched = simulate(with_scratch(_chain(), {"b": 4096}))
    # Requested: a 400; b 440, + 4096 (its scratch, after its output); c writes into b's buffer
    # (440) and the scratch is gone, freed right after b as an output nobody reads; d: a is freed
    # 1 + LAG after its read by b, and d writes into c's buffer (40).
    assert list(plain.requested) == [400, 440, 440, 40]
    assert list(scratched.requested) == [400, 440 + 4096, 440, 40]
    assert scratched.peak_bytes - plain.peak_bytes == 4096  # 4096 is a multiple of 256: one chunk
    assert scratched.peak_op == "b"


def test_scratch_is_a_buffer_of_live_but_not_of_buffer_spans():
    sim = Simulator(with_scratch(_chain(), {"b": 4096}))
    position = list(sim.order).index("b")
    assert ("b (scratch)", 4096) in sim.live(position)
    assert [span[0] for span in sim.buffer_spans()] == [span[0] for span in Simulator(_chain()).buffer_spans()]
    assert sim.largest_buffer() == 4096  # one contiguous chunk, as the allocator needs


def test_scratch_on_the_host_is_not_counted():
    host = "/job:worker/replica:0/task:0/device:CPU:0"
    ops = [op("a", "Relu", outputs=[f32(100)]), op("b", "Relu", ["a:0"], [f32(10)], device=host)]
    model = GraphModel.from_ops(ops)
    assert simulate(with_scratch(model, {"b": 4096}), host=host).peak_bytes == simulate(model, host=host).peak_bytes


def test_profile_scratch_round_trips_and_rejects_bad_bytes(tmp_path):
    profile = OpProfile({"b": ("Conv2DBackpropFilter", 1e-3), "c": ("Relu", 1e-4)}, scratch={"b": 4096, "c": 0})
    assert profile.scratch == {"b": 4096}  # an op without one is not listed
    loaded = OpProfile.load(profile.save(tmp_path / "p.json"))
    assert loaded.scratch == {"b": 4096} and loaded.ops == profile.ops
    record = json.loads((tmp_path / "p.json").read_text())["ops"]
    assert record["b"]["scratch_bytes"] == 4096 and "scratch_bytes" not in record["c"]
    with pytest.raises(ValueError, match=r"scratch\['b'\]=-1"):
        OpProfile({"b": ("X", 1.0)}, scratch={"b": -1})


def test_a_plan_made_with_a_profile_counts_its_scratch(tmp_path):
    model = _chain()
    path = OpProfile({n: (model.dag.nodes[n]["type"], 1e-3) for n in model.dag}, scratch={"b": 1 << 20}).save(
        tmp_path / "p.json"
    )
    plain = make_plan(model, LMSConfig(budget=None))
    measured = make_plan(model, LMSConfig(budget=None).with_knobs(op_profile=str(path)))
    assert plain.peak_bytes_before == simulate(model).peak_bytes
    assert measured.peak_bytes_before == simulate(with_scratch(model, {"b": 1 << 20})).peak_bytes
    assert measured.peak_bytes_before >= plain.peak_bytes_before + (1 << 20)
