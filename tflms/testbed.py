"""A real-memory test bed for machines without a GPU.

One process on one machine cannot show what swapping frees: copies between two
logical CPUs of one process share their buffer. Two processes can. The
*measured* process plays the device: its CPU runs the step through TensorFlow's
BFC allocator, whose peak :func:`memory` reads and :func:`reset_peak` resets,
and which can be capped for real (``cap``). A second TensorFlow process, a
:class:`HostWorker` (``tf.distribute.Server``), plays the host: swapped tensors
travel to it over gRPC and back.

The BFC allocator must be chosen before TensorFlow starts, so the measured
process is usually a fresh one: :func:`run_measured` starts it with the right
environment, starts the host worker inside it, calls your function and returns
what it returned, and reports an out-of-memory death (a segfault, or oneDNN's
abort in a conv backprop, are common under a BFC cap) as a result instead of
a crash::

    result = tflms.testbed.run_measured("mypkg.bench:measure", {"batch": 32}, cap="1GiB")
    if result.ok: print(result.value)

``result.status`` says how it ended: ``'ok'``, ``'oom'``, ``'budget'`` (a
:class:`tflms.BudgetError`) or ``'error'``; ``result.raised`` what the function raised.
To measure your own Keras model (or training step), plain and with tflms, step by step,
:func:`measure_model` takes a factory that builds it and its data::

    m = tflms.testbed.measure_model("mypkg.models:build", batch_size=64, cap="1GiB")
    print(m.summary()); m["plain"].status, m["lms"].peaks, m["lms"].losses

Inside the measured process (``measure`` above, or your own script started with
:func:`device_environ`)::

    with tflms.testbed.HostWorker() as worker:
        tflms.testbed.connect(worker)
        step = tflms.function(train_step, device=tflms.testbed.DEVICE, host=tflms.testbed.HOST)
        tflms.testbed.reset_peak(); step(x, y); print(tflms.testbed.memory()["peak"])

On a machine with a GPU, ``run_measured(..., gpu=True)`` measures the same way on the GPU:
the measured process's device is ``/GPU:0`` (``cap`` becomes a real limit of TensorFlow's
GPU allocator: a logical device with ``memory_limit``), its host this process's CPU, and
:func:`devices`, :func:`memory` and :func:`reset_peak` answer for the GPU.

The link is gRPC on loopback (about 0.4-1.2 GiB/s one way), far slower than
PCIe; a device buffer stays alive until it has been sent. :func:`connect` lowers the
measured process's priority (:data:`DEVICE_NICE`) so that the host worker, which
shares this machine's cores, is not starved by the device's compute.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from .config import parse_bytes
from .errors import TflmsError

__all__ = [
    "DEVICE",
    "DEVICE_NICE",
    "GPU_DEVICE",
    "GPU_HOST",
    "HOST",
    "TestBedError",
    "HostWorker",
    "MeasuredResult",
    "ModelMeasurement",
    "ModelRun",
    "STATUSES",
    "WAYS",
    "allocator_oom_report",
    "connect",
    "device_environ",
    "devices",
    "is_measured_process",
    "measure_model",
    "memory",
    "oom_message",
    "reset_peak",
    "run_measured",
    "setup_gpu",
]

#: The measured process's device (its CPU, through the BFC allocator).
DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
#: The host: the CPU of the :class:`HostWorker` process.
HOST = "/job:worker/replica:0/task:0/device:CPU:0"
#: How much :func:`connect` lowers the measured process's priority (its nice value) below
#: the host worker's. Both share this machine's cores, while on a GPU machine the host's
#: CPU is idle while the device computes; a worker starved by the device's compute takes
#: the swapped-out tensors late, and the device holds them until they are sent. Measured
#: on 2 CPUs, the transformer of :mod:`tflms.measure` (batch 16, tflms, predicted 144 MiB),
#: five processes of five steps after a warm-up each: 141-177 MiB per step, median 165,
#: at nice 0; 138-173 MiB, median 145, at nice 10. ResNet50 96² batch 32 did not change
#: beyond its spread (441-512 against 443-494 MiB, two processes each).
DEVICE_NICE = 10

_BFC = "TF_CPU_ALLOCATOR_USE_BFC"
_CAP = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
_ONEDNN = "TF_ENABLE_ONEDNN_OPTS"
_GPU = "TFLMS_MEASURED_GPU"  # a measured GPU process: its cap in MiB, or 0 (no cap)
#: The measured GPU process's device and host (``run_measured(..., gpu=True)``).
GPU_DEVICE = "/job:localhost/replica:0/task:0/device:GPU:0"
GPU_HOST = "/job:localhost/replica:0/task:0/device:CPU:0"
_RESULT_MARK = "TFLMS_TESTBED_RESULT "
_FAILED_MARK = "TFLMS_TESTBED_FAILED "
_IMPORTING_MAIN = "TFLMS_TESTBED_IMPORTING_MAIN"  # set while a measured process imports its caller's script
_READY_MARK = "TFLMS_HOST_READY"


class TestBedError(TflmsError, RuntimeError):
    """The test bed could not start, connect or measure."""

    __test__ = False  # not a pytest test class


def device_environ(
    cap: int | str | None = None, base: Mapping[str, str] | None = None, gpu: bool = False
) -> dict[str, str]:
    """Environment for a measured process: BFC allocator on the CPU, optional real cap.

    ``cap`` (bytes or a size string such as ``"1GiB"``) is rounded down to whole MiB.

    The CPU kernels are pinned to oneDNN's (``TF_ENABLE_ONEDNN_OPTS=1``) unless ``base``
    already sets ``TF_ENABLE_ONEDNN_OPTS``: TensorFlow turns oneDNN on by default only on
    CPUs with AVX-512 VNNI and newer, and its fallback, Eigen's kernels, give different
    peaks (a conv's filter gradient allocates up to 30 MiB of im2col scratch), so without
    the pin the same step measures differently from one machine to the next.

    With ``gpu=True`` the measured device is GPU 0 instead: the environment marks the
    process as such (``TFLMS_MEASURED_GPU``: the cap in MiB, 0 for none), and the CPU
    keeps TensorFlow's defaults.

    >>> env = device_environ("512MiB", base={})
    >>> env["TF_CPU_ALLOCATOR_USE_BFC"], env["TF_CPU_BFC_MEM_LIMIT_IN_MB"], env["TF_ENABLE_ONEDNN_OPTS"]
    ('true', '512', '1')
    >>> device_environ(base={"TF_ENABLE_ONEDNN_OPTS": "0"})["TF_ENABLE_ONEDNN_OPTS"]
    '0'
    >>> device_environ("1GiB", base={"TF_CPU_ALLOCATOR_USE_BFC": "true"}, gpu=True)
    {'TFLMS_MEASURED_GPU': '1024'}
    """
    env = dict(os.environ if base is None else base)
    for key in (_BFC, _CAP, _GPU):
        env.pop(key, None)
    mib = 0
    if cap is not None:
        mib = parse_bytes(cap, "cap") // 2**20
        if mib < 1:
            raise ValueError(f"cap must be at least 1 MiB. Received: cap={cap!r}")
    if gpu:
        env[_GPU] = str(mib)
        return env
    env[_BFC] = "true"
    env.setdefault(_ONEDNN, "1")
    if cap is not None:
        env[_CAP] = str(mib)
    return env


def is_measured_process() -> bool:
    """True when this process's device memory is measured: its CPU allocator is BFC (the test
    bed), or it was started as a measured GPU process (``run_measured(..., gpu=True)``)."""
    return os.environ.get(_BFC, "").lower() == "true" or _is_gpu_process()


def _is_gpu_process() -> bool:
    return os.environ.get(_GPU, "") != ""


def devices() -> tuple[str, str]:
    """``(device, host)`` of this measured process: :data:`DEVICE` and :data:`HOST` on the test
    bed, :data:`GPU_DEVICE` and :data:`GPU_HOST` in a measured GPU process."""
    return (GPU_DEVICE, GPU_HOST) if _is_gpu_process() else (DEVICE, HOST)


def memory() -> dict[str, int]:
    """``{'current': bytes, 'peak': bytes}`` of the measured device (``get_memory_info``)."""
    import tensorflow as tf

    _require_measured("memory")
    return dict(tf.config.experimental.get_memory_info("GPU:0" if _is_gpu_process() else "CPU:0"))


def reset_peak() -> None:
    """Reset the measured device's peak to its current use."""
    import tensorflow as tf

    _require_measured("reset_peak")
    tf.config.experimental.reset_memory_stats("GPU:0" if _is_gpu_process() else "CPU:0")


