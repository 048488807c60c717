"""JAX: sharded training state (``shard="optimizer" | "gradients" | "all"``, ZeRO stages 1-3) as array layouts.

A JAX step is one SPMD program over the mesh, jitted with the variables' current shardings as its
output shardings (Keras' ``make_train_function``). So sharding the training state needs no new step:
it is a layout along the mesh's data axis ("batch"), and XLA's partitioner inserts the collectives.

- ``"optimizer"``: every optimizer variable (slots, EMA averages, gradient accumulators) is split along
  "batch"; the model's variables stay replicated. XLA all-reduces the gradient, each device updates its
  slice of the weights, and the new weights are all-gathered to their replicated layout.
- ``"gradients"``: also a sharding constraint on the gradients as they enter the optimizer, so XLA
  reduce-scatters them instead of all-reducing (each device holds 1/N of every gradient).
- ``"all"``: also the trainable variables; XLA all-gathers a weight where a layer uses it, forward and
  backward. Non-trainable variables (BatchNormalization's statistics, seed states) stay replicated: they are
  small, and updated from the whole batch inside the step.

Which dimension: the largest one the device count divides (the first of equal ones), so a slice is as
even and as large as it gets. A variable none of whose dimensions divides stays replicated (a bias of 3 on
2 devices, a scalar step counter); those are named once per distribution, with their share of the bytes
(:func:`warn_replicated`), not hidden. The math is unchanged: the same program, laid out differently (only
the order of some float sums, e.g. a global norm, may differ by rounding).

Why a ``DataParallel`` subclass (:class:`ShardedDataParallel`): Keras asks the current distribution for a
variable's layout when the variable is created under it (``JaxVariable._initialize_layout``), so a model
built later (an unbuilt subclassed model at its first fit) gets the mode's layouts as it is created, and
``get_variable_layout`` is the one rule every caller (Keras, and the adapter's re-layout) reads.
Optimizer variables are the exception: Keras creates a slot with its model variable's layout
(``add_variable_from_reference`` passes ``layout=reference._layout``), which would give a replicated weight
replicated slots. So each optimizer's ``add_variable``, through which every optimizer variable is made, is
hooked on the instance (:func:`hook_optimizers`) to pass the sharded layout instead: the state is created
sharded (the first fit() builds the optimizer), never whole on every device first.

No "variable read outside call" problem on JAX: a sharded array is a global array; wherever it is used
(a tied weight read by two layers, ``get_weights()``, a callback) XLA or JAX gathers it. Across processes a
sharded array is not fully addressable, so ``save``/``save_weights``/``get_weights`` gather it first
(:func:`gathering`, ``process_allgather``: every process takes part, which the saving rule already makes
them do) and rank 0 writes the plain model.
"""

import contextlib
import functools
import inspect
import logging

import keras

from .. import keras_model

logger = logging.getLogger("distkeras")

#: What the modes shard, besides the optimizer state.
_CONSTRAIN_GRADIENTS = ("gradients", "all")


class ShardedDataParallel(keras.distribution.DataParallel):
    """``keras.distribution.DataParallel`` whose layouts split the training state along the "batch" axis.

    Args:
        devices: the mesh's devices (JAX devices), one "batch" axis over them.
        shard: ``"optimizer"``, ``"gradients"`` or ``"all"``.
        rank: this process' rank (rank 0 names the variables left replicated).
    """

    def __init__(self, devices, shard, rank=0):
        super().__init__(devices=devices)
        self.shard = shard
        self.rank = rank
        self._named = set()  # variables already named as left replicated

    @property
    def parts(self):
        return self.device_mesh.shape[0]

    def sharded_layout(self, shape):
        """The layout splitting ``shape`` along "batch" at its largest dimension the device count divides;
        replicated where none does."""
        axes = [None] * len(shape)
        dimension = best_dimension(shape, self.parts)
        if dimension is not None:
            axes[dimension] = self.batch_dim_name
        return keras.distribution.TensorLayout(axes, self.device_mesh)

    def get_variable_layout(self, variable):
        # Keras' contract: a layout given at creation wins (an optimizer variable: see hook_optimizers).
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        if self.shard == "all" and variable.trainable:
            return self.sharded_layout(variable.shape)
        return super().get_variable_layout(variable)

    def wants_sharded(self, variable, optimizer_ids):
        """Whether the mode shards ``variable`` (an optimizer's, or trainable under "all")."""
        return id(variable) in optimizer_ids or (self.shard == "all" and variable.trainable)

    def constrain_gradients(self, grads):
        """``grads`` constrained to their sharded layouts (inside the jitted step): XLA reduce-scatters them."""
        import jax

        return [g if g is None else jax.lax.with_sharding_constraint(g, self.sharded_layout(g.shape).backend_layout)
                for g in grads]


def best_dimension(shape, parts):
    """The largest dimension of ``shape`` that ``parts`` divides (the first of equal ones), or None."""
    fits = [(size, -i) for i, size in enumerate(shape) if size >= parts and size % parts == 0]
    return -max(fits)[1] if fits and parts > 1 else None


