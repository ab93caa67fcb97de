"""Find and run a real `tritonserver` on a model repository.

In NGC containers `tritonserver` is on PATH with its backends in /opt/tritonserver/backends.
Elsewhere the binary bundled in the `nvidia-pytriton` wheel is used; its Python backend only finds
the stub for the running Python when the stub sits in the backend directory, so we assemble a
private backend directory (symlinks, never writes into site-packages) for each server.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.errors import DflashTrtError

HOST = "127.0.0.1"
READY_TIMEOUT_S = 180.0
STOP_GRACE_S = 15.0


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver binary and its Python backend pieces live."""

    executable: Path
    # The bundled pieces, set only for the nvidia-pytriton wheel (None: use the binary's defaults).
    python_backend: Path | None = None  # holds libtriton_python.so, triton_python_backend_utils.py
    stub: Path | None = None  # triton_python_backend_stub for the running Python
    lib_dir: Path | None = None  # the wheel's bundled shared libraries (nvidia_pytriton.libs)


def find_tritonserver(explicit: str | Path | None = None) -> TritonInstall:
    """An explicit path, else `tritonserver` on PATH, else the one in the nvidia-pytriton wheel."""
    if explicit is not None:
        exe = Path(explicit)
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            raise DflashTrtError(f"--tritonserver {exe} is not an executable file; point it at "
                                 "the tritonserver binary")
        bundled = _pytriton_install()
        if bundled is not None and exe.resolve() == bundled.executable.resolve():
            return bundled
        return TritonInstall(executable=exe)
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(executable=Path(on_path))
    bundled = _pytriton_install()
    if bundled is None:
        raise DflashTrtError("no tritonserver found: not on PATH and the nvidia-pytriton wheel is "
                             "not installed; run `pip install 'dflash-trt[triton]'` or use an NGC "
                             "Triton container")
    return bundled


def _pytriton_install() -> TritonInstall | None:
    # find_spec on the top-level package only reads its location; pytriton itself is not imported.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(
        executable=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        lib_dir=root.parent.parent / "nvidia_pytriton.libs",
    )
    if not install.executable.is_file():
        return None
    if not install.stub.is_file():
        raise DflashTrtError(f"nvidia-pytriton has no Python backend stub for Python {version}; "
                             "use Python 3.8-3.13 or a Triton container")
    return install


def make_backend_dir(install: TritonInstall, into: Path) -> Path | None:
    """Assemble `into/python/` for the bundled server; None when the binary's default is right."""
    if install.python_backend is None or install.stub is None:
        return None
    python_dir = into / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in (install.python_backend / "libtriton_python.so",
                install.python_backend / "triton_python_backend_utils.py", install.stub):
        (python_dir / src.name).symlink_to(src.resolve())
    return into


def server_env(install: TritonInstall) -> dict[str, str]:
    """The environment the Python backend stub needs to run this interpreter's venv."""
    env = dict(os.environ)
    # The stub runs the first python3 on PATH (PYTHONPATH is ignored), so the venv's bin goes first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # libtriton_python.so is reached through a symlink, so its $ORIGIN rpath no longer finds the
    # wheel's libraries; and the stub must load this interpreter's libpython, not the system one.
    lib_dirs = [sysconfig.get_config_var("LIBDIR") or ""]
    if install.lib_dir is not None:
        lib_dirs.append(str(install.lib_dir))
    lib_dirs.append(env.get("LD_LIBRARY_PATH", ""))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(d for d in lib_dirs if d)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def free_port() -> int:
    """A localhost port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class TritonServer:
    """A tritonserver on localhost for the lifetime of a `with` block (or start()/stop())."""

    model_repository: Path
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    tritonserver: str | Path | None = None
    host: str = HOST
    ready_timeout_s: float = READY_TIMEOUT_S
    log_verbose: int = 0
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _workdir: Path | None = field(default=None, init=False, repr=False)
    _final_log: str = field(default="", init=False, repr=False)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path | None:
        return self._workdir / "tritonserver.log" if self._workdir else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self, install: TritonInstall, backend_dir: Path | None) -> list[str]:
        cmd = [
            str(install.executable),
            f"--model-repository={Path(self.model_repository).resolve()}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false", "--exit-timeout-secs=5", "--exit-on-error=true", "--strict-readiness=true",
            f"--log-verbose={self.log_verbose}",
        ]
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        return cmd

    def start(self) -> TritonServer:
        """Start the server and wait until /v2/health/ready answers 200."""
        repo = Path(self.model_repository)
        if not repo.is_dir():
            raise DflashTrtError(f"model repository {repo} is not a directory; run "
                                 "`dflash-trt build RECIPE` first or pass the triton_repo dir")
        install = find_tritonserver(self.tritonserver)
        self.http_port = self.http_port or free_port()
        self.grpc_port = self.grpc_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        self._workdir = Path(tempfile.mkdtemp(prefix="dflash-trt-server-"))
        backend_dir = make_backend_dir(install, self._workdir / "backends")
        with open(self.log_path, "wb") as log:
            # A new session makes the server and its Python stubs one process group to stop.
            self._proc = subprocess.Popen(
                self.command(install, backend_dir), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=server_env(install), start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        url = f"http://{self.host}:{self.http_port}/v2/health/ready"
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise DflashTrtError(f"tritonserver exited with code {self._proc.returncode} "
                                     f"before it was ready; its log ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise DflashTrtError(f"tritonserver was not ready after {self.ready_timeout_s:.0f} s; "
                             f"its log ends:\n{self.log_tail()}")

    def is_running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def is_ready(self) -> bool:
        """True while the server answers /v2/health/ready with 200."""
        try:
            url = f"http://{self.host}:{self.http_port}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log (for error messages)."""
        text = self._final_log
        if self.log_path is not None and self.log_path.is_file():
            text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period; remove the work dir."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _stop_group(proc, grace_s)
        if self._workdir is not None:
            self._final_log = self.log_tail(400)
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    pgid = proc.pid  # start_new_session=True: the server leads its own group
    _signal_group(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(pgid, signal.SIGKILL)
        proc.wait()
    # The Python stubs may outlive the server by a moment; wait, then kill what is left.
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_members(pgid):
        _signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group, read from /proc (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members