def _require_measured(what: str) -> None:
    if not is_measured_process():
        raise TestBedError(
            f"{what}: this process's CPU memory is not measured. Start it with "
            f"{_BFC}=true set before TensorFlow is imported (tflms.testbed.device_environ() gives that "
            f"environment; tflms.testbed.run_measured starts such a process for you, and with gpu=True one "
            f"that measures GPU 0). Received: {_BFC}={os.environ.get(_BFC)!r}"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Ask Linux to kill this (child) process when its parent dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class HostWorker:
    """A TensorFlow server in a child process: the host of the test bed.

    Takes a free loopback port, waits until the worker reports that its server
    listens, and stops with
    :meth:`stop` or at the end of a ``with`` block. It dies with its parent (Linux
    parent-death signal, plus a watchdog on the parent's pid), so a crashed
    measured process leaves no server behind. A server that does not start raises
    :class:`TestBedError` with the end of its output.
    """

    def __init__(self, port: int | None = None, timeout: float = 60.0) -> None:
        self.port = port
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._log: Any = None
        self._deadline = 0.0

    @property
    def address(self) -> str:
        if self.port is None:
            raise TestBedError("the host worker has not been started; call start() or use it in a with block")
        return f"localhost:{self.port}"

    @property
    def cluster_spec(self) -> Any:
        """The ``tf.train.ClusterSpec`` with the worker's one task (job ``worker``)."""
        import tensorflow as tf

        return tf.train.ClusterSpec({"worker": [self.address]})

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, wait: bool = True) -> HostWorker:
        """Start the worker process; with ``wait`` (default), return once its server listens.

        ``wait=False`` returns at once: call :meth:`wait` before :func:`connect`. The
        measured process of :func:`run_measured` starts its worker that way, so that the
        worker loads TensorFlow while the measured process loads its own (about 3 s
        saved per measured process on 2 CPUs)."""
        if self.running:
            return self.wait() if wait else self
        self.port = self.port or _free_port()
        env = dict(os.environ)
        env.pop(_BFC, None)
        env.pop(_CAP, None)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tflms.testbed", "--port", str(self.port), "--parent", str(os.getpid())],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self._deadline = time.monotonic() + self.timeout
        return self.wait() if wait else self

    def wait(self) -> HostWorker:
        """Return once the started worker's server listens; :class:`TestBedError` if it exits
        first or does not listen within ``timeout`` seconds of :meth:`start`."""
        while self._proc is not None and time.monotonic() < self._deadline:
            rc = self._proc.poll()
            if rc is not None:
                output = self._output()
                self._proc = None
                raise TestBedError(
                    f"the host worker exited with code {rc} before listening on "
                    f"{self.address}. Its output ends: {output[-1500:]!r}"
                )
            if _READY_MARK in self._output():  # printed by the worker once its server listens
                return self
            time.sleep(0.1)
        if self._proc is None:
            raise TestBedError("the host worker has not been started; call start() or use it in a with block")
        self.stop()
        raise TestBedError(f"the host worker did not listen on {self.address} within timeout={self.timeout} s")

    def _output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> HostWorker:
        return self if self.running else self.start()  # started by the caller: it waits when it chooses

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()


