"""What the Keras adapters share: hooks on a model instance, every optimizer a model holds, and a rebuild for
tf.keras 2.x. (The policies every backend follows, rank 0's atomic saves among them, are in :mod:`.policies`.)

The adapters distribute the user's own model object in place (its variables' storage re-created or laid
out on the devices). What changes behaviour is installed as *instance attributes* through :func:`hook`,
never on the class, so ``save()`` and ``get_config()`` stay exactly the single-device model's, and a
second ``distribute()`` replaces the first one's hooks instead of stacking on them (:func:`unhook`).

:func:`clone` and :func:`compile_like` remain for tf.keras 2.x only (see the TensorFlow adapter).
"""

import contextlib
import importlib
import inspect
import weakref

from ..errors import ModelError
from . import keras_package

#: The instance attribute that lists the names :func:`hook` set on an object.
_HOOKS = "_distkeras_hooks"
#: Every object :func:`hook` set something on, for :func:`suspended` (weakly: a dropped model goes).
_hooked = weakref.WeakSet()
#: How many suspended() blocks are open (plain Keras runs inside them: the one-device check's reference step).
_suspended = [0]


def hook(obj, name, function):
    """Set ``function`` as the instance attribute ``name`` of ``obj`` (a model, layer or optimizer).

    Written into the instance ``__dict__`` directly: Keras layers track what ``setattr`` gives them
    (and torch modules register it), and a hook is neither a layer nor a weight. Nothing of it is saved.
    """
    obj.__dict__[name] = function
    names = obj.__dict__.setdefault(_HOOKS, [])
    if name not in names:
        names.append(name)
    try:
        _hooked.add(obj)
    except TypeError:  # not weak-referenceable: suspended() can't reach it
        pass


@contextlib.contextmanager
def suspended():
    """Every hook :func:`hook` set, on every object of this process, taken off for the ``with`` block and put
    back after it: the classes' own methods, i.e. plain Keras, show through (the one-device check's reference)."""
    saved = []
    _suspended[0] += 1
    for obj in list(_hooked):
        names = obj.__dict__.get(_HOOKS, ())
        saved.append((obj, {name: obj.__dict__.pop(name) for name in names if name in obj.__dict__}))
    try:
        yield
    finally:
        _suspended[0] -= 1
        for obj, hooks in saved:
            obj.__dict__.update(hooks)


def is_suspended():
    """Whether plain Keras is running inside :func:`suspended` (checks of distkeras' own must stand aside)."""
    return _suspended[0] > 0


def is_hooked(obj, name):
    """Whether ``obj``'s attribute ``name`` is a hook :func:`hook` set."""
    return name in obj.__dict__.get(_HOOKS, ())


def unhook(obj, *names):
    """Remove every hook :func:`hook` set on ``obj`` (or those of ``names`` only): its class' own methods
    show through again."""
    hooked = obj.__dict__.get(_HOOKS, [])
    for name in [n for n in hooked if not names or n in names]:
        hooked.remove(name)
        obj.__dict__.pop(name, None)
    if not hooked:
        obj.__dict__.pop(_HOOKS, None)


def optimizers_of(model):
    """The model's optimizer and, for a wrapper such as LossScaleOptimizer, the optimizer it wraps."""
    found = []
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None and optimizer not in found:
        found.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return found


def _is_optimizer(obj):
    # By type, not isinstance: Keras 3 and tf.keras optimizers alike, and no property of an arbitrary
    # attribute is read.
    return callable(getattr(type(obj), "apply_gradients", None)) and hasattr(type(obj), "variables")


