"""``fit()``, ``evaluate()`` and ``predict()`` on arrays in a worker of a multi-worker MXNet job: Keras' own loops
over the global arrays, as one process runs them, on every worker.

Every worker runs Keras' loop at the global ``batch_size`` (:func:`_fit`, :func:`_evaluate`, :func:`_predict`, which
the adapter puts in place of the model's methods), with rank 0's NumPy random state at every epoch's start so that
every worker shuffles alike (:func:`_same_random_state`); the steps (:mod:`.steps`) keep the worker's rows of each
global batch while ``model._distkeras_shard`` is set (:func:`_sharded`). The calls are compared across the workers
first (:func:`_check_same_everywhere`): a mismatch raises a ``ShardError`` on every worker where it would hang; then
the arrays themselves (the data check, :func:`~distkeras.backends.policies.check_arrays`).
Tensors, generators and ``steps`` pass through, whole on every worker.
"""

from ... import sharding
from .. import policies

#: The model's data check (:func:`~distkeras.backends.policies.array_watch`), set by the adapter's check_data.
WATCH = "_distkeras_data_watch"


def _given(bound):
    """evaluate()'s or predict()'s ``(x, y, sample_weight)`` (None for what the call doesn't take or wasn't given)."""
    return tuple(bound.arguments.get(name) for name in ("x", "y", "sample_weight"))


def _fit(model, fit, *args, **kwargs):
    """Keras' ``fit`` on arrays, as one process runs it at ``batch_size``: Keras' loop shuffles, splits off
    ``validation_split``, weighs classes and gathers every global batch, the same on every worker (each
    takes rank 0's NumPy random state before every epoch, :func:`_same_random_state`), and the train step
    keeps the worker's rows ``[rank::workers]`` of it (:func:`.steps._my_rows`). So every step is one process's,
    and Keras' epoch averages, which weigh each step by the rows Keras gathered, are one process's too.
    Generators and ``steps_per_epoch`` pass through (each worker trains on what it is given)."""
    job = model._distkeras_job
    bound, data = sharding.fit_on_arrays(fit, args, kwargs)
    if data is None:
        return fit(*bound.args, **bound.kwargs)
    given = bound.arguments
    shuffle = given["shuffle"]
    validation = given["validation_data"]
    _check_same_everywhere(job, "fit", policies.array_call_values(
        sharding.num_samples([part for part in data if part is not None]), given["batch_size"]) + [
        (name, policies.fit_code(name, value)) for name, value in (
            ("epochs", given["epochs"]), ("shuffle", shuffle),
            ("validation_samples", sharding.num_samples([p for p in validation if p is not None]) if _arrays(validation) else None),
            ("validation_split", given["validation_split"]))])
    policies.check_arrays(getattr(model, WATCH, None), "fit", data, given["batch_size"])
    given["callbacks"] = list(given["callbacks"] or []) + [_same_random_state(job)]  # last: after any user's draw
    model._distkeras_shard = (job.rank, job.workers)
    try:
        return fit(*bound.args, **bound.kwargs)
    finally:
        model._distkeras_shard = None


def _evaluate(model, evaluate, *args, **kwargs):
    """Keras' ``evaluate`` on arrays, as one process runs it at ``batch_size``: every worker runs Keras' loop over
    the global arrays, each test step keeps the worker's rows ``[rank::workers]`` of the global batch and the
    job adds up the values (:func:`.steps._test_step_in_job`). Tensors and ``steps`` pass through, whole on every
    worker."""
    bound, samples = sharding.on_arrays(evaluate, args, kwargs)
    if samples is None:
        return evaluate(*bound.args, **bound.kwargs)
    job = model._distkeras_job
    _check_same_everywhere(job, "evaluate", policies.array_call_values(samples, bound.arguments["batch_size"]))
    policies.check_arrays(getattr(model, WATCH, None), "evaluate", _given(bound), bound.arguments["batch_size"])
    return _sharded(model, job, evaluate, bound)


def _predict(model, predict, *args, **kwargs):
    """Keras' ``predict`` on arrays, as one process runs it: each worker predicts its rows ``[rank::workers]`` of
    every global batch, and every worker gets the whole prediction, in order (:func:`.steps._predict_step_in_job`)."""
    bound, samples = sharding.on_arrays(predict, args, kwargs)
    if samples is None:
        return predict(*bound.args, **bound.kwargs)
    job = model._distkeras_job
    _check_same_everywhere(job, "predict", policies.array_call_values(samples, bound.arguments["batch_size"]))
    policies.check_arrays(getattr(model, WATCH, None), "predict", _given(bound), bound.arguments["batch_size"])
    if not model.compiled:
        # A model never compiled predicts with a module of its own made at every step (keras-mxnet), which no
        # train step has given rank 0's weights: every worker takes them here, each worker's rows being one model's.
        _take_rank0_weights(model, job)
    return _sharded(model, job, predict, bound)


def _sharded(model, job, method, bound):
    """``method`` with the steps keeping this worker's rows of each global batch (``model._distkeras_shard``)."""
    before = getattr(model, "_distkeras_shard", None)
    model._distkeras_shard = (job.rank, job.workers)
    try:
        return method(*bound.args, **bound.kwargs)
    finally:
        model._distkeras_shard = before


def _take_rank0_weights(model, job):
    """Every worker takes rank 0's weights (collective): rank 0 pushes them, the others zeros, all take the sum."""
    import numpy as np

    weights = model.get_weights()
    if not weights:
        return
    flat = np.concatenate([np.asarray(w, "float32").ravel() for w in weights])
    summed = job.all_sum(flat if job.rank == 0 else np.zeros_like(flat))
    taken, start = [], 0
    for w in weights:
        taken.append(summed[start:start + w.size].reshape(w.shape).astype(w.dtype))
        start += w.size
    model.set_weights(taken)


def _same_random_state(job):
    """A Keras callback that gives every worker rank 0's state of NumPy's (and Python's) global random generator
    at the start of every epoch, before Keras' fit loop shuffles with it (``np.random.shuffle``; ``shuffle='batch'``
    too): :func:`~distkeras.backends.policies.sync_random_state`, its bytes summed through the job's KVStore."""
    import keras

    broadcast = policies.broadcast_by_sum(job.all_sum, job.rank)

    class SameRandomState(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            policies.sync_random_state(broadcast)

    return SameRandomState()


def _arrays(value):
    """True where ``value`` is a tuple/list of NumPy arrays (fit()'s validation_data on arrays)."""
    import numpy as np

    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(a, np.ndarray) for part in value if part is not None for a in sharding.parts(part))


def _check_same_everywhere(job, call, values):
    """:func:`~distkeras.backends.policies.check_same_everywhere` over this job's workers."""
    policies.check_same_everywhere(job.all_sum, job.rank, job.workers, call, values)
