"""The model and its optimizers made what they would be had they been created inside ``strategy.scope()``, and the
optimizers given the global gradient.

Mirroring (:func:`mirror_in_place`): each variable's storage (weights, metrics, optimizer slots) re-created under the
strategy from its value, one at a time, and the model and every optimizer it holds told the strategy; again after
each ``compile()``, for variables created late (:func:`build_from_one_replica`, an optimizer's ``build`` by hand) and
for an optimizer or metric a hand-written loop made (:func:`adopt`).

The global gradient (:func:`global_gradient_first`): ``optimizer.apply`` all-reduces the gradients, each replica's
weighed by its share of the global batch (:mod:`.steps`), before Keras clips, accumulates or checks them, and the
TensorFlow optimizer's own later all-reduce is turned off; gradient accumulation and EMA overwriting decide across
replicas (:func:`_decided_across_replicas`).
"""

import functools

from .. import keras_model, policies
from . import loops as tensorflow_loops
from . import steps as tensorflow_steps

#: The wire dtype of each ``compression`` (TensorFlow's names).
_WIRE = {"bf16": "bfloat16", "fp16": "float16"}


def mirror_in_place(model, tf, strategy, compression=None):
    """Make ``model`` (Keras 3) what it would be had it been created inside ``strategy.scope()``.

    Each variable's storage is re-created in the scope from its current value: a mirrored variable (a
    sync-on-read one for metrics), one variable at a time, so the weights are never held twice. This
    reaches into Keras' TensorFlow ``Variable``: its storage is the private ``_value`` (a ``tf.Variable``)
    and ``_initialize(value)`` makes a new one, exactly as when the variable was first created; no
    public API re-creates a variable under another strategy. The model's and the optimizers' private
    ``_distribute_strategy`` / ``_distribution_strategy`` are the strategy Keras read from the scope at
    their construction; the optimizer's variable index is keyed by the storage's id, so it is rebuilt.
    tests/backends/test_tensorflow.py pins all of these.
    """
    for target in list(model._flatten_layers()) + _every_optimizer(model):
        keras_model.unhook(target)  # an earlier distribute()'s hooks
    _mirror_variables(tf, strategy, _state_variables(model))
    object.__setattr__(model, "_distribute_strategy", strategy)
    for optimizer in _every_optimizer(model):
        _adopt_optimizer(optimizer, strategy)
    # Steps traced before (a model trained before distribute()) hold the old variables.
    model.train_function = model.test_function = model.predict_function = None

    compile_ = model.compile

    @functools.wraps(compile_)
    def compile(*args, **kwargs):
        # A new optimizer and new metrics: created, and their variables built, under the strategy.
        with strategy.scope():
            compile_(*args, **kwargs)
        # Optimizers (and metrics) a compile() of the model's own was given, created outside the scope.
        _mirror_variables(tf, strategy, _state_variables(model))
        for optimizer in _every_optimizer(model):
            keras_model.unhook(optimizer)
            _adopt_optimizer(optimizer, strategy)
        global_gradient_first(model, tf, strategy, compression)

    keras_model.hook(model, "compile", compile)


def _every_optimizer(model):
    """Every optimizer of the model (:func:`keras_model.all_optimizers`) and the optimizers they wrap."""
    found = []
    for optimizer in keras_model.all_optimizers(model):
        while optimizer is not None and all(optimizer is not known for known in found):
            found.append(optimizer)
            optimizer = getattr(optimizer, "inner_optimizer", None)
    return found


def _state_variables(model):
    """:func:`keras_model.state_variables`, with the variables of every other optimizer the model holds."""
    variables = keras_model.state_variables(model)
    seen = {id(v) for v in variables}
    for optimizer in _every_optimizer(model):
        for variable in optimizer.variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    return variables


