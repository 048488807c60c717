"""The hooks that make one Keras model (torch backend) train data-parallel over the processes of a job.

Keras' torch trainer runs ``fit()`` like this: for every batch its data adapter yields,
``train_step(batch)`` computes the loss, calls ``loss.backward()`` and hands the gradients to
``optimizer.apply()``; after the epoch, ``_get_metrics_result_or_logs()`` turns the metrics into the
epoch logs. distkeras hooks in at exactly those places, as attributes of the model's (and its layers' and
optimizer's) *instances* (:func:`distkeras.backends.keras_model.hook`), so the classes, the configs and what
``save()`` writes stay the user's. :func:`install` removes an earlier call's hooks before it sets its own,
so distributing a model twice replaces the hooks instead of stacking them.

- ``train_step`` / ``test_step``: every rank iterates the same global batches (``fit()``'s batch_size is
  the global batch) and keeps ``batch[rank::world]``. When the world size divides the batch this is
  ``x[rank::world]`` at a per-rank batch of G/world; when it doesn't (10 on 3 ranks: 4, 3, 3; a last
  batch of 1) global step k still uses exactly the samples one process would, and every rank takes the
  same number of steps. A rank whose share of a batch is empty runs the step on a stand-in (the batch's
  first sample) with weight zero: it joins every collective of the step (the gradient all-reduce, the
  BatchNormalization statistics forward and backward) and returns logs shaped like the other ranks',
  but its gradients and statistics count for nothing, and its metric states and its model's local state
  (per-replica statistics, seed generators) are put back as they were. ``fit``/``evaluate`` read only those rows
  where Keras reads the data (:func:`sharded_batches`): for arrays (NumPy, tensors) the global batch's
  indices, in the order one process draws them, are split before the rows are gathered and converted; a
  PyDataset's or generator's whole batches are sliced before Keras converts (copies) them. A DataLoader
  the user passes yields whole global batches of tensors, which each rank slices in the step. While a
  step runs, Keras' random functions draw for this rank's rows of the global batch
  (:func:`~distkeras.backends.torch_random.global_draws`: the same values one device draws for them).
  Before a step, variables no broadcast has covered yet (a subclassed model built by its first ``fit()``,
  a new optimizer's) take rank 0's values (:func:`broadcast_new_variables`).
- ``predict_step``: the same split; every output with a row per sample is gathered back into the global
  batch's order on every rank (one ``all_gather``, shares padded to the largest), so ``predict()`` and
  ``predict_on_batch()`` return one device's predictions on every rank, each row computed once.
- ``optimizer.apply`` of every optimizer the model holds (:func:`~distkeras.backends.keras_model.all_optimizers`:
  ``model.optimizer`` and those in its attributes, as a GAN's ``d_optimizer`` and ``g_optimizer``; a
  LossScaleOptimizer's inner one is left to the outer): Horovod's DistributedOptimizer idea, on the
  instance, so the optimizer keeps its exact class. It hands the optimizer the average over the ranks of
  ``n_r * grad_r / N`` (``n_r``: the rank's samples in the step, ``N`` the global batch's): the gradient
  of the mean loss over the whole global batch, regularisation included, however unequal the shares
  (a loss written by hand with ops, a Loss object called in the step, ``add_loss`` and a scalar loss
  function alike, as long as it is the mean over the rank's rows). Everything the optimizer does next
  (clipping, gradient accumulation, loss scaling, weight decay, EMA, learning-rate schedules) acts on
  that average, as on one device. Exact for losses that average over the batch (Keras' default
  reduction); a ``Loss`` with ``reduction="sum"`` returns ``N / n_r`` times the rank's sum in a step
  (:func:`_gate_sum_reduction`), so its weighted average is one device's sum; a sum written by hand with
  ops can't be told from a mean and is weighed as one. With ``overlap`` (the default, more than one rank) most of that
  all-reduce has already run during the backward pass (next item), and ``apply`` launches what is left
  and waits; without it, or when the step's gradients are not the backward pass' own, one all-reduce
  sums the weighted gradients and the counts after the backward pass
  (:func:`~distkeras.backends.torch_collectives.average_gradients`).
- the trainable variables' torch parameters (``register_post_accumulate_grad_hook``, public torch): with
  ``overlap``, each variable's gradient goes into a bucket as soon as the backward pass has accumulated
  it, and a full bucket's all-reduce starts at once, as in PyTorch DDP
  (:class:`~distkeras.backends.torch_buckets.Buckets`, which describes the buckets, their order on
  every rank and the fallback). The hooks act only in a train step in flight; the model holds them in
  its instance attribute ``_distkeras_buckets``, and :func:`uninstall` takes them off the parameters.
- ``BatchNormalization._moments`` (a Keras private, the one place the layer computes its batch
  statistics): with ``sync_batchnorm`` (the default) the BatchNormalization instances in the model,
  nested models and layers included, that the rule of :mod:`distkeras.backends.batchnorm` selects take
  the mean and variance of the *global* batch (:func:`~distkeras.backends.batchnorm.global_moments`,
  gathered by :func:`~distkeras.backends.torch.collectives.gather_statistics`: one all-reduce in the
  forward pass, one in the backward pass, per layer call), so the normalisation, the gradients through
  the statistics and the moving mean and variance are one device's. A subclass with a ``_moments`` of
  its own keeps it (per rank), with a warning on rank 0.
- ``_get_metrics_result_or_logs`` (a Keras private; :func:`install` checks that it exists): the metric
  states (totals, counts) are summed over the ranks, in sorted metric-name order, before the results
  are read, so epoch logs, validation logs and ``evaluate()`` are the global values. A custom step's own
  logs: a value named after one of the model's metrics (``{m.name: m.result() for m in self.metrics}``,
  as the Keras guide writes it) becomes that metric's global result, any other scalar (a Loss object's
  value, the mean over the rank's rows) is averaged over the ranks weighted by their rows: the global
  batch's value. A ``keras.metrics.Mean`` tracker the step updates with a scalar (``update_state(loss)``,
  the guides' GAN and VAE) gets the rank's rows over an equal share as its sample weight
  (:func:`~distkeras.backends.keras_model.weigh_scalar_means`), so its summed states are the global batch's
  too, however unevenly the batch splits. The logs of each train and test step (what ``on_train_batch_end``,
  ``on_test_batch_end``, the progress bar, ``train_on_batch`` and ``test_on_batch`` get) are made global the
  same way, in one all-reduce per step, where something reads them (:func:`_batch_logs_read`, agreed by every
  rank when ``fit``/``evaluate`` starts); ``batch_logs="local"`` keeps each rank's own running values.
- ``fit`` / ``evaluate`` / ``predict``: ``verbose=0`` on ranks other than 0. ``fit()`` starts, and
  every epoch begins, with rank 0's random state (Python, NumPy, torch), so shuffling and augmentation
  produce the same global batches on every rank. ``fit``/``evaluate``/``predict`` read only this rank's
  rows of array data.
- ``save`` / ``save_weights`` (also when a callback such as ModelCheckpoint calls them): rank 0 writes
  (a temporary file, then a rename); the other ranks write a throwaway copy into a temporary folder of
  their own, deleted when the call returns, as on every backend (:func:`~distkeras.backends.policies.rank0_writes`),
  and return once rank 0's file is complete (:func:`~distkeras.backends.agreement.saving`, over the job's
  store). Rank 0 waits for nobody: calling ``save()`` on rank 0 alone works as well.
- ``predict`` / ``evaluate`` start with every rank agreeing, over the store, that all make the call
  (:func:`~distkeras.backends.agreement.join`): on one rank only they raise within ``DISTKERAS_JOIN_TIMEOUT``.

Every rank must call ``fit``/``evaluate``/``predict`` alike: they are collective, and so is a
BatchNormalization layer called in training mode. A custom ``train_step`` (the Keras guide's:
``loss.backward()``, then ``self.optimizer.apply(gradients, trainable_weights)``; a GAN's two backward
passes and two optimizers) must apply its gradients through optimizers the model holds, each as often as
it likes; a step that applies none raises :class:`~distkeras.DistKerasError`. With ``overlap``, the first
``apply`` of a step takes the buckets of the first backward pass; later ones in the step are averaged
after their backward pass.
"""