def connect(worker: HostWorker, nice: int = DEVICE_NICE) -> str:
    """Make the worker's CPU usable from this process as :data:`HOST`; return that string.

    The ClusterSpec itself is passed to ``experimental_connect_to_cluster`` (a
    cluster resolver without a master makes that call a silent no-op), and local
    ops stay local (``make_master_device_default=False``). Raises
    :class:`TestBedError` when the host device does not appear.

    First this process's priority is lowered by ``nice`` (every thread it has, and so
    every thread it starts later; the worker, started before, keeps its own), so that
    the host is not starved by the device's compute: see :data:`DEVICE_NICE`.
    ``nice=0`` leaves it as it is.
    """
    import tensorflow as tf

    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
        raise ValueError(f"nice must be an int from 0 to 19 (0: leave the priority alone). Received: nice={nice!r}")
    if not worker.running:
        raise TestBedError(f"connect needs a started HostWorker. Received: worker={worker!r} (not running)")
    _lower_priority(nice)
    tf.config.experimental_connect_to_cluster(worker.cluster_spec, make_master_device_default=False)
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    if HOST not in names:
        raise TestBedError(
            f"connected to {worker.address} but its CPU does not appear among the devices: {names}. "
            f"Received: worker={worker.address!r}"
        )
    return HOST


