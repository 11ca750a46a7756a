"""The ``tflms`` command line (also ``python -m tflms``).

Commands:
    tflms demo     ResNet50 under a real memory cap (test bed, or GPU 0): the plain step runs
                   out of memory, the step rewritten by tflms trains; measured peaks
    tflms plan     plan a keras.applications model (or your factory) for a batch size
    tflms bench    run a benchmark script from benchmarks/
    tflms build-horovod   build/install the Horovod wheel for this TensorFlow
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._util import format_sizes

__all__ = ["main"]


class CLIError(Exception):
    """An error reported as one line, exit code 1."""


#: Run in a child process by :func:`import_tensorflow`: copies its stdin to its stdout line by line,
#: leaving out the lines of absl's log format whose severity ``TF_CPP_MIN_LOG_LEVEL`` (argv[1]) hides
#: (I: 0, W: 1, E: 2; F lines are always kept) or that repeat an earlier line's source and message
#: (the same log statement of a second copy of a library), and absl's notice that logging is not
#: initialised where the level is 1 or more or it came before. Every other line (Python warnings,
#: tracebacks, anything else) is copied as it is.
_LOG_FILTER = r"""
import re, sys
level = int(sys.argv[1])
line_re = re.compile(rb"^([IWEF])\d{4} [\d:.]+ +\d+ ([^ \]]+:\d+\] .*?)\s*$")
notice = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
seen = set()
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    m = line_re.match(line)
    if m and m.group(1) != b"F":
        if b"IWE".index(m.group(1)) < level or m.group(2) in seen:
            continue
        seen.add(m.group(2))
    elif line.rstrip() == notice:
        if level >= 1 or notice in seen:
            continue
        seen.add(notice)
    out.write(line)
    out.flush()
"""


def min_log_level() -> int:
    """``TF_CPP_MIN_LOG_LEVEL`` as TensorFlow reads it: 0 (everything) to 3 (no errors either);
    0 when unset or not a number."""
    try:
        return max(0, int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0")))
    except ValueError:
        return 0


def import_tensorflow() -> None:
    """Import TensorFlow, leaving out of stderr the load-time log lines ``TF_CPP_MIN_LOG_LEVEL`` hides
    and the second copy of a repeated one.

    TensorFlow 2.21 logs "oneDNN custom operations are on ..." (INFO) from a static
    initializer of each of two libraries it loads on import (``libtensorflow_framework.so.2``,
    then ``_pywrap_profiler_plugin.so``), each before its copy of absl logging is set up, so the
    line comes twice and ``TF_CPP_MIN_LOG_LEVEL`` does not hide it (its later logs it does).
    Here stderr (file descriptor 2) goes through a filter process while TensorFlow is imported:
    the log lines whose severity ``TF_CPP_MIN_LOG_LEVEL`` hides, and repeats, are left out; every
    other line is passed on as it comes (errors, Python warnings and tracebacks included; if this
    process crashes during the import, what it wrote before still shows, since the filter outlives
    it). With TensorFlow already imported it does nothing. Call it before anything imports
    TensorFlow: ``tflms.cli.main`` does for ``tflms demo`` and ``tflms plan``.
    """
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        filt = subprocess.Popen(
            [sys.executable, "-S", "-c", _LOG_FILTER, str(min_log_level())], stdin=subprocess.PIPE, stdout=saved
        )
    except OSError:  # no filter: import as it is
        os.close(saved)
        import tensorflow

        return
    os.dup2(filt.stdin.fileno(), 2)
    try:
        import tensorflow  # noqa: F401
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        filt.stdin.close()
        filt.wait()


def _setup_devices() -> tuple[str | None, str]:
    """On a machine without GPU, split the CPU into two logical devices.

    Returns (device, explanation). Must run before TensorFlow initialises devices.
    """
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return None, "GPU found: LMS swaps between /device:GPU:0 and the host"
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return "/device:CPU:1", "no GPU: /device:CPU:1 plays the GPU and /device:CPU:0 the host"


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"expected dimensions like 224,224,3. Received: {text!r}")
    return shape


class _Size(int):
    """A byte count parsed from a size string; ``text`` is what the user typed."""

    text: str

    def __new__(cls, n: int, text: str = "") -> _Size:
        self = super().__new__(cls, n)
        self.text = text or str(n)
        return self

    def __reduce__(self) -> tuple[type, tuple[int]]:  # copies and pickles are plain ints
        return int, (int(self),)


def _parse_size(text: str) -> int:
    from .config import parse_bytes

    try:
        return _Size(parse_bytes(text, "budget"), text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _parse_budget(text: str) -> int | str | None:
    """``--budget``: ``'auto'``, ``'none'`` or a size."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return None if word == "none" else "auto"
    return _parse_size(text)


