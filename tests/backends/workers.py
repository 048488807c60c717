"""Worker processes for backends whose replicas are processes (PyTorch): a job the tests hand functions to.

A :class:`Job` starts ``size`` processes with the variables a launcher sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), so ``distkeras.distribute()`` in them joins one
torch.distributed job instead of starting processes itself. :meth:`Job.run` sends every rank the same
module-level function and arguments and returns every rank's result with what it printed. The
processes stay up between calls (importing torch and Keras is most of a test's time); every wait is
bounded, and a job whose rank fails or hangs is killed and started afresh on its next use.

Each worker runs ``python -m tests.backends.workers``: it reads tasks from one pipe and writes results to
another, and exits when the test process is gone.
"""

import importlib
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPES_ENV = "DISTKERAS_TEST_PIPES"
#: Seconds one call may take on every rank, start-up included, unless the caller says otherwise.
TIMEOUT = 300.0
#: Seconds the other ranks get to finish once one rank has failed (they may be waiting for it).
GRACE = 10.0


class Outcome(object):
    """One rank's answer: ``result`` (what the function returned), and its ``stdout`` and ``stderr``."""

    def __init__(self, result, stdout, stderr):
        self.result, self.stdout, self.stderr = result, stdout, stderr


class WorkerError(AssertionError):
    """A rank raised, died or timed out; the message holds its traceback or the end of its log."""


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Job(object):
    """``size`` worker processes on 127.0.0.1 (``local_size`` per simulated host, default all of them).

    Args:
        size: the number of processes (WORLD_SIZE).
        local_size: LOCAL_WORLD_SIZE; ``size // local_size`` hosts are simulated on this one.
        env: extra environment variables for every worker.
    """

    def __init__(self, size, local_size=None, env=None):
        self.size = size
        self.local_size = local_size or size
        self.logs = tempfile.mkdtemp(prefix="distkeras-workers-")
        port = str(free_port())
        self.procs, self.tasks, self.results = [], [], []
        for rank in range(size):
            task_read, task_write = os.pipe()
            result_read, result_write = os.pipe()
            worker_env = dict(os.environ, **(env or {}))
            worker_env.update(
                RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank % self.local_size),
                LOCAL_WORLD_SIZE=str(self.local_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
            )
            worker_env[PIPES_ENV] = "{},{}".format(task_read, result_write)
            with open(self._log(rank), "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.backends.workers"], cwd=ROOT, env=worker_env,
                    stdout=log, stderr=subprocess.STDOUT, pass_fds=(task_read, result_write),
                ))
            os.close(task_read)
            os.close(result_write)
            self.tasks.append(multiprocessing.connection.Connection(task_write, readable=False))
            self.results.append(multiprocessing.connection.Connection(result_read, writable=False))

    def _log(self, rank):
        return os.path.join(self.logs, "rank{}.log".format(rank))

    def log_tail(self, rank, chars=4000):
        try:
            with open(self._log(rank), errors="replace") as log:
                return log.read()[-chars:]
        except OSError:
            return ""

    @property
    def alive(self):
        return all(p.poll() is None for p in self.procs)

    def run(self, fn, *args, timeout=TIMEOUT, **kwargs):
        """Call ``fn(*args, **kwargs)`` on every rank; a list of :class:`Outcome`, by rank.

        Raises:
            WorkerError: a rank raised (its traceback), died, or the ranks took longer than ``timeout``.
        """
        task = (fn.__module__, fn.__qualname__, args, kwargs)
        for connection in self.tasks:
            connection.send(task)
        answers = [None] * self.size
        deadline = time.monotonic() + timeout
        while None in answers:
            for rank, connection in enumerate(self.results):
                if answers[rank] is None and connection.poll(0.05):
                    answers[rank] = connection.recv()
            failed = [r for r, a in enumerate(answers) if a is not None and a[0] == "error"]
            dead = [r for r, p in enumerate(self.procs) if answers[r] is None and p.poll() is not None]
            if failed and deadline > time.monotonic() + GRACE:
                deadline = time.monotonic() + GRACE
            if dead or time.monotonic() > deadline:
                self.close()
                problems = ["rank {} raised:\n{}".format(r, answers[r][1]) for r in failed]
                problems += ["rank {} died (exit code {}); its log ends:\n{}".format(
                    r, self.procs[r].returncode, self.log_tail(r)) for r in dead]
                problems += ["rank {} gave no answer within {:.0f} s; its log ends:\n{}".format(
                    r, timeout, self.log_tail(r)) for r, a in enumerate(answers) if a is None and r not in dead]
                raise WorkerError("{} on {} processes failed:\n{}".format(fn.__qualname__, self.size, "\n".join(problems)))
        failed = [r for r, a in enumerate(answers) if a[0] == "error"]
        if failed:
            raise WorkerError("\n".join("rank {} raised:\n{}".format(r, answers[r][1]) for r in failed))
        return [Outcome(*a[1:]) for a in answers]

    def close(self):
        """Ask the workers to exit; kill those that don't within a few seconds."""
        for connection in self.tasks:
            try:
                connection.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for connection in self.tasks + self.results:
            connection.close()


class _Captured(object):
    """Redirect this process' stdout and stderr (the file descriptors, so C code's output too) to files."""

    def __enter__(self):
        self.files = [tempfile.TemporaryFile() for _ in range(2)]
        self.saved = []
        for fd, stream, target in zip((1, 2), (sys.stdout, sys.stderr), self.files):
            stream.flush()
            self.saved.append(os.dup(fd))
            os.dup2(target.fileno(), fd)
        return self

    def __exit__(self, *exc):
        for fd, stream, saved in zip((1, 2), (sys.stdout, sys.stderr), self.saved):
            stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
        self.text = []
        for target in self.files:
            target.seek(0)
            self.text.append(target.read().decode(errors="replace"))
            target.close()
        return False


def _exit_with_parent():
    parent = os.getppid()

    def poll():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=poll, daemon=True).start()


def main():
    _exit_with_parent()
    task_fd, result_fd = (int(fd) for fd in os.environ[PIPES_ENV].split(","))
    tasks = multiprocessing.connection.Connection(task_fd, writable=False)
    results = multiprocessing.connection.Connection(result_fd, readable=False)
    import torch

    torch.set_num_threads(1)  # the test machine's cores are shared by every rank
    import tests.backends.harness  # noqa: F401  (the same set-up as the test process: CPU devices, Keras)

    while True:
        try:
            task = tasks.recv()
        except EOFError:
            return
        if task is None:
            return
        module, name, args, kwargs = task
        with _Captured() as captured:
            try:
                answer = ["ok", getattr(importlib.import_module(module), name)(*args, **kwargs)]
            except BaseException:
                answer = ["error", traceback.format_exc()]
        try:
            results.send(tuple(answer + captured.text))
        except Exception:  # the result doesn't pickle
            results.send(("error", traceback.format_exc()) + tuple(captured.text))


if __name__ == "__main__":
    main()