def assign_layouts(model, distribution):
    """Set every state variable's ``_layout`` (which Keras reads when it assigns the variable): the
    optimizers' variables sharded, the model's by :meth:`ShardedDataParallel.get_variable_layout`. Returns
    the variables the mode shards that stay replicated (no dimension divides)."""
    optimizer_ids = {id(v) for o in keras_model.all_optimizers(model) for v in o.variables}
    replicated = []
    for v in keras_model.state_variables(model):
        if id(v) in optimizer_ids:
            v._layout = distribution.sharded_layout(v.shape)
        else:
            v._layout = None  # an earlier distribution's, or the mode's rule for model variables
            v._layout = distribution.get_variable_layout(v)
        if distribution.wants_sharded(v, optimizer_ids) and best_dimension(v.shape, distribution.parts) is None:
            replicated.append(v)
    return replicated


def hook_optimizers(model, distribution):
    """Make every optimizer of ``model`` create its variables sharded (see the module docstring), and, for
    "gradients" and "all", constrain the gradients entering ``stateless_apply`` (Keras' JAX train_step, and
    a custom one written as Keras' guide shows, hand the gradients to the model's optimizer there)."""
    for optimizer in keras_model.all_optimizers(model):
        if not keras_model.is_hooked(optimizer, "add_variable"):
            keras_model.hook(optimizer, "add_variable", _sharded_add_variable(optimizer, distribution))
    optimizer = getattr(model, "optimizer", None)
    if (distribution.shard in _CONSTRAIN_GRADIENTS and optimizer is not None
            and not keras_model.is_hooked(optimizer, "stateless_apply")):
        keras_model.hook(optimizer, "stateless_apply", _constrained_apply(optimizer, distribution))


def unhook_optimizers(model):
    """Remove :func:`hook_optimizers`' hooks (an earlier ``distribute()``'s)."""
    for optimizer in keras_model.all_optimizers(model):
        keras_model.unhook(optimizer, "add_variable", "stateless_apply")


def _sharded_add_variable(optimizer, distribution):
    own = type(optimizer).add_variable.__get__(optimizer)
    signature = inspect.signature(own)

    @functools.wraps(own)
    def add_variable(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["layout"] = distribution.sharded_layout(tuple(bound.arguments["shape"]))
        return own(*bound.args, **bound.kwargs)

    return add_variable


def _constrained_apply(optimizer, distribution):
    own = type(optimizer).stateless_apply.__get__(optimizer)

    @functools.wraps(own)
    def stateless_apply(optimizer_variables, grads, trainable_variables):
        return own(optimizer_variables, distribution.constrain_gradients(list(grads)), trainable_variables)

    return stateless_apply


def warn_replicated(model, distribution, variables):
    """Name, once per variable and distribution and on rank 0, the variables the mode shards that stay
    replicated, with their share of the bytes it shards. Scalars (step counters, a learning rate) go unnamed:
    nothing of theirs can be split."""
    new = [v for v in variables if len(v.shape) and v.path not in distribution._named]
    if not new or distribution.rank != 0:
        return
    distribution._named.update(v.path for v in new)
    total = sum(_bytes(v) for v in _wanted(model, distribution))
    left = sum(_bytes(v) for v in new)
    logger.warning(
        "shard=%r: %d variable(s) stay whole on each of the %d devices, as no dimension of theirs divides by %d: %s "
        "(%d bytes, %.1f%% of the state shard=%r splits). Sizes divisible by the device count are split.",
        distribution.shard, len(new), distribution.parts, distribution.parts,
        ", ".join("{} {}".format(v.path, tuple(v.shape)) for v in new[:12]) + (", ..." if len(new) > 12 else ""),
        left, 100.0 * left / max(total, 1), distribution.shard)


def replicated_share(model, distribution):
    """The share of the bytes the mode shards that stays replicated, in [0, 1]."""
    wanted = _wanted(model, distribution)
    total = sum(_bytes(v) for v in wanted)
    left = sum(_bytes(v) for v in wanted if best_dimension(v.shape, distribution.parts) is None)
    return left / total if total else 0.0


def _wanted(model, distribution):
    optimizer_ids = {id(v) for o in keras_model.all_optimizers(model) for v in o.variables}
    return [v for v in keras_model.state_variables(model) if distribution.wants_sharded(v, optimizer_ids)]


def _bytes(variable):
    import numpy as np

    return int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize


@contextlib.contextmanager
def gathering(model):
    """While it runs, every state variable whose array other processes hold parts of reads as the whole
    array (``process_allgather``, a collective: every process must enter, in the same order).

    Private Keras API, on purpose: the variable's ``_value`` is swapped for the gathered array and put back
    after. Keras' saving reads ``variable.numpy()``/``np.asarray(variable)``, which JAX refuses for an array
    not fully addressable from this process, and there is no public hook between them. Pinned by a test.
    """
    import jax
    from jax.experimental import multihost_utils

    swapped = []
    try:
        if jax.process_count() > 1:
            for v in keras_model.state_variables(model):
                value = v._value
                if isinstance(value, jax.Array) and not value.is_fully_addressable and not value.is_fully_replicated:
                    whole = multihost_utils.process_allgather(value, tiled=True)
                    swapped.append((v, value))
                    v._value = jax.numpy.asarray(whole)
        yield
    finally:
        for v, value in swapped:
            v._value = value


def gathered(method, model):
    """``method`` (a bound ``save``, ``save_weights`` or ``get_weights``) run inside :func:`gathering`."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        with gathering(model):
            return method(*args, **kwargs)

    return call
