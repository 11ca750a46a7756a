"""tflms.tools.build_horovod's cache layout, against the install command that docs/horovod.md shows.

No real build: ``pip download`` copies a small sdist made here, the wheel build writes an empty
wheel, and the interpreter's TensorFlow and Horovod are given. The sdist's cache, its extraction
and patches, the wheels' folders and the printed command are the tool's own.
"""

import glob
import io
import re
import shutil
import tarfile
from importlib import metadata
from pathlib import Path

import pytest

from tflms.tools import build_horovod as bh
from tflms.tools import horovod_wheel
from tflms.tools.horovod_wheel import Environment

from conftest import REPO

pytestmark = pytest.mark.unit

DEFAULT_CACHE = "~/.cache/tflms/wheels"
#: The pip tag of the fake wheel: the name pip gives a Horovod wheel built here.
WHEEL = f"horovod-{bh.HOROVOD_VERSION}-cp311-cp311-linux_x86_64.whl"


def _documented_command() -> str:
    """The one ``pip install`` of a cached wheel that docs/horovod.md shows."""
    text = (REPO / "docs" / "horovod.md").read_text()
    commands = re.findall(rf"^pip install {re.escape(DEFAULT_CACHE)}/\S+$", text, flags=re.MULTILINE)
    assert len(commands) == 1, f"docs/horovod.md shows {len(commands)} `pip install {DEFAULT_CACHE}/...` commands"
    return commands[0]


def _sdist(path: Path) -> Path:
    """A horovod sdist with what the build needs: its setup.py and the text the patches edit."""
    files = {"setup.py": ""}
    for patch in bh.PATCHES:
        files[patch.path] = files.get(patch.path, "") + patch.old
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"horovod-{bh.HOROVOD_VERSION}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _fake_build(monkeypatch, tmp_path: Path, tf_version: str, gpu: bool) -> tuple[Path, list[Path]]:
    """Run ensure_horovod into the cache ``tmp_path / 'wheels'`` with the toolchain, pip and the
    interpreter faked; returns the cache and the wheels it was asked to install."""
    cache = tmp_path / "wheels"
    tmp_path.mkdir(exist_ok=True)
    sdist = _sdist(tmp_path / f"horovod-{bh.HOROVOD_VERSION}.tar.gz")
    installed: list[Path] = []
    probes = iter(
        [
            Environment(tf_version=tf_version, tf_cuda=gpu),
            Environment(tf_version=tf_version, tf_cuda=gpu, hvd_version=bh.HOROVOD_VERSION,
                        hvd_tf_version=tf_version, hvd_ok=True, hvd_nccl=gpu),
        ]
    )  # fmt: skip
    patched: list[str] = []

    def build_wheel(src, out_dir, env_extra, log_path, verbose=False):
        patched.extend(p.path for p in bh.PATCHES if p.new in (src / p.path).read_text())
        out_dir.mkdir(parents=True)
        log_path.write_text("fake build\n")
        (out_dir / WHEEL).write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip
        return out_dir / WHEEL

    monkeypatch.setattr(bh, "probe_environment", lambda: next(probes))
    monkeypatch.setattr(bh, "python_tag", lambda: "cp311")
    monkeypatch.setattr(bh, "platform_tag", lambda: "linux_x86_64")
    monkeypatch.setattr(horovod_wheel, "find_cuda", lambda: "/usr/local/cuda" if gpu else None)
    monkeypatch.setattr(bh, "check_toolchain", lambda: None)
    monkeypatch.setattr(bh, "_missing_requirements", lambda reqs: [])

    def pip_download(cmd, env=None):  # pip download -d DEST horovod==VERSION
        assert cmd[1:4] == ["-m", "pip", "download"] and cmd[-1] == f"horovod=={bh.HOROVOD_VERSION}", cmd
        shutil.copy(sdist, cmd[cmd.index("-d") + 1])

    monkeypatch.setattr(horovod_wheel, "_run", pip_download)
    monkeypatch.setattr(bh, "build_wheel", build_wheel)
    monkeypatch.setattr(bh, "install_wheel", installed.append)
    bh.ensure_horovod(cache, gpu="on" if gpu else "off", jobs=1)
    assert patched == [p.path for p in bh.PATCHES]
    return cache, installed


def test_the_documented_pip_install_finds_the_cached_wheel(monkeypatch, tmp_path, capsys):
    """The wheel lies one folder down, in its configuration's folder. The command docs/horovod.md
    shows, its cache folder replaced by a temporary one, matches exactly the wheel of the installed
    TensorFlow's version, beside the sdist folder and another TensorFlow version's wheel; and the
    tool ends by printing the ``pip install`` command of the wheel it installed."""
    tf_version = metadata.version("tensorflow")
    _fake_build(monkeypatch, tmp_path / "older", "2.20.0", gpu=False)
    cache, installed = _fake_build(monkeypatch, tmp_path, tf_version, gpu=False)
    (older,) = (tmp_path / "older" / "wheels").glob("*/*.whl")
    older.parent.rename(cache / older.parent.name)  # another configuration in the same cache
    (wheel,) = installed
    assert wheel.parent.parent == cache and wheel.name == WHEEL
    assert wheel.parent.name == f"horovod-{bh.HOROVOD_VERSION}_tf-{tf_version}_cp311_linux_x86_64_cpu"
    assert sorted(p.name for p in cache.iterdir()) == sorted([wheel.parent.name, older.parent.name, "sdist"])

    command = _documented_command()
    pattern = command.removeprefix("pip install ").replace(DEFAULT_CACHE, str(cache), 1)
    assert glob.glob(pattern) == [str(wheel)], (command, sorted(cache.rglob("*")))

    printed = [line for line in capsys.readouterr().out.splitlines() if "pip install" in line]
    assert printed and printed[-1].endswith(f"pip install {wheel}"), printed


def test_a_cached_wheel_is_reused_and_its_install_command_printed(monkeypatch, tmp_path, capsys):
    """A second run finds the wheel in its folder, builds nothing and prints the same command."""
    cache, (wheel,) = _fake_build(monkeypatch, tmp_path, "2.21.0", gpu=True)
    assert wheel.parent.name.endswith("_gpu")
    capsys.readouterr()
    probes = iter([Environment(tf_version="2.21.0", tf_cuda=True)] * 2)
    monkeypatch.setattr(bh, "probe_environment", lambda: next(probes))

    def no_build(*args, **kwargs):
        raise AssertionError("built again")

    monkeypatch.setattr(bh, "build_wheel", no_build)
    assert bh.ensure_horovod(cache, gpu="on", dry_run=True) == wheel
    out = capsys.readouterr().out
    assert f"would install cached wheel {wheel}" in out and out.rstrip().endswith(f"pip install {wheel}")