import collections
import functools
import inspect
import logging
import os
import threading
import weakref

import keras
import torch

from ...errors import DistKerasError, LaunchError
from .. import agreement, batchnorm, keras_model, policies
from ..base import swapped
from . import buckets as torch_buckets
from . import collectives
from . import random as torch_random
from . import shard as torch_shard
from . import shard_step as torch_shard_step
from .batches import sharded_batches

_PRIVATE_LOGS = "_get_metrics_result_or_logs"
_PRIVATE_LAYERS = "_flatten_layers"
#: The instance attribute that holds a model's :class:`~distkeras.backends.torch_buckets.Buckets`.
_BUCKETS = "_distkeras_buckets"

logger = logging.getLogger("distkeras")


class Replica(object):
    """This process' place in the job, and the sample count of the step in flight.

    Args:
        rank: this process' rank.
        world: the number of processes.
        store: the job's rendezvous store, or None.
        timeout: seconds a collective may wait for the other processes.
        launch_failure: ``failure(wait)`` of the self-launch watcher, or None.
        compression: None, ``"bf16"`` or ``"fp16"``: the dtype gradients are all-reduced in.
    """

    def __init__(self, rank, world, store, timeout, launch_failure=None, compression=None):
        self.rank = rank
        self.world = world
        # This process among all of the job's: who prints and writes (with tensor parallelism ``rank``/``world``
        # are its place among the replicas, the model shards of one replica sharing it).
        self.process, self.processes = rank, world
        self.store = store
        self.timeout = timeout
        self.launch_failure = launch_failure
        self.compression = compression
        self.count = None  # samples of the train or test step in flight (None outside one)
        self.total = None  # samples of the whole global batch of that step (every rank's counts summed)
        self.last_count = None  # samples of the last train or test step
        self.batch_logs = True  # whether train and test steps return the global logs (one all-reduce)
        self.batch_logs_mode = "global"  # distribute()'s batch_logs: "global" or "local" (never global)
        self.checked_logs = None  # the checked step's global logs, where the step hands Keras its local ones
        self.applied = 0  # calls of the averaging optimizer.apply() in the train step in flight
        self.buckets = None  # the overlapping all-reduce (torch_buckets.Buckets), when on
        self.shard = None  # the sharded training state (torch_shard.Sharding), with distribute(shard=...)
        self.known = {}  # id -> weak reference of each variable broadcast from rank 0 so far
        # (rows, count, total) of the batches the sharded loader in its pass read and no step has taken yet.
        self.read = collections.deque()

    def scalar_share(self):
        """In a train or test step: this rank's rows over an equal share of the global batch (the sample
        weight :func:`~distkeras.backends.keras_model.weigh_scalar_means` gives a Mean tracker's scalar update)."""
        if self.count is None or not self.total:
            return None
        return policies.relative_share(self.count, self.total, self.world)

    def split(self, data):
        """What this rank's step runs on, its sample count and the global batch's: ``(rows, count, total)``.

        ``data`` is this rank's rows as its data loader read them (:func:`sharded_batches`, found in
        :attr:`read` by identity: Keras hands the loader's object to the step unchanged) or a whole global
        batch, of which this rank keeps ``[rank::world]``. ``rows`` is a stand-in (the global batch's first
        sample) where ``count`` is 0; where the batch has no batch dimension every rank takes the whole step,
        weighted alike.
        """
        for index, entry in enumerate(self.read):
            if entry[0] is data:
                del self.read[index]  # by position: comparing entries would compare tensors
                return entry
        if self.read:  # slicing the rows of a sharded read again would train on the wrong samples, silently
            raise DistKerasError(
                "distkeras read this rank's rows of a batch in Keras' data loader, but the step got another "
                "object than the loader made (this Keras, {}, changes batches between its data loader and "
                "train_step). Please report it; feeding fit() a torch DataLoader avoids the sharded read.".format(
                    keras.__version__)
            )
        return self.rows_of(data)

    def rows_of(self, data):
        """``(rows, count, total)`` of :meth:`split` for a whole global batch (tensors or NumPy arrays)."""
        total = None
        for leaf in keras.tree.flatten(data):
            shape = getattr(leaf, "shape", None)
            if shape is not None and len(shape):
                total = int(shape[0])
                break
        if total is None:
            return data, 1, self.world

        def part(value, rows):
            shape = getattr(value, "shape", None)
            return value[rows] if shape is not None and len(shape) else value

        count = len(range(total)[self.rank :: self.world])
        rows = slice(self.rank, None, self.world) if count else slice(0, 1)
        return keras.tree.map_structure(lambda value: part(value, rows), data), count, total


