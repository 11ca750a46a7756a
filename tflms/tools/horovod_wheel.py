"""The steps of a Horovod wheel build for the installed TensorFlow: probe, fetch, patch, build, install
(driven by :mod:`tflms.tools.build_horovod`)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

HOROVOD_VERSION = "0.28.1"


PREFIX = "[tflms.tools.build_horovod]"


CACHE_ENV = "TFLMS_WHEEL_CACHE"


DEFAULT_CACHE_DIR = Path("~/.cache/tflms/wheels")


MIN_CMAKE = (3, 13)


#: Environment for a CPU (Gloo-only) TensorFlow build.
BASE_BUILD_ENV: dict[str, str] = {
    "HOROVOD_WITH_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_PYTORCH": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_MPI": "1",
}


#: Python packages needed in the build environment. The last four are
#: Horovod's ``setup_requires``; without them setuptools would try to fetch
#: eggs during ``bdist_wheel``.
BUILD_REQUIRES: tuple[str, ...] = (
    "setuptools",
    "wheel",
    "packaging",
    "cloudpickle",
    "psutil",
    "pyyaml",
)


class BuildError(RuntimeError):
    """A build step failed; the message is a one-line explanation."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """Replace exactly one occurrence of ``old`` by ``new`` in ``path``."""

    path: str
    old: str
    new: str
    reason: str


PATCHES: tuple[Patch, ...] = (
    Patch(
        path="horovod/tensorflow/CMakeLists.txt",
        old='list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n',
        new="# tflms: xla_mpi_ops.cc dropped: TF 2.21 no longer ships the "
        "tensorflow/compiler/xla headers it includes (optional XLA op only)\n",
        reason="drop xla_mpi_ops.cc (needs XLA headers absent from TF 2.21)",
    ),
)


@dataclasses.dataclass(frozen=True)
class Environment:
    """What the current interpreter has: TensorFlow and (maybe) Horovod."""

    tf_version: str
    tf_cuda: bool
    hvd_version: str | None = None
    hvd_tf_version: str | None = None
    hvd_ok: bool = False
    hvd_nccl: bool = False
    hvd_error: str | None = None


def log(msg: str) -> None:
    """Print a progress line."""
    print(f"{PREFIX} {msg}", flush=True)


def _fmt_cmd(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(cmd)


def _run(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Run ``cmd`` (output passes through); raise BuildError on failure."""
    full_env = {**os.environ, **env} if env else None
    proc = subprocess.run(list(cmd), env=full_env, check=False)
    if proc.returncode != 0:
        raise BuildError(f"command failed (exit {proc.returncode}): {_fmt_cmd(cmd, env)}")


_PROBE = r"""
import json, os
out = {}
import tensorflow as tf
out["tf_version"] = tf.__version__
out["tf_cuda"] = bool(tf.test.is_built_with_cuda())
try:
    import horovod
    out["hvd_version"] = horovod.__version__
    with open(os.path.join(os.path.dirname(horovod.__file__), "metadata.json")) as f:
        out["hvd_tf_version"] = json.load(f).get("tensorflow")
    import horovod.tensorflow as hvd
    out["hvd_ok"] = bool(hvd.gloo_built()) or bool(hvd.mpi_built())
    out["hvd_nccl"] = bool(hvd.nccl_built())
except Exception as e:  # noqa: BLE001
    out["hvd_error"] = f"{type(e).__name__}: {e}"
print("TFLMS_PROBE=" + json.dumps(out))
"""


