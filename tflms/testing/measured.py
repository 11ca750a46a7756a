"""Measured processes: :func:`run_measured` runs a function in a fresh process whose device memory
is measured (the test bed's device, or a GPU), and reports what happened, out of memory included."""

from __future__ import annotations

import base64
import dataclasses
import importlib
import json
import os
import pickle
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from .testbed import (
    _GPU,
    CLAIM_MARK,
    HostWorker,
    _is_gpu_process,
    claim_memory,
    connect,
    device_environ,
    setup_gpu,
)

__all__ = ["MeasuredResult", "STATUSES", "allocator_oom_report", "oom_message", "run_measured"]

_RESULT_MARK = "TFLMS_TESTBED_RESULT "


_FAILED_MARK = "TFLMS_TESTBED_FAILED "


_IMPORTING_MAIN = "TFLMS_TESTBED_IMPORTING_MAIN"  # set while a measured process imports its caller's script


@dataclasses.dataclass(frozen=True)
class MeasuredResult:
    """What :func:`run_measured` saw: the function's value, or how the process ended.

    ``status`` is one of :data:`STATUSES`: ``'ok'`` (``value`` is what the function
    returned); ``'oom'`` (it raised ``ResourceExhaustedError`` or an error that says it
    ran out of memory, the device's allocator failed a request, or the process died by a
    signal under a cap); ``'budget'`` (it raised :class:`tflms.BudgetError`: no plan
    brings the predicted peak within the budget asked for; ``raised`` has the budget and
    the best predicted peak); or ``'error'`` (anything else, a timeout included).
    ``error`` holds the last lines of the process's output (the traceback of what the
    function raised). ``oom`` is what the device's allocator reported when it ran out of
    memory (:func:`allocator_oom_report`), or None. ``raised`` is what the function raised,
    as the measured process reported it (no traceback to parse), or None:
    ``{'type': 'module.Class', 'message': str}``, plus for a ``BudgetError`` its
    ``budget``, ``best_peak_bytes`` and ``plain_peak_bytes``.
    """

    status: str
    value: Any = None
    error: str = ""
    returncode: int = 0
    seconds: float = 0.0
    oom: dict[str, Any] | None = None
    raised: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


_RAN_OUT = re.compile(r"ran out of memory trying to allocate .*?\(rounded to (\d+)\)\s*requested by op (\S+)")


_CHUNK = re.compile(r"\] (InUse|Free) +at \w+ of size (\d+)")


_REGION = re.compile(r"\] Next region of size (\d+)")


def allocator_oom_report(log: str) -> dict[str, Any] | None:
    """What TensorFlow's BFC allocator logged when it first ran out of memory, or None.

    Parsed from the log of a process whose allocator failed (``TF_CPP_MIN_LOG_LEVEL=0``
    for the chunk dump; :func:`run_measured` sets it under a cap): ``requested`` (bytes,
    rounded as the allocator does) and ``op``; from the dump that follows, ``in_use``
    and ``free`` (bytes of the chunks), ``largest_free`` (the largest free chunk),
    ``pool`` (bytes of all regions) and ``regions`` (their sizes). A request larger
    than ``largest_free`` while ``in_use`` is well below the cap is fragmentation.

    >>> log = "\\n".join([
    ...     "W0 bfc_allocator.cc:502] Allocator (bfc) ran out of memory trying to allocate 3.0KiB "
    ...     "(rounded to 3072)requested by op grad/Mul",
    ...     "I0 bfc_allocator.cc:1085] Next region of size 4096",
    ...     "I0 bfc_allocator.cc:1105] InUse at 7f00 of size 1024 next 2",
    ...     "I0 bfc_allocator.cc:1105] Free  at 7f04 of size 2048 next 3",
    ...     "I0 bfc_allocator.cc:1105] InUse at 7f0c of size 1024 next 4",
    ...     "I0 bfc_allocator.cc:1117] Sum Total of in-use chunks: 2.0KiB"])
    >>> r = allocator_oom_report(log)
    >>> r["requested"], r["op"], r["in_use"], r["free"], r["largest_free"], r["regions"]
    (3072, 'grad/Mul', 2048, 2048, 2048, [4096])
    """
    found = _RAN_OUT.search(log)
    if found is None:
        return None
    report: dict[str, Any] = {"requested": int(found.group(1)), "op": found.group(2)}
    end = log.find("Sum Total of in-use chunks", found.end())
    dump = log[found.end() : end if end >= 0 else len(log)]
    chunks = [(kind, int(n)) for kind, n in _CHUNK.findall(dump)]
    if chunks:
        free = [n for kind, n in chunks if kind == "Free"]
        regions = [int(n) for n in _REGION.findall(dump)]
        report.update(
            in_use=sum(n for kind, n in chunks if kind == "InUse"),
            free=sum(free),
            largest_free=max(free, default=0),
            pool=sum(regions),
            regions=regions,
        )
    return report