def uninstall(model):
    """Remove the hooks of an earlier :func:`install` from ``model``, its layers, its optimizers and its
    variables' parameters."""
    torch_shard.uninstall(model)  # first: every rank gets the full optimizer state back
    buckets = model.__dict__.get(_BUCKETS)
    if buckets is not None:
        buckets.remove()
    for obj in keras_model.layers_of(model) + keras_model.all_optimizers(model):
        keras_model.unhook(obj)


def broadcast_new_variables(model, replica):
    """Give every rank rank 0's values of the model's variables that no broadcast has covered yet (all of
    them the first time; later, those a model built after distribute() made, or a new optimizer's): a
    subclassed model built by its first fit(), an optimizer built by its first apply(). Every rank calls it
    at the same points, and finds the same new variables, in the same order."""
    known = replica.known
    # Weak references: a variable that is gone must not hide a new one that got its id.
    new = [v for v in keras_model.state_variables(model) if id(v) not in known or known[id(v)]() is not v]
    # Every rank first agrees on what is new (a rank with none would skip the broadcast the others wait in).
    collectives.check_same_variables(new, "new variables")
    if new:
        collectives.broadcast_variables(new)
        known.update((id(v), weakref.ref(v)) for v in new)


def _unreduced_metrics_result(model):
    """``get_metrics_result`` as the class after Keras' torch trainer defines it, where that trainer's own
    one all-reduces the metric states (Keras after 3.15); None where it doesn't (Keras 3.15), or where the
    user's class defines its own."""
    defining = [klass for klass in type(model).__mro__ if "get_metrics_result" in vars(klass)]
    if len(defining) < 2 or not defining[0].__module__.startswith("keras.src.backend.torch."):
        return None
    return vars(defining[1])["get_metrics_result"].__get__(model)


