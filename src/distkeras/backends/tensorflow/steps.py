"""What a TensorFlow replica knows of the step it runs, and the two rules built on it: losses and random draws.

MirroredStrategy runs a step as ``strategy.run(step, args=(data,))``, every replica in a thread of its
own, each on its rows of the global batch (the batch split into contiguous chunks in replica order).
:func:`tell_replicas_their_rows` wraps the strategy's ``run`` so that each replica holds, in a
thread-local, its :class:`Rows`: how many rows it has, where they start in the global batch, and the
global batch size. On one host all of it is known before the replicas start (every replica's batch is
at hand); across workers the replicas all-gather their batch sizes (one small collective a step).

**One loss rule.** Keras divides some losses by the replica count (``scale_loss_for_distribution``: a
compiled loss that reduces over the batch, ``add_loss`` terms) and not others (a loss function that
returns a scalar, a loss written by hand with ops, a ``Loss`` object whose value a custom step reports),
and undoes its division for the loss it logs. While a replica runs a step, :func:`gate_keras_loss_scaling`
makes both functions the identity, so every loss a replica computes, however it is written, is its own
mean over its own rows, as one device computes it over the whole batch; the optimizer hook (:mod:`.mirror`)
then hands the optimizer ``sum_r (n_r / N) * g_r`` (:func:`batch_share`), the gradient of the global
mean. A ``Loss`` object with ``reduction="sum"`` returns N / n_r times its replica's sum, so its gradient
and logged value are one device's sum. The logged loss is one device's too: Keras' loss tracker and a
custom step's ``Mean`` metrics keep sync-on-read totals and counts, which are summed over the replicas
when read. Not exact: a sum written by hand with ops (weighed as if it were a mean), a ``Loss`` with
``reduction="mean_with_sample_weight"`` and uneven sample weights (weighed by row count, not by weight),
and a sum a custom step returns itself (weighed as if it were a mean).

**A custom step's logs.** Keras averages the values a step returns over the replicas and, where their
names are not exactly the model's metrics' (a custom step's own values), reports the last step's as the
epoch's and ``evaluate()``'s. :func:`one_device_step_logs` makes every metric's ``result()`` read inside a
custom step the result over all replicas (the variables all-reduced, read through Keras'
``stateless_result``), and weighs every other scalar it returns by ``R * n_r / N``: Keras' average is then
the global batch's value (a replica a short batch left empty counts for nothing).

**Gathers.** :func:`depends_on_batch` tells the indices of a sparse gradient looked up per sample (token
ids: the replicas' slices, concatenated, are one device's) from indices no sample gives (a position
embedding's ``arange``: the same on every replica; one device has their values summed).

**Empty replicas.** :func:`convolve_empty_batches`: TensorFlow's oneDNN convolution and pooling kernels
mishandle a batch of no rows, which a replica gets when a batch is smaller than the replica count.

**Random draws.** Keras' seed generators are mirrored variables, so every replica draws with the same
seed. While a replica runs a step, :func:`draw_like_one_device` has Keras' TensorFlow random functions
draw a value whose leading dimension is the replica's row count at the global batch size instead, with
the same seed, and keep the replica's rows: exactly what one device draws for those rows. A leading
dimension k times the row count that is only known when the step runs (noise over
``concatenate([generated, real])``, as the Keras GAN guides draw label noise) is read as k batches
concatenated: drawn at k times the global batch, the replica keeps its rows of each block. Exact for
``normal``, ``uniform``, ``truncated_normal``, ``randint``, ``dropout``, and ``gamma``, ``binomial``,
``beta`` with scalar parameters. ``categorical`` and ``gamma``/``binomial``/``beta`` with per-row
parameters draw over parameters placed at the replica's rows of the global batch: independent for every
replica, not shown to be one device's. ``shuffle``
along the batch can't be one device's (its permutation mixes all rows) and permutes each replica's rows
by keys drawn for its own rows. Draws of any other shape are the same on every replica, as on one device;
one whose leading dimension equals the replica's row count by coincidence (a weight-shaped draw) is not.
Across workers a worker's rows are not a contiguous block of the global batch: draws are independent
per replica there, not one device's.
"""