def _mirror_variables(tf, strategy, variables):
    """Re-create each variable's storage under ``strategy`` from its value (those already there are kept)."""
    with tf.init_scope():
        for variable in variables:
            storage = getattr(variable, "_value", None)
            if storage is None:  # not created yet: it will be, under the strategy (see below)
                continue
            if getattr(storage, "distribute_strategy", None) is strategy:
                continue
            value = storage.read_value()
            # Keras' ``_initialize`` passes the variable's *current* Keras flag as the tf.Variable's ``trainable``,
            # and a GradientTape watches only trainable tf.Variables: a layer frozen now (transfer learning's
            # base) and unfrozen later would never get a gradient. The new storage keeps the flag the old
            # storage was created with, as on one device (where freezing a built layer changes Keras' flag
            # only; Keras' steps take the gradients of ``trainable_variables``, which follow that flag).
            flag = variable.trainable
            variable.trainable = _storage_trainable(storage, flag)
            try:
                with strategy.scope():
                    variable._initialize(value)
            finally:
                variable.trainable = flag


def _storage_trainable(storage, flag):
    """The ``trainable`` of a variable's new mirrored storage: its old ``tf.Variable``'s own, not Keras' ``flag``
    at this moment (see :func:`_mirror_variables`)."""
    return bool(getattr(storage, "trainable", flag))


def _adopt_optimizer(optimizer, strategy):
    object.__setattr__(optimizer, "_distribution_strategy", strategy)
    _rekey(optimizer)
    if not keras_model.is_hooked(optimizer, "build"):
        keras_model.hook(optimizer, "build", _built_in_scope(optimizer.build, strategy))


def _built_in_scope(build, strategy):
    """An optimizer's ``build``, run in the strategy's scope when called outside any (``optimizer.build(
    model.trainable_variables)`` by hand, as on one device): Keras' TensorFlow optimizer creates its slots next to
    each variable through the strategy, which raises "Need to be inside with strategy.scope()" out of it, and
    only for variables of the strategy's own."""
    import tensorflow as tf

    @functools.wraps(build)
    def build_in_scope(*args, **kwargs):
        if tf.distribute.has_strategy():  # in a scope or a replica's step: Keras' own path
            return build(*args, **kwargs)
        variables = args[0] if args else kwargs.get("var_list", ())
        _mirror_variables(tf, strategy, list(variables))  # created since distribute(), out of the scope (model(x))
        with strategy.scope():
            return build(*args, **kwargs)

    return build_in_scope


def _rekey(optimizer):
    """A built optimizer's index of its variables, keyed anew: Keras' TensorFlow optimizer keys each by its storage
    (``_var_key``: the ``tf.Variable`` or its mirrored container), which :func:`_mirror_variables` replaces."""
    if getattr(optimizer, "built", False) and hasattr(optimizer, "_trainable_variables_indices"):
        optimizer._trainable_variables_indices = {
            optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)
        }


def adopt(obj, tf, strategy, compression=None):
    """An optimizer or metric a hand-written loop made (:func:`distkeras.attach`), distributed as the model's own:
    variables mirrored; an optimizer told the strategy and given the global gradient."""
    optimizers = [o for o in [obj, getattr(obj, "inner_optimizer", None)] if o is not None and hasattr(o, "apply")]
    _mirror_variables(tf, strategy, list(obj.variables))
    for optimizer in optimizers:
        if keras_model.is_hooked(optimizer, "apply"):
            continue  # the model's own, adopted already
        _adopt_optimizer(optimizer, strategy)
        if hasattr(optimizer, "_all_reduce_sum_gradients"):
            keras_model.hook(optimizer, "_all_reduce_sum_gradients", list)
        if hasattr(optimizer, "_backend_apply_gradients") and hasattr(optimizer, "gradient_accumulation_steps"):
            keras_model.hook(optimizer, "_backend_apply_gradients", _decided_across_replicas(optimizer, tf))
    if optimizers and not keras_model.is_hooked(optimizers[0], "apply"):
        keras_model.hook(optimizers[0], "apply", _apply_global(optimizers[0], tf, compression))