def all_optimizers(model):
    """Every optimizer the model holds, once each: ``model.optimizer`` first, then the optimizers it wraps
    (LossScaleOptimizer's ``inner_optimizer``), then the others found in the model's attributes, directly or
    in a list, tuple or dict (a GAN's ``d_optimizer`` and ``g_optimizer`` set in its ``compile()``), each
    followed by the optimizers it wraps. A model's training steps may use any of them, so each one's
    variables are placed (and its gradients averaged) like ``model.optimizer``'s."""
    found = list(optimizers_of(model))
    candidates = []
    for value in list(vars(model).values()):
        if isinstance(value, dict):
            candidates.extend(value.values())
        elif isinstance(value, (list, tuple)):
            candidates.extend(value)
        else:
            candidates.append(value)
    for optimizer in candidates:
        while _is_optimizer(optimizer) and all(optimizer is not known for known in found):
            found.append(optimizer)
            optimizer = getattr(optimizer, "inner_optimizer", None)
    return found


def state_variables(model):
    """Every variable a model's training touches, once each: its weights (seed-generator states
    included), its metrics' (compiled loss tracker included) and every optimizer's (:func:`all_optimizers`)."""
    variables, seen = [], set()
    groups = [model.variables, getattr(model, "metrics_variables", [])]
    groups += [optimizer.variables for optimizer in all_optimizers(model)]
    for group in groups:
        for variable in group:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    return variables


def keras_module(model):
    """The ``keras`` (or ``tf_keras``) module the model's class derives from."""
    return importlib.import_module(keras_package(model) or "keras")


def _fresh(obj):
    """A new, stateless copy of a metric or optimizer object; strings and functions pass through."""
    if hasattr(obj, "get_config") and hasattr(type(obj), "from_config"):
        return type(obj).from_config(obj.get_config())
    return obj