import contextlib
import inspect
import threading
from typing import NamedTuple

from .. import policies

_held = threading.local()


class Rows(NamedTuple):
    """A replica's rows of the global batch (scalar int32 tensors); ``exact_losses``: the loss rule is on;
    ``batch``: the replica's batch tensors (what :func:`depends_on_batch` looks for)."""

    local: object
    offset: object
    total: object
    exact_losses: bool
    batch: tuple = ()


def current():
    """The :class:`Rows` of the replica step running in this thread, or None."""
    return getattr(_held, "rows", None)


@contextlib.contextmanager
def holding_rows(rows):
    """This thread's step holds ``rows`` (a :class:`Rows`) for the ``with`` block: a pipeline stage's micro-batch
    (:mod:`.pipeline`) draws its rows of the global batch's draws as a replica does."""
    outer, _held.rows = current(), rows
    try:
        yield
    finally:
        _held.rows = outer


def tell_replicas_their_rows(tf, strategy, exact_losses):
    """Wrap ``strategy.run`` (this instance only, which distkeras made) so each replica holds its :class:`Rows`.

    A run whose arguments' first leaf isn't one batch per local replica (a custom loop's own arguments), or
    whose function is itself a ``tf.function``, goes through unchanged: Keras' own rules apply there.
    """
    run = strategy.run
    replicas = strategy.num_replicas_in_sync
    local_replicas = len(strategy.extended.worker_devices)

    def first_batch(structure):
        for leaf in tf.nest.flatten(structure):
            if leaf is not None:
                return leaf
        return None

    def sizes_known_here(args, kwargs):
        """Every replica's row count when they are all in this process, else None; False: not a batch."""
        leaf = first_batch((args, kwargs))
        if not isinstance(leaf, tf.distribute.DistributedValues) or len(leaf.values) != local_replicas:
            return False
        if not all(isinstance(value, tf.Tensor) and value.shape.rank for value in leaf.values):
            return False
        if local_replicas != replicas:
            return None
        return tf.stack([tf.shape(value)[0] for value in leaf.values])

    def run_telling_rows(fn, args=(), kwargs=None, options=None):
        sizes = False
        if not isinstance(fn, tf.types.experimental.GenericFunction):
            sizes = sizes_known_here(args, kwargs)
        if sizes is False:
            return run(fn, args=args, kwargs=kwargs, options=options)

        def replica_fn(*replica_args, **replica_kwargs):
            context = tf.distribute.get_replica_context()
            local = tf.shape(first_batch((replica_args, replica_kwargs)))[0]
            every = sizes if sizes is not None else context.all_gather(tf.reshape(local, [1]), axis=0)
            index = context.replica_id_in_sync_group
            offset = tf.reduce_sum(every[:index])
            outer = current()
            batch = tuple(t for t in tf.nest.flatten((replica_args, replica_kwargs)) if isinstance(t, tf.Tensor))
            _held.rows = Rows(local, tf.cast(offset, tf.int32), tf.cast(tf.reduce_sum(every), tf.int32), exact_losses,
                              batch)
            try:
                return fn(*replica_args, **replica_kwargs)
            except (ValueError, TypeError) as exc:
                said = policies.split_batch_note(exc, static_rows(first_batch((replica_args, replica_kwargs))),
                                        static_total(first_batch((args, kwargs))))
                if said is None:
                    raise
                raise type(exc)(said) from exc
            finally:
                _held.rows = outer

        return run(replica_fn, args=args, kwargs=kwargs, options=options)

    strategy.run = run_telling_rows


def static_rows(tensor):
    """A tensor's leading dimension where the traced step knows it, else None."""
    shape = getattr(tensor, "shape", None)
    return int(shape[0]) if shape is not None and shape.rank and shape[0] is not None else None


def static_total(leaf):
    """The global batch's row count (every replica's rows) where the traced step knows it, else None."""
    values = getattr(leaf, "values", None)
    rows = [static_rows(v) for v in values or ()]
    return sum(rows) if rows and all(r is not None for r in rows) else None