def _parse_policy(text: str) -> tuple[str, ...]:
    """``--policy``: comma-separated pass names (checked by :class:`tflms.LMSConfig`)."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _parse_window(text: str) -> int | str:
    """``--swapout-window``: ``'auto'``, ``'none'`` or an integer (checked by :class:`tflms.Knobs`)."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return word
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, 'auto' or 'none'; received {text!r}") from None


def _window_option(value: int | str) -> int | str | None:
    return None if value == "none" else value


def _parse_label_shape(text: str) -> tuple[int, ...]:
    if text.strip() in ("", "()", "scalar"):
        return ()
    return _parse_shape(text)


def _budget_text(budget: int, exact: bool = False) -> str:
    """``'16 GB' (14.9 GiB = 16.0 GB)``: what was typed and what it means."""
    text = getattr(budget, "text", None)
    return f"{text!r} ({format_sizes(budget, exact)})" if text is not None else format_sizes(budget, exact)


def _one_line(err: BaseException, limit: int = 500) -> str:
    """``'TypeError: first words of the message'``, whitespace collapsed, clipped to ``limit``."""
    text = " ".join(str(err).split()) or "(no message)"
    text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _import_factory_module(name: str) -> Any:
    """Import ``name`` as ``python -m`` would: the current directory is searched first.

    The ``tflms`` console script runs with its own folder, not the current directory,
    as ``sys.path[0]``, so ``tflms plan mymodels:unet`` would not find ``./mymodels.py``.
    """
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.insert(0, cwd)
    return importlib.import_module(name)


def build_model(spec: str, input_shape: tuple[int, ...], classes: int = 1000) -> Any:
    """A compiled Keras model from a keras.applications name or ``package.module:factory``.

    A factory is called with no arguments and must return a compiled ``keras.Model``;
    its module is looked up in the current directory first, then on ``sys.path``.
    """
    import keras

    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(_import_factory_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise CLIError(
                f"cannot load MODEL factory {spec!r} (searched the current directory {os.getcwd()} and "
                f"sys.path): {_one_line(err)}"
            ) from None
        except Exception as err:  # noqa: BLE001 - the module itself raised while being imported: one line
            raise CLIError(f"importing the module of MODEL factory {spec!r} failed: {_one_line(err)}") from None
        try:
            model = factory()
        except Exception as err:  # noqa: BLE001 - any error of the user's factory becomes one line
            raise CLIError(f"MODEL factory {spec!r} raised {_one_line(err)}") from None
        if not isinstance(model, keras.Model):
            raise CLIError(f"MODEL factory {spec!r} must return a keras.Model. Received: {type(model).__name__}")
        return model
    ctor = getattr(keras.applications, spec, None)
    if ctor is None or not callable(ctor) or spec[:1].islower():
        names = sorted(n for n in dir(keras.applications) if n[:1].isupper())
        raise CLIError(
            f"unknown MODEL {spec!r}: use a keras.applications name ({', '.join(names[:6])}, ...) "
            f"or package.module:factory"
        )
    model = ctor(weights=None, input_shape=input_shape, classes=classes)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    return model


def demo(args: argparse.Namespace) -> int:
    """The demo (``tflms demo``, what ``make run`` runs): see :mod:`tflms.testing.demo`."""
    from .testing.demo import run_demo

    try:
        return run_demo(args)
    except ValueError as err:  # e.g. BudgetError
        raise CLIError(str(err)) from None


def plan_cmd(args: argparse.Namespace) -> int:
    """Plan MODEL at --batch; print the summary, optionally write JSON and a plot.

    Every failure is one line on stderr (a :class:`CLIError`), unless ``--traceback``.
    """
    if args.max_batch and args.budget is None:
        raise CLIError("--max-batch needs --budget, the memory budget to fit. Received: --max-batch without --budget")
    if ":" in args.model:
        given = [f"--{n.replace('_', '-')}" for n in ("input_shape", "classes") if getattr(args, n) is not None]
        if given:
            raise CLIError(
                f"{' and '.join(given)} apply to keras.applications models only; the model of a factory has its "
                f"own inputs and outputs. Received: {', '.join(given)} with MODEL {args.model!r}"
            )
    _setup_devices()
    _show_progress()
    try:
        return _plan(args)
    except CLIError:
        raise
    except Exception as err:
        if args.traceback:
            raise
        raise CLIError(f"{_one_line(err)} (run with --traceback for the full traceback)") from None


def _show_progress() -> None:
    """Show the progress of long plans on stderr: the INFO records of logger ``tflms`` itself (the
    stages of :func:`tflms.make_plan`, each batch size :func:`tflms.max_batch_size` tries), as
    ``tflms: <message>`` lines. Its child loggers (``tflms.passes``) stay as quiet as before."""
    import logging

    logger = logging.getLogger("tflms")
    if any(getattr(h, "tflms_progress", False) for h in logger.handlers):  # main() called again
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.tflms_progress = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("tflms: %(message)s"))
    handler.addFilter(lambda record: record.name == "tflms")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the level set here would let tflms.passes reach any root handler