#: The Replica whose train or test step runs in this thread (for the sum-reduction gate).
_stepping = threading.local()


def _gate_sum_reduction():
    """A ``Loss`` with ``reduction="sum"`` gives one device's gradient and logged value in a distributed step.

    One device's gradient is the sum over the global batch; each rank's gradient is weighed by ``n_r / N``
    (right for the mean reductions), which would shrink it. So while a step runs, Keras' ``reduce_values``
    (a private module function of ``keras.src.losses.loss``, which ``Loss.__call__`` looks up at call time:
    the one place Keras reduces a loss) returns ``N / n_r`` times the rank's sum: weighed and summed over
    the ranks, gradient and logged value are the global sum. Idempotent; outside a step, Keras' own.
    Pinned by a test. A sum written by hand with ops can't be told from a mean, and is weighed as one.
    """
    from keras.src.losses import loss as loss_module

    keras_reduce = loss_module.reduce_values
    if getattr(keras_reduce, "_distkeras_torch_gated", False):
        return

    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        loss = keras_reduce(values, sample_weight, reduction)
        replica = getattr(_stepping, "replica", None)
        if os.environ.get("DISTKERAS_TEST_NO_SUM_GATE") or reduction != "sum" or replica is None or not replica.count or not replica.total:
            return loss
        if tuple(getattr(values, "shape", ())) in ((), (0,)):
            return loss
        return loss * (float(replica.total) / float(replica.count))

    reduce_values._distkeras_torch_gated = True
    reduce_values.__wrapped__ = keras_reduce
    loss_module.reduce_values = reduce_values
    _gate_masked_mean(loss_module)


def _gate_masked_mean(loss_module):
    """A masked mean (a Keras mask on the predictions, ``ignore_class``) averages over the kept entries: one device
    over the global batch's, each rank over its own. While a step runs, the weight Keras' ``apply_mask`` gives the
    kept entries (``entries / kept`` of the rank's batch) is that ratio over the global batch (two counts summed
    over the ranks with one all-reduce): weighed by ``n_r / N`` and summed, the ranks' losses are one device's. A
    private module function of ``keras.src.losses.loss``, looked up at call time by ``reduce_weighted_values``;
    pinned by a test (the TensorFlow adapter's :func:`~distkeras.backends.tensorflow.steps.gate_keras_masked_mean`
    is the same rule). Idempotent.
    """
    keras_apply = loss_module.apply_mask
    if getattr(keras_apply, "_distkeras_torch_gated", False):
        return

    def apply_mask(sample_weight, mask, dtype, reduction):
        replica = getattr(_stepping, "replica", None)
        if mask is None or replica is None or replica.world < 2 or reduction not in ("mean", "sum_over_batch_size"):
            return keras_apply(sample_weight, mask, dtype, reduction)
        kept = keras.ops.cast(keras.ops.cast(mask, "bool"), dtype)
        counts = torch.stack([torch.tensor(float(kept.numel()), dtype=torch.float64, device=kept.device),
                              kept.detach().sum().to(torch.float64)]).to(collectives.device())
        if not replica.count:  # a rank without rows of this step runs it on a stand-in: none of its entries count
            counts = torch.zeros_like(counts)
        torch.distributed.all_reduce(counts, group=collectives.data_group())
        ratio = torch.where(counts[1] > 0, counts[0] / counts[1].clamp_min(1.0), torch.zeros_like(counts[0]))
        ratio = keras.ops.cast(ratio.to(kept.device), dtype)  # no .item(): no wait for the device
        weight = keras.ops.where(keras.ops.cast(mask, "bool"), ratio, keras.ops.zeros_like(kept))
        if sample_weight is None:
            return weight
        sample_weight = keras.ops.cast(sample_weight, dtype)
        weight, sample_weight = loss_module.squeeze_or_expand_to_same_rank(weight, sample_weight)
        return sample_weight * weight

    apply_mask._distkeras_torch_gated = True
    apply_mask.__wrapped__ = keras_apply
    loss_module.apply_mask = apply_mask


def _in_step(replica):
    return swapped(_stepping, "replica", replica)