def scalar_share(tf, replicas):
    """The function :func:`~distkeras.backends.keras_model.weigh_scalar_means` asks for a Mean tracker's scalar
    update: ``replicas * n_r / N`` in a replica step with the loss rule on (the tracker's sync-on-read total
    and count, summed over the replicas, then hold one device's mean), else None."""

    def share():
        rows = current()
        if rows is None or not rows.exact_losses:
            return None
        return policies.relative_share(rows.local, rows.total, replicas, divide=lambda a, b: tf.math.divide_no_nan(
            tf.cast(a, tf.float32), tf.cast(b, tf.float32)))

    return share


def depends_on_batch(tf, tensor):
    """Whether ``tensor``, in the replica step running in this thread, is computed from the replica's batch
    (a walk up the step's graph, when it is traced). True where that can't be told (eagerly, outside a
    replica step): the caller's rule for batch-derived values is the one that held before.

    What it tells apart: the indices of a gather's gradient (``IndexedSlices``). One device's slices are
    one per lookup; for a lookup per sample (token ids, from the batch) they are the replicas' slices
    concatenated, for a lookup that is no sample's (a position embedding's ``arange(maxlen)``, the same on
    every replica) they are the replicas' values summed under their common indices.
    """
    rows = current()
    if rows is None or not rows.batch or tf.executing_eagerly() or not hasattr(tensor, "op"):
        return True
    batch = {t.ref() for t in rows.batch}
    seen, stack = set(), [tensor]
    while stack:
        value = stack.pop()
        if value.ref() in batch:
            return True
        op = value.op
        if (op.graph, op.name) in seen:
            continue
        seen.add((op.graph, op.name))
        stack.extend(op.inputs)
        if op.type == "Placeholder":  # a value a nested graph (a loop's, a cond's body) captured: its source
            stack.extend(outer for outer, inner in getattr(op.graph, "captures", ()) if inner is value)
    return False


def looked_up_per_sample(tf, indices):
    """Whether the indices of a gather's gradient (``IndexedSlices.indices``, in the replica step running in this
    thread) are lookups per sample, one set per row of the replica's batch, rather than one set for the whole
    batch (a position embedding's ``arange(maxlen)``, added to every row by broadcasting).

    Per sample where they are computed from the batch (:func:`depends_on_batch`), and also where they are shaped
    like it: the gather's indices (before the gradient flattens them) have a row per row of the replica's batch.
    The second catches what the data flow hides: ``cumsum(ones_like(inputs))``, ``broadcast_to(arange(n),
    shape(inputs))`` over a batch whose shape is static (NumPy input) are constants in the traced step, the same on
    every replica, and still one lookup per sample, as on one device.
    """
    if depends_on_batch(tf, indices):
        return True
    rows = current()
    sizes = {int(t.shape[0]) for t in rows.batch if getattr(t, "shape", None) is not None and t.shape.rank
             and t.shape[0] is not None}
    source = indices
    while getattr(source, "op", None) is not None and source.op.type in ("Reshape", "Cast", "Identity") \
            and source.op.inputs:
        source = source.op.inputs[0]
    shape = getattr(source, "shape", None)
    return bool(sizes) and shape is not None and shape.rank is not None and shape.rank >= 2 and \
        shape[0] is not None and int(shape[0]) in sizes


def batch_share(tf, dtype):
    """``n_r / N`` for the replica step running in this thread (its weight in the global gradient:
    :func:`~distkeras.backends.policies.batch_share`, computed in the graph), or None where the loss rule is off."""
    rows = current()
    if rows is None or not rows.exact_losses:
        return None
    return policies.batch_share(tf.cast(rows.local, dtype), tf.cast(rows.total, dtype), divide=tf.math.divide_no_nan)