def oom_message(error: str) -> str | None:
    """The line of a failed process's output that says what ran out of memory, and the node it
    names, or None. Where the allocator logged no report (:func:`allocator_oom_report`), e.g.
    when cuDNN's search for a convolution algorithm found no workspace on a capped GPU, this
    is what TensorFlow said.

    >>> oom_message("No algorithm worked!\\n  eng1{}: RESOURCE_EXHAUSTED: Out of memory while trying to "
    ...     "allocate 16.00MiB. [tf-allocator-allocation-error='']\\n\\t [[{{node m/conv}}]] [Op:__inference_f_7]")
    'eng1{}: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 16.00MiB (node m/conv)'
    >>> oom_message("ValueError: bad shape") is None
    True
    """
    lines = error.splitlines()
    for i, line in enumerate(lines):
        if re.search(r"out of memory|OOM when allocating", line, re.IGNORECASE):
            said = re.sub(r"\s*\[tf-allocator-allocation-error=[^\]]*\]", "", line.strip()).rstrip(".")
            node = next((m.group(1) for rest in lines[i:] if (m := re.search(r"\{\{node (\S+?)\}\}", rest))), None)
            return f"{said[:300]} (node {node})" if node else said[:300]
    return None


_OOM_MARKS = ("ResourceExhaustedError", "OOM when allocating", "Out of memory", "out of memory")


#: The statuses of a :class:`MeasuredResult` (and of a :class:`ModelRun`).
STATUSES = ("ok", "oom", "budget", "error")