def install(model, replica, sync_batchnorm, overlap, bucket_mb, shard=None, batch_logs="global", steps=None):
    """Install the hooks of the module docstring on ``model`` (already on this rank's device).

    Hooks an earlier call installed are removed first. Keras' cached step functions are dropped, so a
    model trained before makes them again. With ``overlap`` (and more than one rank) the gradients are
    all-reduced in buckets of ``bucket_mb`` MiB during the backward pass
    (:class:`~distkeras.backends.torch_buckets.Buckets`). With ``shard`` (``"optimizer"``, ``"gradients"``,
    ``"all"``) the training state is sharded (:mod:`~distkeras.backends.torch.shard`); with ``"all"`` each
    step first shards the weights of layers built since (``Sharding.prepare_weights``) and ends with every
    weight freed again off its owner. ``batch_logs`` (``"global"``, ``"local"``): whether the logs of each
    step are one device's (where something reads them: :func:`_batch_logs_read`) or this rank's own.
    ``steps``: the train/test/predict steps to wrap instead of the model's own (a pipeline's stage steps).
    """
    uninstall(model)
    replica.batch_logs_mode = batch_logs
    replica.batch_logs = batch_logs == "global"
    _gate_sum_reduction()
    for name in (_PRIVATE_LOGS, _PRIVATE_LAYERS):
        if not callable(getattr(model, name, None)):
            raise DistKerasError(
                "distkeras needs Keras' {}.{}, and this Keras ({}) has none. Install Keras 3.0 or later.".format(
                    "Trainer" if name == _PRIVATE_LOGS else "Layer", name, keras.__version__
                )
            )
    selection = batchnorm.select(model, sync_batchnorm)
    batchnorm.warn_left(selection, replica.process)
    synced = selection.synchronized
    for layer in synced:
        keras_model.hook(layer, batchnorm.MOMENTS, _global_moments(layer, replica))
    global_state = frozenset(id(v) for layer in synced for v in layer.non_trainable_variables)
    global_logs = _global_logs(model, getattr(model, _PRIVATE_LOGS), replica)
    steps = steps or {}
    hooks = {
        "train_step": _train_step(model, steps.get("train_step", model.train_step), replica, global_state, global_logs),
        "test_step": _test_step(model, steps.get("test_step", model.test_step), replica, global_logs),
        "predict_step": _predict_step(model, steps.get("predict_step", model.predict_step), replica),
        _PRIVATE_LOGS: global_logs,
        "fit": _entry(model.fit, replica, sync_random=True, sharded=True, logs="train"),
        "evaluate": _entry(model.evaluate, replica, sharded=True, logs="test"),
        "predict": _entry(model.predict, replica, sharded=True),
    }
    # Keras after 3.15 (keras-nightly 3.16.0.dev) does data parallelism of its own once torch.distributed
    # is initialized: its make_*_function wraps the model in DistributedDataParallel (the private
    # Trainer._initialize_ddp), which averages gradients equally over ranks before distkeras weighs them by
    # their samples, and its get_metrics_result() sums the metric states over the ranks, which
    # _get_metrics_result_or_logs above already did. Both are turned off on the instance; on Keras 3.15,
    # which has neither, nothing changes. Found by scripts/nightly.sh.
    if callable(getattr(type(model), "_initialize_ddp", None)):
        hooks["_initialize_ddp"] = lambda *args, **kwargs: None
    unreduced = _unreduced_metrics_result(model)
    if unreduced is not None:
        hooks["get_metrics_result"] = unreduced
    # Buckets run on a group of every process: not with tensor parallelism's groups of replicas (all at once then).
    overlap = overlap and collectives.data_group() is None
    replica.buckets = torch_buckets.Buckets(replica, bucket_mb) if overlap and replica.world > 1 else None
    if replica.buckets is not None:
        hooks[_BUCKETS] = replica.buckets
    for name, hook in hooks.items():
        keras_model.hook(model, name, hook)
    policies.rank0_writes(model, replica.process)
    agreement.use(agreement.store_board(replica.store, replica.process, replica.processes)
                  if replica.store is not None else None)
    policies.every_rank_calls(model)  # predict()/evaluate() on one rank only: an error within seconds
    replica.shard = None
    if shard is not None:
        replica.shard = torch_shard.Sharding(
            shard, model, replica.rank, replica.world, lambda: broadcast_new_variables(model, replica))
        torch_shard.install(replica.shard)
        if replica.buckets is not None:
            replica.buckets.sharding = replica.shard
            replica.shard.buckets = replica.buckets
            replica.buckets.drop = shard != "optimizer"
    model.train_function = model.test_function = model.predict_function = None


def install_tensor_parallel(model, replica, whole, split, data_parallel=False):
    """The hooks of a model split by tensor parallelism over every rank (:mod:`distkeras.backends.torch.tensor`):
    every rank runs the same global batches (no row split, no gradient all-reduce: what is replicated
    computes alike), quiet off rank 0, rank 0's random state at ``fit()``'s start and every epoch's, and
    ``save``/``save_weights``/``get_weights`` of the whole model: ``whole()`` puts every split variable's whole
    value back for the call (collective), ``split()`` the shards after. Saves follow the saving rule
    (:func:`~distkeras.backends.policies.rank0_writes`); called on one rank only they raise CollectiveError.
    With ``data_parallel`` (several replicas of model shards) :func:`install` has set the data-parallel hooks
    already, on the replicas' groups, and only the whole-model calls are added."""
    if not data_parallel:
        _install_model_shards_only(model, replica)
    for name in ("save", "save_weights", "get_weights", "load_weights", "set_weights"):
        keras_model.hook(model, name, agreement.agreed(_whole_while(getattr(model, name), whole, split), name))


