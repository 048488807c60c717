"""JAX: sharded training state (``shard="optimizer" | "gradients" | "all"``, ZeRO stages 1-3) as array layouts.

A JAX step is one SPMD program over the mesh, jitted with the variables' current shardings as its
output shardings (Keras' ``make_train_function``). So sharding the training state is a layout along the
mesh's data axis ("batch"), and XLA's partitioner inserts the collectives; only the gradients' reduction
needs a step of its own (below).

- ``"optimizer"``: every optimizer variable (slots, EMA averages, gradient accumulators) is split along
  "batch"; the model's variables stay replicated. Each device updates its slice of the weights, and the new
  weights are all-gathered to their replicated layout. The gradients are reduce-scattered by the step below,
  as in "gradients": left to XLA, the CPU program all-reduces them and then all-gathers the weights, 1.5 times
  the bytes of one all-reduce (measured 1.67x the unsharded step across 100 Mbit/s hosts); ZeRO-1 moves the
  bytes of one all-reduce. Inside one compiled step a gradient is transient, so the two modes compile alike.
- ``"gradients"``: also the gradients split, by a step of distkeras' own: XLA's CPU compiler does not turn an
  all-reduce and the slice after it into a reduce-scatter (GPU pipelines do), so a sharding constraint alone
  compiled to "optimizer"'s program on CPU. The model's ``train_step`` is replaced on the instance by Keras' own
  JAX one computing each device's gradient on its batch shard inside ``jax.shard_map``
  (:mod:`distkeras.backends.jax.steps`, as for ``compression``), which leaves it with
  ``psum_scatter(..., tiled=True)`` along the dimension its optimizer state is split on (``psum`` for a gradient
  left whole), so the optimizer updates slices with no further gradient collective; the updated slices are
  all-gathered to the replicated weights. With ``compression`` the slices travel in 16 bits (an ``all_to_all``
  of their bits: XLA's CPU compiler widens 16-bit float collectives). Where that step can't replace the model's
  (its class' own ``train_step``, a batch the devices don't divide) the gradients keep a sharding constraint as
  they enter the optimizer and XLA places the collectives: the same math. Measured (2 CPU devices, the MLP
  below, ``compiled.memory_analysis()``): 7.4 MB of temporary memory per device against "optimizer"'s 10.6 MB
  at batch 32 (the whole averaged gradient is never held), the same at batch 2048 (activations dominate).
- ``"all"``: also the trainable variables; XLA partitions the step by their layout (each matmul split by the
  weight's split, the activations gathered instead of the weights where they are smaller). Not the step above
  with the weights gathered into the shard_map (FSDP's "gather the weights, compute on the batch shard,
  reduce-scatter the gradients"): measured on 2 CPU devices (Adam, 256-1024-1024-16 MLP, 1.3 M parameters;
  ``compiled.memory_analysis()``; 2-core machine shared with other jobs, step time noisy) the FSDP step needs as
  much or more temporary memory per device (7.3 vs 2.8 MB at batch 32, 7.3 vs 5.6 MB at 256, 25.3 MB both at
  2048: it holds every gathered weight through forward and backward) and was slower at batch 32 and 256 (21 vs
  12 ms, 60 vs 40 ms), faster only at 2048 (340-480 vs 450-690 ms). The persistent state is 1/N in both.
  Non-trainable variables (BatchNormalization's statistics, seed states) stay replicated: they are small, and
  updated from the whole batch inside the step.

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
#: The modes whose gradients distkeras' own step reduce-scatters (:func:`scatter_rule`); "all" keeps XLA's
#: partitioning (measured: see the module docstring). "optimizer" too: ZeRO-1 moves the bytes of one all-reduce
#: (a reduce-scatter, then the updated slices all-gathered), where XLA's CPU program for it all-reduces and then
#: all-gathers (1.5 times the bytes; measured 1.67x the unsharded step across 100 Mbit/s hosts). Inside one
#: compiled step a gradient is transient either way, so "optimizer" and "gradients" compile alike here.
SCATTERED = ("optimizer", "gradients")


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


def scatter_rule(model, distribution, compressed):
    """For :func:`distkeras.backends.jax.steps.install`: ``shape -> dimension`` a gradient is reduce-scattered
    along, in the modes that scatter gradients with their own step (:data:`SCATTERED`); None in the others, and
    where that step can't replace the model's train_step (then the gradients keep their sharding constraint and
    XLA places the collectives, as in "optimizer" on CPU; rank 0 says so once), unless ``compressed`` (the
    compressed step raises its own error there)."""
    from . import steps

    if distribution.shard not in SCATTERED:
        return None
    reason = None if compressed else steps.why_not(model)
    if reason is not None:
        if distribution.rank == 0:
            logger.warning(
                "shard=%r: the gradients are not reduce-scattered by distkeras' step, as %s; they are constrained to "
                "their sharded layout and XLA places the collectives (on CPU an all-reduce, then each device keeps "
                "its slice: shard='optimizer''s memory). Training is unchanged.", distribution.shard, reason)
        return None
    return functools.partial(best_dimension, parts=distribution.parts)


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
