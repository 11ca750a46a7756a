"""Build, cache and install a Horovod 0.28.1 wheel for the installed TensorFlow.

Run as ``python -m tflms.tools.build_horovod`` (``--help`` for options) or call
:func:`ensure_horovod` from Python.

Why: Horovod 0.28.1 (the latest release, 2023) publishes only an sdist, and
that sdist does not build against TensorFlow 2.21 as published. This module
makes the build reproducible:

1. If ``horovod`` 0.28.1 is already importable in this interpreter, was built
   against the installed TensorFlow version (``horovod/metadata.json``) and
   ``horovod.tensorflow`` loads its ops library, do nothing (unless
   ``--force``).
2. If a wheel for this configuration is already in the cache, install it.
3. Otherwise: ``pip download --no-binary :all: --no-deps horovod==0.28.1``
   (the sdist is cached too), extract it into a temporary directory, apply
   the patches below, build with ``pip wheel --no-deps
   --no-build-isolation`` (TensorFlow must be importable at build time),
   store the wheel in the cache and install it with ``pip install
   --no-deps`` plus the runtime requirements listed in the wheel METADATA
   (cloudpickle, psutil, pyyaml, packaging), only those not yet satisfied.

Patches (precise text edits; idempotent; the build stops with a clear error
if the expected text is not found):

* ``horovod/tensorflow/CMakeLists.txt``: drop ``xla_mpi_ops.cc`` from
  ``TF_SOURCES``. It includes ``tensorflow/compiler/xla/...`` headers that
  TF 2.21 no longer ships; it only provides the optional XLA custom-call op
  (``HOROVOD_ENABLE_XLA_OPS``), which tflms does not use.

No other patch is needed for TF 2.21 / Python 3.11 / GCC 12 / CMake 3.25.

Build environment: ``HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1
HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1`` and
``MAKEFLAGS=-j<jobs>`` (default: number of usable CPUs). Any
``HOROVOD_BUILD_ARCH_FLAGS`` / ``HOROVOD_CMAKE`` already in the environment
is passed through (Horovod's default arch flags are ``-mf16c -mavx -mfma``).

GPU (untested here): with ``--gpu auto`` (default) a GPU build is made when a
CUDA toolkit is found (``nvcc`` on PATH, or ``CUDA_HOME``/``CUDA_PATH`` set)
*and* the installed TensorFlow is built with CUDA; it adds
``HOROVOD_GPU_OPERATIONS=NCCL`` (NCCL headers and library must be findable,
e.g. via ``HOROVOD_NCCL_HOME``). A CUDA toolkit next to a CPU-only
TensorFlow (e.g. ``tensorflow-cpu``) gives a CPU build. ``--gpu on|off``
overrides the detection.

Cache: ``~/.cache/tflms/wheels/`` (override with ``--cache-dir`` or env
``TFLMS_WHEEL_CACHE``), one directory per key
``horovod-<ver>_tf-<ver>_<pytag>_<platform>_<cpu|gpu>`` holding the wheel,
``build.log`` and ``build-info.json``; downloaded sdists go in ``sdist/``.

Running with Horovod over localhost: ``horovodrun --gloo -np 2 -H
localhost:2 python train.py`` (the venv's ``bin`` must be on PATH so that
``horovodrun`` and the right ``python`` are found; no ``HOROVOD_GLOO_IFACE``
was needed).

Known limits with Keras 3 (seen with TF 2.21 / Keras 3.15): ``hvd.allreduce``
/ ``hvd.grouped_allreduce`` work eagerly and in ``tf.function``;
``horovod.tensorflow.keras`` imports, but ``model.fit`` with its
``DistributedOptimizer``, ``hvd.DistributedGradientTape.gradient(loss,
model.trainable_variables)`` and ``hvd.broadcast_variables(model.variables)``
fail (Keras 3 variables have no ``.ref()`` / ``.assign`` in that form); pass
``[v.value for v in ...]`` (the backing ``tf.Variable``) instead.
"""

from __future__ import annotations