def run_measured(
    target: str | Callable[[], Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    cap: int | str | None = None,
    timeout: float = 1800.0,
    pythonpath: list[str] | None = None,
    gpu: bool = False,
    onednn: bool | None = None,
    growth: bool = False,
) -> MeasuredResult:
    """Call ``target`` in a fresh measured process; return what it returned, or how it failed.

    ``target`` is ``'package.module:function'``, or a picklable callable (a function
    defined at the top level of a module, or a ``functools.partial`` of one; a function
    of the script that runs this call works too, as with :mod:`multiprocessing`'s spawn:
    the measured process imports the script, so its own work must sit under
    ``if __name__ == "__main__":``). A callable target gets this process's ``sys.path``.

    The process gets the BFC allocator (and the real memory ``cap``, if any), starts
    a :class:`HostWorker` and connects to it before calling
    ``function(**kwargs)``; the function's JSON-serialisable return value comes back
    in :attr:`MeasuredResult.value`. Nothing is raised here for what happens there:
    :attr:`MeasuredResult.status` says whether it returned (``'ok'``), ran out of memory
    (``'oom'``, also for a process that dies under a cap), raised
    :class:`tflms.BudgetError` (``'budget'``) or failed otherwise (``'error'``), and
    :attr:`MeasuredResult.raised` what it raised. ``pythonpath`` entries are prepended to the
    child's ``PYTHONPATH`` (for targets outside installed packages). Under a cap the
    child logs at ``TF_CPP_MIN_LOG_LEVEL=0`` (its output is captured, not shown), so that
    :attr:`MeasuredResult.oom` gets the allocator's out-of-memory report.

    With ``gpu=True`` the process measures GPU 0 instead (no host worker: the host is its
    own CPU, :func:`devices`); ``cap`` becomes TensorFlow's GPU memory limit (a logical
    device with ``memory_limit``), and without it the GPU's memory grows as needed. A
    process that sees no GPU ends with ``status='error'`` and says so.

    ``onednn``: the test bed's processes run TensorFlow's own CPU kernels, which raise
    ``ResourceExhaustedError`` past the cap as a GPU does; ``True`` runs oneDNN's (whose
    out-of-memory inside a conv backprop aborts the process: ``status='oom'`` all the same).
    ``None``: as ``TFLMS_TESTBED_ONEDNN`` in the environment says (:func:`device_environ`).

    ``growth``: a capped process first claims its cap in one region, as a GPU's allocator holds
    its memory (:func:`tflms.testing.testbed.claim_memory`); ``True`` lets the pool grow by regions.
    """
    if _IMPORTING_MAIN in os.environ:
        raise RuntimeError(
            "run_measured (or measure_model) was called while a measured process imported your script to find "
            "the function to run there, which would start another measured process, and so on. Put the script's "
            'own work under `if __name__ == "__main__":`. '
            f"Received: the script {os.environ[_IMPORTING_MAIN]!r}"
        )
    if isinstance(target, str):
        if target.count(":") != 1:
            raise ValueError(
                f"target must be 'package.module:function' or a picklable callable. Received: target={target!r}"
            )
        request: dict[str, Any] = {"target": target}
    elif callable(target):
        request = _pickled_request(target, "target")
    else:
        raise TypeError(
            f"target must be 'package.module:function' or a picklable callable. Received: target={target!r}"
        )
    env = device_environ(cap, gpu=gpu, onednn=onednn, growth=growth)
    # Under a cap, the allocator's out-of-memory dump (INFO lines) feeds MeasuredResult.oom.
    env["TF_CPP_MIN_LOG_LEVEL"] = "0" if cap is not None else env.get("TF_CPP_MIN_LOG_LEVEL", "2")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    payload = json.dumps({**request, "kwargs": dict(kwargs or {})})
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tflms.testing.measured"],
            input=payload,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-2000:]
        return MeasuredResult("error", error=f"timed out after {timeout} s: {tail!r}", returncode=-9)
    seconds = time.monotonic() - start
    raised = None
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            return MeasuredResult(
                "ok", json.loads(line[len(_RESULT_MARK) :]), returncode=proc.returncode, seconds=seconds
            )
        if line.startswith(_FAILED_MARK):
            raised = json.loads(line[len(_FAILED_MARK) :])
    stderr = proc.stderr
    claimed = stderr.rfind(CLAIM_MARK)  # the claim's own tries ran out of memory on purpose
    stderr = stderr[claimed + len(CLAIM_MARK) :] if claimed >= 0 else stderr
    output = (proc.stdout + stderr)[-4000:]
    report = allocator_oom_report(stderr)
    if raised is not None:  # the function raised: the measured process said what
        status = raised.pop("status")
        if status == "error" and report is not None:  # the allocator failed a request first
            status = "oom"
    else:  # the process died before it could say (e.g. a segfault under a cap)
        died = proc.returncode < 0 or proc.returncode in (134, 139)  # by a signal (abort, segfault)
        oom = report is not None or any(m in output for m in _OOM_MARKS) or (died and cap is not None)
        status = "oom" if oom else "error"
    return MeasuredResult(status, error=output, returncode=proc.returncode, seconds=seconds, oom=report, raised=raised)