def _install_model_shards_only(model, replica):
    uninstall(model)
    replica.batch_logs = False
    hooks = {
        "fit": _entry(model.fit, replica, sync_random=True),
        "evaluate": _entry(model.evaluate, replica),
        "predict": _entry(model.predict, replica),
    }
    if callable(getattr(type(model), "_initialize_ddp", None)):  # Keras > 3.15's own DDP: off (see install())
        hooks["_initialize_ddp"] = lambda *args, **kwargs: None
    for name, hook in hooks.items():
        keras_model.hook(model, name, hook)
    policies.rank0_writes(model, replica.rank)
    agreement.use(agreement.store_board(replica.store, replica.rank, replica.world) if replica.store is not None else None)
    policies.every_rank_calls(model)
    model.train_function = model.test_function = model.predict_function = None


def _whole_while(method, whole, split):
    @functools.wraps(method)
    def call(*args, **kwargs):
        whole()
        try:
            return method(*args, **kwargs)
        finally:
            split()

    return call


def _global_moments(layer, replica):
    keras_moments = getattr(type(layer), batchnorm.MOMENTS).__get__(layer)

    def moments(inputs, mask):
        if not isinstance(inputs, torch.Tensor) or inputs.device.type == "meta":
            return keras_moments(inputs, mask)  # a symbolic call (shapes only): no data, no collective
        weight = 1 if replica.count is None else replica.count

        def gather(row):
            return collectives.gather_statistics(row, replica.rank, replica.world, weight)

        return batchnorm.global_moments(keras.ops, inputs, layer._reduction_axes, mask, gather, keras.backend.epsilon())

    return moments


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
        replica.applied += 1
        count = 1 if replica.count is None else replica.count
        buckets = replica.buckets

        def update(averaged):
            if replica.shard is not None:  # this rank's variables only, then every owner's sent to all
                return replica.shard.apply(optimizer, apply, averaged, variables)
            return apply(averaged, trainable_variables)

        if buckets is not None and buckets.collecting:  # the backward pass all-reduced them already
            averaged = buckets.finish(grads, variables, count)
            if averaged is not None:
                return update(averaged)
        if not count:  # a stand-in sample's gradients: this rank joins the all-reduce with weight zero
            grads = [None] * len(grads)
        if replica.shard is not None:  # each gradient to its owner only (the owners broadcast the weights after)
            return update(torch_shard_step.reduce_to_owners(grads, variables, count, replica.shard, replica.compression,
                                                       drop=replica.shard.mode != "optimizer"))
        return update(collectives.average_gradients(grads, variables, count, replica.compression))

    keras_model.hook(optimizer, "apply", averaged_apply)
    keras_model.hook(optimizer, "_distkeras_replica", replica)


def _local_state(model, global_state):
    """What a stand-in step must leave as it was: metric states and the model's own non-trainable state
    (per-replica statistics, seed generators), but not what is computed over the job (global statistics)."""
    variables = _metric_variables(model)
    seen = {id(v) for v in variables} | global_state
    return variables + [v for v in model.non_trainable_variables if id(v) not in seen]


def _without_trace(step, data, variables):
    saved = [v.value.detach().clone() for v in variables]
    try:
        return step(data)
    finally:
        for variable, value in zip(variables, saved):
            variable.assign(value)


def _wrap_optimizers(model, replica):
    """The averaging apply on every optimizer the model holds, except one another of them wraps (a
    LossScaleOptimizer's inner optimizer gets the outer one's averages, and must not average again)."""
    optimizers = keras_model.all_optimizers(model)
    inner = {id(getattr(o, "inner_optimizer", None)) for o in optimizers}
    for optimizer in optimizers:
        if id(optimizer) not in inner:
            _wrap_optimizer(optimizer, replica)


