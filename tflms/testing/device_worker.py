"""A second measured device for the test bed: a TensorFlow server process whose CPU, through
TensorFlow's BFC allocator and an optional real cap, plays one more device of a placed step.

The test bed (:mod:`tflms.testing.testbed`) measures one device: the measured process itself. A
step placed on two devices (``devices=[...]``) needs a second one, whose allocator the client cannot
read (``get_memory_info`` of another task raises "No matching devices found", ``DESIGN.md`` §2b). So
the worker reads its own allocator and reports over a file: a thread writes its peak (bytes) to
``peak_file`` every few milliseconds, and resets the peak when ``peak_file + '.reset'`` appears.

Inside a measured process (started with :func:`tflms.testing.testbed.device_environ`)::

    with DeviceWorker(cap="1GiB") as dev1:
        dev1.connect()
        step = tflms.function(train_step, devices=[tflms.testbed.DEVICE, dev1.device])
        dev1.reset_peak(); step(x, y); print(dev1.peak())
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .testbed import TestBedError, _die_with_parent, _free_port, claim_memory, device_environ

__all__ = ["DeviceWorker", "JOB"]

#: The job name of the worker's task in the cluster.
JOB = "dev1"
_READY = "TFLMS_DEVICE_READY"


class DeviceWorker:
    """A measured device in a child process (job :data:`JOB`, one task), its BFC allocator capped at
    ``cap`` (bytes or a size string; ``None``: no cap), on the kernels of :func:`device_environ`
    (``onednn``: as there; by default those of the process that starts it). Use it in a ``with`` block; it dies with its
    parent. :attr:`device` is its device string; :meth:`peak` and :meth:`reset_peak` read and reset
    its allocator's peak."""

    def __init__(self, cap: int | str | None = None, timeout: float = 60.0, onednn: bool | None = None) -> None:
        self.cap = cap
        self.onednn = onednn
        self.timeout = timeout
        self.port = _free_port()
        self.device = f"/job:{JOB}/replica:0/task:0/device:CPU:0"
        self._dir = tempfile.TemporaryDirectory()
        self.peak_file = Path(self._dir.name) / "peak"
        self._proc: subprocess.Popen | None = None
        self._log: Any = None

    def __enter__(self) -> DeviceWorker:
        env = device_environ(self.cap, onednn=self.onednn)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self._log = tempfile.TemporaryFile()
        args = ["--port", str(self.port), "--parent", str(os.getpid()), "--peak-file", str(self.peak_file)]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tflms.testing.device_worker", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise TestBedError(
                    f"the device worker exited with code {self._proc.returncode}: {self.output()[-1500:]!r}"
                )
            if _READY in self.output() and self.peak_file.exists():
                return self
            time.sleep(0.1)
        self.__exit__()
        raise TestBedError(f"the device worker did not listen on localhost:{self.port} within {self.timeout} s")

    def __exit__(self, *exc: Any) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    @property
    def alive(self) -> bool:
        """Whether the worker process still runs (a capped worker may die of an out-of-memory)."""
        return self._proc is not None and self._proc.poll() is None

    def connect(self) -> str:
        """Connect this process to the worker (this process's own devices stay its default); its device."""
        import tensorflow as tf

        spec = tf.train.ClusterSpec({JOB: [f"localhost:{self.port}"]})
        tf.config.experimental_connect_to_cluster(spec, make_master_device_default=False)
        names = [d.name for d in tf.config.list_logical_devices("CPU")]
        if self.device not in names:
            raise TestBedError(f"connected to localhost:{self.port} but {self.device} is not among {names}")
        return self.device

    def peak(self) -> int:
        """The worker's allocator peak (bytes) since its last reset, as it last wrote it."""
        time.sleep(0.05)  # one more write of the worker's thread
        return int(self.peak_file.read_text() or 0)

    def reset_peak(self) -> None:
        """Reset the worker's peak to its current use (and wait until it did)."""
        flag = Path(str(self.peak_file) + ".reset")
        flag.write_text("")
        deadline = time.monotonic() + 10
        while flag.exists() and time.monotonic() < deadline:
            time.sleep(0.01)


def _serve(port: int, parent: int | None, peak_file: Path) -> None:
    import tensorflow as tf

    claim_memory()  # one region, as a GPU's allocator has
    server = tf.distribute.Server(tf.train.ClusterSpec({JOB: [f"localhost:{port}"]}), job_name=JOB, task_index=0)
    flag = Path(str(peak_file) + ".reset")

    def report() -> None:
        while True:
            if parent and os.getppid() != parent:
                os._exit(0)
            if flag.exists():
                tf.config.experimental.reset_memory_stats("CPU:0")
                with contextlib.suppress(OSError):
                    flag.unlink()
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            tmp = Path(str(peak_file) + ".tmp")
            tmp.write_text(str(peak))
            tmp.replace(peak_file)
            time.sleep(0.005)

    threading.Thread(target=report, daemon=True).start()
    print(_READY, flush=True)
    server.join()


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tflms.testing.device_worker", description="Serve as a device.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent", type=int)
    parser.add_argument("--peak-file", type=Path, required=True)
    args = parser.parse_args(argv)
    _serve(args.port, args.parent, args.peak_file)


if __name__ == "__main__":
    main()
