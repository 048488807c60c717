"""`distkeras launch`: start this host's workers, watch them, stop them all when one fails.

    distkeras launch --nproc-per-node 2 train.py --epochs 3
    distkeras launch --nproc-per-node 4 --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:29500 train.py

Each worker gets the variables its backend's own engine reads: RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torch.distributed's env:// rendezvous, as torchrun sets
them), JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (jax.distributed), and TF_CONFIG
(MultiWorkerMirroredStrategy). With the CNTK backend the workers are MPI ranks, started by ``mpiexec``.
With the MXNet backend the launchers also start MXNet's parameter-server processes (:mod:`distkeras.backends.mxnet.launch`): node 0
a scheduler, every node one server, all of them and the workers described by the ``DMLC_*`` variables.
Every output line is prefixed with its rank (a worker's stdout and stderr, in the order it wrote them, on the
launcher's stdout; progress bars in place on a terminal, collapsed elsewhere: :mod:`distkeras.launch.relay`), ``--ranks``
picks the ranks the console shows and ``--log-dir`` keeps each one's output in a file; SIGINT/SIGTERM are forwarded to every worker; when a
worker fails, the others are stopped within ``--stop-timeout`` seconds and the launcher exits with the
failing worker's code, saying which rank (or which scheduler or server) died and how. It never waits on a
dead job. A worker that exits with :data:`EXIT_PREEMPTED` (75) was preempted, not crashed: the others stop
after the same step (``distkeras.callbacks.BackupAndRestore``), so they get ``--stop-timeout`` seconds to
exit on their own, and the launcher exits 75 too.

Part of the Python 3.6-compatible core: no framework import, standard library only.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .. import backends
from . import processes, relay
from ..backends.base import LaunchJob
from ..errors import LaunchError
from .network import INTERFACE_ENV, free_port, parse_address  # noqa: F401 (part of this module's API)
from .processes import EXIT_PREEMPTED, LAUNCHER_ENV, orphan_proof, python_command  # noqa: F401 (part of this module's API)

#: How a launcher names a preempted worker, to the user and to the other hosts' launchers.
_PREEMPTED = "was preempted (exit code {})".format(EXIT_PREEMPTED)
#: Seconds between SIGTERM and SIGKILL when stopping the surviving workers.
DEFAULT_STOP_TIMEOUT = 20.0
STOP_TIMEOUT_ENV = "DISTKERAS_STOP_TIMEOUT"


def check_port_free(host: str, port: int, coordinator_port: Optional[int] = None) -> None:
    """Raise LaunchError if ``host:port`` can't be bound (in use, or not an address of this host).

    The error says which of the job's ports it is: ``--coordinator``'s PORT (on one host the engine's rendezvous
    itself, across hosts where the launchers meet) or, across hosts, one of the engine's ports after it (PORT+1:
    torch.distributed's store and jax.distributed's service; PORT+1 .. PORT+N: TensorFlow's workers). Given
    ``coordinator_port`` (the PORT of ``--coordinator``), it names the one; without it, it lists both."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the engines bind theirs: connections of an earlier job still in TIME_WAIT don't count, a listener does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            engines = ("PORT+1 for the engine's rendezvous (torch.distributed's store, jax.distributed's service; "
                       "TensorFlow's workers take PORT+1 .. PORT+N)")
            if coordinator_port is None:
                which = ("Port {} on this host ({}) can't be used ({}). distkeras launch binds --coordinator's PORT on "
                         "node rank 0's host (on one host the engine's rendezvous itself; across hosts where the "
                         "launchers meet) and, across hosts, the ports after it: {}.".format(
                             port, host, exc.strerror, engines))
            elif port == coordinator_port:
                which = ("Port {} on this host ({}), --coordinator's PORT (where the launchers meet; on one host the "
                         "engine's rendezvous), can't be used ({}).".format(port, host, exc.strerror))
            else:
                which = ("Port {} on this host ({}), PORT+{} after --coordinator's PORT {} (the launchers' own), "
                         "can't be used ({}): across hosts the engines use the ports after the launchers' PORT, "
                         "{}.".format(port, host, port - coordinator_port, coordinator_port, exc.strerror, engines))
            raise LaunchError(
                "{} Free it (`ss -ltnp 'sport = :{}'` shows who holds it), or pass --coordinator HOST:PORT with a "
                "PORT whose next ports are free too; on a single host, leave --coordinator out and distkeras picks "
                "a free one.".format(which, port)
            )