def _lower_priority(nice: int) -> None:
    """Raise the nice value of every thread of this process by ``nice`` (at most to 19).

    On Linux a nice value belongs to a thread, and a new thread inherits its creator's:
    so the threads TensorFlow starts afterwards are lowered too.
    """
    if nice == 0:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's priority
        os.nice(nice)
        return
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that has ended since
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


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
    env = device_environ(cap, gpu=gpu)
    # Under a cap, the allocator's out-of-memory dump (INFO lines) feeds MeasuredResult.oom.
    env["TF_CPP_MIN_LOG_LEVEL"] = "0" if cap is not None else env.get("TF_CPP_MIN_LOG_LEVEL", "2")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    payload = json.dumps({**request, "kwargs": dict(kwargs or {})})
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tflms.testbed", "--run"],
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
    output = (proc.stdout + proc.stderr)[-4000:]
    report = allocator_oom_report(proc.stderr)
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
    from .errors import BudgetError

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
        return fn(**request["kwargs"])

    _call_and_exit(on_test_bed)


#: What :func:`measure_model` can run: the step as written, and the step rewritten by tflms.
WAYS = ("plain", "lms")


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """One way (``'plain'`` or ``'lms'``) of :func:`measure_model`: its measured process and steps.

    ``status`` is the measured process's (:attr:`MeasuredResult.status`: ``'ok'``,
    ``'oom'``, ``'budget'`` or ``'error'``; ``result`` has its ``error`` output, ``oom``
    report and what it ``raised``). Per step, the warm-up steps included and in order: ``peaks``
    (bytes: the device's measured peak during the step), ``held`` (bytes in use on the device
    as the step began: weights, optimizer slots, and any input data held in device memory) and
    ``losses``. A run that failed part way keeps the steps it finished. ``loaded`` is the
    device's bytes in use once the factory had returned (the model and the data it made, before
    any step). ``predicted`` and ``predicted_plain`` are the simulator's peaks of the rewritten
    and the plain step (``'lms'`` only, from its plan; None otherwise), ``n_swaps`` the plan's
    number of swapped tensors.
    """

    way: str
    status: str
    result: MeasuredResult
    warmup: int
    peaks: list[int] = dataclasses.field(default_factory=list)
    held: list[int] = dataclasses.field(default_factory=list)
    losses: list[float | None] = dataclasses.field(default_factory=list)
    loaded: int | None = None
    predicted: int | None = None
    predicted_plain: int | None = None
    n_swaps: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def peak(self) -> int | None:
        """The steady-state peak: the largest measured peak after the warm-up steps (None without one)."""
        steady = self.peaks[self.warmup :]
        return max(steady) if steady else None


@dataclasses.dataclass(frozen=True)
class ModelMeasurement:
    """What :func:`measure_model` measured: a :class:`ModelRun` per way, ``runs[way]`` or ``m[way]``."""

    runs: dict[str, ModelRun]
    cap: int | None = None

    def __getitem__(self, way: str) -> ModelRun:
        return self.runs[way]

    def summary(self) -> str:
        """A table: per way its status, steady-state peak, bytes in use as its last step began (before
        any step: once the factory had returned), last loss, predicted peak (``'lms'``), and what went
        wrong where it did.

        >>> r = MeasuredResult("ok")
        >>> m = ModelMeasurement({"plain": ModelRun("plain", "ok", r, 1, [3 << 20, 2 << 20], [1 << 20] * 2,
        ...                                         [0.5, 0.25], 1 << 20)})
        >>> print(m.summary())
        way    status   peak (MiB)   held (MiB)   last loss   predicted (MiB)
        plain  ok              2.0          1.0      0.2500                 -
        """
        mib = lambda n: "-" if n is None else f"{n / 2**20:.1f}"  # noqa: E731
        head = ("way", "status", "peak (MiB)", "held (MiB)", "last loss", "predicted (MiB)")
        lines = ["{:6} {:6} {:>12} {:>12} {:>11} {:>17}".format(*head)]
        for way, run in self.runs.items():
            loss = next((f"{v:.4f}" for v in reversed(run.losses) if v is not None), "-")
            held = run.held[-1] if run.held else run.loaded
            line = f"{way:6} {run.status:6} {mib(run.peak):>12} {mib(held):>12} {loss:>11} {mib(run.predicted):>17}"
            if not run.ok:
                line += f"  ({len(run.peaks)} steps done: {_what_went_wrong(run.result)})"
            lines.append(line)
        return "\n".join(lines)


