"""What ``import distkeras`` does in a worker of a multi-worker job: start the engine early, exit promptly on error.

Called by the package root at import, and again by :func:`distkeras.environments.ray.prepare_jax` once it has set
the variables the import read too early. Part of the Python 3.6-compatible core: no framework import (the
active backend's adapter imports its own).
"""

import logging
import os
import signal
import sys
import threading

from . import backends
from . import cluster as cluster_lib

logger = logging.getLogger("distkeras")


def prepare_multi_worker():
    """Applied at import: let the adapter start its engine early in a worker of a multi-worker job.

    A malformed environment or an unavailable backend is reported by distribute() instead."""
    try:
        cluster = cluster_lib.from_env()
        if cluster.is_multi_worker:
            exit_promptly_on_error()
            backends.get(backends.active_name()).prepare(cluster)
    except Exception as exc:  # import must not fail; distribute() reports it where it matters
        logger.debug("multi-worker engine not prepared at import: %s", exc)


#: Seconds a worker of a multi-worker job that raised gets to shut down before it ends itself.
EXIT_GRACE = 10.0


def exit_promptly_on_error(grace: float = EXIT_GRACE) -> None:
    """In a worker of a multi-worker job: after an uncaught exception, exit within ``grace`` seconds.

    Python runs its exit handlers after the traceback, and engines register theirs: jax.distributed's
    shutdown waits on a barrier of every process, torch's process group on its peers. A worker that failed
    while the others wait for it in a collective would then never exit, and its launcher would never see
    it fail. The traceback is printed as usual; a timer then ends the process with exit code 1 (and,
    should the interpreter hold its lock in a native call, SIGALRM ends it a little later).
    """
    previous = sys.excepthook
    if getattr(previous, "distkeras_exits", False):
        return

    def hook(kind, value, traceback):
        try:
            previous(kind, value, traceback)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            timer = threading.Timer(grace, os._exit, (1,))
            timer.daemon = True
            timer.start()
            if hasattr(signal, "alarm") and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None):
                signal.alarm(int(grace) + 5)

    hook.distkeras_exits = True  # type: ignore
    sys.excepthook = hook