def _resolve_budget(config: Any) -> tuple[Any, str]:
    """``budget="auto"`` for ``tflms plan``: the limit of this machine's first GPU, if it has one."""
    from .config import resolve_budget

    if config.budget != "auto":
        return resolve_budget(config, None, "")
    import tensorflow as tf

    if tf.config.list_logical_devices("GPU"):
        from .integrations.function import device_memory_limit

        return resolve_budget(config, *device_memory_limit("/device:GPU:0"))
    return resolve_budget(config, None, "no GPU on this machine")


def _plan(args: argparse.Namespace) -> int:
    import tflms
    from tflms.ir.trace import keras_step_source, keras_train_step, specs_text

    # The options first: a bad one fails before the model is built and traced.
    knobs = {} if args.serialize is None else {"serialize": args.serialize}  # None: the knob's default
    try:
        if args.swapout_window is not None:
            knobs["swapout_window"] = _window_option(args.swapout_window)
        config = tflms.LMSConfig(
            budget=args.budget if args.budget in (None, "auto") else int(args.budget),
            policy=args.policy,
            on_budget_miss=args.on_budget_miss,
            offload=args.offload,
            knobs=tflms.Knobs(**knobs),
        )
    except ValueError as err:
        raise CLIError(str(err)) from None
    config, budget_text = _resolve_budget(config)
    shape = tuple(args.input_shape or (224, 224, 3))
    model = build_model(args.model, shape, classes=args.classes or 1000)
    if isinstance(args.budget, int):
        print(f"budget: {_budget_text(args.budget)}; KB/MB/GB are powers of 10, KiB/MiB/GiB and K/M/G powers of 2")
    else:
        print(budget_text)
    try:
        step = keras_train_step(model, label_shape=args.label_shape, label_dtype=args.label_dtype)
    except (TypeError, ValueError) as err:
        raise CLIError(" ".join(str(err).split())) from None
    x_spec, y_spec = step.structured_input_signature[0]
    print(f"{args.model}: inputs {specs_text(x_spec)}; labels {specs_text(y_spec)}; batch {args.batch}")
    from tflms.plan.capacity import unknown_dims

    gaps = unknown_dims(step, model)
    if gaps:  # sized as 1, they would plan (and search the batch of) a smaller step
        raise CLIError(
            f"cannot plan MODEL {args.model!r}: {'; '.join(gaps)}. Only the batch (the leading dimension) may be "
            "unknown: tflms would size every other unknown dimension as 1 (a sequence of length 1) and plan that "
            "smaller step. Make the factory return a model on inputs of concrete shapes, e.g. inputs = "
            "keras.Input(shape=(128,), dtype='int32') (one per input), keras.Model(inputs, model(inputs)), compiled "
            f"as the model is. Received: MODEL {args.model!r} with inputs {specs_text(x_spec)}; labels "
            f"{specs_text(y_spec)}"
        )
    source = keras_step_source(model, step, args.label_shape, args.label_dtype)
    if source is step:
        gm = tflms.GraphModel.from_func_graph(step.graph, batch_size=args.batch)
    else:  # traced again at this batch: the unknown batch leaves a forward tensor's size unknown
        gm = tflms.GraphModel.from_func_graph(source(args.batch).graph)
    if config.offload is not None:  # the step as it runs with the offload: the update on the host
        from tflms.plan.capacity import offloaded

        gm = offloaded(gm, config)
    try:
        plan = tflms.make_plan(gm, config)
    except tflms.BudgetError as err:
        raise CLIError(
            "no swap plan brings the predicted device peak within the budget "
            f"{_budget_text(args.budget if isinstance(args.budget, int) else err.budget, True)}: "
            f"the best plan's peak is {format_sizes(err.best_peak_bytes, True)} "
            f"({format_sizes(err.plain_peak_bytes)} without LMS; simulator). Raise --budget or lower --batch. "
            f"Received: --budget={getattr(args.budget, 'text', 'auto')!r}"
        ) from None
    print(plan.summary(max_rows=args.rows))
    if args.json:
        Path(args.json).write_text(plan.to_json() + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from tflms.report.plot import plot_memory

        plot_memory(gm, plan, args.plot)
        print(f"wrote {args.plot}")
    if args.max_batch:
        if config.budget is None:
            raise CLIError("--max-batch needs --budget: pass --budget 16GiB (or --budget auto where a GPU has one)")
        print(tflms.max_batch_size(source, config.budget, config=config.replace(budget=None), bound=True))
    return 0


BENCHMARKS = {
    "pass-speed": "pass_speed.py",
    "capacity": "capacity.py",
    "overhead": "cpu_overhead.py",
    "gpu": "gpu.py",
}


def bench(args: argparse.Namespace) -> int:
    """Run benchmarks/<name>.py with the remaining arguments."""
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / BENCHMARKS[args.name]
    if not script.exists():
        raise CLIError(f"benchmark script {script} not found: run tflms bench from a source checkout")
    return subprocess.call([sys.executable, str(script), *args.rest])


def build_horovod(args: argparse.Namespace) -> int:
    from .tools import build_horovod as bh

    return bh.main(args.rest)


def _add_demo(sub: Any) -> None:
    """The ``demo`` command's parser, on ``sub`` (the subparsers of :func:`_parser`)."""
    p = sub.add_parser("demo", help="ResNet50: the plain step runs out of memory, tflms trains (measured)")
    p.add_argument(
        "--budget",
        type=_parse_size,
        help="tflms's memory budget (default: 85%% of the cap)",
    )
    p.add_argument(
        "--cap",
        type=_parse_size,
        help="the real memory cap of the device, the test bed's or GPU 0's (default: 75%% of the plain step's "
        "measured peak)",
    )
    p.add_argument(
        "--batch",
        type=int,
        help="batch size (default 32)",
    )
    p.add_argument("--image-size", type=int, default=96, help="input height and width (default 96)")
    p.add_argument(
        "--steps", type=int, default=3, help="measured training steps per run, after one warm-up step (default 3)"
    )
    p.set_defaults(func=demo)


def _add_plan(sub: Any) -> None:
    """The ``plan`` command's parser, on ``sub``."""
    p = sub.add_parser("plan", help="plan a model for a batch size (simulator)")
    p.add_argument("model", metavar="MODEL", help="keras.applications name (e.g. ResNet50) or package.module:factory")
    p.add_argument("--batch", type=int, required=True, help="batch size")
    p.add_argument("--input-shape", type=_parse_shape, help="keras.applications models: e.g. 224,224,3 (the default)")
    p.add_argument("--classes", type=int, help="keras.applications models: number of classes (default 1000)")
    p.add_argument(
        "--label-shape",
        type=_parse_label_shape,
        help="labels without the batch axis, e.g. 128,128 ('()' for one label per sample); default: derived from "
        "the output and its loss (a sparse loss takes the output shape without its last axis)",
    )
    p.add_argument(
        "--label-dtype", help="dtype of the labels, e.g. int32 (default: int32 for a sparse loss, else float32)"
    )
    p.add_argument(
        "--budget",
        type=_parse_budget,
        default="auto",
        help="device memory budget: a size such as 16GiB (autotune to it), auto (default: the limit of this "
        "machine's first GPU x 0.9; none without a GPU) or none (swap every candidate)",
    )
    p.add_argument(
        "--swapout-window",
        type=_parse_window,
        metavar="N|auto|none",
        help="at most N swap-outs in flight: fence each swapped tensor's producer on the swap-out N before it "
        "(default auto: 2 where the device is a GPU; `plan` names no device, so none)",
    )
    p.add_argument(
        "--serialize",
        action=argparse.BooleanOptionalAction,
        help="memory-aware schedule: order backward branches where the simulator predicts a lower peak "
        "(default: on; --no-serialize: the swaps alone, faster planning)",
    )
    p.add_argument(
        "--policy",
        type=_parse_policy,
        default=("default",),
        metavar="NAMES",
        help="the passes the planner may use besides swaps, comma-separated: default (swap_gradients), none, "
        "or names such as default,order_updates (default: default)",
    )
    p.add_argument(
        "--on-budget-miss",
        choices=("raise", "best"),
        default="raise",
        help="when no plan is predicted to fit --budget: raise (an error, the default) or best (a warning, and "
        "the plan with the lowest predicted peak)",
    )
    p.add_argument(
        "--offload",
        choices=("optimizer", "weights"),
        help="plan the step with the optimizer's state (optimizer), or the weights and that state (weights), on "
        "the host and the update run there; --max-batch searches that step too (default: nothing offloaded)",
    )
    p.add_argument("--json", help="write the plan JSON here")
    p.add_argument("--plot", help="write the memory timeline PNG here")
    p.add_argument("--max-batch", action="store_true", help="also print the largest batch that fits the budget")
    p.add_argument("--rows", type=int, default=30, help="rows of the plan table to print (default 30)")
    p.add_argument("--traceback", action="store_true", help="on an error, show the full traceback")
    p.set_defaults(func=plan_cmd)


def _add_bench(sub: Any) -> None:
    """The ``bench`` command's parser, on ``sub``."""
    p = sub.add_parser("bench", help="run a benchmark from benchmarks/ (writes JSON, prints a table)")
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options for the benchmark script")
    p.set_defaults(func=bench)


def _add_build_horovod(sub: Any) -> None:
    """The ``build-horovod`` command's parser, on ``sub``."""
    p = sub.add_parser("build-horovod", help="build/install the Horovod wheel (options: build-horovod -- --help)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to python -m tflms.tools.build_horovod")
    p.set_defaults(func=build_horovod)


#: The commands, in the order ``tflms --help`` lists them: each adds its parser to the subparsers.
_COMMANDS = (_add_demo, _add_plan, _add_bench, _add_build_horovod)


def _parser() -> argparse.ArgumentParser:
    """The ``tflms`` command line's parser: one subparser per command, its ``func`` the command."""
    parser = argparse.ArgumentParser(prog="tflms", description="Large model support for TensorFlow 2.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tflms`` console script."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("batch", "image_size", "steps", "rows", "classes"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. Received: {value}")
    try:
        if args.func in (demo, plan_cmd):
            import_tensorflow()
        return args.func(args)
    except CLIError as err:
        print(f"tflms: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