def gate_keras_loss_scaling():
    """Make Keras' ``scale_loss_for_distribution`` / ``unscale_loss_for_distribution`` the identity while a
    replica step runs with the loss rule on; Keras' own elsewhere. Idempotent.

    They are module functions of ``keras.src.losses.loss`` that every caller looks up there at call time
    (``Loss.__call__``'s reduction as a module global, the TensorFlow trainer and ``compile_utils`` as
    ``loss_module.<name>``), so replacing the module attributes reaches them all. Private Keras API, and
    the only place Keras decides this; pinned by a test.
    """
    import tensorflow as tf
    from keras.src.losses import loss as loss_module

    for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"):
        keras_fn = getattr(loss_module, name)
        if getattr(keras_fn, "_distkeras_gated", False):
            continue

        def gated(value, _keras_fn=keras_fn, _logged=name.startswith("un")):  # noqa: B008 (binds this name)
            rows = current()
            if rows is None or not rows.exact_losses:
                return _keras_fn(value)
            if _logged:
                # The value Keras logs, weighed by the replica's row count: a replica a short batch left
                # without rows logs 0 with weight 0, not the NaN a scalar mean over no rows is.
                value = tf.convert_to_tensor(value)
                return tf.where(rows.local > 0, value, tf.zeros_like(value))
            return value

        gated._distkeras_gated = True
        gated.__wrapped__ = keras_fn
        gated.__name__ = name
        setattr(loss_module, name, gated)

    keras_reduce = loss_module.reduce_values
    if getattr(keras_reduce, "_distkeras_gated", False):
        return

    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        loss = keras_reduce(values, sample_weight, reduction)
        rows = current()
        if rows is None or not rows.exact_losses or reduction != "sum" or tuple(values.shape) in ((), (0,)):
            return loss
        # A Loss with reduction="sum": one device's gradient is the sum over the global batch, which the
        # weighing by n_r / N would shrink; N / n_r times the replica's sum undoes it (and its logged
        # value, weighed by n_r and summed over the replicas, is the global sum).
        return loss * tf.math.divide_no_nan(tf.cast(rows.total, loss.dtype), tf.cast(rows.local, loss.dtype))

    reduce_values._distkeras_gated = True
    reduce_values.__wrapped__ = keras_reduce
    loss_module.reduce_values = reduce_values
    gate_keras_masked_mean(tf, loss_module)


def gate_keras_masked_mean(tf, loss_module):
    """A masked mean (a Keras mask on the predictions, ``ignore_class``) averages over the kept entries: one device
    divides the global batch's sum by its kept entries, each replica by its own. So while a replica step runs with
    the loss rule on, the mask weight Keras' ``apply_mask`` gives kept entries, ``entries / kept`` over the replica,
    is that ratio over the global batch (two counts summed across the replicas in the step): weighed by ``n_r / N``
    and summed, the replicas' losses are one device's. ``apply_mask`` is a private module function of
    ``keras.src.losses.loss`` that ``reduce_weighted_values`` looks up at call time; pinned by a test. Idempotent.
    """
    keras_apply = loss_module.apply_mask
    if getattr(keras_apply, "_distkeras_gated", False):
        return

    def apply_mask(sample_weight, mask, dtype, reduction):
        rows = current()
        context = tf.distribute.get_replica_context()
        if mask is None or rows is None or not rows.exact_losses or reduction not in ("mean", "sum_over_batch_size") \
                or context is None or context.num_replicas_in_sync < 2:
            return keras_apply(sample_weight, mask, dtype, reduction)
        kept = tf.cast(tf.cast(mask, "bool"), dtype)
        counts = tf.stop_gradient(tf.stack([tf.cast(tf.size(kept), dtype), tf.reduce_sum(kept)]))
        entries, valid = tf.unstack(context.all_reduce(tf.distribute.ReduceOp.SUM, counts))
        weight = tf.where(tf.cast(mask, "bool"), tf.math.divide_no_nan(entries, valid), tf.zeros_like(kept))
        if sample_weight is None:
            return weight
        sample_weight = tf.cast(sample_weight, dtype)
        weight, sample_weight = loss_module.squeeze_or_expand_to_same_rank(weight, sample_weight)
        return sample_weight * weight

    apply_mask._distkeras_gated = True
    apply_mask.__wrapped__ = keras_apply
    loss_module.apply_mask = apply_mask


