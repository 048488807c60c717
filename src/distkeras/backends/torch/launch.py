"""Self-launch: a plain ``python script.py`` that asks for N > 1 devices starts the other N-1 replicas itself.

The process becomes rank 0 and re-runs its own command line once per other device (Lightning's
subprocess launcher does the same), each child with RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE /
MASTER_ADDR=127.0.0.1 / MASTER_PORT in its environment, so the child's own call of ``distribute()``
joins the job instead of launching again. Rank 0 binds the rendezvous port (127.0.0.1 only) before the
children start, so the port can't be taken in between. A child's stdout and stderr reach rank 0 through one pipe
and come out on rank 0's stdout, each line prefixed ``[rank N] `` as ``distkeras launch`` does (:mod:`distkeras.launch.relay`).

The lifetimes are tied both ways, within bounded time:

- A child dies with its parent. On Linux the kernel kills it (``PR_SET_PDEATHSIG``, set by a small
  bootstrap that then execs the command); everywhere, ``distribute()`` in the child starts a thread
  that exits the child once its parent is gone.
- A child that fails ends the job. A watcher thread in the parent notices a non-zero exit within
  a fraction of a second, prints which rank failed with which exit code, stops the other children, and
  gives the parent :data:`GRACE` seconds to fail by itself (a collective with the dead rank fails at
  once, and ``fit()`` then raises :class:`~distkeras.LaunchError` naming the rank) before ending it.
- When the parent's script ends, it waits for its children (at most the job's timeout) and exits
  non-zero if one of them failed. A child that exits with ``EXIT_PREEMPTED`` (75) was preempted, which
  is no failure: every process of the job stops after the same step, and rank 0 exits 75 itself.

What can't be re-run — an interactive interpreter, a notebook, a program read from standard input, a test
run — gets a :class:`~distkeras.LaunchError` saying to start the job with ``distkeras launch`` or
``torchrun``. No framework import here.
"""

import atexit
import os
import socket
import subprocess
import sys
import threading
import time

from ...launch import relay
from ...errors import LaunchError
from ...launch.processes import EXIT_PREEMPTED, describe_exit, memory_hint, oom_kills, orphan_proof

#: Set in every child to its parent's pid.
PARENT_ENV = "DISTKERAS_LAUNCHED_BY"
#: Seconds the parent's main thread gets to fail by itself after a child failed, before it is ended.
GRACE = 10.0
_POLL = 0.2


def script_command(count):
    """The command line that runs this program again: interpreter, its options, script (or -m/-c) and arguments.

    Raises:
        LaunchError: the program can't be re-run (interactive, notebook, standard input, test run).
    """
    main = sys.modules.get("__main__")
    argv = list(sys.argv)
    reason = None
    # PYTEST_CURRENT_TEST is inherited by scripts a test starts: only a process running pytest counts.
    if os.environ.get("PYTEST_CURRENT_TEST") and "_pytest" in sys.modules:
        reason = "this is a test run, and re-running it would run every test once per device"
    elif not argv or argv[0] in ("", "-") or (getattr(main, "__file__", None) is None and argv[0] != "-c"):
        reason = "this program is not a script file (an interactive interpreter, a notebook or standard input)"
    if reason:
        raise LaunchError(
            "distribute() asked for {n} devices, and with PyTorch each device is a process of its own. This "
            "process can't start the other {m} by re-running itself: {reason}. Put the code in a script and run "
            "`distkeras launch --nproc-per-node {n} script.py` or `torchrun --nproc-per-node {n} script.py`.".format(
                n=count, m=count - 1, reason=reason
            )
        )
    original = list(getattr(sys, "orig_argv", None) or [])
    spec = getattr(main, "__spec__", None)
    if argv[0] != "-c" and spec is None:  # python [options] script.py args: the script by absolute path
        options = original[1 : len(original) - len(argv)] if len(original) > len(argv) else []
        return [sys.executable] + options + [os.path.abspath(main.__file__)] + argv[1:]
    if original:  # python [options] -m module args, or -c code args: exactly as typed
        return [sys.executable] + original[1:]
    return [sys.executable, "-m", spec.name] + argv[1:]


