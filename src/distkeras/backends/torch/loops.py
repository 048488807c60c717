"""PyTorch's primitives for hand-written loops (:mod:`distkeras.loops`).

Each process is one replica and runs the user's loop itself. :func:`distribute_dataset` hands it its rows
``[rank::world]`` of every global batch (the rows ``fit()`` gives it: each global step uses exactly the samples
one device uses) and remembers how many rows this rank and the whole batch have. An attached optimizer averages
the gradients over the ranks, each weighed by its rows (:func:`~distkeras.backends.torch.collectives.average_gradients`),
before Keras' ``apply`` or torch's ``step`` uses them; an attached metric's ``result()`` is computed from its
state summed over the ranks (every rank calls it, as the guides do), the rank's own state kept.

A model called outside ``fit``/``evaluate``/``predict`` on a multi-process job with a batch no distributed dataset
gave warns once: every rank would compute the whole batch.
"""

import functools
import logging
import weakref

import keras
import torch
import torch.distributed as dist

from ...errors import LoopError
from .. import keras_model
from . import collectives

logger = logging.getLogger("distkeras")

#: Model -> its :class:`_Loop`, for every distributed model.
_loops = weakref.WeakKeyDictionary()
_HOOKED = "call"
#: The model's own loops, wrapped (after the adapter's hooks) to tell their calls of the model from a loop's.
_KERAS_LOOPS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
#: The attribute the adapter's fit() reads to know an optimizer averages already (torch trainer's marker).
_FIT_MARKER = "_distkeras_replica"


class _Loop(object):
    """This rank's place (``replica``: the trainer's Replica) and the rows of the batch a loop took last."""

    def __init__(self, replica):
        self.replica = replica
        self.count = None  # this rank's rows of the last batch a distributed dataset gave
        self.total = None  # that global batch's rows
        self.batch = ()  # its leaves (what the model may be called on without a warning)
        self.warned = False
        self.inside = 0  # fit/evaluate/predict calls in flight


def install(model, replica):
    """Know ``model``'s replica, and warn once when a loop calls it on a whole batch."""
    loop = _Loop(replica)
    _loops[model] = loop
    if replica.world > 1:
        keras_model.hook(model, _HOOKED, _checked(model, type(model).call.__get__(model), loop))
        for name in _KERAS_LOOPS:  # their calls of the model are split already
            keras_model.hook(model, name, _inside(getattr(model, name), loop))


def _loop(model):
    loop = _loops.get(model)
    if loop is None:
        raise LoopError.not_distributed(model, "PyTorch")
    return loop


class _Rows(object):
    """``dataset``'s batches, this rank's rows of each."""

    def __init__(self, dataset, loop):
        self.dataset = dataset
        self.loop = loop

    def __iter__(self):
        for batch in self.dataset:
            rows, count, total = self.loop.replica.rows_of(batch)
            self.loop.count, self.loop.total = count, total
            self.loop.batch = tuple(keras.tree.flatten(rows))
            yield rows

    def __len__(self):
        return len(self.dataset)


def distribute_dataset(dataset, model):
    """An iterable of this rank's rows ``[rank::world]`` of every batch of ``dataset``."""
    loop = _loop(model)
    if not hasattr(dataset, "__iter__"):
        raise LoopError("Expected an iterable of batches (a torch DataLoader, a tf.data.Dataset, a list of (x, y)) "
                        "for distribute_dataset(). Received: {!r} of type {}".format(dataset, type(dataset).__name__))
    return _Rows(dataset, loop)


def distribute_step(step, model):
    """``step`` itself: each process runs its own step on its rows."""
    _loop(model)
    return step


def attach(model, obj):
    """An optimizer averaging the ranks' gradients by their rows first; a metric whose result is the job's."""
    loop = _loop(model)
    if loop.replica.shard is not None:
        raise LoopError("Hand-written loops need the training state replicated; this model was distributed with "
                        "shard={!r}. Use fit(), or distribute(model) without shard.".format(loop.replica.shard.mode))
    if isinstance(obj, keras.optimizers.Optimizer):
        keras_model.hook(obj, "apply", _averaged_apply(obj, loop))
        keras_model.unhook(obj, _FIT_MARKER)  # fit() puts its own averaging back for its steps
    elif isinstance(obj, torch.optim.Optimizer):
        keras_model.hook(obj, "step", _averaged_step(obj, loop))
    elif isinstance(obj, keras.metrics.Metric):
        keras_model.hook(obj, "result", _global_result(obj, loop))
    else:
        raise LoopError("Expected Keras optimizers, torch.optim optimizers and Keras metrics for attach(). Received: "
                        "{!r} of type {}".format(obj, type(obj).__name__))


