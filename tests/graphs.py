"""Hand-built graph models for planner and simulator tests (no TensorFlow)."""

from tflms.ir.graph import GraphModel

MIB = 1 << 20


def mib(n_mib: int) -> list:
    """The outputs of an op of one flat float32 tensor of ``n_mib`` MiB."""
    return [("float32", (n_mib * MIB // 4,), n_mib * MIB, False)]


def f32(*shape):
    n = 4
    for d in shape:
        n *= d
    return ("float32", tuple(shape), n, False)


def op(name, type_, inputs=(), outputs=(), control=(), device=""):
    return {
        "name": name,
        "type": type_,
        "inputs": list(inputs),
        "outputs": list(outputs),
        "control_inputs": list(control),
        "device": device,
    }


def relu_chain(ops, prev, prefix, n, output):
    """Append ``n`` Relu ops ``prefix0``... to ``ops``, the first reading ``prev``; return the last's output."""
    for i in range(n):
        ops.append(op(f"{prefix}{i}", "Relu", [prev], [output]))
        prev = f"{prefix}{i}:0"
    return prev


def chain_model(n_fwd=6, size=(8, 128), variable_bytes=0):
    """x -> f0 -> f1 ... -> loss -> gradient_tape/b{n-1} ... -> gradient_tape/b0 -> update.

    Backward op b_i reads the incoming gradient and forward activation f_i.
    Every activation is 4 KiB with the default size; levels: x=0, f_i=i+1,
    loss=n_fwd+1, b_i=n_fwd+2+(n_fwd-1-i), update right after b0.
    """
    ops = [op("x", "Placeholder", outputs=[f32(*size)])]
    prev = "x:0"
    for i in range(n_fwd):
        ops.append(op(f"f{i}", "Relu", [prev], [f32(*size)]))
        prev = f"f{i}:0"
    ops.append(op("loss", "Sum", [prev], [f32(*size)]))
    grad = "loss:0"
    for i in reversed(range(n_fwd)):
        ops.append(op(f"gradient_tape/b{i}", "ReluGrad", [grad, f"f{i}:0"], [f32(*size)]))
        grad = f"gradient_tape/b{i}:0"
    ops.append(op("update", "AssignSubVariableOp", [grad], []))
    return GraphModel.from_ops(ops, variable_bytes=variable_bytes, name="chain")


def bn_relu_model(scale_type="Placeholder", cheap="Mul", x_type="Placeholder", offset_type="Placeholder"):
    """x -> conv c -> m = c * s -> a = m + o -> r = Relu(a) -> conv c2 -> loss, then a backward
    pass whose late ops read r (a filter gradient and ReluGrad) and c (a BatchNorm gradient).
    ``x_type``, ``offset_type``: the ops that make x and o (a ``Placeholder`` is an argument, held
    for the whole step)."""
    big = f32(64, 64)
    ops = [
        op("x", x_type, outputs=[big]),
        op("s", scale_type, outputs=[f32(64)]),
        op("o", offset_type, outputs=[f32(64)]),
        op("c", "Conv2D", ["x:0"], [big]),
        op("m", cheap, ["c:0", "s:0"], [big]),
        op("a", "AddV2", ["m:0", "o:0"], [big]),
        op("r", "Relu", ["a:0"], [big]),
        op("c2", "Conv2D", ["r:0"], [f32(2, 2)]),
        op("loss", "Sum", ["c2:0"], [f32(2, 2)]),
    ]
    prev = relu_chain(ops, "loss:0", "gradient_tape/g", 6, f32(2, 2))
    ops += [
        op("gradient_tape/filter", "Conv2DBackpropFilter", ["r:0", prev], [f32(2, 2)]),
        op("gradient_tape/rg", "ReluGrad", [prev, "r:0"], [big]),
        op("gradient_tape/bn", "Mul", ["gradient_tape/rg:0", "c:0"], [big]),
        op("update", "AssignSubVariableOp", ["gradient_tape/bn:0", "gradient_tape/filter:0"], []),
    ]
    return GraphModel.from_ops(ops, name="bn_relu")


def two_group_model(late_u=False):
    """x, u = Conv2D(x) -> m = x * u -> a = m + u -> r = Relu(a) -> loss. The backward pass reads
    r twice, far apart (two swap-in groups: ReluGrad rg1 early, Mul rg2 late), and u once (du), right
    after rg1 or, with ``late_u``, right after rg2."""
    big = f32(64, 64)
    ops = [
        op("x", "Placeholder", outputs=[big]),
        op("u", "Conv2D", ["x:0"], [big]),
        op("m", "Mul", ["x:0", "u:0"], [big]),
        op("a", "AddV2", ["m:0", "u:0"], [big]),
        op("r", "Relu", ["a:0"], [big]),
        op("c2", "Conv2D", ["r:0"], [f32(2, 2)]),
        op("loss", "Sum", ["c2:0"], [f32(2, 2)]),
    ]
    prev = relu_chain(ops, "loss:0", "gradient_tape/g", 6, f32(2, 2))
    ops.append(op("gradient_tape/rg1", "ReluGrad", [prev, "r:0"], [big]))
    prev = relu_chain(ops, "gradient_tape/rg1:0", "gradient_tape/h", 10, big)
    ops.append(op("gradient_tape/rg2", "Mul", [prev, "r:0"], [big]))
    du_after = "gradient_tape/rg2:0" if late_u else "gradient_tape/rg1:0"
    ops.append(op("gradient_tape/du", "Mul", [du_after, "u:0"], [big]))
    ops.append(op("update", "AssignSubVariableOp", ["gradient_tape/rg2:0", "gradient_tape/du:0"], []))
    return GraphModel.from_ops(ops, name="two_group")


def chained_pushdown_model():
    """``c * (x * (y * z))``: Grappler's constant push-down goes down it twice."""
    return GraphModel.from_ops(
        [
            op("c", "Const", outputs=[f32(1)]),
            op("x", "Placeholder", outputs=[f32(8)]),
            op("y", "Relu", ["x:0"], [f32(8)]),
            op("z", "Relu", ["x:0"], [f32(8)]),
            op("yz", "Mul", ["y:0", "z:0"], [f32(8)]),
            op("k", "Mul", ["x:0", "yz:0"], [f32(8)]),
            op("p", "Mul", ["k:0", "c:0"], [f32(8)]),
        ]
    )


RESOURCE = ("resource", (), 0, False)


def variable_update_model(wait=False, weight=64 * 1024, activation=256 * 1024, other=256 * 1024):
    """A weight ``v`` read once (``rv``) by the forward ``y`` and the backward ``dx``, and updated
    by ``update`` from its gradient ``dv``; ``w`` is another variable (``other`` bytes), never
    written. With ``wait`` the update has a control input on ``dx``; without it, the executor
    may update ``v`` while ``dx`` still holds ``rv``, and TensorFlow then copies ``v`` first."""
    n, k = activation // 4, weight // 4
    ops = [
        op("v", "Placeholder", outputs=[RESOURCE]),
        op("w", "Placeholder", outputs=[RESOURCE]),
        op("rv", "ReadVariableOp", ["v:0"], [f32(k)]),
        op("x", "RandomStandardNormal", outputs=[f32(n)]),
        op("y", "MatMul", ["x:0", "rv:0"], [f32(n)]),
        op("loss", "Sum", ["y:0"], [f32()]),
        op("gradient_tape/dy", "Fill", ["loss:0"], [f32(n)]),
        op("gradient_tape/dv", "MatMul", ["x:0", "gradient_tape/dy:0"], [f32(k)]),
        op("gradient_tape/dx", "MatMul", ["gradient_tape/dy:0", "rv:0"], [f32(n)]),
        op("update", "AssignSubVariableOp", ["v:0", "gradient_tape/dv:0"], [], ["gradient_tape/dx"] if wait else []),
    ]
    return GraphModel.from_ops(ops, variable_bytes=weight + other, variables=[("w:0", other), ("v:0", weight)])