def global_gradient_first(model, tf, strategy, compression=None):
    """All-reduce the gradients when they reach ``optimizer.apply`` (of every optimizer the model holds),
    before clipping, accumulation or the loss-scale overflow check, and skip the all-reduce Keras'
    TensorFlow optimizer would do after them.

    ``_all_reduce_sum_gradients`` is the private method of Keras' TFOptimizer that sums the replicas'
    gradients inside ``_backend_update_step``; with the gradients already summed it must pass them
    through (on the wrapped optimizer of a LossScaleOptimizer too). Pinned by a test.

    With ``compression`` the gradients are cast to bfloat16/float16 for the all-reduce and back to their
    own dtype after it (half the bytes on the wire; Horovod's ``Compression.fp16``).
    """
    optimizers = _every_optimizer(model)
    for optimizer in optimizers:
        if hasattr(optimizer, "_all_reduce_sum_gradients"):
            keras_model.hook(optimizer, "_all_reduce_sum_gradients", list)
        if hasattr(optimizer, "_backend_apply_gradients") and hasattr(optimizer, "gradient_accumulation_steps"):
            keras_model.hook(optimizer, "_backend_apply_gradients", _decided_across_replicas(optimizer, tf))
    inner = {id(getattr(o, "inner_optimizer", None)) for o in optimizers}
    for outer in optimizers:
        if id(outer) not in inner:  # the optimizer a step calls, not one a LossScaleOptimizer wraps
            keras_model.hook(outer, "apply", _apply_global(outer, tf, compression))


def _apply_global(optimizer, tf, compression):
    """``optimizer.apply`` given the global gradient: sparse gradients made dense, each replica's weighed by
    its share of the global batch (see steps.py), all-reduced, then Keras' own ``apply``."""
    apply = type(optimizer).apply.__get__(optimizer)

    def apply_global(grads, trainable_variables=None):
        tensorflow_loops.check_apply(tf, optimizer, trainable_variables)  # a hand-written loop's mistakes, said
        context = tf.distribute.get_replica_context()
        grads = list(grads)
        if not optimizer.built and trainable_variables is not None and context is not None:
            # An optimizer first used inside a step (a GAN's d_optimizer): its slots created once, in the
            # cross-replica context, as mirrored variables, rather than by every replica's thread.
            variables = list(trainable_variables)
            context.merge_call(lambda _: _build(tf, optimizer, variables))
        if context is not None and context.num_replicas_in_sync > 1:
            present = [i for i, g in enumerate(grads) if g is not None]
            if present:
                # An IndexedSlices gradient (a gather: Embedding, ops.take) stays one: all-reduced, the replicas'
                # slices are concatenated in replica order, i.e. one slice per lookup of the global batch, as
                # one device's gradient has them. Not made dense (Horovod's sparse_as_dense): Keras' TensorFlow
                # optimizers treat slices apart (Adam squares each slice, ``ops.square`` being elementwise on
                # IndexedSlices), so a dense sum would train something else than one device.
                sent = [grads[i] for i in present]
                share = tensorflow_steps.batch_share(tf, sent[0].dtype)
                if share is not None:
                    sent = [_scaled(tf, g, share) for g in sent]
                if compression is not None:
                    sent = [tf.cast(g, _WIRE[compression]) for g in sent]
                # A lookup that is no sample's (a position embedding's arange(maxlen)): the same indices on
                # every replica, and one device has one slice per index with the whole batch's sum, not the
                # replicas' slices side by side. Its values are summed as a dense tensor.
                common = [isinstance(g, tf.IndexedSlices) and not tensorflow_steps.looked_up_per_sample(tf, g.indices)
                          for g in sent]
                sent = [g.values if shared else g for g, shared in zip(sent, common)]
                summed = context.all_reduce(tf.distribute.ReduceOp.SUM, sent)
                for i, g, shared in zip(present, summed, common):
                    if shared:
                        g = tf.IndexedSlices(g, grads[i].indices, grads[i].dense_shape)
                    grads[i] = tf.cast(g, grads[i].dtype) if compression is not None else g
        return apply(grads, trainable_variables)

    return apply_global


def _build(tf, optimizer, variables):
    with tf.init_scope():
        optimizer.build(variables)


def _scaled(tf, gradient, factor):
    factor = tf.cast(factor, gradient.dtype)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor


def _decided_across_replicas(optimizer, tf):
    """Keras' gradient accumulation and EMA overwriting, with their ``cond`` taken across replicas.

    Keras 3 decides "update now, or only accumulate?" (``gradient_accumulation_steps``) and "overwrite the
    weights with their moving averages now?" (``ema_overwrite_frequency``) with a ``cond`` in the replica
    context whose branch updates mirrored variables, i.e. calls ``merge_call``, which TensorFlow refuses
    inside a ``cond``: plain Keras 3 + MirroredStrategy fails with either option. The gradients here are
    already the global ones (see :func:`global_gradient_first`), so the decision is the same on every
    replica and is taken once in the cross-replica context, where each branch runs the replicas' part with
    ``call_for_each_replica`` (the pattern Keras' own LossScaleOptimizer uses). The replicas' part is Keras'
    own ``_backend_apply_gradients`` with both options off while it runs; accumulating, resetting the
    accumulators and overwriting are Keras' own private methods and variables
    (``_backend_increment_gradient_accumulators``, ``_accumulated_gradients``,
    ``_overwrite_model_variables_with_average_value``). Pinned by tests.
    """
    original = type(optimizer)._backend_apply_gradients.__get__(optimizer)

    def backend_apply_gradients(grads, trainable_variables):
        context = tf.distribute.get_replica_context()
        steps = optimizer.gradient_accumulation_steps
        overwrite = optimizer.use_ema and optimizer.ema_overwrite_frequency
        if context is None or context.num_replicas_in_sync == 1 or not (steps or overwrite):
            return original(grads, trainable_variables)
        return context.merge_call(across_replicas, args=(list(grads), list(trainable_variables)))

    def across_replicas(distribution, grads, trainable_variables):
        steps = optimizer.gradient_accumulation_steps
        frequency = optimizer.ema_overwrite_frequency if optimizer.use_ema else None
        call = distribution.extended.call_for_each_replica
        accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in trainable_variables] if steps else []

        def update(grads, variables):
            if steps:
                grads = [(g + a) / steps for g, a in zip(grads, accumulators)]
            original(grads, variables)

        def update_and_reset():
            call(update, args=(grads, trainable_variables))
            for accumulator in accumulators:
                distribution.extended.update(accumulator.value, lambda a: a.assign(tf.zeros_like(a)), group=False)

        def accumulate(grads):
            optimizer._backend_increment_gradient_accumulators(grads, accumulators)

        optimizer.gradient_accumulation_steps = None
        optimizer.ema_overwrite_frequency = None
        try:
            if steps:
                is_update_step = tf.equal((optimizer.iterations + 1) % steps, 0)
                tf.cond(is_update_step, update_and_reset, lambda: call(accumulate, args=(grads,)))
            else:
                call(update, args=(grads, trainable_variables))
        finally:
            optimizer.gradient_accumulation_steps = steps
            optimizer.ema_overwrite_frequency = frequency if optimizer.use_ema else optimizer.ema_overwrite_frequency
        if frequency:
            tf.cond(
                tf.equal((optimizer.iterations + 1) % frequency, 0),
                lambda: optimizer._overwrite_model_variables_with_average_value(optimizer._trainable_variables),
                lambda: None,
            )

    return backend_apply_gradients


