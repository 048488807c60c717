"""What the Keras 3 backends' one-device checks share (:mod:`distkeras.verify` holds the idea).

:func:`install` hooks the model so that the first step of every ``fit()`` (and the first after a ``compile()``,
which drops Keras' step function) goes through the backend's checked step function. :class:`State` reads and
writes a model's whole training state (weights, every optimizer's and metric's variables, Keras' global seed
generator) as NumPy arrays: TensorFlow and PyTorch train their variables in place, so the check snapshots them
before the step, puts the snapshot back for the one-device run, and puts the distributed result back after it.
:func:`one_device` is the reference's context: every distkeras hook off (plain Keras).
"""

import contextlib
import functools

from ..verify import check as verify
from . import keras_model

#: Keras' global SeedGenerator (keras.random without a seed draws from it) lives in Keras' global state under
#: this name; no public API returns it without creating it. Pinned by tests/backends/test_verify.py.
_GLOBAL_SEED = "global_seed_generator"


def numpy(value):
    """A tensor, Keras variable or number of any backend as a NumPy array (a copy)."""
    import keras
    import numpy as np

    if hasattr(value, "assign") and callable(getattr(value, "numpy", None)):
        return np.array(value.numpy())  # a Keras variable (a mirrored one's primary value on TensorFlow)
    return np.array(keras.ops.convert_to_numpy(value))


def _global_seed_variables():
    from keras.src.backend.common import global_state  # private: see _GLOBAL_SEED

    generator = global_state.get_global_attribute(_GLOBAL_SEED)
    return [generator.state] if generator is not None else []


def named_variables(model):
    """``[(name, kind, variable)]``: every variable a step of ``model`` may change, once each."""
    kinds = {}
    for variable in model.variables:
        kinds.setdefault(id(variable), "weight")
    for variable in getattr(model, "metrics_variables", []):
        kinds.setdefault(id(variable), "metric")
    for optimizer in keras_model.all_optimizers(model):
        inner = optimizer
        while inner is not None:
            for variable in inner.variables:
                kinds.setdefault(id(variable), "optimizer")
            inner = getattr(inner, "inner_optimizer", None)
    named, seen = [], set()
    for variable in (keras_model.state_variables(model) + [v for o in keras_model.all_optimizers(model)
                                                           for v in _wrapped_variables(o)]):
        if id(variable) not in seen:
            seen.add(id(variable))
            named.append((getattr(variable, "path", None) or variable.name, kinds.get(id(variable), "weight"), variable))
    for variable in _global_seed_variables():
        if id(variable) not in seen:
            named.append(("keras.random's global seed", "seed", variable))
    return named


def _wrapped_variables(optimizer):
    found = []
    inner = getattr(optimizer, "inner_optimizer", None)
    while inner is not None:
        found.extend(inner.variables)
        inner = getattr(inner, "inner_optimizer", None)
    return found


class State:
    """A model's training state as NumPy arrays, read and written in place (TensorFlow, PyTorch)."""

    def __init__(self, model, numpy):
        self.named = named_variables(model)
        self.numpy = numpy

    def read(self):
        return [(name, kind, self.numpy(variable)) for name, kind, variable in self.named]

    def write(self, values):
        for (_, _, variable), (_, _, value) in zip(self.named, values):
            variable.assign(value)


@contextlib.contextmanager
def one_device():
    """Plain Keras for the ``with`` block: every hook distkeras set, on every object, off."""
    with keras_model.suspended():
        yield


def compute_dtype(model):
    """The narrowest half-precision compute dtype among the model's layers ("bfloat16", "float16"), or None: what
    the check's tolerance follows (:func:`distkeras.verify.check.tolerance_for`). A mixed policy's float32 output layer
    doesn't make the step float32."""
    found = None
    for layer in keras_model.layers_of(model):
        dtype = getattr(layer, "compute_dtype", None)
        if dtype in verify.HALF_EPS and (found is None or verify.HALF_EPS[dtype] > verify.HALF_EPS[found]):
            found = dtype
    return found


def rows_of(batch):
    """The rows of a batch (its first array's leading dimension), or None."""
    import keras

    for leaf in keras.tree.flatten(batch):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape):
            return int(shape[0])
    return None


def logs_of(logs, numpy):
    """A step's logs as ``{name: NumPy value}`` (a nested dict flattened with "/"); what isn't a number is left out."""
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(prefix + str(key) if not prefix else prefix + "/" + str(key), item)
            return
        try:
            flat[prefix] = numpy(value)
        except Exception:  # noqa: BLE001 - a log that is no tensor (a string, None): not compared
            pass

    walk("", logs if isinstance(logs, dict) else {"logs": logs})
    return flat


