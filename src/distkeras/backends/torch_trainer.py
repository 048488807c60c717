"""The hooks that make one Keras model (torch backend) train data-parallel over the processes of a job.

Keras' torch trainer runs ``fit()`` like this: for every batch its data adapter yields,
``train_step(batch)`` computes the loss, calls ``loss.backward()`` and hands the gradients to
``optimizer.apply()``; after the epoch, ``_get_metrics_result_or_logs()`` turns the metrics into the
epoch logs. distkeras hooks in at exactly those places, as attributes of the model (and optimizer)
instance, so the class, the config and what ``save()`` writes stay the user's:

- ``train_step`` / ``test_step``: every rank iterates the same global batches (``fit()``'s batch_size is
  the global batch) and keeps ``batch[rank::world]``. When the world size divides the batch this is
  ``x[rank::world]`` at a per-rank batch of G/world; when it doesn't (10 on 3 ranks: 4, 3, 3; a last
  batch of 1) global step k still uses exactly the samples one process would, and every rank takes the
  same number of steps. A rank whose share of a batch is empty skips the forward pass and joins the
  gradient all-reduce with weight zero.
- ``optimizer.apply``: Horovod's DistributedOptimizer idea, on the instance, so the optimizer keeps its
  exact class. One all-reduce sums ``n_r * grad_r`` and ``n_r`` over the ranks (``n_r``: the rank's
  samples in the step); the optimizer applies ``sum / sum(n_r)``, the gradient of the mean loss over the
  whole global batch, regularisation included, however unequal the shares. Gradient clipping and loss
  scaling then act on that average, as on one device. Exact for losses that average over the batch
  (Keras' default reduction); with ``reduction="sum"`` each rank's sum is weighted by its share, which
  gives about 1/world of the one-device gradient.
- ``_get_metrics_result_or_logs`` (a Keras private; :func:`install` checks that it exists): the metric
  states (totals, counts) are summed over the ranks, in sorted metric-name order, before the results
  are read, so epoch logs, validation logs and ``evaluate()`` are the global values. Per-batch progress
  shows rank 0's own running values.
- ``fit`` / ``evaluate`` / ``predict``: ``verbose=0`` on ranks other than 0. ``fit()`` starts, and
  every epoch begins, with rank 0's random state (Python, NumPy, torch), so shuffling and augmentation
  produce the same global batches on every rank. ``predict()`` runs the whole input on every rank.
- ``save`` / ``save_weights``: rank 0 writes (a temporary file, then a rename); the other ranks write
  nothing and return once rank 0's file is in place, so a script that saves and reloads runs unchanged
  on every rank. Calling ``save()`` on rank 0 alone works as well.

Every rank must call ``fit``/``evaluate`` alike: they are collective. A custom ``train_step`` must apply
its gradients through ``model.optimizer``, once per step.
"""

import collections
import datetime
import functools
import inspect
import os

import keras
import torch

from ..errors import DistKerasError, LaunchError
from . import torch_collectives as collectives

_PRIVATE_LOGS = "_get_metrics_result_or_logs"


class Replica(object):
    """This process' place in the job, and the sample count of the step in flight.

    Args:
        rank: this process' rank.
        world: the number of processes.
        store: the rendezvous store (for the save hand-over), or None.
        timeout: seconds a rank waits for rank 0's file.
        launch_failure: ``failure(wait)`` of the self-launch watcher, or None.
    """

    def __init__(self, rank, world, store, timeout, launch_failure=None):
        self.rank = rank
        self.world = world
        self.store = store
        self.timeout = timeout
        self.launch_failure = launch_failure
        self.count = None
        self._saves = collections.Counter()

    def share(self, data):
        """This rank's part ``[rank::world]`` of a global batch, and its number of samples."""

        def part(value):
            shape = getattr(value, "shape", None)
            return value[self.rank :: self.world] if shape is not None and len(shape) else value

        local = keras.tree.map_structure(part, data)
        for leaf in keras.tree.flatten(local):
            shape = getattr(leaf, "shape", None)
            if shape is not None and len(shape):
                return local, int(shape[0])
        return data, 1  # no batch dimension to split: every rank takes the whole step, weighted alike

    def save_key(self, path):
        self._saves[path] += 1
        return "save:{}:{}".format(path, self._saves[path])


def install(model, replica):
    """Install the hooks of the module docstring on ``model`` (already on this rank's device)."""
    if not callable(getattr(model, _PRIVATE_LOGS, None)):
        raise DistKerasError(
            "distkeras needs Keras' Trainer.{} to aggregate metrics over processes, and this Keras ({}) has "
            "none. Install Keras 3.0 or later.".format(_PRIVATE_LOGS, keras.__version__)
        )
    hooks = {
        "train_step": _train_step(model, model.train_step, replica),
        "test_step": _test_step(model, model.test_step, replica),
        _PRIVATE_LOGS: _global_logs(model, getattr(model, _PRIVATE_LOGS), replica),
        "fit": _entry(model.fit, replica, sync_random=True),
        "evaluate": _entry(model.evaluate, replica),
        "predict": _entry(model.predict, replica),
        "save": _rank0_writes(model.save, replica),
        "save_weights": _rank0_writes(model.save_weights, replica),
    }
    for name, hook in hooks.items():
        # object.__setattr__: Keras layers (torch Modules) track attributes; these are plain functions.
        object.__setattr__(model, name, hook)