def _train_step(model, step, replica, global_state, global_logs):
    def train_step(data):
        # Wrapped here, not once: compile() after distribute() brings new optimizers.
        _wrap_optimizers(model, replica)
        broadcast_new_variables(model, replica)
        if replica.shard is not None:
            replica.shard.prepare_weights()
        local, count, total = replica.split(data)
        replica.count = replica.last_count = count
        replica.total = total
        keras_model.weigh_scalar_means(model, replica.scalar_share)
        replica.applied = 0
        if replica.buckets is not None:
            replica.buckets.begin(model.trainable_variables)
        try:
            with torch_random.global_draws(replica.rank, replica.world, count, total), _in_step(replica):
                if count:
                    logs = step(local)
                else:  # no samples here: a stand-in with weight zero joins the step's collectives
                    logs = _without_trace(step, local, _local_state(model, global_state))
        finally:
            replica.count = None
            if replica.buckets is not None:
                replica.buckets.end()
            if replica.shard is not None:
                replica.shard.release_weights()
        if not replica.applied and model.trainable_weights:
            raise DistKerasError(
                "distkeras averages the replicas' gradients in the apply() of the model's optimizers ({}), and "
                "{}.train_step() ended a step without calling any, so the replicas would train apart. Apply the "
                "gradients with an optimizer the model holds (self.optimizer, or one kept in an attribute, as a "
                "GAN's d_optimizer): optimizer.apply(gradients, variables), as the Keras guide's PyTorch "
                "train_step does, instead of changing the weights by hand.".format(
                    ", ".join(type(o).__name__ for o in keras_model.all_optimizers(model)) or "none",
                    type(model).__name__,
                )
            )
        # The one-device check (distribute(verify=...), its Check held as "_distkeras_check") compares the logs of
        # the step it checks with one device's, so it reads them global ("due" is alike on every rank); Keras is
        # handed what it is handed without the check (the rank's own where nothing reads a batch's logs), so
        # the check leaves no trace in them.
        checked = getattr(model.__dict__.get("_distkeras_check"), "due", False)
        if checked and not replica.batch_logs:
            replica.checked_logs = global_logs(logs)
            return logs
        return global_logs(logs) if replica.batch_logs else logs

    return train_step


def _test_step(model, step, replica, global_logs):
    def test_step(data):
        broadcast_new_variables(model, replica)
        if replica.shard is not None:
            replica.shard.prepare_weights()
        local, count, total = replica.split(data)
        replica.last_count = count
        replica.count, replica.total = count, total
        keras_model.weigh_scalar_means(model, replica.scalar_share)
        try:
            with torch_random.global_draws(replica.rank, replica.world, count, total), _in_step(replica):
                if count:
                    logs = step(local)
                else:
                    logs = _without_trace(step, local, _metric_variables(model))
        finally:
            replica.count = None
        return global_logs(logs) if replica.batch_logs else logs

    return test_step


def _predict_step(model, step, replica):
    """Each rank predicts its rows of the batch; every output with a row per sample is gathered back into
    the global batch's order on every rank (:func:`~distkeras.backends.torch_collectives.gather_rows`)."""

    def predict_step(data):
        broadcast_new_variables(model, replica)
        if replica.shard is not None:
            replica.shard.prepare_weights()
        local, count, total = replica.split(data)
        with torch_random.global_draws(replica.rank, replica.world, count, total):
            outputs = step(local)

        def gather(value):
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == (count or 1):
                return collectives.gather_rows(value, count, replica.rank, replica.world, total)
            return value

        return keras.tree.map_structure(gather, outputs)

    return predict_step


def _metric_variables(model):
    seen, ordered = set(), []
    for metric in sorted(model.metrics, key=lambda m: m.name):
        for variable in metric.variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                ordered.append(variable)
    return ordered


def _global_logs(model, local_logs, replica):
    """The logs of the step or epoch that just ended as one device has them (one all-reduce).

    ``local_logs`` is Keras' ``_get_metrics_result_or_logs``. The metric states are summed over the ranks
    (sorted metric names), read, and put back; a custom step's own scalars travel in the same all-reduce.
    """

    def global_logs(logs):
        if not isinstance(logs, dict):
            return logs
        # A custom step's own logs are its rows' mean: weighted by the rows, their average is the global
        # batch's (a stand-in step's count for nothing).
        weight = 1.0 if replica.last_count is None else float(replica.last_count)
        variables = _metric_variables(model)
        if not variables:
            return collectives.average_logs(logs, weight) if logs else logs
        metrics = {metric.name: metric for metric in model.metrics}
        others = {k: collectives.plain(v) for k, v in logs.items() if k not in metrics}
        names = sorted(k for k, v in others.items() if isinstance(v, float))
        saved = [v.value.detach().clone() for v in variables]
        try:
            sums = collectives.all_reduce_states(
                variables, replica.rank, replica.world, [others[k] * weight for k in names] + [weight])
            result = local_logs(logs)
            if result is not logs:
                return {name: collectives.plain(value) for name, value in result.items()}
            # A custom step's logs, which Keras passes through: those named after a metric are its global result.
            others.update(zip(names, (value / (sums[-1] or 1.0) for value in sums[:-1])))
            return {k: collectives.plain(metrics[k].result()) if k in metrics else others[k] for k in logs}
        finally:  # the local states again: the global ones are never counted twice
            for variable, value in zip(variables, saved):
                variable.assign(value)

    return global_logs


