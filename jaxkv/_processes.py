"""Several JAX processes on one machine, for the mesh tests and benchmarks:
start them (each with its own CPU devices), bounded by a timeout, and join
one ``jax.distributed`` run on localhost from inside each.

Only the standard library at import: a worker must fix its device count
(``XLA_FLAGS``) before JAX initializes a backend.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

__all__ = ["add_process_arguments", "free_port", "join_cpu_run", "run_processes"]


def free_port() -> int:
    """A TCP port free on localhost now (for the coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(command: list[str], processes: int, *, timeout: float, cwd: str | None = None,
                  env: dict | None = None) -> list[tuple[int, str, str]]:
    """Run ``python command...`` as ``processes`` processes (with
    ``--num-processes``, ``--port`` and ``--process-id`` added when there
    are several), all started together and waited for; any still running
    after ``timeout`` seconds is killed. Returns ``(returncode, stdout,
    stderr)`` per process."""
    command = [sys.executable, *command]
    if processes > 1:
        command += ["--num-processes", str(processes), "--port", str(free_port())]
    env = dict(os.environ if env is None else env, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(command + (["--process-id", str(i)] if processes > 1 else []), cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(processes)]
    outs = []
    try:
        for proc in procs:
            try:
                outs.append(proc.communicate(timeout=timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                outs.append((out, err + f"\n(killed after {timeout} s)"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outs)]


def join_cpu_run(devices: int, num_processes: int = 1, process_id: int = 0, port: int = 0) -> None:
    """In a worker, before anything touches a device: ``devices`` CPU
    devices for this process, and with ``num_processes > 1`` join the
    ``jax.distributed`` run whose coordinator is ``localhost:port`` (CPU
    collectives over gloo)."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=120)


def add_process_arguments(parser) -> None:
    """The options :func:`run_processes` passes and :func:`join_cpu_run`
    takes, on a worker's ``argparse`` parser."""
    parser.add_argument("--devices", type=int, default=1, help="CPU devices per process")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