def worker_env(backend: str,
               rank: int,
               world_size: int,
               local_rank: int,
               local_world_size: int,
               coordinator: str) -> Dict[str, str]:
    """The variables every worker gets, whatever its backend: torch.distributed's and jax.distributed's (each engine
    reads its own; a backend adds what only its engine reads, :meth:`~distkeras.backends.base.Adapter.workers_env`)."""
    host, port = parse_address(coordinator)
    return {
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


#: Seconds the parameter-server processes get to exit on their own once every worker has exited.
ROLE_EXIT_GRACE = 10.0


class _Worker(object):
    def __init__(self, rank, process, label):
        self.rank = rank  # None for a process of the job that is no worker (MXNet's scheduler and servers)
        self.process = process
        self.label = label
        self.ended_at: Optional[float] = None
        self.relay: Optional[relay.Relay] = None


#: The cgroup's out-of-memory kills when this module was imported (before any worker starts): a worker's SIGKILL
#: is named the OOM killer's where the count grew since (:func:`distkeras.launch.processes.memory_hint`).
_OOM_KILLS_AT_START = processes.oom_kills()


def _describe_exit(code):
    return processes.describe_exit(code)


class Launcher(object):
    """Runs one host's workers to completion; see the module docstring."""

    def __init__(self, commands: Sequence[List[str]], envs: Sequence[Dict[str, str]], ranks: Sequence[int], stop_timeout: float = DEFAULT_STOP_TIMEOUT, stdout: object = None, stderr: object = None,
                 supervisor: object = None, roles: Sequence[Tuple[List[str], Dict[str, str], str]] = (),
                 log_dir: Optional[str] = None, show: Optional[Sequence[int]] = None) -> None:
        """``roles``: ``(command, env, label)`` of processes that serve the workers (MXNet's scheduler and
        servers): started first; while any worker runs, one that fails fails the job, and so does one that
        exited with code 0 ``stop_timeout`` seconds before; after the workers they get :data:`ROLE_EXIT_GRACE`
        seconds to end on their own.

        ``log_dir``: every process' whole output also goes to ``log_dir/rank<N>.log`` (``scheduler.log``,
        ``server<N>.log``), collapsed as on a pipe, the folder made if missing. ``show``: the ranks whose output the
        console shows (default all; a process of no numbered rank always shows): the last lines of one not shown are
        shown when it fails."""
        self.commands = [r[0] for r in roles] + list(commands)
        self.envs = [r[1] for r in roles] + list(envs)
        self.ranks: List[Optional[int]] = [None] * len(roles) + list(ranks)
        self.labels = [r[2] for r in roles] + ["rank {}".format(rank) for rank in ranks]
        self.stop_timeout = stop_timeout
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.console = relay.Console(self.stdout)
        self.log_dir = log_dir
        self.show = None if show is None else set(show)
        self.workers: List[_Worker] = []
        self.failure: Optional[Tuple[int, int]] = None
        self.interrupted_at: Optional[float] = None
        self.supervisor = supervisor  # a rendezvous.Supervisor across hosts: the other hosts' news

    def _say(self, message):
        self.console.message(self.stderr, "distkeras launch: {}\n".format(message))

    def start(self):
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
        logs = [None] * len(self.commands)
        if self.log_dir is not None:  # every log made before any worker starts: a bad one loses nothing
            logs = [open_log(os.path.join(self.log_dir, "rank{}.log".format(rank) if rank is not None else
                                          "{}.log".format(label.replace(" ", ""))))
                    for rank, label in zip(self.ranks, self.labels)]
        for command, env, rank, label, log in zip(self.commands, self.envs, self.ranks, self.labels, logs):
            # One pipe for the worker's stdout and stderr: it keeps their order as the worker wrote them (with
            # two pipes, two readers race, and a traceback lands before the lines printed ahead of it). Not a pty:
            # the worker sees a pipe, as it always has (libraries don't switch to terminal output, no line
            # discipline turns "\n" into "\r\n"), and the relay shows it as a terminal needs (relay.Console).
            # The cost: a worker's stderr comes out on the launcher's stdout; the launcher's own words stay on stderr.
            process = subprocess.Popen(
                orphan_proof(command, LAUNCHER_ENV) if LAUNCHER_ENV in env else command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                bufsize=0,  # chunks as they come (relay.Relay reads them)
                start_new_session=True,  # its own process group: stopping it stops its children too
            )
            worker = _Worker(rank, process, label)
            shown = self.show is None or not isinstance(rank, int) or rank in self.show
            worker.relay = relay.Relay(self.console, label, shown=shown, log=log)
            worker.relay.start(process.stdout)
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

    def wait(self) -> int:
        """Block until every worker has exited (and, across hosts, every host's); return the exit code."""
        while True:
            running = False
            workers_running = any(w.rank is not None and w.process.poll() is None for w in self.workers)
            for worker in self.workers:
                code = worker.process.poll()
                if code is None:
                    running = running or worker.rank is not None
                elif self.failure is not None:
                    pass
                elif worker.rank is None and workers_running and code == 0 and self.interrupted_at is None:
                    # A server ends once every worker has said goodbye, a moment before the workers end:
                    # only workers still running long after that are a job its servers left.
                    worker.ended_at = worker.ended_at or time.time()
                    if time.time() - worker.ended_at > self.stop_timeout:
                        self._fail(worker, 1, "exited (exit code 0) {:.0f} s ago and the workers are still "
                                              "running".format(self.stop_timeout))
                elif code != 0 and (worker.rank is not None or workers_running) and self.interrupted_at is not None:
                    self.failure = (worker.rank, code)  # ended by the forwarded signal: let the others end too
                    if self.supervisor is not None:
                        self.supervisor.failed(worker.label, _PREEMPTED if code == EXIT_PREEMPTED else
                                               "died ({})".format(_describe_exit(code)))
                elif code == EXIT_PREEMPTED and worker.rank is not None:
                    self._preempted(worker)
                elif code != 0 and (worker.rank is not None or workers_running):
                    self._fail(worker, code, "died ({})".format(_describe_exit(code)))
            if self.failure is None and self.supervisor is not None:
                verdict = self.supervisor.poll() if running else self.supervisor.finish()
                if verdict is not None:
                    self._remote_failure(verdict)
            if not running or (self.failure is not None and self.interrupted_at is None):
                break
            if self.interrupted_at is not None and time.time() - self.interrupted_at > self.stop_timeout:
                self._say("workers still running {:.0f} s after the signal; stopping them".format(self.stop_timeout))
                self.stop_all()
            time.sleep(0.05)
        self._end_roles()
        for worker in self.workers:
            worker.relay.join(timeout=5)
        if self.failure is not None:
            rank, code = self.failure
            if code == EXIT_PREEMPTED:
                self._say("job preempted: exiting with status {}; run the same command again to resume from its "
                          "checkpoint".format(EXIT_PREEMPTED))
            return code if code > 0 else 128 - code
        return 0

    def _preempted(self, worker):
        """A worker stopped after a SIGTERM, its job's checkpoint written: the others stop after the same step."""
        self.failure = (worker.rank, EXIT_PREEMPTED)
        if self.supervisor is not None:
            self.supervisor.failed(worker.label, _PREEMPTED)
        self._say("{} {}; the other workers stop after the same step".format(worker.label, _PREEMPTED))
        if self.interrupted_at is None:
            self.interrupted_at = time.time()  # as after a forwarded signal: --stop-timeout seconds to exit

    def _fail(self, worker, code, how):
        self.failure = (worker.rank, code)
        if self.supervisor is not None:
            self.supervisor.failed(worker.label, how)
        started = time.time()
        self._say("{} {}; stopping the other workers".format(worker.label, how))
        hint = processes.memory_hint(code, _OOM_KILLS_AT_START,
                                     processes.oom_kills() if code == -signal.SIGKILL else None)
        if hint:
            self._say("{} died {}".format(worker.label, hint))
        self._show_tail(worker)
        self.stop_all()
        self._say("all workers stopped {:.1f} s after {} {}".format(time.time() - started, worker.label, how.split(" (")[0]))

    def _show_tail(self, worker):
        """A failed worker whose output --ranks hides: its last lines (a traceback, most often), now."""
        if worker.relay is None or worker.relay.shown:
            return
        worker.relay.join(timeout=1.0)  # its last words may still be in the pipe
        lines = list(worker.relay.tail)
        where = " (all of it in {})".format(os.path.join(self.log_dir, "rank{}.log".format(worker.rank))) \
            if self.log_dir is not None else ""
        self._say("{}'s output isn't shown (--ranks); its last {} line(s){}:".format(worker.label, len(lines), where))
        self.console.lines(worker.relay.key, worker.relay.prefix, lines)

    def _end_roles(self):
        """Once the workers are done: give the parameter-server processes time to end, then stop them."""
        deadline = time.time() + ROLE_EXIT_GRACE
        while time.time() < deadline and any(w.process.poll() is None for w in self.workers):
            time.sleep(0.05)
        left = [w.label for w in self.workers if w.process.poll() is None]
        if left:
            self._say("{} still running {:.0f} s after the workers; stopping them".format(", ".join(left), ROLE_EXIT_GRACE))
            self.stop_all()

    def _remote_failure(self, verdict):
        """Another host failed or was lost: stop this host's workers, exit 1 naming what happened. A worker of
        another host that was preempted is no failure: this host's workers stop after the same step on their
        own (they agree on it), so they get ``--stop-timeout`` seconds, and the launcher exits 75 too."""
        if _PREEMPTED in verdict:
            self.failure = (None, EXIT_PREEMPTED)
            self._say("{}; this host's workers stop after the same step".format(verdict))
            if self.interrupted_at is None:
                self.interrupted_at = time.time()
            return
        self.failure = (None, 1)
        started = time.time()
        self._say("{}; stopping this host's workers".format(verdict))
        if any(w.process.poll() is None for w in self.workers):
            self.stop_all()
            self._say("this host's workers stopped {:.1f} s later".format(time.time() - started))

    def run(self) -> int:
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


def plan(script_args: List[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, coordinator: Optional[str] = None, backend: str = "tensorflow",
         tf_hosts: Optional[List[str]] = None, python: Optional[str] = None, environ: Optional[Dict[str, str]] = None, addresses: Optional[List[str]] = None, interface: Optional[str] = None) -> Tuple[List[List[str]], List[Dict[str, str]], List[int]]:
    """Commands, environments and ranks for this host's workers (pure: no process is started).

    On one host the engine's rendezvous is ``coordinator`` (default: 127.0.0.1 and a free port). Across
    hosts ``coordinator`` is where the launchers meet (:mod:`distkeras.launch.rendezvous`), and the engines use the
    ports after it: torch.distributed's store and jax.distributed's service PORT+1, TensorFlow's workers
    PORT+1 .. PORT+nproc_per_node on every host, at each host's address in ``addresses``.

    Args:
        addresses: across hosts, every host's address by node rank (the rendezvous' plan); default
            ``tf_hosts``.
        interface: the interface (or address) the engines use, passed on as DISTKERAS_INTERFACE.

    Raises:
        LaunchError: bad counts, a malformed coordinator, or a multi-host job without the hosts' addresses.
    """
    check_counts(script_args, nproc_per_node, nnodes, node_rank)
    if coordinator is None:
        if nnodes > 1:
            raise LaunchError("A job of {} hosts needs --coordinator HOST:PORT (rank 0's host), the same on every host.".format(nnodes))
        engine = "127.0.0.1:{}".format(free_port())
    else:
        host, port = parse_address(coordinator)
        engine = coordinator if nnodes == 1 else "{}:{}".format(host, engine_port(port))
    addresses = addresses or tf_hosts
    if nnodes > 1 and (not addresses or len(addresses) != nnodes):
        raise LaunchError(
            "A job of {} hosts needs every host's address in node-rank order (the launchers exchange them; "
            "or pass --hosts with {} addresses, the same on every host). Received: {!r}".format(nnodes, nnodes, addresses)
        )
    world_size = nnodes * nproc_per_node
    base_env = dict(os.environ if environ is None else environ)
    if interface and not base_env.get(INTERFACE_ENV):
        base_env[INTERFACE_ENV] = interface
    job = LaunchJob(nproc_per_node, nnodes, node_rank, engine, addresses if nnodes > 1 else None)
    own = backends.adapter_class(backend).workers_env(job, base_env)
    python = python or sys.executable
    command = python_command(script_args, python)
    commands, envs, ranks = [], [], []
    for local_rank in range(nproc_per_node):
        rank = node_rank * nproc_per_node + local_rank
        env = dict(base_env)
        env.update(worker_env(backend, rank, world_size, local_rank, nproc_per_node, engine))
        env.update(own[local_rank])
        env[LAUNCHER_ENV] = str(os.getpid())
        commands.append(command)
        envs.append(env)
        ranks.append(rank)
    return commands, envs, ranks


def check_counts(script_args: List[str], nproc_per_node: int, nnodes: int, node_rank: int) -> None:
    """Raise LaunchError for counts or a script ``distkeras launch`` can't run."""
    for name, value, low in (("--nproc-per-node", nproc_per_node, 1), ("--nnodes", nnodes, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise LaunchError("Expected {} >= {}. Received: {}={!r}".format(name, low, name, value))
    if not 0 <= node_rank < nnodes:
        raise LaunchError("Expected 0 <= --node-rank < --nnodes ({}). Received: --node-rank={}".format(nnodes, node_rank))
    if not script_args:
        raise LaunchError("Expected a script to run: distkeras launch --nproc-per-node N script.py [args...]")
    if script_args[0] == "-m" and len(script_args) < 2:
        raise LaunchError("Expected a module name after -m: distkeras launch --nproc-per-node N -m package.module")
    command = script_args[0]
    if command != "-m" and not command.endswith(".py") and shutil.which(command) is None:
        # Checked before any worker starts: else every worker dies of a bare FileNotFoundError.
        if os.path.isfile(command) and os.access(command, os.X_OK):  # "prog" in this folder: exec searches PATH
            raise LaunchError(
                "Expected a command distkeras launch can run. Received: {!r}, which is not on PATH; a program of that "
                "name is in this folder: run it as ./{}.".format(command, command))
        if os.path.isfile(command):
            raise LaunchError(
                "Expected a command distkeras launch can run. Received: {!r}, a file that is not executable. Make it "
                "executable (chmod +x {}), or name its interpreter first (distkeras launch ... python {}).".format(
                    command, command, command))
        raise LaunchError(
            "Expected a command distkeras launch can run: a script ending in .py, -m package.module, or a program. "
            "Received: {!r}, which is neither a program on PATH nor a file (in {}). Check its spelling, give its "
            "full path, or add its folder to PATH.".format(command, os.getcwd()))


def check_script(script_args: List[str]) -> None:
    """Raise LaunchError where the script to run (``train.py``) is no file here: refused before any worker starts,
    rather than every worker failing with Python's "can't open file" and the job ending on the first.

    Not part of :func:`plan`, which reads nothing of this host but PATH."""
    command = script_args[0] if script_args else ""
    if command.endswith(".py") and not os.path.isfile(command):
        raise LaunchError(
            "Can't find the script {!r} in {}, so no worker was started. Give its path (relative to the folder "
            "distkeras launch runs in), or -m for a module.".format(command, os.getcwd()))


def parse_ranks(text: Optional[str], world_size: int) -> Optional[List[int]]:
    """``--ranks``: the comma-separated ranks whose output the console shows; None (every rank) for None.

    Examples:
        >>> parse_ranks("0,2", 4)
        [0, 2]

    Raises:
        LaunchError: something other than ranks of the job (0 .. world_size-1).
    """
    if text is None:
        return None
    ranks = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) >= world_size:
            raise LaunchError("Expected --ranks to list ranks of the job, comma-separated, each 0..{} (--nnodes x "
                              "--nproc-per-node = {} workers). Received: --ranks={}".format(
                                  world_size - 1, world_size, text))
        ranks.append(int(item))
    return sorted(set(ranks))


def engine_port(port: int) -> int:
    """Across hosts: the port of the engine's rendezvous, after the launchers' own."""
    return port + 1


def from_scheduler(nnodes: Optional[int] = None,
                   node_rank: Optional[int] = None,
                   coordinator: Optional[str] = None,
                   environ: Optional[Dict[str, str]] = None) -> Tuple[int, int, Optional[str]]:
    """``--nnodes``, ``--node-rank`` and ``--coordinator``, those not given taken from the scheduler.

    Inside a Slurm step (``srun --ntasks-per-node=1 distkeras launch --nproc-per-node N ...``) every task is
    one node's launcher: the step's tasks are the nodes, ``SLURM_PROCID`` the node rank and the step's first
    node the coordinator (:func:`distkeras.environments.slurm.launch_arguments`). Elsewhere: one node, rank 0,
    no coordinator.

    Raises:
        ClusterError: a Slurm step with several tasks on a node, or Slurm variables that disagree.
    """
    from ..environments import slurm

    if nnodes is not None and node_rank is not None and coordinator is not None:
        return nnodes, node_rank, coordinator  # all given: Slurm's variables aren't even read
    taken = slurm.launch_arguments(os.environ if environ is None else environ)
    return (nnodes if nnodes is not None else int(taken.get("nnodes", 1)),  # type: ignore
            node_rank if node_rank is not None else int(taken.get("node_rank", 0)),  # type: ignore
            coordinator if coordinator is not None else taken.get("coordinator"))  # type: ignore


def run_job(script_args: List[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, coordinator: Optional[str] = None, backend: str = "tensorflow",
            hosts: Optional[List[str]] = None, interface: Optional[str] = None, stop_timeout: Optional[float] = None, join_timeout: Optional[float] = None, peer_timeout: Optional[float] = None, environ: Optional[Dict[str, str]] = None,
            token_file: Optional[str] = None, log_dir: Optional[str] = None, ranks: Optional[str] = None) -> int:
    """``distkeras launch``: on one host, start and watch the workers; across hosts, meet the other hosts'
    launchers first (:mod:`distkeras.launch.rendezvous`), then start this host's workers and watch the whole job.

    Everything that can be checked before a worker starts is: the counts, the coordinator (an address of
    node 0's host with free ports; reachable from the others), the interface, ``--hosts`` (one address of
    this host at this node's rank, the same list everywhere), and that every host agrees.

    Across hosts the launchers authenticate each other with the job's secret (``token_file``, else
    DISTKERAS_TOKEN_FILE / DISTKERAS_TOKEN: :func:`distkeras.launch.rendezvous.secret`); the workers don't get it.

    ``log_dir`` and ``ranks`` (``"0,2"``: the ranks the console shows, :func:`parse_ranks`) are
    :class:`Launcher`'s ``log_dir`` and ``show``.

    Returns:
        The exit code: 0, a failed worker's code, or 1 when another host failed or was lost.
    """
    from . import network, rendezvous

    env = dict(os.environ if environ is None else environ)
    check_counts(script_args, nproc_per_node, nnodes, node_rank)
    adapter = backends.adapter_class(backend)
    stop_timeout = _seconds(stop_timeout, STOP_TIMEOUT_ENV, DEFAULT_STOP_TIMEOUT, "--stop-timeout", env)
    output = {"log_dir": log_dir, "show": parse_ranks(ranks, nnodes * nproc_per_node)}
    secret_given = {variable: env.pop(variable) for variable in (rendezvous.TOKEN_ENV, rendezvous.TOKEN_FILE_ENV)
                    if variable in env}  # the launchers' secret, never the workers', one host or many
    if nnodes == 1:
        if coordinator is not None:
            host, port = parse_address(coordinator)
            check_port_free(_local_host(host), port, coordinator_port=port)
        commands, envs, ranks = plan(script_args, nproc_per_node, 1, 0, coordinator, backend, environ=env)
        engine = "{}:{}".format(envs[0]["MASTER_ADDR"], envs[0]["MASTER_PORT"])
        roles = adapter.launch_roles(LaunchJob(nproc_per_node, 1, 0, engine, None), env)
        return Launcher(commands, envs, ranks, stop_timeout=stop_timeout, roles=roles, **output).run()
    key = rendezvous.secret(token_file, secret_given)
    join_timeout = _seconds(join_timeout, rendezvous.JOIN_TIMEOUT_ENV, rendezvous.DEFAULT_JOIN_TIMEOUT, "--join-timeout", env)
    peer_timeout = _seconds(peer_timeout, rendezvous.PEER_TIMEOUT_ENV, rendezvous.DEFAULT_PEER_TIMEOUT, "--peer-timeout", env)
    if coordinator is None:
        raise LaunchError("A job of {} hosts needs --coordinator HOST:PORT (node rank 0's host), the same on every "
                          "host.".format(nnodes))
    host, port = parse_address(coordinator)
    if hosts is not None and len(hosts) != nnodes:
        raise LaunchError("Expected --hosts to list the {} hosts' addresses in node-rank order. Received: --hosts={} "
                          "({} address(es))".format(nnodes, ",".join(hosts), len(hosts)))
    route = network.choose(host, override=interface, environ=env)
    known = network.interfaces()
    if hosts is not None and not _is_local(hosts[node_rank], known):
        raise LaunchError(
            "--hosts names {!r} for node rank {} (this host), and that is not an address of this host, which has: "
            "{}. List the hosts in node-rank order, the same on every host.".format(
                hosts[node_rank], node_rank, network.listing(known)))
    address = hosts[node_rank] if hosts is not None else route.address
    me = rendezvous.hello(node_rank, nnodes, nproc_per_node, backend, hosts, address)
    if key is None:
        rendezvous.warn_unauthenticated(coordinator, host, _say_stderr)
    if node_rank == 0:
        if not _is_local(host, known):
            raise LaunchError(
                "Node rank 0 runs the coordinator, and --coordinator {} is not an address of this host, which has: "
                "{}. Start node rank 0 on {}, or give --coordinator one of this host's addresses.".format(
                    coordinator, network.listing(known), host))
        listener = _listen(host, port)
        try:
            engine_ports = [engine_port(port) + i for i in range(adapter.engine_ports(nproc_per_node))]
            for engine in engine_ports:
                check_port_free(_local_host(host), engine, coordinator_port=port)
            supervisor = rendezvous.gather(listener, me, join_timeout, peer_timeout, key=key)
        finally:
            listener.close()
    else:
        supervisor = rendezvous.join(coordinator, me, join_timeout, peer_timeout, key=key)
    env[rendezvous.PEER_TIMEOUT_ENV] = "{:g}".format(peer_timeout)  # the engines' own failure detectors too
    _say_stderr("node rank {} of {}: {} on {} ({}); hosts {}".format(
        node_rank, nnodes, "ranks {}-{}".format(node_rank * nproc_per_node, (node_rank + 1) * nproc_per_node - 1)
        if nproc_per_node > 1 else "rank {}".format(node_rank), network.describe_route(route), route.chosen_by,
        ", ".join(supervisor.plan["addresses"])))
    try:
        addresses = list(supervisor.plan["addresses"])
        commands, envs, ranks = plan(script_args, nproc_per_node, nnodes, node_rank, coordinator, backend,
                                     environ=env, addresses=addresses, interface=route.interface or route.address)
        job = LaunchJob(nproc_per_node, nnodes, node_rank, "{}:{}".format(host, engine_port(port)), addresses)
        roles = adapter.launch_roles(job, env)
        return Launcher(commands, envs, ranks, stop_timeout=stop_timeout, supervisor=supervisor, roles=roles,
                        **output).run()
    finally:
        supervisor.close()


def open_log(path):
    """A new log file at ``path`` for writing text: what a previous run left there (a file, or a link someone
    planted, pointing anywhere) is removed first, never followed or written through; the file is then made with
    O_CREAT | O_EXCL | O_NOFOLLOW, so nothing put there in between is followed either.

    Raises:
        LaunchError: the file can't be made (a folder of that name, no permission, a file put there in between).
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise LaunchError("Can't replace the log file {} ({}): --log-dir must be a folder this user can write, with "
                          "no folder named like a log in it.".format(path, exc.strerror or exc))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        raise LaunchError("Can't make the log file {} ({}): something else made it at the same moment, or the "
                          "folder isn't writable. Give --log-dir a folder this user alone writes.".format(
                              path, exc.strerror or exc))
    return os.fdopen(fd, "w", encoding="utf-8", errors="replace")


def _seconds(value, variable, default, option, env):
    if value is None:
        text = env.get(variable, "").strip()
        if not text:
            return default
        try:
            value = float(text)
        except ValueError:
            raise LaunchError("Expected seconds (a number > 0) in {}. Received: {}={!r}".format(variable, variable, text))
        option = variable
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise LaunchError("Expected {} to be a number of seconds > 0. Received: {!r}".format(option, value))
    return float(value)


def _local_host(host):
    return "127.0.0.1" if host == "localhost" else host


def _is_local(host, known):
    """Whether ``host`` (an address or a name) is one of this host's addresses."""
    mine = {a for addresses in known.values() for a in addresses}
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(resolved & mine)


def _listen(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((_local_host(host), port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise LaunchError(
            "The coordinator address {}:{} can't be used on this host ({}). Pick another port, free this one, or "
            "give --coordinator an address of this host.".format(host, port, exc.strerror))
    return sock


def _say_stderr(message):
    sys.stderr.write("distkeras launch: {}\n".format(message))
    sys.stderr.flush()