def metric_results(model, variables, values, numpy):
    """``([(name, "metric", result)], ids)``: each of the model's metrics' ``result()`` as the values ``values`` of
    ``variables`` give it (``stateless_result``: nothing assigned), and the ids of the variables they read.

    The check compares metrics by result, not by their variables: a custom step's ``tracker.update_state(loss)``
    adds each replica's mean and a count of 1 per replica (total 2, count 2 against one device's 1 and 1), the same
    mean; what the user reads is the result.
    """
    by_id = {id(variable): value for variable, value in zip(variables, values)}
    results, read = [], set()
    for metric in getattr(model, "metrics", []):
        mine = [by_id.get(id(variable)) for variable in metric.variables]
        if not mine or any(value is None for value in mine):
            continue
        try:
            result = metric.stateless_result(mine)
        except Exception:  # noqa: BLE001 - a metric that can't be read statelessly: its variables are compared
            continue
        read.update(id(variable) for variable in metric.variables)
        results.extend((name, "metric", value) for name, value in sorted(logs_of({metric.name: result}, numpy).items()))
    return results, read


def compared(model, variables, got, want, numpy):
    """``(name, kind, distributed, one_device)`` entries of two named states of ``variables``: metric variables
    by their metrics' results (:func:`metric_results`), everything else as it is."""
    got_results, read = metric_results(model, variables, [value for _, _, value in got], numpy)
    want_results, _ = metric_results(model, variables, [value for _, _, value in want], numpy)
    keep = [i for i, variable in enumerate(variables) if id(variable) not in read]
    return (verify.pairs([got[i] for i in keep], [want[i] for i in keep])
            + verify.pairs(got_results, want_results))


def checked_in_place(model, check, numpy, distributed_step, one_device_step, random_state=None, reduce=None,
                     storage=contextlib.nullcontext, compare_logs=True, exact=None, rows=None):
    """The check for backends that train variables in place: ``distributed_step()`` (returns its logs) from the
    current state, then ``one_device_step()`` from the same state, compared; the distributed result stays.

    ``random_state``: ``(get, set)`` of random state outside Keras' variables (torch's global generator, which
    unseeded Dropout draws from), put back for the one-device step too. ``reduce``: what the distributed state
    is over the job, from this rank's (metric states that each rank keeps for its own rows, summed).
    ``storage``: a context manager under which the variables are held as one device holds them, for the
    one-device step and the read of its result (TensorFlow's plain ``tf.Variable`` in place of mirrored ones).
    ``compare_logs=False``: the step's logs are not one device's by choice (``batch_logs="local"``); the metrics
    are still compared, by their results. ``exact``: ``(snapshot, restore)`` of the named variables' storage as
    it is held (TensorFlow's per-replica parts of a sync-on-read metric total), for putting the distributed
    result back bit for bit; by default the values :class:`State` reads and writes. ``rows``: the global batch's,
    for the tolerance of a half-precision step (:meth:`distkeras.verify.check.Check.judge`).
    """
    state = State(model, numpy)
    before = state.read()
    drawn = random_state[0]() if random_state else None
    logs = distributed_step()
    if len(State(model, numpy).named) != len(state.named):
        # The step made variables (an optimizer Keras builds at its first apply: a GAN's d_optimizer): their
        # values before it are gone, so this step can't be replayed from its start. The next one is checked.
        check.defer("the first step built variables (an optimizer's slots)")
        return logs
    after = state.read()
    held = exact[0](state.named) if exact else None
    got = reduce(after) if reduce else after
    got_logs = logs_of(logs, numpy)
    drawn_after = random_state[0]() if random_state else None
    state.write(before)
    try:
        if random_state:
            random_state[1](drawn)
        with storage():
            with one_device():
                want_logs = logs_of(one_device_step(), numpy)
            reference = state.read()
    finally:
        if exact:
            exact[1](state.named, held)
        else:
            state.write(after)
        if random_state:
            random_state[1](drawn_after)
    variables = [variable for _, _, variable in state.named]
    logs_compared = verify.log_pairs(got_logs, want_logs) if compare_logs else []
    check.judge(compared(model, variables, got, reference, numpy) + logs_compared, compute_dtype(model), rows)
    return logs


def install(model, check, wrap):
    """Hook ``model`` so that its next ``fit()``'s first step, and the first after each ``compile()``, is checked.

    ``wrap(train_function)`` is the backend's checked step function around Keras' own. Instance hooks, wrapping
    whatever ``fit``/``make_train_function`` the adapter installed; nothing is saved.
    """
    make = model.make_train_function
    fit = model.fit

    @functools.wraps(make)
    def make_train_function(*args, **kwargs):
        result = make(*args, **kwargs)
        function = model.train_function
        if function is not None and not getattr(function, "_distkeras_checked", False):
            checked = wrap(function)
            checked._distkeras_checked = True
            model.train_function = checked
            check.due = check.skipped is None  # a new step function: a compile(), a first fit()
        return result

    @functools.wraps(fit)
    def checked_fit(*args, **kwargs):
        check.due = check.skipped is None
        return fit(*args, **kwargs)

    keras_model.hook(model, "make_train_function", make_train_function)
    keras_model.hook(model, "fit", checked_fit)
    keras_model.hook(model, "_distkeras_check", check)