def build_from_one_replica(model, tf, strategy):
    """Build metrics and optimizer before the first step, as Keras 3 does under a strategy, without drawing a batch.

    Keras 3's TensorFlow trainer builds them from one batch (``_maybe_symbolic_build``) before fit() and
    evaluate() start: under a strategy it takes the batch from a fresh iterator of the distributed dataset and
    resets it, so a shuffling pipeline (``tf.data`` ``shuffle()``, a ``PyDataset`` under ``shuffle=True``, a
    shuffling torch ``DataLoader``) spends one of its permutations there, and training runs on the dataset's
    second pass where one device runs on its first; on an empty dataset (an empty ``validation_data``) the
    peek raises a bare ``StopIteration`` where one device only warns. Only the batch's shapes and dtypes are
    used there, so they are read from the distributed dataset's ``element_spec`` (the first replica's: a
    batch the replica count doesn't divide, 32 on 3 devices, splits 11+11+10), which iterates nothing. A
    dataset whose spec leaves a non-batch dimension unknown, given to a model with unbuilt layers, is still
    peeked (no shape to build them from otherwise). The epoch iterator's ``_distributed_dataset`` is Keras'
    private attribute (pinned by tests/backends/test_tensorflow_round2.py). Installed only where Keras has the
    method this replaces; an instance attribute, never saved.
    """
    if not (hasattr(model, "_maybe_symbolic_build") and hasattr(model, "_symbolic_build")):
        return

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    keras = keras_model.keras_module(model)
    inherited = (getattr(keras.Model, "call", None), getattr(keras.layers.Layer, "call", None))

    def maybe_symbolic_build(iterator=None, data_batch=None):
        if not model.built and getattr(type(model), "call", None) in inherited:
            # A wrapper with no call() of its own (a GAN of built sub-models): nothing to build from a batch;
            # its step builds what it uses, as Keras does on one device (where it skips this build). An
            # unbuilt model with a call() is built here, in the scope, as Keras builds it under a strategy.
            return
        if iterator is not None:
            data_batch = _batch_spec(tf, model, iterator)
        if iterator is not None and data_batch is None:
            for _, _, batches in iterator:
                try:
                    data_batch = tf.nest.map_structure(local, next(batches))
                except (StopIteration, tf.errors.OutOfRangeError):
                    return  # an empty dataset: no step will run to need the build (one device warns later)
                break
            if data_batch is None:
                return
        # Variables created after distribute() outside the scope (an unbuilt model called eagerly, ``model(x)``,
        # before fit()) are mirrored before the optimizer is built from them: it keys its slots by each
        # variable's storage, which mirroring afterwards would replace ("Unknown variable" at the first step).
        _mirror_variables(tf, strategy, _state_variables(model))
        for optimizer in _every_optimizer(model):
            _rekey(optimizer)  # one built by hand from those variables (``optimizer.build(...)``) too
        with strategy.scope():
            try:
                model._symbolic_build(data_batch=data_batch)
            except (ValueError, TypeError) as exc:
                # Built from one replica's share of a batch: the global batch had about N times its rows.
                rows = tensorflow_steps.static_rows(tf.nest.flatten(data_batch)[0] if data_batch is not None else None)
                replicas = strategy.num_replicas_in_sync
                said = policies.split_batch_note(exc, rows, range(rows * replicas - replicas + 1,
                                                                          rows * replicas + 1)) if rows else None
                if said is None:
                    raise
                raise type(exc)(said) from exc
        # Keras builds metrics in a stateless scope and creates their variables only when it exits, under
        # tf.init_scope(), which leaves the strategy scope behind: plain variables every replica would
        # update (a compiled metric a custom step updates read half the rows). Mirrored like the rest.
        _mirror_variables(tf, strategy, _state_variables(model))

    keras_model.hook(model, "_maybe_symbolic_build", maybe_symbolic_build)


def _batch_spec(tf, model, iterator):
    """The shapes and dtypes of the first replica's batch of ``iterator`` (a Keras ``TFEpochIterator``), read
    from its distributed dataset's ``element_spec`` without iterating; None where they can't be read so or
    leave a layer of an unbuilt model without the dimensions it builds from."""
    dataset = getattr(iterator, "_distributed_dataset", None)
    try:
        spec = dataset.element_spec
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None

    def first_replica(leaf):
        values = getattr(leaf, "_value_specs", None)  # a PerReplicaSpec: one spec per local replica
        return values[0] if values else leaf

    spec = tf.nest.map_structure(first_replica, spec)
    leaves = tf.nest.flatten(spec)
    if not all(hasattr(leaf, "shape") and hasattr(leaf, "dtype") and leaf.shape.rank is not None for leaf in leaves):
        return None
    unbuilt = not all(layer.built for layer in model._flatten_layers())
    if unbuilt and not all(leaf.shape.rank is not None and leaf.shape[1:].is_fully_defined() for leaf in leaves):
        return None
    return spec