def probe_environment(python: str = sys.executable) -> Environment:
    """Import TensorFlow (and Horovod) in a fresh interpreter and report versions."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("TFLMS_PROBE="):
            data = json.loads(line.split("=", 1)[1])
            return Environment(**data)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise BuildError(f"cannot import tensorflow in {python}: {tail}")


def find_cuda() -> str | None:
    """Location of a CUDA toolkit (``nvcc`` on PATH, ``CUDA_HOME`` or ``CUDA_PATH``)."""
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    return None


def want_gpu(mode: str, env: Environment) -> bool:
    """Decide cpu/gpu build from ``mode`` ('auto', 'on', 'off')."""
    if mode == "off":
        return False
    cuda = find_cuda()
    if mode == "on":
        if not cuda:
            raise BuildError("--gpu on but no CUDA toolkit found (nvcc, CUDA_HOME or CUDA_PATH)")
        if not env.tf_cuda:
            log("warning: --gpu on but TensorFlow is not built with CUDA")
        return True
    if cuda and not env.tf_cuda:
        log(f"CUDA toolkit found ({cuda}) but TensorFlow is not built with CUDA: CPU build")
        return False
    if cuda and not shutil.which("nvidia-smi"):
        # The tensorflow package is built with CUDA on every Linux machine; a GPU build also
        # needs the CUDA runtime, which comes with a driver (as setup.py decides TensorFlow's build).
        log(f"CUDA toolkit found ({cuda}) but no NVIDIA driver (nvidia-smi): CPU build")
        return False
    return bool(cuda) and env.tf_cuda


def python_tag() -> str:
    """E.g. ``cp311``."""
    impl = {"cpython": "cp", "pypy": "pp"}.get(sys.implementation.name, sys.implementation.name)
    return f"{impl}{sys.version_info.major}{sys.version_info.minor}"


def platform_tag() -> str:
    """E.g. ``linux_x86_64``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", sysconfig.get_platform())


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``cache_dir``, else ``$TFLMS_WHEEL_CACHE``, else ``~/.cache/tflms/wheels``."""
    raw = cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
    return Path(raw).expanduser().resolve()


def check_toolchain() -> None:
    """Fail with a one-line error naming what to install if a build tool is missing."""
    cmake = os.environ.get("HOROVOD_CMAKE") or shutil.which("cmake")
    if not cmake:
        raise BuildError("cmake not found: install CMake >= 3.13 (e.g. `apt-get install cmake` or `pip install cmake`)")
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"version\s+(\d+)\.(\d+)", out.stdout)
    if not match or tuple(map(int, match.groups())) < MIN_CMAKE:
        raise BuildError(
            f"{cmake} is too old or broken ({out.stdout.strip()[:40] or 'no version'}): "
            "install CMake >= 3.13 (e.g. `pip install cmake`)"
        )
    tools = {
        "C++ compiler": ("g++", (os.environ.get("CXX"), "c++", "g++", "clang++")),
        "C compiler": ("gcc", (os.environ.get("CC"), "cc", "gcc", "clang")),
        "make": ("make", ("make", "gmake")),
    }
    for what, (package, candidates) in tools.items():
        if not any(c and shutil.which(c.split()[0]) for c in candidates):
            raise BuildError(
                f"no {what} found on PATH: install one (e.g. `apt-get install {package}` "
                "or `apt-get install build-essential`)"
            )


def _missing_requirements(reqs: Sequence[str]) -> list[str]:
    """Those of ``reqs`` (PEP 508 strings) not satisfied in this interpreter."""
    from importlib import metadata

    from packaging.requirements import Requirement

    missing = []
    for spec in reqs:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(spec)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            missing.append(spec)
    return missing


def wheel_requirements(wheel: Path) -> list[str]:
    """All ``Requires-Dist`` entries of ``wheel`` (markers are evaluated later)."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def apply_patch(root: Path, patch: Patch) -> bool:
    """Apply ``patch`` under ``root``; False if it was already applied."""
    path = root / patch.path
    if not path.is_file():
        raise BuildError(f"patch '{patch.reason}': {path} does not exist")
    text = path.read_text()
    count = text.count(patch.old)
    if count == 0:
        if patch.new in text:
            return False
        raise BuildError(
            f"patch '{patch.reason}': expected text not found in {patch.path}: "
            f"{patch.old.strip()!r} (sdist changed? update tflms.tools.build_horovod.PATCHES)"
        )
    if count > 1:
        raise BuildError(f"patch '{patch.reason}': expected text found {count}x in {patch.path}")
    path.write_text(text.replace(patch.old, patch.new))
    return True


