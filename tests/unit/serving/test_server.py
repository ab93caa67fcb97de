"""Finding tritonserver and preparing its environment (no server is started here)."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest

from dflash_trt.errors import DflashTrtError
from dflash_trt.serving.server import (
    TritonServer,
    find_tritonserver,
    free_port,
    group_members,
    make_backend_dir,
    server_env,
)

pytest.importorskip("pytriton", reason="nvidia-pytriton is not installed")


def test_bundled_server_is_found_without_path(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    install = find_tritonserver()
    assert install.executable.name == "tritonserver" and install.executable.is_file()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert install.stub.parent.name == version and install.stub.is_file()
    assert (install.python_backend / "libtriton_python.so").is_file()


def test_path_wins_over_the_bundled_server(tmp_path, monkeypatch):
    fake = tmp_path / "tritonserver"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    install = find_tritonserver()
    assert install.executable == fake and install.stub is None
    assert make_backend_dir(install, tmp_path / "b") is None  # the container's own backends


def test_explicit_path_must_be_executable(tmp_path):
    with pytest.raises(DflashTrtError, match="not an executable"):
        find_tritonserver(tmp_path / "missing")


def test_private_backend_dir_links_the_matching_stub(tmp_path):
    install = find_tritonserver(find_tritonserver().executable)
    site = Path(install.executable).resolve().parents[2]
    before = sorted(p.name for p in (site / "tritonserver" / "backends" / "python").iterdir())
    backends = make_backend_dir(install, tmp_path / "backends")
    python_dir = backends / "python"
    names = sorted(p.name for p in python_dir.iterdir())
    assert names == ["libtriton_python.so", "triton_python_backend_stub",
                     "triton_python_backend_utils.py"]
    assert (python_dir / "triton_python_backend_stub").resolve() == install.stub.resolve()
    after = sorted(p.name for p in (site / "tritonserver" / "backends" / "python").iterdir())
    assert before == after  # nothing written into site-packages


def test_server_env_puts_this_venv_first():
    install = find_tritonserver(find_tritonserver().executable)
    env = server_env(install)
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert libs[0] == sysconfig.get_config_var("LIBDIR")
    assert str(install.lib_dir) in libs


def test_start_refuses_a_missing_repository(tmp_path):
    with pytest.raises(DflashTrtError, match="not a directory"):
        TritonServer(tmp_path / "nope").start()


def test_helpers():
    assert 0 < free_port() < 65536
    assert os.getpid() in group_members(os.getpgid(0))