def _pickled_request(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    """The part of a measured process's request that carries the callable ``fn``, pickled.

    With it go this process's ``sys.path`` and, when the pickle refers to ``__main__``, how
    to import this process's main module there (as :mod:`multiprocessing`'s spawn does)."""
    try:
        data = pickle.dumps(fn)
    except Exception as err:  # noqa: BLE001 - pickle raises PicklingError, AttributeError, TypeError, ...
        raise TypeError(
            f"{name} must be 'package.module:function' or a picklable callable (a function defined at the top "
            f"level of a module, or a functools.partial of one; not a lambda or a nested function): {err}. "
            f"Received: {name}={fn!r}"
        ) from None
    request: dict[str, Any] = {
        "pickled": base64.b64encode(data).decode("ascii"),
        "sys_path": [os.path.abspath(p or os.curdir) for p in sys.path],
    }
    if b"__main__" in data:
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        path = getattr(main, "__file__", None)
        if spec is not None and getattr(spec, "name", None):
            request["main_module"] = spec.name  # python -m package.module
        elif path:
            request["main_path"] = os.path.abspath(path)
        else:
            raise TypeError(
                f"{name} is defined in an interactive session, which the measured process cannot import: "
                f"define it in a module (a .py file on sys.path) and pass it, or 'module:function'. "
                f"Received: {name}={fn!r}"
            )
    return request


def _load_target(request: Mapping[str, Any]) -> Callable[..., Any]:
    """The function a measured process's request names (in the measured process)."""
    if "pickled" not in request:
        module_name, _, attr = request["target"].partition(":")
        return getattr(importlib.import_module(module_name), attr)
    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    if "main_module" in request or "main_path" in request:
        # The caller's main module, imported under another name so that its main block does not run.
        os.environ[_IMPORTING_MAIN] = request.get("main_module") or request["main_path"]
        try:
            if "main_module" in request:
                main = importlib.import_module(request["main_module"])
            else:
                spec = importlib.util.spec_from_file_location("__tflms_main__", request["main_path"])
                main = importlib.util.module_from_spec(spec)
                sys.modules["__tflms_main__"] = main
                spec.loader.exec_module(main)
        finally:
            del os.environ[_IMPORTING_MAIN]
        sys.modules["__main__"] = main
    return pickle.loads(base64.b64decode(request["pickled"]))


def _failure(err: BaseException) -> dict[str, Any]:
    """What a measured process reports about an exception its function raised."""
    from ..errors import BudgetError

    kind = type(err)
    report: dict[str, Any] = {"type": f"{kind.__module__}.{kind.__qualname__}", "message": str(err)}
    tf = sys.modules.get("tensorflow")
    if isinstance(err, BudgetError):
        report.update(
            status="budget",
            budget=err.budget,
            best_peak_bytes=err.best_peak_bytes,
            plain_peak_bytes=err.plain_peak_bytes,
        )
    elif (tf is not None and isinstance(err, tf.errors.ResourceExhaustedError)) or any(
        m in report["message"] for m in _OOM_MARKS
    ):
        report["status"] = "oom"
    else:
        report["status"] = "error"
    return report


def _call_and_exit(call: Callable[[], Any]) -> None:
    """Run ``call()`` (the measured process's work: load the function, connect, call it), print
    its result (or what it raised) for :func:`run_measured`, and end this process at once.

    ``os._exit`` skips TensorFlow's teardown. That matters most after a failure: the
    teardown removes every function this process made from the host worker too, and once the
    worker is gone each removal logs "Failed to remove function remotely due to Socket
    closed". Here the worker is still up, and no removal is even tried; the host worker dies
    with this process (its parent-death signal)."""
    try:
        line = _RESULT_MARK + json.dumps(call())
        code = 0
    except BaseException as err:  # noqa: BLE001 - reported to run_measured, whatever it was
        traceback.print_exc()
        sys.stderr.flush()
        line = _FAILED_MARK + json.dumps(_failure(err), default=repr)
        code = 1
    print(line, flush=True)
    sys.stdout.flush()
    os._exit(code)


def _run_child() -> None:
    """Body of the measured process started by :func:`run_measured`."""
    request = json.loads(sys.stdin.read())
    sys.path.insert(0, os.getcwd())
    if _is_gpu_process():

        def on_gpu() -> Any:
            mib = int(os.environ[_GPU])
            setup_gpu(mib * 2**20 if mib else None)
            return _load_target(request)(**request["kwargs"])

        _call_and_exit(on_gpu)
    # The worker loads TensorFlow while this process does (two processes, two cores).
    worker = HostWorker().start(wait=False)

    def on_test_bed() -> Any:
        fn = _load_target(request)
        import tensorflow  # noqa: F401  (before waiting: connect needs it)

        worker.wait()
        connect(worker)
        claim_memory()
        return fn(**request["kwargs"])

    _call_and_exit(on_test_bed)


if __name__ == "__main__":
    _run_child()