def _download_cmd(dest: Path, version: str) -> list[str]:
    """The pip command that downloads the horovod sdist into ``dest``."""
    return [
        sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
        "--disable-pip-version-check", "-q", "-d", str(dest), f"horovod=={version}",
    ]  # fmt: skip


def download_sdist(cache_dir: Path, version: str = HOROVOD_VERSION) -> Path:
    """Download (or reuse) the horovod sdist into ``cache_dir/sdist``."""
    dest = cache_dir / "sdist"
    existing = sorted(dest.glob(f"horovod-{version}.tar.gz"))
    if existing:
        log(f"using cached sdist {existing[0]}")
        return existing[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = _download_cmd(dest, version)
    log(f"downloading sdist: {_fmt_cmd(cmd)}")
    _run(cmd)
    found = sorted(dest.glob(f"horovod-{version}.tar.gz"))
    if not found:
        raise BuildError(f"pip download produced no horovod-{version}.tar.gz in {dest}")
    return found[0]


def extract_sdist(sdist: Path, dest: Path) -> Path:
    """Extract ``sdist`` into ``dest`` and return the source root."""
    with tarfile.open(sdist) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")
        else:  # pragma: no cover - Python without PEP 706 backport
            tf.extractall(dest)
    roots = [p for p in dest.iterdir() if (p / "setup.py").is_file()]
    if len(roots) != 1:
        raise BuildError(f"unexpected sdist layout in {sdist}")
    return roots[0]


def build_env(gpu: bool, jobs: int) -> dict[str, str]:
    """Environment variables to add for the wheel build."""
    env = dict(BASE_BUILD_ENV)
    env["MAKEFLAGS"] = f"-j{jobs}"
    if gpu:
        env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
    return env


def _default_jobs() -> int:
    """Number of CPUs this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    """os.environ + ``extra``, minus stray HOROVOD_GPU*/framework switches from the caller."""
    env = {k: v for k, v in os.environ.items() if not re.match(r"HOROVOD_(GPU|WITH|WITHOUT)", k)}
    env.update(extra)
    return env


_PCT = re.compile(r"^\s*\[\s*(\d+)%\]")


def build_wheel(src: Path, out_dir: Path, env_extra: Mapping[str, str], log_path: Path, verbose: bool = False) -> Path:
    """Run ``pip wheel`` on ``src``; full output goes to ``log_path``."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--disable-pip-version-check",
        "-v",
        "-w",
        str(out_dir),
        str(src),
    ]
    log(f"building wheel (full log: {log_path}): {_fmt_cmd(cmd, env_extra)}")
    start = time.monotonic()
    last_pct = -10
    with (
        open(log_path, "w") as fh,
        subprocess.Popen(
            cmd,
            env=_clean_env(env_extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            if verbose:
                sys.stdout.write(line)
            m = _PCT.match(line)
            if m and int(m.group(1)) >= last_pct + 10:
                last_pct = int(m.group(1))
                log(f"  compile {last_pct:3d}%  ({time.monotonic() - start:.0f}s)")
        rc = proc.wait()
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        sys.stderr.write("\n".join(tail) + "\n")
        errors = [ln.strip() for ln in tail if "error" in ln.lower()]
        raise BuildError(f"pip wheel failed (exit {rc}); {errors[0] if errors else 'see'} -- full log: {log_path}")
    wheels = sorted(out_dir.glob("horovod-*.whl"))
    if not wheels:
        raise BuildError(f"pip wheel succeeded but no wheel in {out_dir}")
    return wheels[-1]


def install_wheel(wheel: Path) -> None:
    """``pip install --no-deps`` the wheel, plus its unmet runtime requirements."""
    missing = _missing_requirements(wheel_requirements(wheel))
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", *missing]
        log(f"installing runtime requirements: {_fmt_cmd(cmd)}")
        _run(cmd)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--force-reinstall",
        "--disable-pip-version-check",
        "-q",
        str(wheel),
    ]
    log(f"installing: {_fmt_cmd(cmd)}")
    _run(cmd)