def _fresh_tree(value):
    if isinstance(value, dict):
        return type(value)((k, _fresh_tree(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh_tree(v) for v in value)
    return _fresh(value)


def clone(model):
    """A model of the same class and architecture, built, with new variables (created in the caller's scope).

    Raises:
        ModelError: a subclassed model without ``get_config``/``from_config``, which Keras can't clone.
    """
    keras = keras_module(model)
    # Keras' clone_model also compiles the clone from the *serialized* compile config, which fails for
    # unregistered custom metrics/losses; compile_like() compiles from the live objects instead.
    compiled = getattr(model, "compiled", None)
    try:
        if compiled:
            model.compiled = False
        new = keras.models.clone_model(model)
    except (NotImplementedError, TypeError, ValueError) as exc:
        raise ModelError(
            "distkeras must recreate the model on the devices, and Keras can't clone a {} ({}: {}). Give the "
            "class get_config() and from_config() (Keras needs them to save .keras files too), or build it "
            "with the Functional API or keras.Sequential.".format(
                type(model).__name__, type(exc).__name__, " ".join(str(exc).split())[:160] + "...")
        )
    finally:
        if compiled:
            model.compiled = compiled
    if not new.built:
        build_config = model.get_build_config() if hasattr(model, "get_build_config") else None
        if build_config:
            new.build_from_config(build_config)
    if len(new.weights) != len(model.weights):
        raise ModelError(
            "The clone of {} has {} weights, the original {}: its get_config() misses something that "
            "creates weights.".format(type(model).__name__, len(new.weights), len(model.weights))
        )
    new.set_weights(model.get_weights())
    return new


def compile_like(new, model):
    """Compile ``new`` the way ``model`` was compiled, with a fresh optimizer and fresh metric objects
    (they own variables, which must live where ``new``'s do), then copy the optimizer's state."""
    if not getattr(model, "compiled", getattr(model, "_is_compiled", False)) or model.optimizer is None:
        return
    raw = getattr(model, "_compile_config", None)
    config = dict(raw.config) if raw is not None and hasattr(raw, "config") else None
    if config is None:
        new.compile_from_config(model.get_compile_config())
    else:
        config["optimizer"] = _fresh(model.optimizer)
        # Metrics own variables, which must be created in the new scope. Losses own none and are
        # passed as they are: a round trip through get_config() can lose arguments (Keras 3.15's
        # Huber forgets its delta).
        for key in ("metrics", "weighted_metrics"):
            config[key] = _fresh_tree(config.get(key))
        new.compile(**config)
    copy_optimizer_state(model.optimizer, new.optimizer, new.trainable_variables)


def copy_optimizer_state(source, target, variables):
    """Carry a used optimizer's slots (momenta, iteration count) over to its fresh copy."""
    if not getattr(source, "built", False) or not source.variables:
        return
    target.build(variables)
    if len(source.variables) != len(target.variables):
        raise ModelError(
            "The optimizer's state has {} variables, its copy {}; distribute the model before training it, "
            "or report this as a distkeras bug.".format(len(source.variables), len(target.variables))
        )
    for src, dst in zip(source.variables, target.variables):
        dst.assign(src.numpy() if hasattr(src, "numpy") else src)


def layers_of(model):
    """The model and every layer in it, nested models and layers included (through Keras' private
    ``_flatten_layers``, the one walk that reaches layers held in attributes, lists and dicts alike)."""
    flatten = getattr(model, "_flatten_layers", None)
    return list(flatten(include_self=True, recursive=True)) if callable(flatten) else [model]


def weigh_scalar_means(model, share):
    """Make the model's own ``keras.metrics.Mean`` trackers log one device's value in a distributed step.

    A custom step that logs a loss with ``tracker.update_state(loss)`` (a scalar: the Keras guides' GAN, VAE
    and "customizing fit()" style) adds its replica's own mean with weight 1 on every replica; the states,
    summed over the replicas, then average the replicas' means equally, which is not the global batch's mean
    when the batch splits unevenly. While a step runs, ``share()`` gives this replica's ``replicas * n_r / N``
    (its rows over an equal share): such an update gets it as its sample weight, so the summed totals and
    counts are exactly one device's. Updates with a sample weight or per-sample values, and subclasses that
    override ``update_state``, are left as they are. Instance hooks; nothing is saved.
    """
    keras = keras_module(model)
    base = getattr(getattr(keras, "metrics", None), "Mean", None)
    if base is None:
        return
    for metric in getattr(model, "metrics", []):
        if isinstance(metric, base) and getattr(type(metric), "update_state", None) is base.update_state:
            hook(metric, "update_state", _scalar_weighted(type(metric).update_state.__get__(metric), share, keras))


def _scalar_weighted(update_state, share, keras):
    def weighted_update_state(values, sample_weight=None):
        if sample_weight is None and _is_scalar(values):
            sample_weight = share()
            if sample_weight is not None:
                # A replica a short batch left without rows has a mean over no rows (NaN): weight 0, value 0.
                values = keras.ops.where(keras.ops.greater(sample_weight, 0), values, keras.ops.zeros_like(values))
        return update_state(values, sample_weight=sample_weight)

    return weighted_update_state


def _is_scalar(values):
    shape = getattr(values, "shape", ())
    try:
        return len(shape) == 0
    except (TypeError, ValueError):  # a tensor of unknown rank
        return False


class Arguments(object):
    """A call's arguments by name, whether the method names them or takes them in ``**kwargs``: a KerasHub task's
    ``fit(x, y, ..., **kwargs)`` passes ``verbose`` and ``callbacks`` on to Keras' own, so reading or setting them
    in ``BoundArguments.arguments`` (where a name the signature lacks is silently dropped) would miss them.
    ``get``/``set`` by name, then call with ``*args``, ``**kwargs``."""

    def __init__(self, signature, args, kwargs):
        self.bound = signature.bind(*args, **kwargs)
        self.named = signature.parameters
        self.rest = next((name for name, p in self.named.items() if p.kind is p.VAR_KEYWORD), None)

    def _where(self, name):
        if name in self.named or self.rest is None:
            return self.bound.arguments, self.named[name].default if name in self.named else None
        return self.bound.arguments.setdefault(self.rest, {}), None

    def get(self, name, default=None):
        where, declared = self._where(name)
        found = where.get(name, declared)
        return default if found is None or found is inspect.Parameter.empty else found

    def set(self, name, value):
        where, _ = self._where(name)
        where[name] = value

    @property
    def args(self):
        return self.bound.args

    @property
    def kwargs(self):
        return self.bound.kwargs


def refuse_stateful_rnns(model, backend, how):
    """Raise a ModelError where ``model`` holds a stateful recurrent layer: the caller cuts each batch into parts.

    A stateful layer (``LSTM(stateful=True)``) keeps its state for a fixed batch (its input's ``batch_shape``) from
    one batch to the next. Where parts of a batch run on their own (``how``: "each of the 2 replicas runs its own
    share of every batch"), each part has fewer rows than the state, and Keras fails inside ``fit()`` naming a
    batch size the user never gave. ``backend``: the backend's name in the message.
    """
    stateful = [layer for layer in layers_of(model)
                if getattr(layer, "stateful", False) is True and not hasattr(layer, "layers")]  # not models: RNNs
    if not stateful:
        return
    names = ", ".join("{} '{}'".format(type(layer).__name__, layer.name) for layer in stateful)
    raise ModelError(
        "The model's {} {} stateful: it carries its state from one batch to the next for a fixed number of rows "
        "(its input's batch_shape). With {}, {}, with fewer rows than the state holds. Train this model on one "
        "device, make the layer stateful=False, or use the JAX backend (KERAS_BACKEND=jax), which runs each "
        "global batch as one program.".format(names, "is" if len(stateful) == 1 else "are", backend, how)
    )


def compiled_loss_reductions(model):
    """The Keras ``reduction`` of each compiled loss of ``model`` (one per output given a loss), from what
    ``compile()`` was given: a ``Loss`` object's own, ``"sum_over_batch_size"`` for a name or a function (Keras wraps
    them in a ``LossFunctionWrapper`` with that default). Read from ``CompileLoss._user_loss`` (a Keras private:
    the losses as given, before the first step builds them); pinned by the pipeline reduction tests."""
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None:
        return []
    keras = keras_module(model)
    reductions = []
    for loss in keras.tree.flatten(getattr(compiled, "_user_loss", None)):
        if loss is None:
            continue
        if isinstance(loss, keras.losses.Loss):
            reductions.append(loss.reduction)
        else:
            reductions.append("sum_over_batch_size")
    return reductions


def pipeline_loss_rule(model):
    """The rule by which ``model``'s compiled loss adds up over micro-batches (:func:`distkeras.parallel.pipeline.loss_rule`);
    asked at ``distribute()`` and at every pipelined step (a ``compile()`` after ``distribute()``).

    Raises:
        OptionError: a reduction no micro-batches add up to, or outputs that reduce by different rules.
    """
    from ..parallel import pipeline

    return pipeline.loss_rule(compiled_loss_reductions(model), getattr(model, "name", "the model"))


def pipeline_loss_factors(model, sizes, sample_weight):
    """``(factors, weight)``: each micro-batch's factor of ``model``'s compiled loss (micro-batches of ``sizes``
    rows, in order; :func:`distkeras.parallel.pipeline.loss_factors`) and, under the ``"weighted"`` rule with sample
    weights, the batch's sum of them (else None). ``sample_weight``: the batch's, as concrete values of any backend.

    Raises:
        OptionError: as :func:`pipeline_loss_rule`; sample weights per output under the ``"weighted"`` rule.
    """
    import numpy as np

    from ..parallel import pipeline

    rule = pipeline_loss_rule(model)
    sums = None
    if rule == "weighted" and sample_weight is not None:
        keras = keras_module(model)
        pipeline.refuse_weights_per_output(keras.tree.is_nested(sample_weight), getattr(model, "name", "the model"))
        weights = np.asarray(keras.ops.convert_to_numpy(sample_weight), "float64")
        offsets = [sum(sizes[:m]) for m in range(len(sizes))]
        sums = [float(weights[o:o + n].sum()) for o, n in zip(offsets, sizes)]
    return pipeline.loss_factors(rule, sizes, sums), (None if sums is None else sum(sums))
