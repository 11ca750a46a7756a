"""Build, cache and install a Horovod 0.28.1 wheel for the installed TensorFlow.

Run as ``python -m tflms.tools.build_horovod`` (``--help`` for options) or call
:func:`ensure_horovod` from Python.

Why: Horovod 0.28.1, its latest release, publishes only an sdist, and
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

GPU (the tests check the detection, not a GPU build): with ``--gpu auto`` (default) a GPU build is made when a
CUDA toolkit is found (``nvcc`` on PATH, or ``CUDA_HOME``/``CUDA_PATH`` set)
*and* the installed TensorFlow is built with CUDA; it adds
``HOROVOD_GPU_OPERATIONS=NCCL`` (NCCL headers and library must be findable,
e.g. via ``HOROVOD_NCCL_HOME``). A CUDA toolkit next to a CPU-only
TensorFlow (e.g. ``tensorflow-cpu``) gives a CPU build. ``--gpu on|off``
overrides the detection.

Cache: ``~/.cache/tflms/wheels/`` (override with ``--cache-dir`` or env
``TFLMS_WHEEL_CACHE``), one directory per key
``horovod-<ver>_tf-<ver>_<pytag>_<platform>_<cpu|gpu>`` holding the wheel,
``build.log`` and ``build-info.json``; downloaded sdists go in ``sdist/``. The wheel is
therefore one folder down: ``pip install ~/.cache/tflms/wheels/horovod-0.28.1_tf-2.21.0_*/horovod-*.whl``
installs it in another environment with the same TensorFlow (when one configuration is
cached), and every run prints the ``pip install`` command of the wheel it built or reused
(:func:`install_command`).

Running with Horovod over localhost: ``horovodrun --gloo -np 2 -H
localhost:2 python train.py`` (the venv's ``bin`` must be on PATH so that
``horovodrun`` and the right ``python`` are found; ``HOROVOD_GLOO_IFACE`` need
not be set).

Known limits with Keras 3 (TF 2.21, Keras 3.15): ``hvd.allreduce``
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
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .horovod_wheel import (
    BUILD_REQUIRES,
    CACHE_ENV,
    DEFAULT_CACHE_DIR,
    HOROVOD_VERSION,
    PATCHES,
    PREFIX,
    BuildError,
    Environment,
    _default_jobs,
    _download_cmd,
    _fmt_cmd,
    _missing_requirements,
    _run,
    apply_patch,
    build_env,
    build_wheel,
    check_toolchain,
    download_sdist,
    extract_sdist,
    install_wheel,
    log,
    platform_tag,
    probe_environment,
    python_tag,
    resolve_cache_dir,
    want_gpu,
)


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


def install_command(wheel: Path) -> str:
    """The ``pip install`` command that installs ``wheel`` (its absolute path) in another environment.

    >>> install_command(Path("/cache/horovod-0.28.1_tf-2.21.0_cp311_linux_x86_64_cpu/horovod-0.28.1-cp311-none.whl"))
    'pip install /cache/horovod-0.28.1_tf-2.21.0_cp311_linux_x86_64_cpu/horovod-0.28.1-cp311-none.whl'
    """
    return shlex.join(["pip", "install", str(Path(wheel).expanduser().absolute())])


def _log_install_hint(wheel: Path) -> None:
    log(f"the cached wheel, for another environment with the same TensorFlow and Python: {install_command(wheel)}")


# --------------------------------------------------------------------------- probing


def installed_matches(env: Environment, cfg: BuildConfig) -> bool:
    """True if the importable horovod is the wanted version, built for this TF and variant."""
    return (
        env.hvd_ok
        and env.hvd_version == cfg.horovod_version
        and env.hvd_tf_version == cfg.tf_version
        and env.hvd_nccl == cfg.gpu
    )


# --------------------------------------------------------------------------- toolchain


# --------------------------------------------------------------------------- build steps


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
            _log_install_hint(cached)
            return cached
        import importlib.util

        spec = importlib.util.find_spec("horovod")
        assert spec is not None and spec.origin is not None
        return Path(spec.origin).parent

    cached = None if rebuild else cfg.cached_wheel()
    if dry_run:
        if cached:
            log(f"dry run; would install cached wheel {cached}")
            _log_install_hint(cached)
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
    _log_install_hint(wheel)
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