def _what_went_wrong(result: MeasuredResult) -> str:
    """One line of what a failed measured process said: the out-of-memory line, or the first line of
    what it raised, or the last line of its output."""
    message = (result.raised or {}).get("message", "")
    said = (oom_message(message) or oom_message(result.error)) if result.status == "oom" else None
    if not said:
        lines = [line for line in (message or result.error).splitlines() if line.strip()]
        said = (lines[0] if message else lines[-1]) if lines else ""
    return " ".join(said.split())[:240]


def measure_model(
    factory: str | Callable[..., Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    steps: int = 3,
    warmup: int = 1,
    cap: int | str | None = None,
    options: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    ways: tuple[str, ...] | list[str] = WAYS,
    seed: int | None = 0,
    timeout: float = 1800.0,
    gpu: bool = False,
) -> ModelMeasurement:
    """Train your own model on the test bed, plain and with tflms, and measure each step's device peak.

    ``factory`` is ``'package.module:function'`` or a picklable callable (see
    :func:`run_measured`); ``factory(**kwargs)`` runs in the measured process and returns
    either

    * ``(model, x)`` or ``(model, x, y)``: a compiled Keras model and its training data, as
      ``model.fit`` takes them (arrays with ``batch_size`` given here, or a ``tf.data.Dataset``
      of batches as ``x``). It is trained with ``model.fit`` one step per epoch (so each step's
      loss is exact), plain, and with :class:`tflms.LMSCallback` (``options``, and
      ``batch_size``, on this process's device and host). Keras starts data of known size
      again when it runs out; a generator or a dataset of unknown size must yield
      ``warmup + steps`` batches (``Dataset.repeat()`` makes any dataset do); or
    * a training step: a callable ``step(*args)`` that trains one step and returns its loss
      (a scalar; of a tuple, list or dict its first value or its ``'loss'``), alone or as
      ``(step, args)``. It is traced with ``tf.function`` (plain) and :func:`tflms.function`
      (``options``).

    Each way in ``ways`` runs in its own fresh measured process (:func:`run_measured`), under
    ``cap`` if given, so a way that runs out of memory, or dies of it, does not stop the
    others, and the ways do not share memory. ``seed`` (``keras.utils.set_random_seed``, before
    the factory is called) gives every way the same weights and data. Per step the device's
    peak is reset before and read after it. On the test bed the device is this machine's CPU:
    every tensor the factory makes there (a ``tf.constant``, and arrays that ``model.fit``
    converts to tensors) is device memory and counts against ``cap``, where on a GPU the input
    data would stay in host memory: see :attr:`ModelRun.loaded` and :attr:`ModelRun.held`.

    Returns a :class:`ModelMeasurement`: per way a :class:`ModelRun` with its status (``'ok'``,
    ``'oom'``, ``'budget'`` for a :class:`tflms.BudgetError` from ``options['budget']``,
    ``'error'``), per-step peaks and losses, and what it raised. Nothing the factory or the
    training does is raised here; bad arguments are.

    Example (``mypkg/models.py`` defines ``build() -> (model, x, y)``)::

        m = tflms.testbed.measure_model("mypkg.models:build", batch_size=64, cap="2GiB")
        print(m.summary())
        m["plain"].status, m["lms"].peak, m["lms"].losses
    """
    from .config import LMSConfig, check_int

    if isinstance(factory, str):
        if factory.count(":") != 1:
            raise ValueError(
                f"factory must be 'package.module:function' or a picklable callable. Received: factory={factory!r}"
            )
    elif callable(factory):
        _pickled_request(factory, "factory")  # refused here, not in the measured process
    else:
        raise TypeError(
            f"factory must be 'package.module:function' or a picklable callable. Received: factory={factory!r}"
        )
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
    check_int("batch_size", batch_size, 1, allow_none=True)
    check_int("seed", seed, 0, allow_none=True)
    if isinstance(ways, str) or not ways or any(w not in WAYS for w in ways) or len(set(ways)) != len(ways):
        raise ValueError(f"ways must be a non-empty list of distinct ways of {WAYS}. Received: ways={ways!r}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping of the factory's keyword arguments. Received: kwargs={kwargs!r}")
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping of tflms.LMSConfig fields. Received: options={options!r}")
    options = dict(options or {})
    taken = sorted({"device", "host"} & set(options))
    if taken:
        raise ValueError(
            f"options must not set {' or '.join(taken)}: measure_model runs the step on the measured process's "
            f"device and host (tflms.testbed.devices()). Received: options={options!r}"
        )
    LMSConfig.from_options(**options)  # unknown or invalid options are refused here
    runs: dict[str, ModelRun] = {}
    for way in ways:
        with tempfile.TemporaryDirectory(prefix="tflms-measure-") as tmp:
            progress = os.path.join(tmp, "steps.jsonl")
            target = functools.partial(
                _measure_way,
                factory,
                dict(kwargs or {}),
                way=way,
                steps=steps,
                warmup=warmup,
                options=options,
                batch_size=batch_size,
                seed=seed,
                progress=progress,
            )
            result = run_measured(target, cap=cap, timeout=timeout, gpu=gpu)
            records = _read_records(progress)
        runs[way] = _model_run(way, result, records, warmup)
    return ModelMeasurement(runs, None if cap is None else parse_bytes(cap, "cap") // 2**20 * 2**20)


def _read_records(path: str) -> list[dict[str, Any]]:
    """The JSON lines a measured process of :func:`measure_model` wrote (the last may be cut off)."""
    records = []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


def _model_run(way: str, result: MeasuredResult, records: list[dict[str, Any]], warmup: int) -> ModelRun:
    info: dict[str, Any] = {}
    steps = []
    for record in records:
        if "step" in record:
            steps.append(record)
        else:
            info.update(record)
    return ModelRun(
        way,
        result.status,
        result,
        warmup,
        peaks=[s["peak"] for s in steps],
        held=[s["held"] for s in steps],
        losses=[s["loss"] for s in steps],
        loaded=info.get("loaded"),
        predicted=info.get("predicted"),
        predicted_plain=info.get("predicted_plain"),
        n_swaps=info.get("n_swaps"),
    )


def _loss_of(out: Any) -> float | None:
    """A training step's loss from what it returned: a scalar, a dict's ``'loss'``, a sequence's first."""
    if isinstance(out, Mapping):
        out = out.get("loss")
    elif isinstance(out, (tuple, list)):
        out = out[0] if out else None
    try:
        return float(out)
    except (TypeError, ValueError):
        return None


def _measure_way(
    factory: str | Callable[..., Any],
    kwargs: dict[str, Any],
    *,
    way: str,
    steps: int,
    warmup: int,
    options: dict[str, Any],
    batch_size: int | None,
    seed: int | None,
    progress: str,
) -> bool:
    """One way of :func:`measure_model`, in its measured process: build, train, and write a JSON line
    per step (and one of what the run was) to ``progress`` as it goes."""
    import keras
    import tensorflow as tf

    from .core import function as lms_function
    from .keras import LMSCallback

    if seed is not None:
        keras.utils.set_random_seed(seed)
    make = factory
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        make = getattr(importlib.import_module(module_name), attr)
    device, host = devices()
    log = open(progress, "a", buffering=1)  # line-buffered: what was written survives a crash

    def write(record: dict[str, Any]) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    class StepMeter(keras.callbacks.Callback):
        """Per training step (``fit`` runs one per epoch): the bytes held as it begins, its peak, its loss."""

        def __init__(self) -> None:
            super().__init__()
            self.done = 0
            self.step: dict[str, Any] = {}

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            self.step = {"step": self.done, "held": memory()["current"]}
            reset_peak()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.step["peak"] = memory()["peak"]

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            if "peak" in self.step:  # else no step ran in this epoch: the data ran out
                write({**self.step, "loss": _loss_of(logs or {})})
                self.step = {}
                self.done += 1

    built = make(**kwargs)
    write({"loaded": memory()["current"]})
    total = warmup + steps
    if isinstance(built, tuple) and built and isinstance(built[0], keras.Model):
        if len(built) not in (2, 3):
            raise TypeError(
                "the factory must return (model, x), (model, x, y), a training step or (step, args). "
                f"Received: a tuple of {len(built)}"
            )
        model, x, y = built[0], built[1], built[2] if len(built) == 3 else None
        if not model.compiled:
            raise ValueError(f"the factory's model must be compiled (model.compile). Received: model={model.name!r}")
        meter = StepMeter()
        callbacks: list[Any] = [meter]
        lms = None
        if way == "lms":
            lms_options = {"batch_size": batch_size, **options} if batch_size else options
            lms = LMSCallback(device=device, host=host, **lms_options)
            callbacks.insert(0, lms)
        fit_kwargs: dict[str, Any] = {"batch_size": batch_size} if batch_size else {}
        model.fit(x, y, epochs=total, steps_per_epoch=1, shuffle=False, verbose=0, callbacks=callbacks, **fit_kwargs)
        if meter.done < total:
            raise TestBedError(
                f"fit ran {meter.done} of warmup + steps = {total} steps: the factory's data ran out. Keras starts "
                "data of known size (arrays, most datasets) again, but a generator or a dataset of unknown size "
                "must yield warmup + steps batches (Dataset.repeat() makes any dataset do). "
                f"Received: warmup={warmup}, steps={steps}"
            )
        plan = None if lms is None else lms.plan
    else:
        step, args = built, ()
        if isinstance(built, tuple) and len(built) == 2 and callable(built[0]) and isinstance(built[1], (tuple, list)):
            step, args = built[0], tuple(built[1])
        if not callable(step):
            raise TypeError(
                "the factory must return (model, x), (model, x, y) with a compiled keras.Model, a training "
                f"step or (step, args). Received: {type(built).__name__}"
            )
        fn = lms_function(step, device=device, host=host, **options) if way == "lms" else tf.function(step)
        with tf.device(device):
            for i in range(total):
                held = memory()["current"]
                reset_peak()
                loss = _loss_of(fn(*args))
                write({"step": i, "held": held, "peak": memory()["peak"], "loss": loss})
        plan = fn.get_plan(*args) if way == "lms" else None
    if plan is not None:
        write({"predicted": plan.peak_bytes_after, "predicted_plain": plan.peak_bytes_before})
        write({"n_swaps": len(plan.swaps)})
    log.close()
    return True


def setup_gpu(cap: int | str | None = None) -> None:
    """Give TensorFlow's allocator on GPU 0 ``cap`` (bytes or a size string, rounded down to whole
    MiB) and no more: a logical device with ``memory_limit``; without ``cap`` its memory grows as
    needed. Call it before TensorFlow creates its context (the measured GPU process of
    :func:`run_measured` does). Raises :class:`TestBedError` when TensorFlow sees no GPU."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise TestBedError("TensorFlow sees no GPU in this process (setup_gpu, run_measured(gpu=True))")
    if cap is not None:
        limit = tf.config.LogicalDeviceConfiguration(memory_limit=parse_bytes(cap, "cap") // 2**20)
        tf.config.set_logical_device_configuration(gpus[0], [limit])
    else:
        tf.config.experimental.set_memory_growth(gpus[0], True)


def _serve(port: int, parent: int | None) -> None:
    """Body of the host worker process."""
    import tensorflow as tf

    if parent:

        def watchdog() -> None:
            while True:
                if os.getppid() != parent:
                    os._exit(0)
                time.sleep(1)

        threading.Thread(target=watchdog, daemon=True).start()
    server = tf.distribute.Server(
        tf.train.ClusterSpec({"worker": [f"localhost:{port}"]}), job_name="worker", task_index=0, start=True
    )
    print(_READY_MARK, flush=True)
    server.join()


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tflms.testbed", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, help="serve as the host worker on this port")
    parser.add_argument("--parent", type=int, help="exit when this process is no longer the parent")
    parser.add_argument("--run", action="store_true", help="be a measured process (request on stdin)")
    args = parser.parse_args(argv)
    if args.run:
        _run_child()
    elif args.port:
        _serve(args.port, args.parent)
    else:
        parser.error("give --port (host worker) or --run (measured process)")


if __name__ == "__main__":
    main()
