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
what it returned, and reports an out-of-memory death (a segfault under a BFC cap,
or oneDNN's abort in a conv backprop where its kernels are chosen) as a result
instead of a crash. The test bed runs TensorFlow's own CPU kernels by default, which
raise ``ResourceExhaustedError`` past the cap as a GPU does (:func:`device_environ`)::

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

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..config import parse_bytes
from ..errors import TflmsError

__all__ = [
    "CLAIM_MARK",
    "DEVICE",
    "DEVICE_NICE",
    "GPU_DEVICE",
    "GROWTH",
    "GPU_HOST",
    "HOST",
    "ONEDNN_OPT_IN",
    "TestBedError",
    "HostWorker",
    "claim_memory",
    "connect",
    "device_environ",
    "devices",
    "is_measured_process",
    "memory",
    "reset_peak",
    "setup_gpu",
]

#: The measured process's device (its CPU, through the BFC allocator).
DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
#: The host: the CPU of the :class:`HostWorker` process.
HOST = "/job:worker/replica:0/task:0/device:CPU:0"
#: How much :func:`connect` lowers the measured process's priority (its nice value) below
#: the host worker's. Both share this machine's cores, while on a GPU machine the host's
#: CPU is idle while the device computes; a worker starved by the device's compute takes
#: the swapped-out tensors late, and the device holds them until they are sent, which raises
#: the measured peak. A lower priority for the device brings its peaks closer to the prediction.
DEVICE_NICE = 10

_BFC = "TF_CPU_ALLOCATOR_USE_BFC"
_CAP = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
_ONEDNN = "TF_ENABLE_ONEDNN_OPTS"
#: Set to ``1`` in the environment to run the test bed's processes on oneDNN's CPU kernels
#: (:func:`device_environ`); by default they run TensorFlow's own (Eigen's), which raise
#: ``ResourceExhaustedError`` under a cap as a GPU does.
ONEDNN_OPT_IN = "TFLMS_TESTBED_ONEDNN"
#: The line :func:`claim_memory` writes to stderr when it is done: the allocator's out-of-memory
#: reports before it are its own tries, not the work's (:func:`tflms.testing.measured.run_measured`).
CLAIM_MARK = "TFLMS_TESTBED_CLAIMED"
#: Set to ``1`` in a measured process's environment, its allocator grows by regions instead of
#: claiming its cap in one (:func:`claim_memory`): ``device_environ(cap, growth=True)``.
GROWTH = "TFLMS_TESTBED_GROWTH"
_GPU = "TFLMS_MEASURED_GPU"  # a measured GPU process: its cap in MiB, or 0 (no cap)
#: The measured GPU process's device and host (``run_measured(..., gpu=True)``).
GPU_DEVICE = "/job:localhost/replica:0/task:0/device:GPU:0"
GPU_HOST = "/job:localhost/replica:0/task:0/device:CPU:0"
_READY_MARK = "TFLMS_HOST_READY"


class TestBedError(TflmsError, RuntimeError):
    """The test bed could not start, connect or measure."""

    __test__ = False  # not a pytest test class


def device_environ(
    cap: int | str | None = None,
    base: Mapping[str, str] | None = None,
    gpu: bool = False,
    onednn: bool | None = None,
    growth: bool | None = None,
) -> dict[str, str]:
    """Environment for a measured process: BFC allocator on the CPU, optional real cap.

    ``cap`` (bytes or a size string such as ``"1GiB"``) is rounded down to whole MiB.
    ``growth=True`` marks the process's allocator to grow region by region instead of claiming
    the cap in one (:func:`claim_memory`, :data:`GROWTH`); ``None`` keeps ``base``'s mark.

    The CPU kernels are TensorFlow's own (Eigen's: ``TF_ENABLE_ONEDNN_OPTS=0``), whatever
    ``base`` sets, unless ``onednn=True``, or ``onednn`` is None and ``base`` sets
    ``TFLMS_TESTBED_ONEDNN=1`` (:data:`ONEDNN_OPT_IN`); the environment records the choice
    there too, so that the processes a measured process starts (its :class:`HostWorker`, a
    :class:`~tflms.testing.device_worker.DeviceWorker`) run the same kernel library. A GPU
    raises ``ResourceExhaustedError`` when its allocator fails a request, and so do Eigen's
    kernels under the BFC cap; oneDNN's kernels abort the process instead (``mkl_util.h`` "'tensor'
    Must be non NULL" in a conv backprop), which no recovery can answer. Pinned either way:
    TensorFlow turns oneDNN on by default only on CPUs with AVX-512 VNNI and newer, so
    without the pin the same step measures differently from one machine to the next.

    With ``gpu=True`` the measured device is GPU 0 instead: the environment marks the
    process as such (``TFLMS_MEASURED_GPU``: the cap in MiB, 0 for none), and the CPU
    keeps TensorFlow's defaults.

    >>> env = device_environ("512MiB", base={"TF_ENABLE_ONEDNN_OPTS": "1"})
    >>> env["TF_CPU_ALLOCATOR_USE_BFC"], env["TF_CPU_BFC_MEM_LIMIT_IN_MB"], env["TF_ENABLE_ONEDNN_OPTS"]
    ('true', '512', '0')
    >>> device_environ(base={}, onednn=True)["TF_ENABLE_ONEDNN_OPTS"]
    '1'
    >>> device_environ(base={"TFLMS_TESTBED_ONEDNN": "1"})["TF_ENABLE_ONEDNN_OPTS"]
    '1'
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
    if onednn is None:
        onednn = env.get(ONEDNN_OPT_IN, "").strip().lower() in ("1", "true", "yes", "on")
    elif not isinstance(onednn, bool):
        raise TypeError(f"onednn must be True, False or None. Received: onednn={onednn!r}")
    env[_BFC] = "true"
    env[_ONEDNN] = env[ONEDNN_OPT_IN] = "1" if onednn else "0"
    if growth is not None:
        env[GROWTH] = "1" if growth else "0"
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


def claim_memory() -> int:
    """Take a capped test bed device's memory in one region, as TensorFlow's GPU allocator does by
    default; return the bytes claimed (0 without a cap, or in a measured GPU process).

    The BFC allocator of the test bed grows its pool region by region, each twice the last, and a
    tensor never spans two regions: under a cap, a request can fail with most of the cap free in
    regions too small for it, where a GPU, whose allocator takes its memory in one region when the
    process starts, would serve it. One allocation of nearly the whole cap, freed at once, leaves
    that one region. The measured processes of :func:`run_measured` and the device worker of
    :class:`~tflms.testing.device_worker.DeviceWorker` call it before their work; a script started
    with :func:`device_environ` calls it first. The peak is reset after it. A process started
    with ``device_environ(cap, growth=True)`` keeps growing by regions: it claims nothing."""
    import tensorflow as tf

    _require_measured("claim_memory")
    mib = int(os.environ.get(_CAP, "0") or 0)
    if _is_gpu_process() or mib <= 0 or os.environ.get(GROWTH) == "1":
        return 0
    rows = (mib * 2**20 - memory()["current"]) >> 20  # whole MiB: a shape's dimensions are 32-bit
    with tf.device(DEVICE):
        while rows > 1:  # regions already made hold a little: the largest request that fits
            try:
                tf.raw_ops.Empty(shape=[rows, 2**20], dtype=tf.uint8, init=False)
                break
            except tf.errors.ResourceExhaustedError:
                rows -= 1
    reset_peak()
    print(CLAIM_MARK, file=sys.stderr, flush=True)
    return max(rows, 0) << 20


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
            [sys.executable, "-m", "tflms.testing.testbed", "--port", str(self.port), "--parent", str(os.getpid())],
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

    parser = argparse.ArgumentParser(prog="python -m tflms.testing.testbed", description="Serve as the host worker.")
    parser.add_argument("--port", type=int, required=True, help="serve as the host worker on this port")
    parser.add_argument("--parent", type=int, help="exit when this process is no longer the parent")
    args = parser.parse_args(argv)
    _serve(args.port, args.parent)


if __name__ == "__main__":
    main()
