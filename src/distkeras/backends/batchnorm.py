"""Which BatchNormalization layers distkeras synchronizes, and the global statistics they then use: one rule,
written once, for every backend.

In training, ``keras.layers.BatchNormalization`` normalizes with the mean and variance of its batch. Data
parallel, each replica holds a share of the global batch; a *synchronized* layer takes the mean and variance
of the whole global batch instead, so N devices train what one device trains (normalization, moving
statistics and the gradient through the statistics). The layer's config is unchanged: Keras' own
``synchronized=True`` would be saved with the model and make the file refuse to load on JAX and PyTorch.

**The rule.** A layer is synchronized when it is a ``keras.layers.BatchNormalization`` (the class or a
subclass) whose ``_moments`` is Keras' own: no class between it and BatchNormalization defines ``_moments``
(the private method where ``BatchNormalization.call`` computes its batch statistics, and the one place
distkeras changes, on the instance). So:

- a subclass that only adds arguments, config, weights or other methods is synchronized like its parent;
- a subclass that overrides ``call`` is synchronized wherever its ``call`` reaches ``_moments``
  (``super().call(...)`` does); statistics its own ``call`` computes without it are its own;
- a subclass that defines its own ``_moments`` keeps it: distkeras never replaces code of the user's. Each
  replica then computes what that code computes, over its own share of the batch. One warning (on rank 0)
  names those layers and says how to opt in or out (:func:`left_message`): give the class no ``_moments``
  of its own, or pass ``sync_batchnorm="all"``, which replaces every BatchNormalization's ``_moments``,
  overrides included, by Keras' formula over the global batch; ``sync_batchnorm=False`` synchronizes none.

**Per backend.**

- TensorFlow (Keras 3) and PyTorch: the rule above, with the option ``sync_batchnorm`` (True, the default;
  ``"all"``; False). The collective is ``ReplicaContext.all_reduce`` on TensorFlow, one ``torch.distributed``
  all-reduce per layer call forward and one backward on PyTorch. With ``sync_batchnorm=False`` every replica
  normalizes with its own share's statistics (a replica a short batch leaves without rows gets zeros, not NaN).
- JAX: an uncompressed step is one SPMD program over the global batch, so every layer, whatever its class and
  its ``_moments``, already sees the whole batch: all are global, there is nothing to select and nothing to
  warn about. With ``compression`` the gradient is computed per shard inside ``shard_map``, and the rule
  applies (the collective is ``jax.lax.all_gather``); a subclass with its own ``_moments`` sees its shard,
  and dropping ``compression`` gives it the whole batch again. JAX has no ``sync_batchnorm`` option.
- tf.keras 2.x models on TensorFlow: not synchronized (their layers are rebuilt inside the strategy; each
  replica normalizes with its own share's statistics).
- MXNet (keras-mxnet): not synchronized. keras-mxnet binds one MXNet module over the contexts, and MXNet's
  BatchNorm operator normalizes each context's slice of the batch with that slice's statistics; the moving
  statistics are the contexts' own (each worker of a job starts from rank 0's). The compiled graph offers no
  hook between the contexts' forward passes.
- CNTK: not synchronized. Each MPI rank runs Keras 2's graph on its rows alone; CNTK's distributed learner
  aggregates gradients only, so each rank normalizes with its own rows' statistics.

Neutral: no framework is imported at module level; Python 3.6 compatible.
"""

import collections
import logging

from ..errors import DistKerasError, OptionError
from . import keras_model

logger = logging.getLogger("distkeras")

#: The private method of ``keras.layers.BatchNormalization`` that computes the batch statistics.
MOMENTS = "_moments"

#: ``sync_batchnorm``, as an adapter's ``options`` describe it.
OPTION_HELP = ("BatchNormalization statistics of the whole global batch: True (default; a subclass with its own "
               "_moments keeps it, per replica, with a warning), 'all' (overrides of _moments replaced too) or False "
               "(per replica)")

#: What the rule decided: the layers to synchronize, and the others, each as ``(layer, reason)``.
Selection = collections.namedtuple("Selection", ["synchronized", "left"])
#: Reasons a layer is left unsynchronized.
OWN_MOMENTS = "own _moments"
NOT_ASKED = "sync_batchnorm=False"


def check_option(value):
    """``sync_batchnorm`` as given, checked.

    Raises:
        OptionError: anything but True, False or "all".
    """
    if value is True or value is False or value == "all":
        return value
    raise OptionError("Expected sync_batchnorm to be True, False or 'all'. Received: sync_batchnorm={!r}".format(value))


def own_moments(layer):
    """The class that defines ``layer``'s own ``_moments``, or None where it is Keras' (or Keras has none)."""
    import keras

    base = getattr(keras.layers.BatchNormalization, MOMENTS, None)
    for klass in type(layer).__mro__:
        if klass is keras.layers.BatchNormalization:
            return None
        if MOMENTS in vars(klass) and vars(klass)[MOMENTS] is not base:
            return klass
    return None


