"""Hand-written training loops on a distributed model: three calls, the same on every backend.

keras.io's "Writing a training loop from scratch" guides (one for TensorFlow, JAX and PyTorch) iterate a
dataset, compute gradients themselves and call ``optimizer.apply`` (or ``stateless_apply``, or a torch
optimizer's ``step``). On a distributed model such a loop needs to know three things that ``fit()`` knows:
which rows of each batch this replica computes, which step function runs once per replica, and which
optimizers and metrics belong to the job. The three calls say it, in the spirit of Horovod's
``DistributedOptimizer``, ``tf.distribute``'s ``experimental_distribute_dataset`` + ``strategy.run`` and
torch's ``DistributedSampler`` + DDP::

    train_dataset = distkeras.distribute_dataset(train_dataset, model)          # distkeras:
    distkeras.attach(model, optimizer, train_acc_metric, val_acc_metric)        # distkeras:
    train_step = distkeras.distribute_step(train_step, model)                   # distkeras:

Each step then computes what one device computes on the whole global batch: gradients averaged by each
replica's share of the batch before the optimizer uses them, metric results over the whole batch. A call a
backend doesn't need returns its argument unchanged, so one script runs on every backend:

============  ===========================================  =======================================  =====================
backend       ``distribute_dataset``                       ``distribute_step``                      ``attach``
============  ===========================================  =======================================  =====================
TensorFlow    ``strategy.experimental_distribute_dataset``  ``strategy.run`` per replica, outputs    optimizer and metric
                                                           reduced to one device's                  variables mirrored
JAX           unchanged                                    the batch's arrays laid out on the       variables laid out on
                                                           mesh's batch axis, then the user's jit   the mesh
PyTorch       this rank's rows ``[rank::world]``           unchanged                                gradients averaged by
                                                                                                    rows, metrics summed
============  ===========================================  =======================================  =====================

A loop without them is caught at its first step: TensorFlow raises :class:`~distkeras.errors.LoopError` from
``optimizer.apply``; JAX and PyTorch warn once when the model is called outside ``fit``/``evaluate``/
``predict`` on data no distributed dataset or step gave it.

Backend-neutral: this module imports no framework; each backend's primitives are in
``distkeras.backends.<name>.loops``.
"""

import importlib
import importlib.util

from . import backends
from .parallel import pipeline
from .errors import ModelError


def _backend_loops(model):
    if backends.keras_package(model) is None:
        raise ModelError(
            "Expected a Keras model distributed with distkeras.distribute(). Received: {!r} of type {}".format(
                model, type(model).__name__))
    if getattr(model, "__dict__", {}).get(pipeline.PLAN) is not None:
        raise ModelError(
            "Hand-written loops (distribute_dataset, distribute_step, attach) don't drive pipeline stages: {!r} is cut "
            "into stages (pipeline_stages=), each on its own device, and only fit(), evaluate() and predict() run "
            "them in turn. Use fit(), or distribute the model without pipeline_stages for this loop.".format(model.name))
    name = backends.active_name(model)
    if importlib.util.find_spec("distkeras.backends.{}.loops".format(name)) is None:  # a backend without loops
        raise ModelError("Hand-written loops are supported on TensorFlow, JAX and PyTorch (Keras 3); this model's "
                         "backend is {}. Use fit().".format(name))
    return importlib.import_module("distkeras.backends.{}.loops".format(name))


def distribute_dataset(dataset, model):
    """The batches of ``dataset`` as this replica's step takes them.

    Args:
        dataset: the loop's dataset of global batches, as it iterates on one device: a ``tf.data.Dataset``
            (TensorFlow: required), a torch ``DataLoader`` or any re-iterable of batches (tuples or dicts of
            arrays or tensors whose first axis is the batch).
        model: the model given to :func:`distkeras.distribute`.

    Returns:
        TensorFlow: the strategy's distributed dataset (each replica's part of every batch, for
        :func:`distribute_step`). PyTorch: an iterable yielding this process' rows ``[rank::world]`` of every
        batch (the split ``fit()`` uses). JAX: ``dataset`` itself (:func:`distribute_step` lays the batch out).

    Raises:
        ModelError: ``model`` is not a distributed Keras 3 model on TensorFlow, JAX or PyTorch.
        LoopError: TensorFlow was given something other than a ``tf.data.Dataset``.
    """
    return _backend_loops(model).distribute_dataset(dataset, model)


def distribute_step(step, model):
    """``step`` run as one step of the whole global batch, by every replica.

    Args:
        step: the loop's step function (a ``tf.function``, a ``jax.jit`` function or a plain one) taking the
            batches :func:`distribute_dataset` gives.
        model: the model given to :func:`distkeras.distribute`.

    Returns:
        TensorFlow: a ``tf.function`` running ``step`` once per replica (``strategy.run``) on its part of the
        batch; what it returns is one device's: a scalar weighed by each replica's share of the batch and
        summed (a loss), a tensor with the replica's rows concatenated (logits), anything else replica 0's.
        JAX: a function laying out the batch's arrays (NumPy, TensorFlow or torch ones: not the state's JAX
        arrays and variables) along the mesh's batch axis, then calling ``step``. PyTorch: ``step``.
    """
    return _backend_loops(model).distribute_step(step, model)


def attach(model, *objects):
    """Attach the optimizers and metrics a hand-written loop uses to the distributed model, in place.

    Args:
        model: the model given to :func:`distkeras.distribute`.
        *objects: Keras optimizers, Keras metrics and (PyTorch) ``torch.optim`` optimizers. ``model.optimizer``
            and the model's compiled metrics are attached already; attaching them again changes nothing.

    Returns:
        The one object given, or the tuple of them, each distributed in place: an optimizer applies the global
        gradient (every replica's weighed by its share of the batch, before clipping or any other use), a
        metric's ``result()`` is the one over every replica's rows.

    Raises:
        LoopError: an object that is neither an optimizer nor a metric.
    """
    loops = _backend_loops(model)
    for obj in objects:
        loops.attach(model, obj)
    return objects[0] if len(objects) == 1 else objects