class _SyncRandomState(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        collectives.sync_random_state()


def _split_batch_note(exc, bound, world):
    """What ``exc`` (raised by fit/evaluate/predict) likely means where it names the global batch size while each
    rank holds its share (:func:`~distkeras.backends.policies.split_batch_note`), else None. The rank's share is
    about ``batch_size / world``; Keras' default batch size is 32."""
    total = bound.get("batch_size") or 32
    if not isinstance(total, int) or world < 2 or total < world:
        return None
    text = "\n".join(str(e) for e in _chain(exc))
    for rows in sorted({-(-total // world), total // world}):
        said = policies.split_batch_note(_Text(text), rows, total)
        if said is not None:
            return str(exc) + said[len(text):]
    return None


class _Text(Exception):
    """A message to read, as an exception (:func:`~distkeras.backends.policies.split_batch_note` takes one)."""


def _chain(exc):
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _entry(method, replica, sync_random=False, sharded=False, logs=None):
    """fit/evaluate/predict: quiet off rank 0; a dead self-launched worker reported by rank and exit code;
    with ``sharded``, each rank reads only its rows of array data (:func:`sharded_batches`); with ``logs``
    (``"train"``, ``"test"``), the steps of the call return one device's logs only where something reads
    them (:func:`_batch_logs_read`)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def entry(*args, **kwargs):
        bound = keras_model.Arguments(signature, args, kwargs)
        outer = replica.batch_logs
        if logs is not None and replica.batch_logs_mode == "global":
            reads = _batch_logs_read(bound.get("callbacks"), bound.get("verbose", "auto"), logs == "train")
            replica.batch_logs = collectives.any_rank(reads)  # every rank alike, or the steps' collectives differ
        if replica.process != 0:
            bound.set("verbose", 0)
        try:
            if sync_random:
                collectives.sync_random_state()
                callbacks = bound.get("callbacks")
                if callbacks is None or isinstance(callbacks, (list, tuple)):
                    bound.set("callbacks", [_SyncRandomState()] + list(callbacks or []))
            if not sharded:
                return method(*bound.args, **bound.kwargs)
            with sharded_batches(replica):
                return method(*bound.args, **bound.kwargs)
        except Exception as exc:
            note = _split_batch_note(exc, bound, replica.world)
            # A collective with a dead rank fails (RuntimeError) about when the watcher sees the exit.
            wait = 2.0 if isinstance(exc, RuntimeError) else 0.0
            failure = replica.launch_failure(wait) if replica.launch_failure else None
            if failure:
                # The other rank most likely met what this one did: say both, this one's own error last.
                own = policies.first_line(_chain(exc)[-1])  # the root cause
                raise LaunchError("{} Rank {} raised: {}{}".format(
                    failure, replica.process, own, note[len(str(exc)):] if note else "")) from exc
            if note is not None and hasattr(exc, "add_note"):
                exc.add_note(note[len(str(exc)):].strip())
            raise
        finally:
            replica.batch_logs = outer

    return entry


#: What a callback overrides when it reads the logs of each batch of fit() (train) or evaluate() (test).
_BATCH_END = {True: ("on_train_batch_end", "on_batch_end"), False: ("on_test_batch_end",)}


def _batch_logs_read(callbacks, verbose, train):
    """Whether anything in a ``fit()`` (``train``) or ``evaluate()`` call reads the logs of each batch, so that
    the steps must return one device's (one small all-reduce each).

    Keras' ``CallbackList`` hands every batch's logs to each callback; only these read them: Keras' progress
    bar (``ProgbarLogger``) at ``verbose=1`` (``"auto"`` is 1) outside ``fit()``'s validation, and any
    callback with a batch-end method of its own (a ``LossHistory``, ``TerminateOnNaN``, ``TensorBoard``,
    ``ModelCheckpoint``, a ``LambdaCallback`` given one). ``History`` reads epoch logs only. Epoch logs are
    one device's either way (:func:`_global_logs`).
    """
    listed = isinstance(callbacks, keras.callbacks.CallbackList)  # fit()'s own, handed to its validation
    progbar = not listed  # Keras adds a bar to a plain list where verbose != 0
    for callback in keras.tree.flatten(callbacks.callbacks if listed else callbacks or []):
        if type(callback) is keras.callbacks.ProgbarLogger:
            progbar = False  # this one decides
            level = callback.verbose if listed else verbose  # a CallbackList's bar is set up already
            # _called_in_fit (a Keras private): a bar that fit() set up shows none of its validation batches.
            if level in (1, "auto") and (train or not getattr(callback, "_called_in_fit", False)):
                return True
            continue
        for name in _BATCH_END[train]:
            method = getattr(callback, name, None)
            if getattr(method, "__func__", method) is not getattr(keras.callbacks.Callback, name):
                return True
    return progbar and verbose in (1, "auto")