def _count(loop):
    """This rank's weight in the step: its rows of the last batch (1 alike where no distributed dataset gave one)."""
    return 1 if loop.count is None else loop.count


def _averaged_apply(optimizer, loop):
    apply = type(optimizer).apply.__get__(optimizer)

    def averaged_apply(grads, trainable_variables=None):
        grads = list(grads)
        variables = optimizer._trainable_variables if trainable_variables is None else list(trainable_variables)
        if loop.replica.world == 1 or not grads or len(grads) != len(variables):
            return apply(grads, trainable_variables)  # Keras' own checks and messages
        count = _count(loop)
        if not count:  # a stand-in row's gradients: this rank joins with weight zero
            grads = [None] * len(grads)
        averaged = collectives.average_gradients(grads, variables, count, loop.replica.compression)
        return apply(averaged, trainable_variables)

    return averaged_apply


def _averaged_step(optimizer, loop):
    step = type(optimizer).step.__get__(optimizer)

    @functools.wraps(step)
    def averaged_step(*args, **kwargs):
        if loop.replica.world > 1:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            count = float(_count(loop))
            grads = [p.grad for p in params]
            present = [g for g in grads if g is not None]
            device = present[0].device if present else params[0].device
            flat = torch.cat([(g.detach().reshape(-1).to(torch.float32) * count) if g is not None else
                              torch.zeros(p.numel(), dtype=torch.float32, device=device) for p, g in zip(params, grads)]
                             + [torch.tensor([float(g is not None) for g in grads] + [count], device=device)])
            dist.all_reduce(flat, group=collectives.data_group())
            total = float(flat[-1]) or 1.0
            offset = 0
            for index, (param, grad) in enumerate(zip(params, grads)):
                size = param.numel()
                if float(flat[flat.numel() - 1 - len(params) + index]) > 0:
                    value = (flat[offset : offset + size] / total).view(param.shape).to(param.dtype)
                    param.grad = value if grad is None else grad.copy_(value)
                offset += size
        return step(*args, **kwargs)

    return averaged_step


def _global_result(metric, loop):
    result = type(metric).result.__get__(metric)

    def global_result():
        variables = list(metric.variables)
        if loop.replica.world == 1 or not variables:
            return result()
        saved = [v.value.detach().clone() for v in variables]
        try:
            collectives.all_reduce_states(variables, loop.replica.rank, loop.replica.world)
            return result()
        finally:  # this rank's own state again: the next updates add to it, not to the job's sum
            for variable, value in zip(variables, saved):
                variable.assign(value)

    return global_result


def _checked(model, call, loop):
    @functools.wraps(call)
    def checked_call(*args, **kwargs):
        if not loop.warned and not loop.inside:
            _check_call(model, loop, args, kwargs)
        return call(*args, **kwargs)

    return checked_call


def _inside(method, loop):
    @functools.wraps(method)
    def inside(*args, **kwargs):
        loop.inside += 1
        try:
            return method(*args, **kwargs)
        finally:
            loop.inside -= 1

    return inside


def _check_call(model, loop, args, kwargs):
    leaves = [leaf for leaf in keras.tree.flatten((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    if not leaves or leaves[0].device.type == "meta" or any(leaves[0] is leaf for leaf in loop.batch):
        return
    if not leaves[0].dim():
        return
    loop.warned = True
    logger.warning(
        "%s %r, distributed over %d processes, was called outside fit()/evaluate()/predict() on a batch that no "
        "distkeras.distribute_dataset() gave: every process computes the whole batch. In a hand-written loop "
        "iterate train_dataset = distkeras.distribute_dataset(train_dataset, model) and attach the optimizer and "
        "metrics: distkeras.attach(model, optimizer, *metrics) (see docs/loops.md).",
        type(model).__name__, model.name, loop.replica.world)