def _wrap_optimizer(optimizer, replica):
    if optimizer is None or optimizer.__dict__.get("_distkeras_replica") is replica:
        return
    apply = type(optimizer).apply.__get__(optimizer)

    def averaged_apply(grads, trainable_variables=None):
        grads = list(grads)
        # apply() itself falls back to the variables the optimizer was built with (a Keras private).
        variables = optimizer._trainable_variables if trainable_variables is None else list(trainable_variables)
        if not grads or len(grads) != len(variables):
            return apply(grads, trainable_variables)  # Keras' own checks and messages
        count = 1 if replica.count is None else replica.count
        return apply(collectives.average_gradients(grads, variables, count), trainable_variables)

    object.__setattr__(optimizer, "apply", averaged_apply)
    object.__setattr__(optimizer, "_distkeras_replica", replica)


def _train_step(model, step, replica):
    def train_step(data):
        # Wrapped here, not once: compile() after distribute() brings a new optimizer.
        _wrap_optimizer(model.optimizer, replica)
        local, count = replica.share(data)
        replica.count = count
        try:
            if count:
                return step(local)
            variables = model.trainable_weights
            if model.optimizer is not None and variables:
                with torch.no_grad():  # no samples here: join the all-reduce with weight zero
                    model.optimizer.apply([None] * len(variables), variables)
            return model.get_metrics_result()
        finally:
            replica.count = None

    return train_step


def _test_step(model, step, replica):
    def test_step(data):
        local, count = replica.share(data)
        return step(local) if count else model.get_metrics_result()

    return test_step


def _metric_variables(model):
    seen, ordered = set(), []
    for metric in sorted(model.metrics, key=lambda m: m.name):
        for variable in metric.variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                ordered.append(variable)
    return ordered


def _global_logs(model, local_logs, replica):
    def global_logs(logs):
        variables = _metric_variables(model)
        if not variables:
            return collectives.average_logs(logs, replica.world) if logs else logs
        saved = [v.value.detach().clone() for v in variables]
        try:
            collectives.all_reduce_states(variables, replica.rank, replica.world)
            result = local_logs(logs)
            if result is logs:  # a custom step's logs, which Keras passes through
                return collectives.average_logs(logs, replica.world)
            return {name: collectives.plain(value) for name, value in result.items()}
        finally:  # the local states again: the global ones are never counted twice
            for variable, value in zip(variables, saved):
                variable.assign(value)

    return global_logs


class _SyncRandomState(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        collectives.sync_random_state()


def _entry(method, replica, sync_random=False):
    """fit/evaluate/predict: quiet off rank 0; a dead self-launched worker reported by rank and exit code."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def entry(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if replica.rank != 0:
            bound.arguments["verbose"] = 0
        try:
            if sync_random:
                collectives.sync_random_state()
                callbacks = bound.arguments.get("callbacks")
                if callbacks is None or isinstance(callbacks, (list, tuple)):
                    bound.arguments["callbacks"] = [_SyncRandomState()] + list(callbacks or [])
            return method(*bound.args, **bound.kwargs)
        except Exception as exc:
            # A collective with a dead rank fails (RuntimeError) about when the watcher sees the exit.
            wait = 2.0 if isinstance(exc, RuntimeError) else 0.0
            failure = replica.launch_failure(wait) if replica.launch_failure else None
            if failure:
                raise LaunchError(failure) from exc
            raise

    return entry


def _local_path(filepath):
    if not isinstance(filepath, (str, os.PathLike)):
        return None
    path = os.fspath(filepath)
    return None if "://" in path else os.path.abspath(path)


def _write_atomically(method, path, args, kwargs):
    if args or kwargs.get("overwrite", True) is False or kwargs.get("zipped", True) is False or kwargs.get(
        "max_shard_size"
    ):
        return method(path, *args, **kwargs)  # Keras' own prompts, folders and shards: written in place
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, ".distkeras-{}-{}".format(os.getpid(), name))
    try:
        result = method(temporary, *args, **kwargs)
        os.replace(temporary, path)
        return result
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _rank0_writes(method, replica):
    @functools.wraps(method)
    def save(filepath, *args, **kwargs):
        path = _local_path(filepath)
        if path is None:  # a file object or a remote path: rank 0 writes, nobody waits
            return method(filepath, *args, **kwargs) if replica.rank == 0 else None
        key = replica.save_key(path)
        if replica.rank != 0:
            return _wait_for_rank0(replica, key, path)
        try:
            result = _write_atomically(method, path, args, kwargs)
        except BaseException as exc:
            replica.store.set(key, "failed: {}: {}".format(type(exc).__name__, exc))
            raise
        replica.store.set(key, "ok")
        return result

    return save


def _wait_for_rank0(replica, key, path):
    try:
        replica.store.wait([key], datetime.timedelta(seconds=replica.timeout))
    except RuntimeError as exc:  # torch raises a DistStoreError (a RuntimeError) on timeout
        raise DistKerasError(
            "Rank {} waited {:.0f} s for rank 0 to write {} and it didn't: call save() on rank 0 too (every rank "
            "may call it; only rank 0 writes). ({})".format(replica.rank, replica.timeout, path, exc)
        )
    status = replica.store.get(key).decode()
    if status != "ok":
        raise DistKerasError("Rank 0 could not write {}: {}".format(path, status.partition(": ")[2]))
    return None
