"""`distkeras launch`: start this host's workers, watch them, stop them all when one fails.

    distkeras launch --nproc-per-node 2 train.py --epochs 3
    distkeras launch --nproc-per-node 4 --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:29500 train.py

Each worker gets the variables its backend's own engine reads: RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torch.distributed's env:// rendezvous, as torchrun sets
them), JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (jax.distributed), and TF_CONFIG
(MultiWorkerMirroredStrategy). With the CNTK backend the workers are MPI ranks, started by ``mpiexec``.
Every output line is prefixed with its rank; SIGINT/SIGTERM are forwarded to every worker; when a
worker fails, the others are stopped within ``--stop-timeout`` seconds and the launcher exits with the
failing worker's code, saying which rank died and how. It never waits on a dead job.

Part of the Python 3.6-compatible core: no framework import, standard library only.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .errors import LaunchError

#: Seconds between SIGTERM and SIGKILL when stopping the surviving workers.
DEFAULT_STOP_TIMEOUT = 30.0


def parse_address(text, option="--coordinator"):
    # type: (str, str) -> Tuple[str, int]
    """``"host:port"`` -> ``(host, port)``, with a clear error for anything else."""
    host, sep, port = (text or "").strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(
            "Expected {} HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:29500. Received: {}={!r}".format(
                option, option, text
            )
        )
    return host, int(port)


def free_port(host="127.0.0.1"):
    # type: (str) -> int
    """A TCP port nobody listens on right now, on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host, port):
    # type: (str, int) -> None
    """Raise LaunchError if ``host:port`` can't be bound (in use, or not an address of this host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise LaunchError(
                "The coordinator address {}:{} can't be used on this host ({}). Pick another port, or leave "
                "--coordinator out on a single host and distkeras picks a free one.".format(host, port, exc.strerror)
            )


def worker_env(backend, rank, world_size, local_rank, local_world_size, coordinator, tf_workers=None):
    # type: (str, int, int, int, int, str, Optional[List[str]]) -> Dict[str, str]
    """The variables worker ``rank`` needs, for every engine at once (each reads its own)."""
    host, port = parse_address(coordinator)
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_NUM_PROCESSES": str(world_size),
        "JAX_PROCESS_ID": str(rank),
        "KERAS_BACKEND": backend,
        "PYTHONUNBUFFERED": "1",
    }
    if backend == "tensorflow" and tf_workers:
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": tf_workers}, "task": {"type": "worker", "index": rank}})
    return env


class _Worker(object):
    def __init__(self, rank, process):
        self.rank = rank
        self.process = process
        self.pumps = []  # type: List[threading.Thread]


def _pump(stream, sink, prefix, lock):
    for line in iter(stream.readline, ""):
        with lock:
            sink.write(prefix + line)
            sink.flush()
    stream.close()


def _describe_exit(code):
    if code < 0:
        try:
            return "killed by {}".format(signal.Signals(-code).name)
        except ValueError:
            return "killed by signal {}".format(-code)
    return "exit code {}".format(code)


class Launcher(object):
    """Runs one host's workers to completion; see the module docstring."""

    def __init__(self, commands, envs, ranks, stop_timeout=DEFAULT_STOP_TIMEOUT, stdout=None, stderr=None):
        # type: (Sequence[List[str]], Sequence[Dict[str, str]], Sequence[int], float, object, object) -> None
        self.commands = list(commands)
        self.envs = list(envs)
        self.ranks = list(ranks)
        self.stop_timeout = stop_timeout
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.workers = []  # type: List[_Worker]
        self.lock = threading.Lock()
        self.failure = None  # type: Optional[Tuple[int, int]]
        self.interrupted_at = None  # type: Optional[float]

    def _say(self, message):
        with self.lock:
            self.stderr.write("distkeras launch: {}\n".format(message))
            self.stderr.flush()

    def start(self):
        for command, env, rank in zip(self.commands, self.envs, self.ranks):
            process = subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                universal_newlines=True,
                bufsize=1,
                start_new_session=True,  # its own process group: stopping it stops its children too
            )
            worker = _Worker(rank, process)
            prefix = "[rank {}] ".format(rank)
            for stream, sink in ((process.stdout, self.stdout), (process.stderr, self.stderr)):
                pump = threading.Thread(target=_pump, args=(stream, sink, prefix, self.lock), daemon=True)
                pump.start()
                worker.pumps.append(pump)
            self.workers.append(worker)

    def signal_all(self, signum):
        # Every worker's process group, exited workers' too: what they started may still run.
        for worker in self.workers:
            try:
                os.killpg(worker.process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def stop_all(self):
        """SIGTERM every live worker, then SIGKILL whatever is left after ``stop_timeout`` seconds."""
        self.signal_all(signal.SIGTERM)
        deadline = time.time() + self.stop_timeout
        while time.time() < deadline and any(w.process.poll() is None for w in self.workers):
            time.sleep(0.05)
        if any(w.process.poll() is None for w in self.workers):
            self._say("workers still running {:.0f} s after SIGTERM; sending SIGKILL".format(self.stop_timeout))
            self.signal_all(signal.SIGKILL)
        for worker in self.workers:
            worker.process.wait()

    def wait(self):
        # type: () -> int
        """Block until every worker has exited; return the launcher's exit code."""
        while True:
            running = False
            for worker in self.workers:
                code = worker.process.poll()
                if code is None:
                    running = True
                elif code != 0 and self.failure is None and self.interrupted_at is not None:
                    self.failure = (worker.rank, code)  # ended by the forwarded signal: let the others end too
                elif code != 0 and self.failure is None:
                    self.failure = (worker.rank, code)
                    started = time.time()
                    self._say("rank {} died ({}); stopping the other workers".format(worker.rank, _describe_exit(code)))
                    self.stop_all()
                    self._say("all workers stopped {:.1f} s after rank {} died".format(time.time() - started, worker.rank))
            if not running or (self.failure is not None and self.interrupted_at is None):
                break
            if self.interrupted_at is not None and time.time() - self.interrupted_at > self.stop_timeout:
                self._say("workers still running {:.0f} s after the signal; stopping them".format(self.stop_timeout))
                self.stop_all()
            time.sleep(0.05)
        for worker in self.workers:
            for pump in worker.pumps:
                pump.join(timeout=5)
        if self.failure is not None:
            rank, code = self.failure
            return code if code > 0 else 128 - code
        return 0

    def run(self):
        # type: () -> int
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                handlers[signum] = signal.signal(signum, lambda s, _frame: self._forward(s))
        try:
            self.start()
            return self.wait()
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            if any(w.process.poll() is None for w in self.workers):
                self.stop_all()

    def _forward(self, signum):
        self._say("got {}; forwarding it to every worker".format(signal.Signals(signum).name))
        if self.interrupted_at is None:
            self.interrupted_at = time.time()
        self.signal_all(signum)


def plan(script_args, nproc_per_node, nnodes=1, node_rank=0, coordinator=None, backend="tensorflow",
         tf_hosts=None, python=None, environ=None):
    # type: (List[str], int, int, int, Optional[str], str, Optional[List[str]], Optional[str], Optional[Dict[str, str]]) -> Tuple[List[List[str]], List[Dict[str, str]], List[int]]
    """Commands, environments and ranks for this host's workers (pure: no process is started).

    Raises:
        LaunchError: bad counts, a malformed or busy coordinator, or a multi-host TensorFlow job without
            ``tf_hosts`` (MultiWorkerMirroredStrategy needs every worker's address).
    """
    for name, value, low in (("--nproc-per-node", nproc_per_node, 1), ("--nnodes", nnodes, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise LaunchError("Expected {} >= {}. Received: {}={!r}".format(name, low, name, value))
    if not 0 <= node_rank < nnodes:
        raise LaunchError("Expected 0 <= --node-rank < --nnodes ({}). Received: --node-rank={}".format(nnodes, node_rank))
    if not script_args:
        raise LaunchError("Expected a script to run: distkeras launch --nproc-per-node N script.py [args...]")
    if coordinator is None:
        if nnodes > 1:
            raise LaunchError("A job of {} hosts needs --coordinator HOST:PORT (rank 0's host), the same on every host.".format(nnodes))
        coordinator = "127.0.0.1:{}".format(free_port())
    else:
        host, port = parse_address(coordinator)
        if node_rank == 0:
            check_port_free(host if host not in ("localhost",) else "127.0.0.1", port)
    world_size = nnodes * nproc_per_node
    tf_workers = None
    if backend == "tensorflow":
        if nnodes == 1:
            tf_workers = ["127.0.0.1:{}".format(free_port()) for _ in range(nproc_per_node)]
        elif tf_hosts and len(tf_hosts) == nnodes:
            base = parse_address(coordinator)[1] + 1
            tf_workers = ["{}:{}".format(h, base + i) for h in tf_hosts for i in range(nproc_per_node)]
        else:
            raise LaunchError(
                "TensorFlow's MultiWorkerMirroredStrategy needs every worker's address: pass --hosts with the {} "
                "hosts' addresses in node-rank order (the same on every host).".format(nnodes)
            )
    base_env = dict(os.environ if environ is None else environ)
    python = python or sys.executable
    if script_args[0] == "-m" and len(script_args) < 2:
        raise LaunchError("Expected a module name after -m: distkeras launch --nproc-per-node N -m package.module")
    command = _python_command(script_args, python)
    commands, envs, ranks = [], [], []
    for local_rank in range(nproc_per_node):
        rank = node_rank * nproc_per_node + local_rank
        env = dict(base_env)
        env.update(worker_env(backend, rank, world_size, local_rank, nproc_per_node, coordinator, tf_workers))
        commands.append(command)
        envs.append(env)
        ranks.append(rank)
    return commands, envs, ranks


def mpiexec_command(script_args, nproc, python=None):
    # type: (List[str], int, Optional[str]) -> List[str]
    """The ``mpiexec`` command line that starts ``nproc`` MPI ranks (the CNTK backend's engine)."""
    return ["mpiexec", "-n", str(nproc)] + _python_command(script_args, python or sys.executable)


def _python_command(script_args, python):
    # type: (List[str], str) -> List[str]
    """``script.py args`` and ``-m module args`` run with ``python``; anything else runs as given."""
    if script_args[0].endswith(".py") or script_args[0] == "-m":
        return [python] + list(script_args)
    return list(script_args)