import argparse
import contextlib
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
import tempfile
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
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


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Everything that determines which wheel is built, and where it is cached."""

    horovod_version: str
    tf_version: str
    python_tag: str
    platform: str
    gpu: bool
    cache_dir: Path

    @property
    def key(self) -> str:
        """Cache key: horovod + TF versions, python tag, platform, cpu/gpu."""
        variant = "gpu" if self.gpu else "cpu"
        return f"horovod-{self.horovod_version}_tf-{self.tf_version}_{self.python_tag}_{self.platform}_{variant}"

    @property
    def wheel_dir(self) -> Path:
        """Directory of the cached wheel for this configuration."""
        return self.cache_dir / self.key

    def cached_wheel(self) -> Path | None:
        """The cached wheel, if one exists."""
        wheels = sorted(self.wheel_dir.glob(f"horovod-{self.horovod_version}-*.whl"))
        return wheels[-1] if wheels else None


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


# --------------------------------------------------------------------------- probing

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


def installed_matches(env: Environment, cfg: BuildConfig) -> bool:
    """True if the importable horovod is the wanted version, built for this TF and variant."""
    return (
        env.hvd_ok
        and env.hvd_version == cfg.horovod_version
        and env.hvd_tf_version == cfg.tf_version
        and env.hvd_nccl == cfg.gpu
    )


# --------------------------------------------------------------------------- toolchain


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


# --------------------------------------------------------------------------- build steps


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


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Exclusive lock so that concurrent runs do not build the same wheel twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX
            yield
            return
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_into_cache(cfg: BuildConfig, jobs: int, verbose: bool) -> Path:
    check_toolchain()
    missing = _missing_requirements(BUILD_REQUIRES)
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", *missing]
        log(f"installing build requirements: {_fmt_cmd(cmd)}")
        _run(cmd)
    sdist = download_sdist(cfg.cache_dir, cfg.horovod_version)
    cfg.wheel_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tflms-horovod-") as tmp:
        src = extract_sdist(sdist, Path(tmp) / "src")
        for patch in PATCHES:
            state = "applied" if apply_patch(src, patch) else "already applied"
            log(f"patch {state}: {patch.path}: {patch.reason}")
        start = time.monotonic()
        built = build_wheel(
            src, Path(tmp) / "dist", build_env(cfg.gpu, jobs), cfg.wheel_dir / "build.log", verbose=verbose
        )
        seconds = time.monotonic() - start
        partial = cfg.wheel_dir / (built.name + ".partial")
        shutil.copyfile(built, partial)
        wheel = cfg.wheel_dir / built.name
        os.replace(partial, wheel)
    info = {
        **dataclasses.asdict(cfg),
        "cache_dir": str(cfg.cache_dir),
        "wheel": wheel.name,
        "build_seconds": round(seconds, 1),
        "size_bytes": wheel.stat().st_size,
        "jobs": jobs,
        "patches": [p.reason for p in PATCHES],
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (cfg.wheel_dir / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"built {wheel.name} in {seconds:.0f}s ({wheel.stat().st_size / 2**20:.1f} MiB)")
    return wheel


def _print_plan(cfg: BuildConfig, jobs: int) -> None:
    py = sys.executable
    src = f"<tmpdir>/src/horovod-{cfg.horovod_version}"
    steps = [
        _fmt_cmd(_download_cmd(cfg.cache_dir / "sdist", cfg.horovod_version)),
        "tar xzf <sdist> -C <tmpdir>/src",
        *(f"patch {p.path}: {p.reason}" for p in PATCHES),
        _fmt_cmd(
            [py, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", "<tmpdir>/dist", src],
            build_env(cfg.gpu, jobs),
        ),
        f"cp <tmpdir>/dist/horovod-*.whl {cfg.wheel_dir}/",
        _fmt_cmd([py, "-m", "pip", "install", "<unmet Requires-Dist of the wheel>"]),
        _fmt_cmd([py, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(cfg.wheel_dir / "<wheel>")]),
    ]
    log("dry run; would run:")
    for step in steps:
        print(f"  {step}")


# --------------------------------------------------------------------------- entry points


def ensure_horovod(
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    *,
    rebuild: bool = False,
    jobs: int | None = None,
    gpu: str = "auto",
    dry_run: bool = False,
    verbose: bool = False,
) -> Path:
    """Make Horovod 0.28.1 for the installed TensorFlow importable; return the wheel path.

    Does nothing if a matching horovod is already importable (unless ``force``),
    installs the cached wheel if there is one (unless ``rebuild``), else builds
    it first. If horovod is already fine and no wheel is cached, returns the
    installed ``horovod`` package directory instead. In ``dry_run`` mode nothing
    is changed and the would-be wheel location is returned.
    """
    force = force or rebuild
    jobs = jobs or _default_jobs()
    env = probe_environment()
    cfg = BuildConfig(
        horovod_version=HOROVOD_VERSION,
        tf_version=env.tf_version,
        python_tag=python_tag(),
        platform=platform_tag(),
        gpu=want_gpu(gpu, env),
        cache_dir=resolve_cache_dir(cache_dir),
    )
    log(
        f"tensorflow {env.tf_version} (cuda={env.tf_cuda}), python {sys.version.split()[0]}, "
        f"{'gpu' if cfg.gpu else 'cpu'} build; cache key {cfg.key}"
    )
    if env.hvd_version:
        state = "ok" if env.hvd_ok else f"broken: {env.hvd_error}"
        log(f"installed: horovod {env.hvd_version} built for tf {env.hvd_tf_version} ({state})")

    if installed_matches(env, cfg) and not force:
        cached = cfg.cached_wheel()
        log("horovod is already installed and matches; nothing to do (use --force to reinstall)")
        if cached:
            return cached
        import importlib.util

        spec = importlib.util.find_spec("horovod")
        assert spec is not None and spec.origin is not None
        return Path(spec.origin).parent

    cached = None if rebuild else cfg.cached_wheel()
    if dry_run:
        if cached:
            log(f"dry run; would install cached wheel {cached}")
        else:
            _print_plan(cfg, jobs)
        return cached or cfg.wheel_dir / f"horovod-{HOROVOD_VERSION}-<tags>.whl"

    with _lock(cfg.wheel_dir / ".lock"):
        cached = None if rebuild else cfg.cached_wheel()
        if cached:
            log(f"using cached wheel {cached}")
            wheel = cached
        else:
            wheel = _build_into_cache(cfg, jobs, verbose)
        install_wheel(wheel)

    after = probe_environment()
    if not installed_matches(after, cfg):
        raise BuildError(
            f"installed {wheel.name} but `import horovod.tensorflow` check failed: {after.hvd_error or after}"
        )
    log(f"ok: horovod {after.hvd_version} for tensorflow {after.tf_version} installed from {wheel}")
    return wheel


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m tflms.tools.build_horovod",
        description=f"Build (once, cached) and install Horovod {HOROVOD_VERSION} for the installed TensorFlow.",
    )
    parser.add_argument("--cache-dir", help=f"wheel cache (default: ${CACHE_ENV} or {DEFAULT_CACHE_DIR})")
    parser.add_argument("--force", action="store_true", help="reinstall even if a matching horovod is importable")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the wheel even if cached (implies --force)")
    parser.add_argument(
        "--print-only", "--dry-run", dest="dry_run", action="store_true", help="print what would run, change nothing"
    )
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile jobs (default: number of CPUs)")
    parser.add_argument(
        "--gpu",
        choices=("auto", "on", "off"),
        default="auto",
        help="NCCL GPU build: auto = CUDA toolkit found and TF built with CUDA",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="stream the full build output")
    args = parser.parse_args(argv)
    try:
        path = ensure_horovod(
            args.cache_dir,
            args.force,
            rebuild=args.rebuild,
            jobs=args.jobs,
            gpu=args.gpu,
            dry_run=args.dry_run,
            verbose=args.verbose,
        )
    except BuildError as exc:
        print(f"{PREFIX} error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
