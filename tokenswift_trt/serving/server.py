"""Start and stop a real `tritonserver` on the `model_repo/` repository.

Locally the binary comes from the `nvidia-pytriton` wheel, with the Python-backend stub for the
running interpreter copied into a private backend folder; on GPU nodes a `tritonserver` on PATH
(NGC container) is used with its own backends.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenswift_trt.decode.threads import usable_cpus
from tokenswift_trt.environment import child_environment

MODEL_REPO = Path(__file__).resolve().parents[2] / "model_repo"
SHARED_MEMORY = Path("/dev/shm")
STAGING_PREFIX = "tokenswift-serve-"  # + the starting process's pid: the staging folder in the temp dir
PR_SET_PDEATHSIG = 1  # prctl option: the signal a process gets when its parent exits
EXIT_TIMEOUT_S = 3  # tritonserver's wait for requests in flight on SIGTERM (journals keep their tokens)


class ServerError(RuntimeError):
    """tritonserver is missing, failed to start, or did not become ready."""


@dataclass(frozen=True)
class ServerConfig:
    engine: Path  # engine directory (or Hugging Face model directory)
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    instances: int = 1
    max_batch: int = 8  # requests an instance decodes together; 0 = one at a time
    max_queue: int = 256  # requests an instance keeps waiting for its batch; more get "server busy"
    device: str = "cpu"
    journal_dir: Path | None = None  # request journals (request_id / resume); None = no journals
    memory_budget_gib: float | None = None  # per-request cache memory cap; None = the free memory
    http_host: str | None = None  # address of tritonserver's HTTP endpoint; None = `host`
    # kernel settings (kernels/config.py) over the engine manifest's; {} = the manifest's
    kernels: dict[str, Any] = field(default_factory=dict)
    tp: int = 1  # tensor-parallel ranks of the one instance (serving/tp_serve.py)
    tp_timeout: float = 120.0  # seconds a rank waits for the others in a collective


def free_ports(count: int, host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> list[int]:
    """`count` distinct TCP ports free on `host` now, none of them in `avoid` (ports the caller has
    already promised to another endpoint: the OS may hand a port just released out again)."""
    probes: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            probe = socket.socket()
            probes.append(probe)  # held open until all are chosen, so no port is chosen twice
            probe.bind((host, 0))
            port = probe.getsockname()[1]
            if port not in avoid:
                ports.append(port)
    finally:
        for probe in probes:
            probe.close()
    return ports


def local_config(engine: Path, **settings: Any) -> ServerConfig:
    """A `ServerConfig` for `engine` on three free loopback ports (tests, the load test)."""
    http, grpc, metrics = free_ports(3)
    return ServerConfig(engine=engine, http_port=http, grpc_port=grpc, metrics_port=metrics, **settings)


def free_port(host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> int:
    """A TCP port free on `host` now and not in `avoid` (for an endpoint only this machine reaches)."""
    return free_ports(1, host, avoid)[0]


def _bundled() -> tuple[Path, Path] | None:
    """(tritonserver binary, pytriton's tritonserver folder) from the nvidia-pytriton wheel."""
    try:
        import pytriton
    except ImportError:
        return None
    root = Path(pytriton.__file__).parent / "tritonserver"
    binary = root / "bin" / "tritonserver"
    return (binary, root) if binary.is_file() else None


def _backends(root: Path, workdir: Path) -> Path:
    """A backend folder with the Python backend and the stub for this interpreter."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    target = workdir / "backends"
    shutil.copytree(root / "backends", target)
    shutil.copy2(stub, target / "python" / "triton_python_backend_stub")
    return target


def kernel_parameter(settings: dict[str, Any]) -> str:
    """Kernel settings as the model's `kernels` parameter: NAME=VALUE items joined by `;` (no quotes to
    escape in config.pbtxt; `Session` reads it back with `kernel_settings_of`)."""
    return ";".join(f"{name}={_kernel_text(value)}" for name, value in settings.items())


def _kernel_text(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def prepare_repository(config: ServerConfig, workdir: Path) -> Path:
    """Copy model_repo/ with the engine path, device and instance count filled in."""
    if not config.engine.is_dir():
        raise ServerError(
            f"engine directory {config.engine} does not exist: build one with `tokenswift-trt build`"
        )
    repo = workdir / "model_repo"
    shutil.copytree(MODEL_REPO, repo, ignore=shutil.ignore_patterns("__pycache__"))
    pbtxt = repo / "tokenswift" / "config.pbtxt"
    text = pbtxt.read_text().replace("ENGINE_DIR", str(config.engine.resolve()))
    text = re.sub(r'(key: "device" value: \{ string_value: )"[^"]*"', rf'\1"{config.device}"', text)
    text = re.sub(r"count: \d+", f"count: {config.instances}", text)
    journal = str(config.journal_dir.resolve()) if config.journal_dir else ""
    text = re.sub(r'(key: "journal_dir" value: \{ string_value: )"[^"]*"', rf'\1"{journal}"', text)
    budget = "" if config.memory_budget_gib is None else str(config.memory_budget_gib)
    text = re.sub(r'(key: "memory_budget_gib" value: \{ string_value: )"[^"]*"', rf'\1"{budget}"', text)
    settings = dict(config.kernels)
    if config.instances > 1 and "threads" not in settings:  # instances split the CPUs, not share each
        settings["threads"] = str(max(1, usable_cpus() // config.instances))
    kernels = kernel_parameter(settings)
    text = re.sub(r'(key: "kernels" value: \{ string_value: )"[^"]*"', lambda m: f'{m[1]}"{kernels}"', text)
    parameters = (
        ("tp", config.tp),
        ("tp_timeout", config.tp_timeout),
        ("python", sys.executable),
        ("max_batch", config.max_batch),
        ("max_queue", config.max_queue),
    )
    for key, value in parameters:
        text = re.sub(
            rf'(key: "{key}" value: \{{ string_value: )"[^"]*"', lambda m, v=value: f'{m[1]}"{v}"', text
        )
    pbtxt.write_text(text)
    return repo


class TritonServer:
    """A tritonserver child process; use as a context manager or call start()/stop().

    The server and its Python-backend stubs run in a process group of their own, and the stubs' shared
    memory regions carry a prefix of this server's: `stop()` ends the whole group (SIGTERM, then
    SIGKILL after a bound) and removes those regions and the staging folder, whatever state the server
    was in (a crashed tritonserver leaves its stub behind otherwise). The log is removed with the
    staging folder unless `log_path` names a place of its own.
    """

    def __init__(self, config: ServerConfig, log_path: Path | None = None) -> None:
        self.config = config
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-"))
        self.log_path = log_path or self.workdir / "tritonserver.log"
        self.keep_log = log_path is not None
        # the starting process's pid in the prefix: a later start removes the regions of one that died
        self.shm_prefix = f"tokenswift_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.config.http_host or self.config.host}:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.config.host}:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.config.host}:{self.config.metrics_port}/metrics"

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = child_environment()
        # the Python-backend stub finds its environment through the `python3` first on PATH
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        # The stub builds the CPU kernels with another command line than this interpreter does, and
        # torch keeps one build per extension name and folder: sharing the folder rebuilt the kernels
        # (about a minute) every time the other side loaded them. Each keeps its own build instead.
        if "TORCH_EXTENSIONS_DIR" not in env:
            env["TORCH_EXTENSIONS_DIR"] = str(
                Path.home() / ".cache" / "torch_extensions" / "tokenswift-triton-stub"
            )
        on_path = shutil.which("tritonserver")
        bundled = _bundled()
        if on_path:
            binary, backend_args = Path(on_path), []
        elif bundled:
            binary, root = bundled
            libs = root.parent.parent / "nvidia_pytriton.libs"
            env["LD_LIBRARY_PATH"] = f"{libs}:{env.get('LD_LIBRARY_PATH', '')}"
            backend_args = [f"--backend-directory={_backends(root, self.workdir)}"]
        else:
            raise ServerError(
                "no tritonserver found: pip install nvidia-pytriton, or run inside Triton's NGC container"
            )
        repo = prepare_repository(self.config, self.workdir)
        c = self.config
        args = [
            str(binary),
            f"--model-repository={repo}",
            *backend_args,
            f"--http-address={c.http_host or c.host}",
            f"--http-port={c.http_port}",
            f"--grpc-address={c.host}",
            f"--grpc-port={c.grpc_port}",
            f"--metrics-address={c.host}",
            f"--metrics-port={c.metrics_port}",
            "--allow-metrics=true",
            "--log-verbose=0",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        return args, env

    def start(self, timeout_s: float = 180.0) -> TritonServer:
        """Start tritonserver and wait until it is ready; on any failure everything started or staged
        is removed again before the error (which quotes the log) is raised."""
        try:
            remove_stale_leftovers()
            args, env = self.command()
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    args,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ServerError(
                        f"tritonserver exited with code {self.process.returncode}: {self._log_tail()}"
                    )
                if self.ready():
                    return self
                time.sleep(0.5)
            raise ServerError(f"tritonserver was not ready after {timeout_s:.0f}s: {self._log_tail()}")
        except BaseException:
            self.stop()
            self.cleanup()
            raise

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        # the model status table: why each model that failed to load failed
        unavailable = [
            line.split("UNAVAILABLE:", 1)[1].strip(" |") for line in lines if "UNAVAILABLE:" in line
        ]
        if unavailable:
            return "the model failed to load: " + " | ".join(unavailable)
        if any(line.startswith("Usage: tritonserver") for line in lines):
            # an argument refused: tritonserver prints its usage, then the reason on the last line
            return next((line for line in reversed(lines) if line.strip()), "(empty log)")
        errors = [line for line in lines if line.startswith("E") or "error" in line.lower()]
        return " | ".join((errors or lines)[-3:])

    def exit_code(self) -> int | None:
        """tritonserver's exit code once it has exited (None while it runs or before start)."""
        return None if self.process is None else self.process.poll()

    def log_tail(self) -> str:
        """The last lines of the log that say what went wrong (for reports of a crash)."""
        return self._log_tail()

    def kill(self) -> None:
        """SIGKILL the server (crash simulation); nothing is flushed."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)

    def stop(self, timeout_s: float = EXIT_TIMEOUT_S + 2.0) -> None:
        """End tritonserver and everything it started, and remove what it left behind.

        tritonserver gets SIGTERM and `timeout_s` to finish; a request still generating then (its stub
        does not stop mid-execute) is ended with SIGKILL, its journal holding what was committed.
        """
        if self.process is not None:
            if self.process.poll() is None:
                _signal_group(self.process.pid, signal.SIGTERM)
                try:
                    self.process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            # the stubs outlive a tritonserver that crashed or stopped late: end the whole group
            _signal_group(self.process.pid, signal.SIGKILL)
            if self.process.poll() is None:
                self.process.wait(timeout=timeout_s)
            _wait_group_gone(self.process.pid, timeout_s)
        for region in SHARED_MEMORY.glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)
        if self.keep_log:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:  # the log stays until the staging folder goes
            for staged in ("model_repo", "backends"):
                shutil.rmtree(self.workdir / staged, ignore_errors=True)

    def cleanup(self) -> None:
        """Remove the staging folder with its log (after `stop()`, once the log has been read)."""
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait (bounded) until no process of the group is left, so that its shared memory is free."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def _die_with_parent() -> None:
    """In the child before exec: tritonserver gets SIGKILL when the process that started it dies,
    even by SIGKILL, so that a killed `serve` leaves no server behind (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def remove_stale_leftovers() -> list[Path]:
    """Remove the shared memory regions and staging folders of servers whose starting process is gone
    (a `serve` killed with SIGKILL cannot remove its own); returns what was removed."""
    removed = []
    for region in SHARED_MEMORY.glob("tokenswift_*_*_*"):
        pid = region.name.split("_")[1]
        if pid.isdigit() and not _alive(int(pid)):
            region.unlink(missing_ok=True)
            removed.append(region)
    for staging in Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*-*"):
        pid = staging.name.removeprefix(STAGING_PREFIX).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