def unhook(model):
    """Remove the ``_moments`` an earlier ``distribute()`` set on the model's BatchNormalization layers (their
    class's shows through again), so a second call applies its own choice."""
    import keras

    for layer in keras_model.layers_of(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            keras_model.unhook(layer, MOMENTS)


def select(model, sync_batchnorm=True):
    """Apply the rule to every BatchNormalization layer of ``model`` (nested models and layers included).

    Args:
        model: a Keras 3 model.
        sync_batchnorm: True (the rule), "all" (every layer, overrides of ``_moments`` included) or False (none).

    Returns:
        A :data:`Selection`: ``synchronized``, the layers whose ``_moments`` the adapter makes global, and
        ``left``, ``(layer, reason)`` for the others (:data:`OWN_MOMENTS`, :data:`NOT_ASKED`).

    Raises:
        DistKerasError: the model has BatchNormalization layers to synchronize and this Keras has no
            ``BatchNormalization._moments``.
    """
    import keras

    sync_batchnorm = check_option(sync_batchnorm)
    layers = [layer for layer in keras_model.layers_of(model) if isinstance(layer, keras.layers.BatchNormalization)]
    if not sync_batchnorm:
        return Selection([], [(layer, NOT_ASKED) for layer in layers])
    if layers and not callable(getattr(keras.layers.BatchNormalization, MOMENTS, None)):
        raise DistKerasError(
            "distkeras synchronizes BatchNormalization through Keras' BatchNormalization.{}, and this Keras ({}) "
            "has none. Pass sync_batchnorm=False to distribute() (each replica then normalizes with the "
            "statistics of its own share of the batch).".format(MOMENTS, keras.__version__))
    synchronized, left = [], []
    for layer in layers:
        if sync_batchnorm != "all" and own_moments(layer) is not None:
            left.append((layer, OWN_MOMENTS))
        else:
            synchronized.append(layer)
    return Selection(synchronized, left)


#: How to opt in and out where ``sync_batchnorm`` is an option (TensorFlow, PyTorch).
OPT_IN = ("give the class no _moments of its own, or pass sync_batchnorm='all' (every BatchNormalization's "
          "_moments is then Keras' formula over the global batch, overrides included)")
OPT_OUT = "pass sync_batchnorm=False (no layer synchronized)"


def left_message(selection, opt_in=OPT_IN, opt_out=OPT_OUT):
    """The warning for the layers :func:`select` left for their own ``_moments``; None where there are none."""
    own = [layer for layer, reason in selection.left if reason == OWN_MOMENTS]
    if not own:
        return None
    named = ", ".join("'{}' ({}.{})".format(layer.name, own_moments(layer).__name__, MOMENTS) for layer in own)
    text = ("BatchNormalization layer(s) {} compute their batch statistics in a {} of their own, which distkeras "
            "leaves as it is: in training each replica normalizes them with the statistics of its own share of the "
            "batch, not of the global batch. To synchronize them, {}".format(named, MOMENTS, opt_in))
    return text + ("; to silence this, {}.".format(opt_out) if opt_out else ".")


def warn_left(selection, rank, opt_in=OPT_IN, opt_out=OPT_OUT):
    """Log :func:`left_message` once, on rank 0 (the other ranks stay quiet)."""
    text = left_message(selection, opt_in, opt_out)
    if text and rank == 0:
        logger.warning(text)
    return text


def global_moments(ops, inputs, axes, mask, gather, epsilon=0.0):
    """Keras' ``BatchNormalization._moments`` over the global batch: mean and (biased) variance of ``inputs``
    over ``axes`` and over every replica's share of the batch.

    Each replica computes, per channel, its element count, its mean and its sum of squared deviations from
    that mean (a mask weighs the elements, as Keras' ``_moments`` does); ``gather`` stacks every replica's
    row; the global statistics follow from Chan's parallel formula, stable, with one collective::

        mean     = sum_r n_r m_r / (N + epsilon)
        variance = sum_r (S_r + n_r (m_r - mean)^2) / (N + epsilon)

    which is exactly Keras' single-device formula (with a mask, Keras adds ``epsilon`` to the weight sum;
    without one it adds nothing). A replica with no rows contributes nothing. Differentiable: the gradient
    reaches every replica's inputs through ``gather``.

    Args:
        ops: the framework's ops, as ``keras.ops`` gives them (``sum``, ``square``, ``stack``...).
        inputs: this replica's share of the batch.
        axes: the axes reduced (the layer's ``_reduction_axes``).
        mask: None, or a mask with one dimension less than ``inputs``.
        gather: ``row -> table``, the backend's collective: every replica's ``row`` (``(3,) + channel shape``)
            stacked along a new first axis, in replica order (or this replica's alone, for per-replica statistics).
        epsilon: added to the element count where a mask weighs the elements (Keras' ``backend.epsilon()``).

    Returns:
        ``(mean, variance)``, shaped as Keras' ``_moments`` returns them (the reduced axes dropped).
    """
    axes = tuple(sorted(a % len(inputs.shape) for a in axes))
    x = inputs
    if mask is None:
        weights = None
        total = ops.sum(x, axis=axes, keepdims=True)
        per_channel = ops.cast(ops.size(x), x.dtype) / ops.cast(ops.size(total), x.dtype)
        count = ops.ones_like(total) * per_channel
        epsilon = 0.0
    else:
        weights = ops.broadcast_to(ops.expand_dims(ops.cast(mask, "bool"), -1), ops.shape(x))
        total = ops.sum(ops.where(weights, x, 0.0), axis=axes, keepdims=True)
        count = ops.sum(ops.cast(weights, x.dtype), axis=axes, keepdims=True)
    mean = total / ops.maximum(count, 1.0)  # a replica without rows: 0, not NaN
    squared = ops.square(x - mean)
    squares = ops.sum(squared if weights is None else ops.where(weights, squared, 0.0), axis=axes, keepdims=True)
    table = gather(ops.stack([count, mean, squares]))
    counts, means, squares = table[:, 0], table[:, 1], table[:, 2]
    denominator = ops.maximum(ops.sum(counts, axis=0), 1.0) + epsilon
    global_mean = ops.sum(counts * means, axis=0) / denominator
    variance = ops.sum(squares + counts * ops.square(means - global_mean), axis=0) / denominator
    return ops.squeeze(global_mean, axis=axes), ops.squeeze(variance, axis=axes)
