"""Agreements between the processes of a job, each bounded in time, over the engine's own key-value store.

Two things every backend needs across processes, written once; each backend brings only its store (a
:class:`Board`: torch's rendezvous ``TCPStore``, ``jax.distributed``'s key-value store, TensorFlow's coordination
service), made current by its ``distribute()`` with :func:`use`:

- **A save is complete when it returns, on every rank** (:func:`saving`). Rank 0 writes the file and posts its
  outcome; every other rank, after its throwaway copy, waits for that post before it returns. So
  ``model.save(p)`` followed by ``keras.saving.load_model(p)`` works on every rank, and a failed write raises on
  every rank. Rank 0 waits for nobody: ``if rank == 0: model.save(p)`` (the Horovod habit) still works. Saves
  pair by their order: a rank's n-th save pairs with rank 0's n-th save. Where both name the same file the rank
  waits for rank 0's; where they name different ones (each rank's own path, as TensorFlow's multi-worker
  tutorial writes non-chief workers' copies) it returns as soon as rank 0's n-th save is through. Saves made on
  rank 0 alone before saves made on every rank shift the pairs: those then return without waiting.
- **A collective call is made by every rank, or fails within seconds** (:func:`join`). ``predict()`` and
  ``evaluate()`` split their batches over the processes: a rank that calls one alone would wait in its first
  collective until the engine's timeout (30 minutes). Before such a call every rank posts which call it makes
  and waits until every rank has; after :func:`join_timeout` seconds the first rank that gives up posts that, and
  every rank (a late one too) raises :class:`~distkeras.errors.CollectiveError` naming the call and the ranks.
  The decision is one entry written once (first writer wins), so all ranks agree on it.

No framework import here; Python 3.6 syntax.
"""

import hashlib
import itertools
import os
import threading
import time

from ..errors import CollectiveError

JOIN_TIMEOUT_ENV = "DISTKERAS_JOIN_TIMEOUT"
#: Seconds every rank has to reach a predict()/evaluate() that one rank has started.
DEFAULT_JOIN_TIMEOUT = 60.0
SAVE_TIMEOUT_ENV = "DISTKERAS_SAVE_TIMEOUT"
#: Seconds a rank other than 0 waits for rank 0 to finish writing a file it saves too.
DEFAULT_SAVE_TIMEOUT = 600.0
#: Seconds between two looks at the board while waiting.
POLL = 0.02


class Board(object):
    """A job-wide key-value store of string entries, each written once.

    Args:
        post: ``post(key, value)`` writes ``value`` at ``key`` unless an entry is there, and returns the entry
            that stands (the first writer's).
        read: ``read(key)`` returns the entry at ``key``, or None at once where there is none.
        rank: this process' rank.
        world: the number of processes.
        counters: ``(calls, saves)``: this process' counts of agreed calls and of saves (``itertools.count``
            objects). Default: the process' own, kept across boards, since a job's store keeps its entries across
            distribute() calls.
    """

    def __init__(self, post, read, rank, world, counters=None):
        self.post, self.read, self.rank, self.world = post, read, rank, world
        self.calls, self.saves = counters if counters is not None else _COUNTERS


def store_board(store, rank, world):
    """A :class:`Board` on a ``torch.distributed`` store (``compare_set`` from ``""`` writes an entry once;
    ``check`` doesn't wait), the job's rendezvous store on PyTorch."""

    def read(key):
        return store.get(key).decode("utf-8") if store.check([key]) else None

    def post(key, value):
        return store.compare_set(key, "", value).decode("utf-8")

    return Board(post, read, rank, world)


_state = threading.local()
_board = [None]
_COUNTERS = (itertools.count(1), itertools.count(1))


def use(board):
    """Make ``board`` (or None: a single process) the job's board; called by each backend's ``distribute()``."""
    _board[0] = board


def current():
    """The job's :class:`Board`, or None in a single process (or on a backend without one: MXNet, CNTK)."""
    board = _board[0]
    return board if board is not None and board.world > 1 else None


def _seconds(name, default):
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value > 0 else default


def join_timeout():
    """Seconds every rank has to join a collective call: ``DISTKERAS_JOIN_TIMEOUT``, default 60."""
    return _seconds(JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT)


def save_timeout():
    """Seconds a rank waits for rank 0's write of a file both save: ``DISTKERAS_SAVE_TIMEOUT``, default 600."""
    return _seconds(SAVE_TIMEOUT_ENV, DEFAULT_SAVE_TIMEOUT)