def _plan(tf, rows, shape):
    """(global shape, the rows of it the replica keeps, the shape asked for) for a draw of ``shape``.

    A leading dimension equal to the replica's row count is its part of the global batch: drawn at the
    global size, the replica keeps its rows. One that is k times its row count and not known before the
    step runs is k batches concatenated (a GAN's ``concatenate([generated, real])``): drawn at k times the
    global size, the replica keeps its rows of each block. Any other is drawn as asked, alike everywhere.
    """
    try:
        asked = tf.cast(tf.convert_to_tensor(shape), tf.int32)
    except (TypeError, ValueError):
        return None
    if asked.shape.rank != 1 or asked.shape[0] == 0:
        return None
    lead, local = asked[0], rows.local
    has_rows = local > 0
    if tf.get_static_value(lead) is not None:  # not batch-derived beyond the replica's own row count
        mine = tf.logical_and(has_rows, tf.equal(lead, local))
    else:
        mine = tf.logical_and(has_rows, tf.equal(lead % tf.maximum(local, 1), 0))
    blocks = tf.where(mine, lead // tf.maximum(local, 1), 1)
    block_rows = tf.where(mine, local, lead)
    block = tf.where(mine, rows.total, lead)
    start = tf.where(mine, rows.offset, 0)
    index = tf.reshape(tf.range(blocks)[:, None] * block + start + tf.range(block_rows)[None, :], [-1])
    return tf.concat([[blocks * block], asked[1:]], 0), index, asked


def _mine(tf, value, index, asked):
    """The replica's rows of ``value``, with the static shape a draw of ``asked`` has."""
    return tf.reshape(tf.gather(value, index), asked)


def _padded(tf, param, asked, drawn, index, fill):
    """A per-element parameter broadcast to ``asked``, placed at the replica's rows of ``drawn``."""
    param = tf.broadcast_to(param, asked)
    return tf.tensor_scatter_nd_update(tf.fill(drawn, tf.cast(fill, param.dtype)), index[:, None], param)


def draw_like_one_device(tf):
    """Patch Keras' TensorFlow random functions (the module ``keras.src.backend.random`` is under the
    TensorFlow backend; every ``keras.random.*`` call, Keras' random layers and its augmentation layers
    call them through it) as the module docstring says, only while a replica step runs. Idempotent.
    Private Keras API (its names are pinned by a test)."""
    from keras.src import backend

    module = backend.random
    if getattr(module, "_distkeras_patched", False):
        return
    module._distkeras_patched = True

    def scalar(value):
        return not hasattr(value, "shape") or len(value.shape) == 0

    def shaped(name, params=()):
        keras_fn = _as_asked(getattr(module, name))
        signature = inspect.signature(keras_fn)

        def draw(shape, *args, **kwargs):
            rows = current()
            plan = _plan(tf, rows, shape) if rows is not None else None
            if plan is None:
                return keras_fn(shape, *args, **kwargs)
            drawn, index, asked = plan
            bound = signature.bind(drawn, *args, **kwargs)
            for param, fill in params:
                value = bound.arguments.get(param)
                if value is not None and not scalar(value):
                    bound.arguments[param] = _padded(tf, tf.convert_to_tensor(value), asked, drawn, index, fill)
            return _mine(tf, keras_fn(*bound.args, **bound.kwargs), index, asked)

        draw.__wrapped__ = keras_fn
        setattr(module, name, draw)

    for name in ("normal", "uniform", "truncated_normal", "randint"):
        shaped(name)
    shaped("gamma", [("alpha", 1.0)])
    shaped("binomial", [("counts", 1.0), ("probabilities", 0.5)])
    shaped("beta", [("alpha", 1.0), ("beta", 1.0)])

    keras_dropout = _as_asked(module.dropout)

    def dropout(inputs, rate, noise_shape=None, seed=None):
        rows = current()
        if rows is None or isinstance(rate, (int, float)) and rate in (0.0, 1.0):
            return keras_dropout(inputs, rate, noise_shape=noise_shape, seed=seed)
        inputs = tf.convert_to_tensor(inputs)
        plan = _plan(tf, rows, module._get_concrete_noise_shape(inputs, noise_shape))
        if plan is None:
            return keras_dropout(inputs, rate, noise_shape=noise_shape, seed=seed)
        drawn, index, asked = plan
        # stateless_dropout's mask depends on the seed and the noise shape only: the global batch's mask,
        # the replica's rows of it.
        mask = keras_dropout(tf.ones(drawn, inputs.dtype), rate, seed=seed)
        return inputs * _mine(tf, mask, index, asked)

    dropout.__wrapped__ = keras_dropout
    module.dropout = dropout

    keras_categorical = _as_asked(module.categorical)

    def categorical(logits, num_samples, dtype="int64", seed=None):
        rows = current()
        logits = tf.convert_to_tensor(logits)
        plan = _plan(tf, rows, tf.shape(logits)) if rows is not None and logits.shape.rank == 2 else None
        if plan is None:
            return keras_categorical(logits, num_samples, dtype=dtype, seed=seed)
        drawn, index, asked = plan
        samples = keras_categorical(_padded(tf, logits, asked, drawn, index, 0.0), num_samples, dtype=dtype, seed=seed)
        return _mine(tf, samples, index, tf.stack([asked[0], tf.shape(samples)[1]]))

    categorical.__wrapped__ = keras_categorical
    module.categorical = categorical

    keras_shuffle = _as_asked(module.shuffle)

    def shuffle(x, axis=0, seed=None):
        rows = current()
        x = tf.convert_to_tensor(x)
        if rows is None or axis != 0 or x.shape.rank == 0:
            return keras_shuffle(x, axis=axis, seed=seed)
        plan = _plan(tf, rows, tf.shape(x)[:1])
        drawn, index, asked = plan
        # Keras sorts uniform keys; the replica sorts its own rows' keys of the global batch's draw.
        keys = _mine(tf, module.uniform.__wrapped__(drawn, seed=seed), index, asked)
        return tf.gather(x, tf.argsort(keys), axis=0)

    shuffle.__wrapped__ = keras_shuffle
    module.shuffle = shuffle


@contextlib.contextmanager
def _held_as_asked():
    outer, _held.as_asked = getattr(_held, "as_asked", False), True
    try:
        yield
    finally:
        _held.as_asked = outer


def _as_asked(fn):
    """``fn`` with TensorFlow's random functions drawing as asked while it runs (:func:`draw_tf_like_one_device`):
    Keras' random functions call ``tf.random.stateless_*`` with the shape their own plan already made global."""

    def as_asked(*args, **kwargs):
        with _held_as_asked():
            return fn(*args, **kwargs)

    as_asked.__wrapped__ = fn
    return as_asked


#: TensorFlow's random functions drawn like one device: name -> (needs an op seed to be one device's, parameters).
_TF_DRAWS = {
    "stateless_normal": (False, ("mean", "stddev")),
    "stateless_uniform": (False, ("minval", "maxval")),
    "stateless_truncated_normal": (False, ("mean", "stddev")),
    "normal": (True, ("mean", "stddev")),
    "uniform": (True, ("minval", "maxval")),
    "truncated_normal": (True, ("mean", "stddev")),
}


def draw_tf_like_one_device(tf):
    """Have TensorFlow's own random functions called in a replica step (``tf.random.normal``, as keras-io's
    WGAN-GP draws its latent vectors and interpolation weights in its ``train_step``) draw one device's values for
    the replica's rows, by the plan of :func:`draw_like_one_device`: drawn at the global batch, the replica keeps
    its rows. Idempotent; patches the ``tf.random`` module's attributes, which user code looks up at call time.

    Exact for ``tf.random.stateless_normal``, ``stateless_uniform``, ``stateless_truncated_normal`` (the values
    depend on the seed and the shape only), and for ``tf.random.normal``, ``uniform``, ``truncated_normal`` given
    an op ``seed``: each replica's kernel is seeded as one device's and, drawing the global shape at every step,
    advances its stream as one device's does. Not one device's, drawn as asked, independently on every replica:
    the stateful functions without an op seed (their op seed is TensorFlow's count of the ops traced before them
    under a global seed, or random without one: no other program, one device's included, draws those values),
    ``tf.random.Generator`` (its state is one variable the replicas would each advance), other functions
    (``categorical``, ``gamma``, ``poisson``, ``shuffle``, ``stateless_binomial`` ...), a mean or bound given per
    element, and functions reached through another module (``tf.compat.v1.random``).
    """
    module = tf.random
    if getattr(module, "_distkeras_patched", False):
        return
    module._distkeras_patched = True

    def patch(name, needs_seed, params):
        tf_fn = getattr(module, name)
        signature = inspect.signature(tf_fn)

        def draw(*args, **kwargs):
            rows = current()
            if rows is None or getattr(_held, "as_asked", False):
                return tf_fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            given = [bound.arguments.get(param) for param in params]
            if (needs_seed and bound.arguments.get("seed") is None
                    or any(value is not None and hasattr(value, "shape") and len(value.shape) for value in given)):
                return tf_fn(*args, **kwargs)
            plan = _plan(tf, rows, bound.arguments["shape"])
            if plan is None:
                return tf_fn(*args, **kwargs)
            drawn, index, asked = plan
            bound.arguments["shape"] = drawn
            return _mine(tf, _as_asked(tf_fn)(*bound.args, **bound.kwargs), index, asked)

        draw.__wrapped__ = tf_fn
        setattr(module, name, draw)

    for name, (needs_seed, params) in _TF_DRAWS.items():
        patch(name, needs_seed, params)


def _every_metric(model):
    """The model's metrics and the metrics inside them (a ``CompileMetrics``' own), each once."""
    found, stack = [], list(model.metrics)
    while stack:
        metric = stack.pop(0)
        if any(metric is seen for seen in found):
            continue
        found.append(metric)
        inner = getattr(metric, "metrics", None)
        stack.extend(list(inner) if isinstance(inner, (list, tuple)) else [])
        stack.extend(getattr(metric, "_metrics", None) or [])
    return found


def _global_result(tf, metric):
    """Hook ``metric.result`` so that, read inside a replica step, it is the result over every replica's
    rows (its sync-on-read variables all-reduced as the strategy reduces them when read outside a step),
    the same on every replica: what one device's ``result()`` is at that point. Idempotent."""
    keras_result = metric.result
    if getattr(keras_result, "_distkeras_global", False):
        return
    reduce_ops = {"sum": tf.distribute.ReduceOp.SUM, "mean": tf.distribute.ReduceOp.MEAN}

    def result():
        context = tf.distribute.get_replica_context()
        if (current() is None or getattr(_held, "in_global_result", False) or context is None
                or context.num_replicas_in_sync == 1):
            return keras_result()
        # Keras' stateless_result reads the metric's variables (its inner metrics' too) as the values given:
        # the replicas' totals all-reduced as the strategy reduces them when read, nothing assigned.
        values = []
        for variable in metric.variables:
            aggregation = getattr(variable, "aggregation", None)
            value = tf.convert_to_tensor(variable.value)
            values.append(context.all_reduce(reduce_ops[aggregation], value) if aggregation in reduce_ops else value)
        _held.in_global_result = True
        try:
            return metric.stateless_result(values)
        finally:
            _held.in_global_result = False

    result._distkeras_global = True
    metric.__dict__["result"] = result


def one_device_step_logs(tf, model, keras_model_class, keras_steps=True):
    """Make what a ``train_step`` / ``test_step`` returns (its per-batch logs) one device's.

    Keras averages a step's returned values over the replicas, and reads a custom step's epoch and
    ``evaluate()`` logs from the last step's values when their names aren't exactly the model's metrics
    (``_get_metrics_result_or_logs``). So (1) every metric's ``result()`` read inside the step is the global
    result (:func:`_global_result`), the same on every replica; (2) each float scalar the step returns is
    weighed by ``R * n_r / N`` (``R`` replicas, ``n_r`` of the ``N`` rows), so Keras' average is the
    batch-share-weighted sum: a metric result stays itself, a replica's mean over its rows becomes the mean
    over the global batch, and a replica a short batch left without rows (whose mean over no rows is NaN
    or 0) counts for nothing. (1) holds for Keras' own steps too, whose per-batch logs are their metrics'
    results: the average of each replica's own result is not one device's for a ratio or a count (AUC,
    Precision, TruePositives: a callback's ``on_train_batch_end`` logs, the progress bar), nor for a mean
    over replicas' unequal parts of a batch. It costs an all-reduce of the metrics' variables a step, in
    the step's graph (``benchmarks/tf_step_logs.py``); ``keras_steps=False`` (``batch_logs="local"``) leaves
    Keras' own steps as Keras has them.
    """
    from distkeras.backends import keras_model

    for name in ("train_step", "test_step"):
        if keras_model.is_hooked(model, name):  # an earlier distribute()'s: the class' own again
            keras_model.unhook(model, name)
        step = getattr(model, name)
        custom = getattr(type(model), name, None) is not getattr(keras_model_class, name, None)
        if not custom and not keras_steps:
            continue

        def one_device_step(data, _step=step, _custom=custom):
            for metric in _every_metric(model):
                _global_result(tf, metric)
            logs = _step(data)
            rows = current()
            context = tf.distribute.get_replica_context()
            if not _custom or rows is None or context is None or context.num_replicas_in_sync == 1:
                return logs  # Keras' own step returns its metrics' results only

            def weighed(value):
                if not isinstance(value, tf.Tensor) or value.shape.rank != 0 or not value.dtype.is_floating:
                    return value
                share = tf.math.divide_no_nan(tf.cast(rows.local * context.num_replicas_in_sync, value.dtype),
                                              tf.cast(rows.total, value.dtype))
                return tf.where(rows.local > 0, value * share, tf.zeros_like(value))

            return tf.nest.map_structure(weighed, logs)

        keras_model.hook(model, name, one_device_step)


def convolve_empty_batches(tf):
    """Patch Keras' TensorFlow convolutions and poolings (``conv``, ``depthwise_conv``, ``separable_conv``,
    ``conv_transpose``, ``max_pool``, ``average_pool`` of ``keras.src.backend.tensorflow.nn``, which
    ``keras.ops`` and the layers call through it) so that, while a replica step runs, a batch of no rows
    gives the output shape it should and a gradient.

    TensorFlow's oneDNN kernels mishandle an empty batch: Conv2D returns the input unchanged (shape and
    all: a 3x3 VALID conv of ``(0, 8, 8, 1)`` is ``(0, 8, 8, 1)``, and the next layer fails with "input
    depth must be evenly divisible by filter depth"), MaxPool's gradient aborts the process. A replica
    gets no rows when a batch is smaller than the replica count (an evaluate() or fit() tail). Such a
    replica runs the op on one row of zeros and keeps none of it (a ``tf.cond``: a replica with rows
    runs Keras' op, and its gradient, alone).
    Idempotent. Private Keras API (its names are pinned by a test).
    """
    from keras.src.backend.tensorflow import nn

    if getattr(nn, "_distkeras_empty_batches", False):
        return
    nn._distkeras_empty_batches = True

    def guarded(name):
        keras_fn = getattr(nn, name)

        def convolve(inputs, *args, **kwargs):
            inputs = tf.convert_to_tensor(inputs)
            if current() is None or inputs.shape.rank is None or inputs.shape[0]:  # no replica step, or rows
                return keras_fn(inputs, *args, **kwargs)
            rows = tf.shape(inputs)[0]
            one = tf.zeros(tf.concat([[1], tf.shape(inputs)[1:]], 0), inputs.dtype)
            # The empty branch keeps ``rows`` (0) rows, not a literal 0: its static batch size stays unknown,
            # as the other branch's may be, and the gradient of the cond takes either shape.
            return tf.cond(rows > 0, lambda: keras_fn(inputs, *args, **kwargs),
                           lambda: keras_fn(one, *args, **kwargs)[:rows])

        convolve.__wrapped__ = keras_fn
        setattr(nn, name, convolve)

    for name in ("conv", "depthwise_conv", "separable_conv", "conv_transpose", "max_pool", "average_pool"):
        guarded(name)
