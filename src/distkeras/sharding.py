"""Rank-based data sharding and batch arithmetic, written once for every backend.

Two ways to split N samples over W workers, both disjoint and together covering every sample once:

- ``"block"`` (the default, and the CNTK recipe's arithmetic): rank r takes ``[r*N//W, (r+1)*N//W)``.
  Shard sizes differ by at most one.
- ``"interleave"``: rank r takes ``x[r::W]``. With a per-rank batch of G/W, global step k then uses
  exactly the samples one process would use at batch G, which is what adapters use inside ``fit()``;
  :func:`batch_rows` adds the rule for a short last batch.

Pure Python; works on anything sliceable (numpy arrays, lists) and on tuples/lists/dicts of them.
Part of the Python 3.6-compatible core.
"""

from typing import List, Optional, Tuple

from .errors import ShardError

MODES = ("block", "interleave")


def _check(n, rank, workers):
    for name, value in (("n", n), ("rank", rank), ("workers", workers)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShardError("Expected an int for {}. Received: {}={!r}".format(name, name, value))
    if workers < 1:
        raise ShardError("Expected workers >= 1. Received: workers={}".format(workers))
    if not 0 <= rank < workers:
        raise ShardError("Expected 0 <= rank < workers. Received: rank={}, workers={}".format(rank, workers))
    if n < 0:
        raise ShardError("Expected a sample count >= 0. Received: n={}".format(n))


def shard_bounds(n: int, rank: int, workers: int) -> Tuple[int, int]:
    """The ``[start, end)`` block of ``n`` samples that ``rank`` of ``workers`` owns.

    Args:
        n: number of samples.
        rank: this worker's rank, 0 .. workers-1.
        workers: number of workers.

    Returns:
        ``(start, end)`` with ``start = rank*n//workers`` and ``end = min((rank+1)*n//workers, n)``.
        The blocks of ranks 0..workers-1 are disjoint, in order, and cover ``range(n)``.

    Examples:
        >>> [shard_bounds(10, r, 3) for r in range(3)]
        [(0, 3), (3, 6), (6, 10)]
    """
    _check(n, rank, workers)
    return rank * n // workers, min((rank + 1) * n // workers, n)


def shard_size(n: int, rank: int, workers: int, mode: str = "block") -> int:
    """How many of ``n`` samples ``rank`` gets (in either mode)."""
    _check(n, rank, workers)
    if mode == "interleave":
        return len(range(rank, n, workers))
    start, end = shard_bounds(n, rank, workers)
    return end - start


def _length(data):
    if isinstance(data, dict):
        lengths = set(_length(v) for v in data.values())
    elif isinstance(data, (tuple, list)) and data and not _is_leaf(data):
        lengths = set(_length(v) for v in data)
    else:
        return len(data)
    if len(lengths) != 1:
        raise ShardError("All arrays must have the same number of samples to shard them. Received lengths: {}".format(sorted(lengths)))
    return lengths.pop()


def _is_leaf(data):
    # A list of numbers is data; a list of arrays is a structure of inputs.
    return not hasattr(data[0], "__len__") or isinstance(data[0], (str, bytes))


def _apply(data, slicer):
    if isinstance(data, dict):
        return type(data)((k, _apply(v, slicer)) for k, v in data.items())
    if isinstance(data, (tuple, list)) and data and not _is_leaf(data):
        return type(data)(_apply(v, slicer) for v in data)
    return slicer(data)


def shard(data: object, rank: Optional[int] = None, workers: Optional[int] = None, mode: str = "block") -> object:
    """This worker's shard of ``data``.

    Args:
        data: an array-like with ``len()`` and slicing (numpy array, list), or a tuple/list/dict of them
            with equal lengths, e.g. ``(x, y)``.
        rank: this worker's rank; read from the launch environment when None.
        workers: the number of workers; read from the launch environment when None.
        mode: ``"block"`` (contiguous, the CNTK recipe) or ``"interleave"`` (``x[rank::workers]``).

    Returns:
        The same structure holding only this rank's samples. Over all ranks the shards are disjoint
        and cover every sample once; no sample is dropped.

    Raises:
        ShardError: a bad rank/workers/mode, or arrays of different lengths.

    Examples:
        >>> shard(list(range(10)), rank=2, workers=3)
        [6, 7, 8, 9]
    """
    if rank is None or workers is None:
        from .cluster import from_env

        cluster = from_env()
        rank = cluster.rank if rank is None else rank
        workers = cluster.world_size if workers is None else workers
    if mode not in MODES:
        raise ShardError("Expected mode in {}. Received: mode={!r}".format(MODES, mode))
    n = _length(data)
    _check(n, rank, workers)
    if mode == "interleave":
        return _apply(data, lambda a: a[rank::workers])
    start, end = shard_bounds(n, rank, workers)
    return _apply(data, lambda a: a[start:end])


def num_samples(data: object) -> int:
    """The number of samples in ``data``: an array-like, or a tuple/list/dict of them of equal lengths.

    Raises:
        ShardError: arrays of different lengths.
    """
    return _length(data)


def select(data, index):
    """The samples ``index`` picks (a slice, or an array of sample indices) from ``data``: any structure
    :func:`shard` takes, e.g. ``(x, y)``."""
    return _apply(data, lambda a: a[index])


def parts(data):
    """The arrays in ``data``: an array, or a list/tuple/dict of them (one per input or output)."""
    if isinstance(data, dict):
        return list(data.values())
    return list(data) if isinstance(data, (list, tuple)) else [data]


def fit_on_arrays(fit, args, kwargs):
    """Keras 2's ``fit(*args, **kwargs)`` bound (defaults applied) and its ``[x, y, sample_weight]``, the
    latter None unless the data are NumPy arrays fed without ``steps_per_epoch`` (what the MXNet and CNTK
    adapters split over workers; anything else each worker trains on as it is given)."""
    import inspect

    import numpy as np

    bound = inspect.signature(fit).bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    data = [given["x"], given["y"], given["sample_weight"]]
    arrays = [a for part in data if part is not None for a in parts(part)]
    if given["steps_per_epoch"] is not None or data[0] is None or not all(isinstance(a, np.ndarray) for a in arrays):
        return bound, None
    return bound, data


def on_arrays(method, args, kwargs):
    """Keras 2's ``evaluate``/``predict(*args, **kwargs)`` bound (defaults applied) and its count of samples, the
    latter None unless the data are NumPy arrays fed without ``steps`` (what the MXNet and CNTK adapters split
    over workers)."""
    import inspect

    import numpy as np

    bound = inspect.signature(method).bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    data = [given.get(name) for name in ("x", "y", "sample_weight")]
    arrays = [a for part in data if part is not None for a in parts(part)]
    if given["steps"] is not None or data[0] is None or not all(isinstance(a, np.ndarray) for a in arrays):
        return bound, None
    return bound, num_samples(arrays)


def batch_rows(n: int, batch: int, rank: int, workers: int) -> Tuple[List[int], Optional[List[float]]]:
    """The rows of ``n`` that worker ``rank`` trains on in batches of ``batch // workers``, and their weights.

    Global batch k is rows ``k*batch`` to ``(k+1)*batch - 1``, and worker r takes those that are r modulo
    ``workers`` (``shard(..., mode="interleave")``): its step k is its part of global batch k. Of a last
    batch of R < ``batch`` rows it takes its part the same way, topped up to ``ceil(R / workers)`` rows with
    copies of that batch's first row weighted 0, its own rows then weighing ``workers * ceil(R / workers) / R``.
    So every worker takes the same number of steps, of the same sizes, and a loss averaged over a worker's
    rows with these weights, then over the workers, is the loss of the global batch.

    Returns:
        ``(rows, weights)``: row indices in training order, and one weight per row, or None when all are 1
        (``n`` minus whole batches is a multiple of ``workers``).

    Raises:
        ShardError: ``batch`` is not a multiple of ``workers``, or bad ints.

    Examples:
        >>> batch_rows(13, 6, 1, 2)   # last batch: row 12 alone, so worker 1 gets a copy weighted 0
        ([1, 3, 5, 7, 9, 11, 12], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    """
    _check(n, rank, workers)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1 or batch % workers:
        lower = batch - batch % workers if isinstance(batch, int) and batch > workers else workers
        raise ShardError("Expected a global batch size that {} workers split evenly (a multiple of {}). Received: "
                         "batch_size={!r}. Pass e.g. {} or {}.".format(workers, workers, batch, lower, lower + workers))
    full = n - n % batch
    rows = list(shard(range(full), rank, workers, mode="interleave"))
    tail = list(shard(range(full, n), rank, workers, mode="interleave"))
    if (n - full) % workers == 0:
        return rows + tail, None
    size = -(-(n - full) // workers)
    padding = size - len(tail)
    return rows + tail + [full] * padding, [1.0] * len(rows) + [workers * size / float(n - full)] * len(tail) + [0.0] * padding


def global_batch_size(per_device: int, replicas: int) -> int:
    """``per_device * replicas``, checked: the global batch to pass to ``fit()``."""
    for name, value in (("per_device", per_device), ("replicas", replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ShardError("Expected a positive int for {}. Received: {}={!r}".format(name, name, value))
    return per_device * replicas