def _ranks(ranks):
    ranks = sorted(ranks)
    return "rank {}".format(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def join(call, board=None, timeout=None):
    """Wait until every rank has entered its next collective call, ``call`` (``"predict"``, ``"evaluate"``).

    Returns once every rank makes the same call; raises :class:`~distkeras.errors.CollectiveError` on every rank
    where some rank made another call, or some rank didn't make one within ``timeout`` seconds
    (:func:`join_timeout`). Every rank calls it before each such call, in the same order; one nested in
    another (:class:`inside`) is no new call. No-op without a board.
    """
    board = current() if board is None else board
    if board is None or getattr(_state, "inside", False):
        return
    timeout = join_timeout() if timeout is None else timeout
    prefix = "distkeras/call/{}/".format(next(board.calls))
    board.post(prefix + str(board.rank), call)
    seen = {board.rank: call}
    deadline = time.time() + timeout
    decision = None
    while decision is None:
        decision = board.read(prefix + "decision")
        if decision is not None:
            break
        for rank in range(board.world):
            if rank not in seen:
                entry = board.read(prefix + str(rank))
                if entry is not None:
                    seen[rank] = entry
        if len(seen) == board.world:
            calls = sorted(set(seen.values()))
            decision = board.post(prefix + "decision", "go" if len(calls) == 1 else "differ " + ";".join(
                "{}={}".format(rank, seen[rank]) for rank in sorted(seen)))
        elif time.time() > deadline:
            decision = board.post(prefix + "decision", "missing " + ",".join(map(str, sorted(seen))))
        else:
            time.sleep(POLL)
    if decision != "go":
        raise _not_everywhere(call, decision, board, timeout)


def _not_everywhere(call, decision, board, timeout):
    kind, _, detail = decision.partition(" ")
    if kind == "differ":
        by_rank = dict(item.split("=") for item in detail.split(";"))
        said = "; ".join("{} called {}()".format(_ranks([int(r) for r in by_rank if by_rank[r] == name]), name)
                         for name in sorted(set(by_rank.values())))
        return CollectiveError(
            "Every rank must make the same collective calls in the same order: {} runs over the job's {} processes, "
            "each computing part of the batches. Received: {}.".format(call, board.world, said))
    joined = [int(rank) for rank in detail.split(",") if rank]
    missing = [rank for rank in range(board.world) if rank not in joined]
    return CollectiveError(
        "{}() is a collective call across the job's {} processes: each computes part of the batches, so every rank "
        "must call it. {} called {}(), {} did not within {:g} s ({}). Call {}() on every rank (each gets the whole "
        "result), or, for one rank's own use, save on every rank and load the model there: "
        "model.save(path); keras.saving.load_model(path).{}(...).".format(
            call, board.world, _ranks(joined).capitalize(), call, _ranks(missing), timeout, JOIN_TIMEOUT_ENV, call,
            call))


class inside(object):
    """While open, :func:`join` in this thread is a no-op (a call nested in an agreed one)."""

    def __enter__(self):
        self.outer = getattr(_state, "inside", False)
        _state.inside = True

    def __exit__(self, *exc):
        _state.inside = self.outer


def agreed(method, call):
    """``method`` (a model's bound ``predict`` or ``evaluate``) preceded by :func:`join` across processes."""
    import functools

    if getattr(method, "distkeras_agreed", False):
        return method

    @functools.wraps(method)
    def joined(*args, **kwargs):
        join(call)
        with inside():
            return method(*args, **kwargs)

    joined.distkeras_agreed = True
    return joined


def _fingerprint(path):
    """A short name of the file ``path`` saves to (the same on every rank), or ``-`` for no path (a file object)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return "-"
    name = os.path.abspath(os.fsdecode(os.fspath(path)))
    return hashlib.sha1(name.encode("utf-8")).hexdigest()[:16]


def saving(path, write, rank, board=None, timeout=None):
    """Run ``write()`` (this rank's save of ``path``) and return what it returned once ``path`` is complete.

    Rank 0: ``write()`` writes the file; its outcome is posted (``"ok"``, or the error) under this save's number,
    whether it succeeds or raises. Other ranks: ``write()`` (their throwaway copy) first, then wait up to
    ``timeout`` seconds (:func:`save_timeout`) for rank 0's save of the same number; where it wrote the same path,
    rank 0's failure raises :class:`~distkeras.errors.CollectiveError` there too. No waiting without a board, nor
    for a save to no path (a file object).
    """
    board = current() if board is None else board
    if board is None:
        return write()
    key = "distkeras/save/{}".format(next(board.saves))
    mine = _fingerprint(path)
    if rank == 0:
        try:
            result = write()
        except BaseException as exc:
            board.post(key, "failed {} {}: {}".format(mine, type(exc).__name__, exc))
            raise
        board.post(key, "ok " + mine)
        return result
    result = write()
    if mine == "-":
        return result
    timeout = save_timeout() if timeout is None else timeout
    deadline = time.time() + timeout
    outcome = board.read(key)
    while outcome is None:
        if time.time() > deadline:
            raise CollectiveError(
                "Rank {} saved {} and waited {:g} s ({}) for rank 0's save of it; rank 0 made none. Save on every "
                "rank (rank 0 writes the file, every rank returns once it is complete), or on rank 0 alone.".format(
                    rank, path, timeout, SAVE_TIMEOUT_ENV))
        time.sleep(POLL)
        outcome = board.read(key)
    status, theirs, detail = (outcome.split(" ", 2) + [""])[:3]
    if theirs != mine:
        return result  # rank 0 saved another file: this one is this rank's own
    if status != "ok":
        raise CollectiveError("Rank 0 failed to write {}, which every rank saved: {}".format(path, detail))
    return result
