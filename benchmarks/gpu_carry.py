"""Carry TensorFlow to a lent GPU machine that has none, then run the GPU benchmarks there.

The lent machine (see the ``device`` tool's notes) runs Python 3.12 with CUDA 13's libraries and
reaches no package registry; each call carries at most 64 MiB. TensorFlow 2.21's wheel is about
546 MiB, so it travels in parts over several calls while the machine stays warm (it is given back
after about 30 idle seconds: make the calls one after another).

Here, once (downloads the wheels into ``.whl/``, which git ignores; splits TensorFlow's into parts
of at most ``--part-mib``; prints the device calls to make)::

    python benchmarks/gpu_carry.py

There, call by call, as printed: each call carries ``.whl/now`` (move the next part into it between
calls) and appends it to ``/tmp/tflms-wheel``; the last carries the small wheels, installs them
with the reassembled wheel into ``/tmp/site`` and runs ``bash benchmarks/gpu_session.sh``, which
names CUDA 13's libraries under the CUDA 12 names TensorFlow loads and runs
``benchmarks/gpu_throughput.py`` and ``benchmarks/gpu_offload.py``, their JSON written to ``$OUT``.
Copy them into ``benchmarks/results/`` here and regenerate the benchmarks page.

Not yet run on a lent machine: treat the first call's output as the check of this procedure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
#: What TensorFlow 2.21 and Keras 3 need that the lent machine's image does not hold (its package
#: list: the device tool's KINDS.md), pinned to what this repository is tested with.
SMALL = ("keras==3.15.1", "namex", "optree", "astunparse", "gast", "google_pasta", "termcolor")
PLATFORMS = ("manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def download(spec: str, dest: Path) -> None:
    """``pip download`` one requirement's cp312 wheel (no dependencies) into ``dest``."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *platforms, "-d", str(dest), spec]  # fmt: skip
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensorflow", default="2.21.0")
    parser.add_argument(
        "--part-mib", type=int, default=56, help="size of one part (a call carries 64 MiB, the working tree included)"
    )
    args = parser.parse_args(argv)
    exclude = ROOT / ".git" / "info" / "exclude"
    if exclude.parent.is_dir() and "/.whl/" not in (exclude.read_text() if exclude.exists() else ""):
        with exclude.open("a") as f:
            f.write("/.whl/\n")
    small, parts = WHEELS / "small", WHEELS / "parts"
    for folder in (small, parts, WHEELS / "now"):
        folder.mkdir(parents=True, exist_ok=True)
    for spec in SMALL:
        download(spec, small)
    big = WHEELS / "big"
    download(f"tensorflow=={args.tensorflow}", big)
    wheel = next(big.glob("tensorflow-*.whl"))
    data, size = wheel.read_bytes(), args.part_mib << 20
    n = (len(data) + size - 1) // size
    for k in range(n):
        (parts / f"{k:02d}").write_bytes(data[k * size : (k + 1) * size])
    print(f"{wheel.name}: {len(data) >> 20} MiB in {n} parts; small wheels: {len(list(small.glob('*.whl')))}")
    print("device calls, one after another; before call k: rm -f .whl/now/*; mv .whl/parts/<k> .whl/now/")
    print("  calls 1..N (carry ['.whl/now']):  mkdir -p /tmp/tflms-wheel && cp .whl/now/* /tmp/tflms-wheel/")
    print(f"  last call (carry ['.whl/small']):  cat /tmp/tflms-wheel/* > /tmp/{wheel.name} && "
          f"python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/{wheel.name} "
          ".whl/small/*.whl && bash benchmarks/gpu_session.sh")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