def start_workers(count, timeout):
    """Start ranks 1..count-1 by re-running this program; make this process rank 0.

    Args:
        count: the number of processes in the job, this one included.
        timeout: seconds the parent waits for its children when it exits.

    Returns:
        ``(cluster, listener, watcher)``: this process' :class:`~distkeras.Cluster` (rank 0), the socket
        already listening on the rendezvous port, and the :class:`Watcher` of the children.

    Raises:
        LaunchError: the program can't be re-run, or a child can't be started.
    """
    from ...cluster import from_env

    command = script_command(count)
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    shared = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(listener.getsockname()[1]),
        "WORLD_SIZE": str(count),
        "LOCAL_WORLD_SIZE": str(count),
    }
    children, relays = {}, []
    # This process' own output is the user's, unprefixed; each child's stdout and stderr come through one pipe (in
    # the order it wrote them, as under distkeras launch) and are written here, "[rank N] " before each line, on
    # this process' sys.stdout, shared (relay.SharedStream): a line lands between this process' lines, never inside
    # one of its print()s, which write their pieces one by one.
    console = relay.Console(relay.SharedStream.install(), shared=True)
    for rank in range(1, count):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), PYTHONUNBUFFERED="1", **shared)
        env[PARENT_ENV] = str(os.getpid())
        try:
            children[rank] = subprocess.Popen(orphan_proof(command, PARENT_ENV), env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, bufsize=0)
        except OSError as exc:
            _stop(children)
            listener.close()
            raise LaunchError("Could not start worker rank {} ({}): {}".format(rank, " ".join(command), exc))
        relays.append(relay.Relay(console, "rank {}".format(rank)))
        relays[-1].start(children[rank].stdout)
    os.environ.update(shared, RANK="0", LOCAL_RANK="0")
    watcher = Watcher(children, timeout, relays)
    watcher.start()
    atexit.register(watcher.finish)
    return from_env(), listener, watcher


def _stop(children):
    """Terminate the children still running; kill the ones that don't exit within 5 s."""
    running = [c for c in children.values() if c.poll() is None]
    for child in running:
        child.terminate()
    deadline = time.monotonic() + 5.0
    for child in running:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _describe_exit(rank, child, code, oom_kills_before=None):
    how = "was {}".format(describe_exit(code)) if code < 0 else "exited with code {}".format(code)
    hint = memory_hint(code, oom_kills_before, oom_kills() if code < 0 else None)
    return "worker rank {} (pid {}) {}{}".format(rank, child.pid, how, " " + hint if hint else "")


class Watcher(threading.Thread):
    """Watches rank 0's children: the first failure ends the job, with a message naming the rank."""

    def __init__(self, children, timeout, relays=()):
        super().__init__(name="distkeras-watcher", daemon=True)
        self.children = children
        self.timeout = timeout
        self.relays = list(relays)  # the children's output: written out before this process ends
        self._failure = None
        self._failed = threading.Event()
        self._finishing = False
        self._oom_kills = oom_kills()  # before the children's deaths: a SIGKILL is named the OOM killer's if it grew

    def run(self):
        while not self._finishing:
            codes = {rank: child.poll() for rank, child in sorted(self.children.items())}
            # A preempted child (distkeras.callbacks.BackupAndRestore) stopped after the step rank 0 stops after too.
            failed = [rank for rank, code in codes.items() if code not in (None, 0, EXIT_PREEMPTED)]
            if failed:
                self._fail(failed[0], codes[failed[0]])
                return
            if all(code in (0, EXIT_PREEMPTED) for code in codes.values()):
                return
            time.sleep(_POLL)

    def _fail(self, rank, code):
        self._failure = "{}; the job is stopped.".format(_describe_exit(rank, self.children[rank], code, self._oom_kills))
        self._failed.set()
        self._drain(1.0)  # the failed child's last words (its traceback) before the news of its failure
        sys.stderr.write("distkeras: error: {}\n".format(self._failure))
        sys.stderr.flush()
        _stop(self.children)
        time.sleep(GRACE)  # the main thread normally fails first, and the interpreter ends this thread
        if not self._finishing:
            sys.stderr.write("distkeras: error: rank 0 did not stop within {:.0f} s; ending it.\n".format(GRACE))
            self._drain(1.0)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _drain(self, timeout):
        """Wait (at most ``timeout`` seconds in all) until the children's output is written out."""
        deadline = time.monotonic() + timeout
        for each in self.relays:
            each.join(max(0.0, deadline - time.monotonic()))

    def failure(self, wait=0.0):
        """The message of a child's failure, waiting up to ``wait`` seconds for one; None if none."""
        self._failed.wait(wait)
        return self._failure

    def finish(self):
        """At rank 0's exit: wait for the children (bounded), stop stragglers, exit non-zero on a failure."""
        self._finishing = True
        deadline = time.monotonic() + self.timeout
        problems = []
        for rank, child in sorted(self.children.items()):
            try:
                code = child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                problems.append("worker rank {} (pid {}) did not finish within {:.0f} s of rank 0".format(
                    rank, child.pid, self.timeout))
                continue
            if code not in (0, EXIT_PREEMPTED):
                problems.append(_describe_exit(rank, child, code, self._oom_kills))
        _stop(self.children)
        self._drain(5.0)
        if problems and not self._failure:  # a failure the watcher saw is reported already
            sys.stderr.write("distkeras: error: {}\n".format("; ".join(problems)))
        if problems or self._failure:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


def watch_parent():
    """In a child of :func:`start_workers`: exit once the parent is gone (where the kernel doesn't do it)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or getattr(watch_parent, "started", False):
        return
    watch_parent.started = True

    def poll():
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=poll, name="distkeras-parent-watch", daemon=True).start()
