"""Hand-built graph models for planner and simulator tests (no TensorFlow)."""

from tflms.graph import GraphModel


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
