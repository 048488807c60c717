"""Sharded training state on PyTorch (ZeRO stages 1, 2 and 3): ``distribute(model, shard="optimizer" | "gradients" | "all")``.

- **Ownership** (:func:`layout`): each trainable variable has one owner rank, chosen greedily by bytes
  (largest first, to the least-loaded rank, ties to the lower rank; the same on every rank), as
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` partitions parameters. Whole variables where that
  balances (within :data:`BALANCE` of an even share): the optimizer then runs its own per-variable math on
  full shapes. Where it doesn't (one variable that is most of the model: a large kernel or embedding), the
  largest variables are split, one by one until it balances, into one contiguous flat part per rank
  (:func:`part_range`), DeepSpeed ZeRO's flat partitioning: every rank owns its part, keeps only that part of
  its slots (and with "all" of the weight: :func:`piece`), receives that part of the gradient and sends
  that part of the update. Only for optimizers that update each element from its own gradient and state
  (:func:`elementwise`: Keras' SGD, Adam, AdamW, RMSprop... as exact classes; not Adafactor, Lamb or a
  subclass) and variables without a constraint; ``clipnorm``, a norm per variable, is taken over the whole
  variable (:func:`clip_by_part_norms`). During the update a split variable and its slots show the
  optimizer this rank's part as a flat variable (:meth:`Sharding._parts_in_place`).
- **The optimizer stays the user's object, built over every variable** (``save()``, checkpoints and
  ``get_config`` are the single-device ones), but the storage of the slots (momentums, velocities,
  accumulators, EMA averages) of the variables a rank does not own is released
  (``parameter.untyped_storage().resize_(0)``, FSDP's trick, on the Keras variable's torch Parameter,
  ``variable._value``, a Keras private) and the variable is marked (its class swapped for a subclass whose
  ``value`` raises :class:`~distkeras.errors.ShardError` naming it): a released slot read by anything
  else than distkeras fails clearly instead of reading freed memory. Slots are found as Keras' optimizers
  keep them: lists of variables (or None) with one entry per trainable variable (:func:`slot_lists`).
- **Apply** (:meth:`Sharding.apply`): the optimizer updates only the (gradient, variable) pairs this rank
  owns (Keras' ``apply`` accepts any subset of the variables it was built with); what it computes over
  *all* gradients stays global: ``global_clipnorm`` (the sum of squares all-reduced), a
  LossScaleOptimizer's finite check (all ranks agree), ``iterations`` (every rank counts every step,
  also a rank that owns nothing). EMA runs over the owned variables and their averages only (the
  optimizer's ``_trainable_variables`` and ``_model_variables_moving_average``, Keras privates, narrowed
  for the call); gradient accumulation, weight decay, ``clipnorm`` and ``clipvalue`` are per variable.
  Then each owner broadcasts its updated variables: every rank holds the full weights between steps.
- **Communication** (ZeRO-1 and 2 alike): the gradients travel to their owner only, as point-to-point
  messages (:class:`OwnerReduce`: every other rank sends the owner its flat buffer of that owner's
  gradients, the owner sums them in rank order; in the overlapped buckets one bucket holds one owner's
  variables), and each owner sends its updated variables to every rank; all owners' messages are issued at
  once, so a link carries both directions together, and across hosts they travel in pieces, a few in flight
  per link (:mod:`~distkeras.backends.torch.messages`: sent whole, a message each way at once ran at half
  the link's rate over gloo). Bytes sent per rank and step: the gradients it doesn't own, then the weights
  it owns: those of one ring all-reduce.
- **"gradients"** (ZeRO-2): a rank also drops the gradients it does not own as soon as they are sent;
  "optimizer" (ZeRO-1) keeps them (so a step whose gradients the overlapped buckets can't use still falls
  back to reducing them after the backward pass).
- **Saving and loading**: ``save``/``save_weights`` gather the optimizer state on every rank first
  (they are collective with ``shard``: every rank must call them, as fit()'s callbacks do), write, and
  release it again; ``load_weights``/``load`` re-allocate, load and release (every rank read the same
  file, so the owners hold the right values). A checkpoint of a sharded run is the single-device one and
  resumes into any ``shard`` value or none.
- **"all"** (ZeRO-3, FSDP1's technique on Keras' layers; :meth:`Sharding.prepare_weights`): gradients as with
  "gradients", and a trainable variable's storage is freed on every rank but its owner. Each layer that
  made trainable variables itself (``Layer._trainable_variables``, a Keras private; a nested layer gets
  its own hook) has an instance hook on ``call``: before, its weights are gathered (the freed storage
  re-allocated in place with ``resize_`` and filled by a broadcast from each owner, through ``.data``:
  the same Parameter and storage, so what autograd saved stays valid and no version counter moves);
  after, freed again. When the outputs need gradients, a ``register_multi_grad_hook`` on them gathers
  the weights again before that call's part of the backward pass, and once every one of the layer's
  weights had its gradient accumulated (``register_post_accumulate_grad_hook``) they are freed again;
  whatever a step leaves held (a weight without a gradient) is freed when the step ends. A layer called
  twice in a step gathers once per use (a use in flight is counted) and frees after the last gradient.
  The owners update their own weights (never freed there) and nothing is broadcast after ``apply``. Non
  trainable state (BatchNorm statistics, seed generators) stays replicated. On every rank, the owner's
  too, a sharded weight's Keras variable gets a subclass (:func:`_guarded_class`) whose ``value``,
  outside its layer's call, is a shape-only :class:`_ReleasedView`: ``value.grad`` works (Keras' torch
  ``train_step`` reads it), any computation raises :class:`~distkeras.errors.ShardError` naming the
  weight and its layer (a layer reading another layer's weight, as tied weights do, a callback or
  custom ``train_step`` computing with ``layer.kernel``; a layer's weight regularizers are computed with
  its weights gathered, as a use of the layer: ``Layer._get_regularization_losses``, a Keras private, hooked): the same error on every rank, so none waits for the
  others. ``model.get_weights()``, ``save()``, ``save_weights()`` gather every weight on every rank
  (collective), ``set_weights()``/``load_weights()`` re-allocate them all and free again after;
  ``predict()``/``evaluate()`` gather per layer as the forward pass does.
- **A split Dense kernel is never whole** (:class:`_Tiler`, ZeRO-Infinity's memory-centric tiling, automatic): gathering
  a layer whole, as FSDP does, holds its whole weight and autograd then makes its whole gradient, which for a kernel
  that is most of the model is more than 1/N of the model's state. A plain Keras ``Dense`` whose kernel is split
  computes its matmul one owner's part at a time, forward and backward, and each part's gradient goes to its owner's
  bucket as soon as it is computed (``Buckets.part_accumulated``).
"""

import contextlib
import functools
import math
import threading

import torch
import torch.distributed as dist

from ...errors import ShardError
from .. import keras_model
from . import messages

#: Pieces one rank may have waiting at an owner for the other ranks' pieces at their offsets (OwnerReduce).
AHEAD = 2
#: The instance attribute of an optimizer that holds its :class:`_Slots`.
_SLOTS = "_distkeras_slots"
#: The model's instance attribute that holds its :class:`Sharding`.
_SHARDING = "_distkeras_sharding"
_RELEASED_CLASSES = {}
_NONE = object()
#: Depth of calls that take released weights' Parameters as objects, without reading them (_bare_parameters).
_BARE = [0]


def owners(sizes, world, loads=None):
    """The owner rank of each of ``sizes`` (bytes): greedy, largest first, to the least-loaded rank.

    Args:
        sizes: bytes per variable, in the variables' order (the same on every rank).
        world: the number of ranks.
        loads: bytes already owned per rank (default none).

    Returns:
        A list of ranks, one per size.
    """
    loads = list(loads or [0] * world)
    result = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        result[index] = rank
        loads[rank] += sizes[index]
    return result


#: :meth:`Sharding.owner_map`'s value for a variable split into one flat part per rank (:func:`layout`).
SPLIT = -1
#: A split variable's parts are at least this many elements per rank (smaller ones stay whole).
MIN_PART = 8
#: How far above an even share (1/N of the bytes) :func:`layout` lets the most-loaded rank be.
BALANCE = 1.05


def part_range(size, world, rank):
    """The flat element range ``(start, stop)`` of rank ``rank``'s part of a variable of ``size`` elements
    split into ``world`` parts: contiguous, ``ceil(size / world)`` each, the last one shorter."""
    chunk = -(-size // world)
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)


def layout(sizes, elements, splittable, world, loads=None):
    """Who owns each variable: a rank, or :data:`SPLIT` (one flat part per rank, :func:`part_range`).

    Whole variables first, greedily (:func:`owners`); while the most-loaded rank holds more than
    :data:`BALANCE` times an even share, the largest whole variable that may be split (``splittable``, and
    at least :data:`MIN_PART` elements per part) is split and the rest placed again. A model whose
    variables balance keeps them whole (each optimizer update stays one variable's); one variable that
    is most of the model (a large embedding or kernel) is split, and every rank then holds 1/N of it.

    Args:
        sizes: bytes per variable, in the variables' order (the same on every rank).
        elements: elements per variable.
        splittable: per variable, whether it may be split (the optimizer updates each element from that
            element's own gradient and state only, and the variable has no constraint).
        world: the number of ranks.
        loads: bytes already owned per rank (default none).

    Returns:
        A list with a rank or :data:`SPLIT` per variable.
    """
    base = list(loads or [0] * world)
    split = set()
    while True:
        loads = list(base)
        for index in split:
            for rank in range(world):
                start, stop = part_range(elements[index], world, rank)
                loads[rank] += sizes[index] * (stop - start) // max(elements[index], 1)
        whole = [i for i in range(len(sizes)) if i not in split]
        placed = owners([sizes[i] for i in whole], world, loads)
        for index, rank in zip(whole, placed):
            loads[rank] += sizes[index]
        even = (sum(sizes) + sum(base)) / world
        candidates = [i for i in whole if splittable[i] and elements[i] >= MIN_PART * world]
        if world < 2 or max(loads) <= BALANCE * even or not candidates:
            result = [SPLIT] * len(sizes)
            for index, rank in zip(whole, placed):
                result[index] = rank
            return result
        split.add(min(candidates, key=lambda i: (-sizes[i], i)))


def elementwise(optimizer):
    """Whether ``optimizer`` (the updating one: a LossScaleOptimizer's inner optimizer) updates every element
    of a variable from that element's gradient and state only (and scalars): then a variable may be split
    across ranks in flat parts (:func:`layout`). Keras' own SGD, Adam, AdamW, Adamax, Adagrad, Adadelta,
    RMSprop, Nadam, Lion and Ftrl, as exact classes (Keras' torch subclasses of them included: its
    ``TorchOptimizer.__new__`` makes those); not Lamb, Adafactor, Muon (norms and factors per variable, or
    per matrix), nor a user's subclass (its ``update_step`` may read the whole variable). ``clipnorm``, a
    norm per variable, is summed over the parts (:meth:`Sharding.apply`)."""
    from keras import optimizers

    known = (optimizers.SGD, optimizers.Adam, optimizers.AdamW, optimizers.Adamax, optimizers.Adagrad,
             optimizers.Adadelta, optimizers.RMSprop, optimizers.Nadam, optimizers.Lion, optimizers.Ftrl)
    cls = type(optimizer)
    if cls in known:
        return True
    # Keras' torch optimizers (keras/src/backend/torch/optimizers/torch_*.py, privates): the same update,
    # written with torch._foreach_* over the variables' values.
    return cls.__module__.startswith("keras.src.backend.torch.optimizers.torch_") and any(
        base in known for base in cls.__bases__)


def nbytes(variable):
    """The bytes of ``variable``'s values (its shape and dtype, whether or not its storage is released)."""
    value = variable._value  # Keras' torch Variable keeps its Parameter here (a private; see the module docstring)
    return int(math.prod(variable.shape)) * value.element_size()


def slot_lists(optimizer):
    """The optimizer's per-variable slot lists: its attributes that are lists with one entry per trainable
    variable it was built with, each a Keras variable or None (Keras' optimizers keep ``_momentums``,
    ``_velocities``, ``_accumulated_gradients``, ``_model_variables_moving_average``... this way)."""
    import keras

    trainable = optimizer.__dict__.get("_trainable_variables") or []
    found = []
    for name, value in sorted(vars(optimizer).items()):
        if name == "_trainable_variables" or not isinstance(value, list) or len(value) != len(trainable):
            continue
        if value and all(v is None or isinstance(v, keras.Variable) for v in value) and any(v is not None for v in value):
            if not any(v is t for v, t in zip(value, trainable)):
                found.append(value)
    return found


def _released_class(base):
    """A subclass of the variable class ``base`` whose ``value`` raises: a released slot's reads."""
    if base not in _RELEASED_CLASSES:

        def value(self):
            raise ShardError(
                "The optimizer variable {!r} is held by another replica: distribute(..., shard=...) keeps each "
                "variable's optimizer state on one replica only. Read optimizer state through model.save() or "
                "model.save_weights() (which gather it), or distribute without shard.".format(self.path)
            )

        _RELEASED_CLASSES[base] = type(base.__name__, (base,), {"value": property(value), "_distkeras_base": base})
    return _RELEASED_CLASSES[base]


def _guarded_class(base):
    """A subclass of the variable class ``base`` for a weight of shard="all", on every rank (its owner's too,
    so that a read outside its layer's call fails on every rank alike, and none waits for the others): its
    ``value`` is the weight while its layer holds it (:class:`_Layer`), else a :class:`_ReleasedView`."""
    key = ("guarded", base)
    if key not in _RELEASED_CLASSES:

        def value(self):
            state = self.__dict__["_distkeras_state"]
            if (state.gathered and allocated(self)) or state.sharding.applying:  # (a tiled kernel: never whole)
                return base.value.__get__(self)
            if _BARE[0]:
                return self._value  # the Parameter object itself (Keras' torch layers track it), not read
            if _symbolic():
                # Keras' torch Variable.value gives a shape-only stub on the "meta" device in a symbolic call
                # (compute_output_spec) and never touches the storage: a released weight may take part.
                return base.value.__get__(self)
            return _released_view(self)

        _RELEASED_CLASSES[key] = type(base.__name__, (base,), {"value": property(value), "_distkeras_guarded": base})
    return _RELEASED_CLASSES[key]


@contextlib.contextmanager
def _bare_parameters():
    """Released weights' ``value`` is their Parameter inside the block: Keras' torch layers' private
    ``_track_variables`` (run by every fit()'s ``_post_build``) collects ``variable.value`` of every variable
    into a ParameterDict, as objects; nothing reads their storage there."""
    _BARE[0] += 1
    try:
        yield
    finally:
        _BARE[0] -= 1


def weight_message(variable):
    return (
        "The weight {!r} of layer {!r} is held by another replica: distribute(..., shard='all') keeps each trainable "
        "variable on one replica and gathers it only while its own layer's call() runs (forward and backward). It "
        "was read outside that call (another layer reading it, as tied weights do, a custom train_step or a callback "
        "computing with layer weights, a weight regularizer). Read weights with model.get_weights() (which gathers "
        "them), or distribute with shard='gradients' (weights replicated).".format(
            variable.path, variable.__dict__.get("_distkeras_layer", "?"))
    )


class _ReleasedView(torch.Tensor):
    """What a released weight's ``value`` is outside its layer's call: a shape-only ("meta") tensor whose
    ``grad`` is the Parameter's (Keras' torch train_step, and the guide's, read ``variable.value.grad`` after
    the backward pass), and any computation with it raises :class:`ShardError` naming the weight. (The
    Parameter itself can't be handed out: its storage is freed, and torch would read freed memory.)"""

    @property
    def grad(self):
        return self._distkeras_parameter.grad

    @grad.setter
    def grad(self, value):
        self._distkeras_parameter.grad = value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("__get__", "__repr__", "__format__", "size", "dim", "numel"):
            with torch._C.DisableTorchFunctionSubclass():  # metadata only (shape, dtype, requires_grad...)
                return func(*args, **(kwargs or {}))
        import keras

        for leaf in keras.tree.flatten([list(args), dict(kwargs or {})]):
            if isinstance(leaf, _ReleasedView):
                raise ShardError(leaf._distkeras_message)
        raise ShardError("A weight held by another replica (distribute(..., shard='all')) was computed with.")


def _released_view(variable):
    view = variable.__dict__.get("_distkeras_view")
    if view is None:
        parameter = variable._value
        stub = torch.empty(parameter.shape, dtype=parameter.dtype, device="meta")
        view = torch.Tensor._make_subclass(_ReleasedView, stub, parameter.requires_grad)
        view._distkeras_parameter = parameter
        view._distkeras_message = weight_message(variable)
        variable.__dict__["_distkeras_view"] = view
    return view


def _symbolic():
    """Whether a symbolic call (Keras' torch compute_output_spec, on the "meta" device) is in flight."""
    from keras.src.backend.torch.core import get_device  # Keras' torch device scope (a private)

    return str(get_device()) == "meta"


def free_storage(variable):
    """Free ``variable``'s storage (keeps its shape, dtype and Parameter object); :func:`alloc_storage` undoes."""
    value = variable._value
    if "_distkeras_nbytes" in variable.__dict__:
        return
    variable.__dict__["_distkeras_nbytes"] = value.untyped_storage().nbytes()
    try:
        value.untyped_storage().resize_(0)
    except RuntimeError:
        # A storage NumPy has shared (Keras' saving reads variables with .numpy()) is not resizable: the
        # Parameter gets a storage of its own (empty() touches no page), which is released instead.
        value.data = torch.empty(value.shape, dtype=value.dtype, device=value.device)
        value.untyped_storage().resize_(0)


def alloc_storage(variable):
    """Re-allocate a freed storage, in place (the same Parameter and storage: what autograd saved stays valid)."""
    nbytes = variable.__dict__.pop("_distkeras_nbytes", None)
    if nbytes is not None:
        variable._value.untyped_storage().resize_(nbytes)


def release(variable):
    """Free ``variable``'s storage and mark it released (its ``value`` raises)."""
    if getattr(type(variable), "_distkeras_base", None) is not None:
        return
    free_storage(variable)
    variable.__class__ = _released_class(type(variable))


def restore(variable):
    """Re-allocate a released ``variable``'s storage (its values undefined until assigned)."""
    base = getattr(type(variable), "_distkeras_base", None)
    if base is None:
        return
    variable.__class__ = base
    alloc_storage(variable)


def is_released(variable):
    return getattr(type(variable), "_distkeras_base", None) is not None


def broadcast_owned(groups, rank):
    """``groups``: per rank, the parts it owns, each ``(variable, start, stop)``: a flat element range of the
    variable (same order on every rank). Each owner's values reach every rank: per owner and (dtype, device)
    one flat buffer, which the owner sends to every other rank and they receive, all of them issued at once
    (as :mod:`~distkeras.backends.torch.messages`: in pieces, a few in flight per link) and then waited for. An owner sends its part's own storage where it keeps one
    (:func:`piece`: a split variable's part, a split slot's) and writes it into the variable's storage too
    where that is allocated. Bytes each rank sends: what it owns, to each other rank (a ring all-gather's).
    Why not ``dist.broadcast``, one per owner, async: gloo ran them one after the other (traced across two
    100 Mbit/s hosts: 0.55 s for the two owners' halves each step, the time of the one-way sum); the direct
    messages of both owners share the link's two directions (0.28-0.33 s in most steps, 0.55 s in some)."""
    pending, world, link = [], len(groups), messages.links()
    for owner, items in enumerate(groups):
        by_kind = {}
        for item in items:
            value = item[0]._value
            by_kind.setdefault((value.dtype, value.device), []).append(item)
        for (dtype, device), group in by_kind.items():
            if owner == rank:
                flat = torch.cat([_source(*item) for item in group])
                sent = [link.send(flat, peer) for peer in range(world) if peer != rank]
            else:
                flat = torch.empty(sum(stop - start for _, start, stop in group), dtype=dtype, device=device)
                sent = [link.recv(flat, owner)]
            pending.append((owner, group, flat, sent))
    messages.wait([message for _, _, _, sent in pending for message in sent])
    for owner, group, flat, _ in pending:
        offset = 0
        with torch.no_grad():  # .data: no autograd version bump on the weights
            for variable, start, stop in group:
                if owner != rank or (piece(variable) is not None and allocated(variable)):
                    variable._value.data.view(-1)[start:stop].copy_(flat[offset : offset + stop - start])
                offset += stop - start


def piece(variable):
    """This rank's part of a split variable or slot, kept in its own storage (None: none kept)."""
    return variable.__dict__.get("_distkeras_piece")


def allocated(variable):
    """Whether ``variable``'s storage holds its values (not freed by :func:`free_storage`)."""
    return "_distkeras_nbytes" not in variable.__dict__


def _source(variable, start, stop):
    kept = piece(variable)
    if kept is not None and variable.__dict__.get("_distkeras_part") == (start, stop):
        return kept
    return variable._value.detach().reshape(-1)[start:stop]


def keep_piece(variable, start, stop):
    """Copy this rank's part ``[start, stop)`` of ``variable``'s (allocated) storage into a storage of its own."""
    kept = variable._value.detach().reshape(-1)[start:stop].clone()
    variable.__dict__["_distkeras_piece"], variable.__dict__["_distkeras_part"] = kept, (start, stop)
    return kept


def release_part(variable, start, stop):
    """Keep only this rank's part of a split variable's slot: its values copied into a storage of their own
    (from the whole, when that is allocated: after a gather or a load), the whole freed and marked released."""
    if is_released(variable):
        return
    keep_piece(variable, start, stop)
    release(variable)


def forget_piece(variable):
    for name in ("_distkeras_piece", "_distkeras_part"):
        variable.__dict__.pop(name, None)


class _Layer(object):
    """A layer whose own trainable variables shard="all" gathers around its call."""

    def __init__(self, layer, sharding):
        self.layer, self.sharding = layer, sharding
        self.variables, self.handles = [], []
        self.gathered = True  # until prepare_weights() releases them
        self.uses = 0  # calls in flight (a layer whose call calls itself)
        self.pending = None  # in a backward pass: ids of the weights whose gradients are still to come
        self.tiled = None  # a Dense layer's split kernel computed part by part (_Tiler), never gathered whole


def _tileable(layer, kernel, owner):
    """Whether ``layer`` is a plain Keras Dense whose split kernel :class:`_Tiler` may compute part by part (its
    ``call`` is known: a matmul, the bias, the activation; no LoRA, no quantization, no kernel regularizer)."""
    import keras

    return (type(layer) is keras.layers.Dense and owner.get(id(kernel)) == SPLIT and len(kernel.shape) == 2
            and not getattr(layer, "lora_enabled", False) and getattr(layer, "quantization_mode", None) is None
            and kernel._value.dtype.is_floating_point
            and getattr(kernel, "regularizer", None) is None)  # a regularizer reads the whole kernel


def _segments(start, stop, columns):
    """Flat elements ``[start, stop)`` of a row-major matrix of ``columns`` columns as rectangles ``(row0, row1,
    col0, col1, offset)`` (``offset``: where the rectangle starts in the flat range): a part of a split kernel is
    a partial first row, whole rows and a partial last row."""
    found, position = [], start
    while position < stop:
        row, column = divmod(position, columns)
        if column or stop - position < columns:
            end = min(stop, (row + 1) * columns)
            found.append((row, row + 1, column, column + end - position, position - start))
            position = end
        else:
            rows = (stop - position) // columns
            found.append((row, row + rows, 0, columns, position - start))
            position += rows * columns
    return found


class _Tiler(object):
    """A plain Dense layer's split kernel with shard="all", computed one owner's part at a time: ZeRO-Infinity's
    memory-centric tiling (DeepSpeed's ``TiledLinear``), done for the user. FSDP gathers a layer's whole weight
    for its forward and backward passes and autograd makes its whole gradient before any part can leave; for a
    kernel that is most of the model (the MLP benchmark's 8000x4000 one: 122 MiB, 78 % of its parameters)
    those two copies alone exceed 1/N of the model's state. Here the forward pass fetches each part from its
    owner (:meth:`fetch`), adds ``inputs[:, rows] @ part`` into the output and drops it; the backward pass
    fetches each part again for the inputs' gradient and computes that part's gradient,
    ``inputs[:, rows].T @ d_outputs``, which goes to its owner's bucket at once (:meth:`deliver`:
    ``Buckets.part_accumulated``; outside a collected step it is added into the kernel's ``.grad``, autograd's
    own result). Each element is computed as the whole matmul computes it, in the same dtypes as Keras' torch
    ``matmul`` (the kernel cast to the layer's compute dtype, float16 computed in float32 on CPU): only the
    order of the forward pass' sums over the parts differs, a float rounding."""

    def __init__(self, sharding, layer, kernel):
        self.sharding, self.layer, self.kernel = sharding, layer, kernel
        #: Uses in this step whose backward pass hasn't run yet, and the parts of the gradient they made so far:
        #: a layer called twice in a step (shared) gets one gradient, the sum, as autograd accumulates it.
        self.uses, self.held = 0, {}

    def flush(self, deliver=True):
        held, self.held, self.uses = self.held, {}, 0
        for start, (stop, grad) in sorted(held.items()) if deliver else ():
            self.deliver(start, stop, grad)

    def dtypes(self, inputs):
        """(the kernel as the layer sees it, the matmul's compute dtype, its result dtype), as torch dtypes: Keras'
        torch ``matmul``'s rule (result_type of both; float16 computed in float32 on CPU)."""
        import keras

        own = keras.backend.standardize_dtype(self.kernel.dtype)
        seen = self.layer.compute_dtype if self.layer.autocast and own != self.layer.compute_dtype else own
        result = keras.backend.result_type(keras.backend.standardize_dtype(inputs.dtype), seen)
        compute = "float32" if result == "float16" and inputs.device.type == "cpu" else result
        return getattr(torch, seen), getattr(torch, compute), getattr(torch, result)  # float names are torch's too

    def parts(self):
        return self.sharding.parts(self.kernel)

    def fetch(self, owner, start, stop):
        """The kernel's flat part ``[start, stop)`` from its ``owner`` on every rank (collective: every rank
        fetches the same parts in the same order)."""
        link, rank = messages.links(), self.sharding.rank
        if owner == rank:
            flat = _source(self.kernel, start, stop)
            messages.wait([link.send(flat, peer) for peer in range(self.sharding.world) if peer != rank])
            return flat
        value = self.kernel._value
        flat = torch.empty(stop - start, dtype=value.dtype, device=value.device)
        messages.wait([link.recv(flat, owner)])
        return flat

    def forward(self, inputs):
        rows, columns = self.kernel.shape
        seen, compute, result = self.dtypes(inputs)
        x = inputs.reshape(-1, rows).to(compute)
        y = torch.zeros(x.shape[0], columns, dtype=compute, device=x.device)
        for owner, start, stop in self.parts():
            part = self.fetch(owner, start, stop).to(seen).to(compute)
            for row0, row1, col0, col1, offset in _segments(start, stop, columns):
                block = part[offset : offset + (row1 - row0) * (col1 - col0)].view(row1 - row0, col1 - col0)
                y[:, col0:col1].addmm_(x[:, row0:row1], block)
            del part
        return y.to(result).reshape(tuple(inputs.shape[:-1]) + (columns,))

    def backward(self, inputs, d_outputs, need_inputs):
        rows, columns = self.kernel.shape
        seen, compute, _ = self.dtypes(inputs)
        x = inputs.reshape(-1, rows).to(compute)
        dy = d_outputs.reshape(-1, columns).to(compute)
        dx = torch.zeros_like(x) if need_inputs else None
        for owner, start, stop in self.parts():
            if need_inputs:
                part = self.fetch(owner, start, stop).to(seen).to(compute)
            grad = torch.empty(stop - start, dtype=compute, device=x.device)
            for row0, row1, col0, col1, offset in _segments(start, stop, columns):
                size = (row1 - row0) * (col1 - col0)
                torch.mm(x[:, row0:row1].t(), dy[:, col0:col1], out=grad[offset : offset + size].view(
                    row1 - row0, col1 - col0))
                if need_inputs:
                    block = part[offset : offset + size].view(row1 - row0, col1 - col0)
                    dx[:, row0:row1].addmm_(dy[:, col0:col1], block.t())
            part = None
            grad = grad.to(seen).to(self.kernel._value.dtype)
            if start in self.held:
                grad = grad + self.held.pop(start)[1]  # (two terms: the sum autograd's accumulation makes)
            if self.uses > 1 and self._collected():
                self.held[start] = (stop, grad)  # another use's backward is still to come
            else:
                self.deliver(start, stop, grad)
            del grad
        self.uses = max(0, self.uses - 1)
        return None if dx is None else dx.to(inputs.dtype).reshape(inputs.shape)

    def _collected(self):
        buckets = getattr(self.sharding, "buckets", None)
        return buckets is not None and buckets.collecting and buckets.replica.count is not None

    def deliver(self, start, stop, grad):
        buckets = getattr(self.sharding, "buckets", None)
        if buckets is not None and buckets.part_accumulated(self.kernel, start, stop, grad):
            return
        parameter = self.kernel._value
        if parameter.grad is None:
            parameter.grad = torch.zeros(parameter.shape, dtype=parameter.dtype, device=parameter.device)
        parameter.grad.view(-1)[start:stop].add_(grad)

    def call(self, inputs, training=None):
        """Dense.call with the matmul tiled (Keras 3's ``Dense.call``: matmul, bias, activation)."""
        from keras import ops

        if torch.is_grad_enabled() and self.kernel._value.requires_grad:
            self.uses += 1  # a backward pass of this use may come
        x = _TiledMatmul.apply(inputs, self.kernel._value, self)
        if self.layer.bias is not None:
            x = ops.add(x, self.layer.bias)
        if self.layer.activation is not None:
            x = self.layer.activation(x)
        return x


class _TiledMatmul(torch.autograd.Function):
    """``inputs @ kernel`` by :class:`_Tiler`. The kernel's Parameter is an input only so that the output needs a
    gradient (a first layer's inputs don't): its gradient goes part by part to the buckets, autograd gets None."""

    @staticmethod
    def forward(ctx, inputs, parameter, tiler):
        ctx.tiler = tiler
        ctx.save_for_backward(inputs)
        return tiler.forward(inputs)

    @staticmethod
    def backward(ctx, d_outputs):
        (inputs,) = ctx.saved_tensors
        return ctx.tiler.backward(inputs, d_outputs, ctx.needs_input_grad[0]), None, None


def _tensors(outputs):
    import keras

    return [t for t in keras.tree.flatten(outputs) if isinstance(t, torch.Tensor)]


class Sharding(object):
    """The sharded state of one distributed model (see the module docstring).

    Args:
        mode: ``"optimizer"``, ``"gradients"`` or ``"all"``.
        model: the Keras model.
        rank: this process' rank.
        world: the number of processes.
        broadcast_new: ``broadcast_new()`` gives every rank rank 0's values of variables made since the last
            call (the trainer's ``broadcast_new_variables`` for this model), called once an optimizer is built.
    """

    def __init__(self, mode, model, rank, world, broadcast_new):
        self.mode, self.model, self.rank, self.world = mode, model, rank, world
        self.broadcast_new = broadcast_new
        self._layout_key, self._owner = None, {}
        self.version = 0  # counts the layouts (the overlapped buckets follow it)
        self._relaying = False
        self._layers = {}  # shard="all": id(layer) -> its _Layer (the weights it gathers around its call)
        self._weights_ids = None  # the trainable variables prepare_weights() last sharded
        self._pinned = 0  # depth of weights_gathered() blocks: every weight held, no layer releases
        self._refresh = False  # weights_restored(): the split weights' parts taken from the loaded values
        self.applying = False  # the owners' update of their own weights in flight: readable there
        self.buckets = None  # the overlapped buckets (set by the trainer), where a tiled kernel's parts go

    # -- ownership

    def _may_split(self):
        """Whether the model's optimizer lets a variable be split (:func:`elementwise`; no optimizer yet: yes)."""
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            return True
        return elementwise(getattr(optimizer, "inner_optimizer", None) or optimizer)

    def owner_map(self, variables=None):
        """id(variable) -> owner rank, or :data:`SPLIT`, over the model's trainable variables (:func:`layout`)
        and ``variables`` beyond them (whole, placed on top of the model's loads).

        A new layout (other trainable variables, or an optimizer that does or doesn't allow splitting) first
        gives every rank the state sharded under the old one (collective; every rank meets the change at
        the same point of a step), then shards under the new one from the next use on."""
        trainable = self.model.trainable_variables
        key = (tuple(id(v) for v in trainable), self._may_split())
        if key != self._layout_key and not self._relaying:
            if self._layout_key is not None and key[1] != self._layout_key[1]:
                self._relaying = True
                try:
                    self.gather()
                    self.unshard_weights()
                finally:
                    self._relaying = False
            split = key[1]
            self._layout_key, self.version = key, self.version + 1
            placed = layout([nbytes(v) for v in trainable], [int(math.prod(v.shape)) for v in trainable],
                            [split and v.constraint is None and not getattr(v, "overwrite_with_gradient", False)
                             for v in trainable], self.world)
            self._owner = dict(zip(key[0], placed))
        extra = [v for v in variables or () if id(v) not in self._owner]
        if extra:
            loads = [0] * self.world
            for variable in trainable:
                for rank, start, stop in self.parts(variable):
                    loads[rank] += nbytes(variable) * (stop - start) // max(int(math.prod(variable.shape)), 1)
            self._owner.update(zip((id(v) for v in extra), owners([nbytes(v) for v in extra], self.world, loads)))
        return self._owner

    def parts(self, variable, owner=None):
        """``[(rank, start, stop)]``: who owns which flat elements of ``variable`` (one part: a whole one)."""
        owner = self._owner if owner is None else owner
        rank = owner.get(id(variable), self.rank)
        size = int(math.prod(variable.shape))
        if rank == SPLIT:
            return [(r,) + part_range(size, self.world, r) for r in range(self.world)]
        return [(rank, 0, size)]

    def own_part(self, variable):
        """``(start, stop)`` of this rank's part of a split ``variable``."""
        return part_range(int(math.prod(variable.shape)), self.world, self.rank)

    def groups(self, variables, owner=None, like=None):
        """Per rank, the parts of ``variables`` it owns, for :func:`broadcast_owned` (``like``: per variable,
        the variable whose ownership it follows, as a slot follows its weight)."""
        owner = self.owner_map() if owner is None else owner
        result = [[] for _ in range(self.world)]
        for index, variable in enumerate(variables):
            for rank, start, stop in self.parts(variable if like is None else like[index], owner):
                result[rank].append((variable, start, stop))
        return result

    # -- weights (shard="all")

    def prepare_weights(self):
        """With shard="all": hook the call of every layer that directly holds trainable variables not hooked
        yet, and release the weights this rank does not own (before every step: a model built by its first
        fit() has new layers). Every rank finds the same layers in the same order."""
        if self.mode != "all":
            return
        trainable = self.model.trainable_variables
        ids = tuple(id(v) for v in trainable)
        if ids == self._weights_ids:
            return
        owner = self.owner_map()
        placed = {id(v) for state in self._layers.values() for v in state.variables}
        for layer in keras_model.layers_of(self.model):
            if callable(getattr(type(layer), "_track_variables", None)) and not keras_model.is_hooked(
                    layer, "_track_variables"):
                keras_model.hook(layer, "_track_variables",
                                 _within(type(layer)._track_variables.__get__(layer), _bare_parameters))
            if callable(getattr(type(layer), "_get_regularization_losses", None)) and not keras_model.is_hooked(
                    layer, "_get_regularization_losses"):
                keras_model.hook(layer, "_get_regularization_losses", self._hooked_regularization(layer))
            # Layer._trainable_variables (a Keras private): the variables the layer made itself, not its
            # nested layers' (those get their own hook); a frozen layer's are not in the owner map.
            direct = [v for v in layer.__dict__.get("_trainable_variables", ()) if id(v) in owner and id(v) not in placed]
            if not direct:
                continue
            placed.update(id(v) for v in direct)
            state = self._layers.get(id(layer))
            if state is None:
                state = self._layers[id(layer)] = _Layer(layer, self)
                keras_model.hook(layer, "call", self._hooked_call(state, type(layer).call.__get__(layer)))
            kernel = getattr(layer, "_kernel", None)  # Dense's own kernel variable (a Keras private; its public
            # ``kernel`` property adds LoRA's terms): pinned by test_a_dominant_dense_kernel_is_computed_part_by_part
            if state.tiled is None and any(v is kernel for v in direct) and _tileable(layer, kernel, owner):
                state.tiled = _Tiler(self, layer, kernel)  # its call: Dense's, the matmul tiled
                keras_model.hook(layer, "call", self._hooked_call(state, state.tiled.call))
            for variable in direct:
                variable.__dict__["_distkeras_layer"] = layer.name
                variable.__dict__["_distkeras_state"] = state
                variable.__class__ = _guarded_class(type(variable))
                state.variables.append(variable)
                state.handles.append(variable._value.register_post_accumulate_grad_hook(self._accumulated(state, variable)))
            if not self._pinned:
                self._release_layer(state, force=True)
        self._weights_ids = ids

    def _hooked_call(self, state, call):
        own = type(state.layer).call.__get__(state.layer)  # (a tiled layer's: Dense's own)

        @functools.wraps(call)
        def hooked(*args, **kwargs):
            if _symbolic():  # shapes only (compute_output_spec): released weights give meta stubs
                return own(*args, **kwargs)
            return self._use(state, call, *args, **kwargs)

        return hooked

    def _use(self, state, function, *args, **kwargs):
        """``function(*args, **kwargs)`` with ``state``'s weights gathered (collective), released after; when
        its outputs need gradients, gathered again for their part of the backward pass."""
        self._gather_layer(state)
        state.uses += 1
        try:
            outputs = function(*args, **kwargs)
        finally:
            state.uses -= 1
        if torch.is_grad_enabled():
            needing = [t for t in _tensors(outputs) if t.requires_grad]
            if needing:
                # Before this use's part of the backward pass runs, its weights are gathered again (autograd
                # saved the Parameters themselves, whose storage is refilled in place); once their gradients
                # are accumulated (_accumulated), released again. FSDP1's pre-backward hook, per use.
                torch.autograd.graph.register_multi_grad_hook(
                    needing, lambda grads: self._gather_backward(state), mode="any")
        if not state.uses:
            self._release_layer(state)
        return outputs

    def _hooked_regularization(self, layer):
        """``layer._get_regularization_losses`` (a Keras private: what ``layer.losses``, and so fit()'s
        compute_loss, calls for the weight regularizers, outside any layer's call) with each sharded weight's
        regularizer computed while its layer's weights are gathered, as a use of that layer (:meth:`_use`:
        released after, gathered again for the backward pass). One gather per layer, the losses in Keras'
        order (their sum is the single-device one); every rank walks the same weights in the same order."""
        regularization = type(layer)._get_regularization_losses.__get__(layer)

        @functools.wraps(regularization)
        def hooked():
            from keras.src import backend as keras_backend

            weights = [v for v in layer.trainable_weights if v.regularizer is not None]
            if _symbolic() or keras_backend.in_stateless_scope() or not any(
                    "_distkeras_state" in v.__dict__ for v in weights):
                return regularization()
            by_state = {}  # id(state) -> (state, [positions]); dicts keep the first use's order
            losses = [None] * len(weights)
            for position, variable in enumerate(weights):
                state = variable.__dict__.get("_distkeras_state")
                if state is None:
                    losses[position] = variable.regularizer(variable)
                else:
                    by_state.setdefault(id(state), (state, []))[1].append(position)
            for state, positions in by_state.values():
                computed = self._use(state, lambda ps: [weights[p].regularizer(weights[p]) for p in ps], positions)
                for position, loss in zip(positions, computed):
                    losses[position] = loss
            return losses

        return hooked

    def _gather_layer(self, state):
        """The layer's weights on every rank (collective; nothing when they are held already; a tiled kernel is
        fetched part by part by its layer's call instead)."""
        if state.gathered:
            return
        variables = self._gathered_by_call(state)
        for variable in variables:
            alloc_storage(variable)
        state.gathered = True
        broadcast_owned(self.groups(variables), self.rank)

    @staticmethod
    def _gathered_by_call(state):
        return [v for v in state.variables if state.tiled is None or v is not state.tiled.kernel]

    def _gather_backward(self, state):
        if state.gathered or any(v._value.requires_grad for v in self._gathered_by_call(state)):
            self._gather_layer(state)
            state.pending = {id(v) for v in self._gathered_by_call(state) if v._value.requires_grad}

    def _accumulated(self, state, variable):
        def on_grad(parameter):
            if state.pending and id(variable) in state.pending:
                state.pending.discard(id(variable))
                if not state.pending:
                    self._release_layer(state)  # every gradient of the layer's weights is in: done with them

        return on_grad

    def _release_layer(self, state, force=False):
        if (self._pinned or not state.gathered or state.uses) and not force:
            return
        owner = self.owner_map()
        for variable in state.variables:
            if owner[id(variable)] == SPLIT:
                # Its part is kept in a storage of its own (taken from the whole the first time, and after a load).
                part = self.own_part(variable)
                if allocated(variable) and (self._refresh or variable.__dict__.get("_distkeras_part") != part):
                    keep_piece(variable, *part)
                free_storage(variable)
            elif owner[id(variable)] != self.rank:
                free_storage(variable)
        state.gathered, state.pending = False, None

    def flush_parts(self, deliver=True):
        """Every tiled kernel's held gradient parts (:class:`_Tiler`) into the buckets (``deliver``), or dropped."""
        for state in self._layers.values():
            if state.tiled is not None:
                state.tiled.flush(deliver)

    def release_weights(self):
        """Release every weight a layer still holds (the end of a train step: a layer whose gradients never
        came, a forward pass without backward)."""
        for state in self._layers.values():
            self._release_layer(state)

    @contextlib.contextmanager
    def weights_gathered(self):
        """Every weight on every rank inside the block (collective; nested blocks gather once)."""
        if self.mode != "all":
            yield
            return
        if not self._pinned:
            variables = []
            for state in self._layers.values():
                if not state.gathered:
                    for variable in state.variables:
                        alloc_storage(variable)
                        variables.append(variable)
                    state.gathered = True
            broadcast_owned(self.groups(variables), self.rank)
        self._pinned += 1
        try:
            yield
        finally:
            self._unpin()

    @contextlib.contextmanager
    def weights_restored(self):
        """Every released weight re-allocated inside the block (values undefined until assigned: a load that
        assigns them all, the same values on every rank); released again after."""
        if self.mode != "all":
            yield
            return
        if not self._pinned:
            for state in self._layers.values():
                for variable in state.variables:
                    alloc_storage(variable)
                state.gathered = True
        self._pinned += 1
        try:
            yield
        finally:
            self._unpin()

    def _unpin(self):
        """The end of a weights_gathered() or weights_restored() block: the weights released again, a split
        weight's part taken from the whole first (a load, or EMA's finalize_variable_values() inside the
        block, wrote the whole; no optimizer step runs inside one, so the whole is never older than the part)."""
        self._pinned -= 1
        if not self._pinned:
            self._refresh = True
            try:
                self.release_weights()
            finally:
                self._refresh = False

    def unshard_weights(self):
        """Every weight back on every rank for good (collective), the layers' hooks taken off."""
        if self.mode != "all" or not self._layers:
            return
        with self.weights_gathered():
            for state in self._layers.values():
                for handle in state.handles:
                    handle.remove()
                keras_model.unhook(state.layer, "call")
                for variable in state.variables:
                    variable.__class__ = type(variable)._distkeras_guarded
                    for name in ("_distkeras_state", "_distkeras_view"):
                        variable.__dict__.pop(name, None)
                    forget_piece(variable)
            self._layers = {}
            for layer in keras_model.layers_of(self.model):
                keras_model.unhook(layer, "_track_variables", "_get_regularization_losses")
        self._weights_ids = None

    # -- optimizer state

    def _slots(self, updating, variables):
        """Release the slots of ``updating`` (the optimizer that updates: a LossScaleOptimizer's inner one)
        whose variable this rank does not own; returns its per-variable slots ``[[slot, ...] per variable]``."""
        owner = self.owner_map(variables)
        lists = slot_lists(updating)
        trainable = updating._trainable_variables
        per_variable = [[lst[i] for lst in lists if lst[i] is not None] for i in range(len(trainable))]
        for variable, slots in zip(trainable, per_variable):
            rank = owner.get(id(variable), self.rank)
            if rank == SPLIT:  # this rank's part of each slot kept, the rest freed
                for slot in slots:
                    if tuple(slot.shape) != tuple(variable.shape):
                        raise ShardError(
                            "The optimizer {} keeps a slot {!r} of shape {} for the variable {!r} of shape {}: "
                            "distribute(..., shard=...) splits a variable across replicas only for optimizers "
                            "whose slots match their variables. Please report it.".format(
                                type(updating).__name__, slot.path, tuple(slot.shape), variable.path,
                                tuple(variable.shape)))
                    release_part(slot, *self.own_part(variable))
            elif rank != self.rank:
                for slot in slots:
                    release(slot)
        if _SLOTS not in updating.__dict__ and updating.use_ema:
            # fit() ends with finalize_variable_values(): EMA's averages of every variable written into them.
            finalize = type(updating).finalize_variable_values.__get__(updating)
            keras_model.hook(updating, "finalize_variable_values", _within(finalize, self.gathered))
        updating.__dict__[_SLOTS] = (trainable, per_variable)
        return per_variable

    def optimizers(self):
        """The model's updating optimizers whose slots this sharding released."""
        return [o for o in keras_model.all_optimizers(self.model) if _SLOTS in o.__dict__]

    def gather(self):
        """Every optimizer's full state on every rank (collective): released slots re-allocated and filled
        by their owners."""
        for optimizer in self.optimizers():
            trainable, per_variable = optimizer.__dict__[_SLOTS]
            owner = self.owner_map(trainable)
            slots, like = [], []
            for variable, its_slots in zip(trainable, per_variable):
                for slot in its_slots:
                    restore(slot)
                    slots.append(slot)
                    like.append(variable)
            broadcast_owned(self.groups(slots, owner, like), self.rank)

    def release_all(self):
        """Release again what :meth:`gather` or :meth:`restored` re-allocated."""
        for optimizer in self.optimizers():
            self._slots(optimizer, optimizer._trainable_variables)

    @contextlib.contextmanager
    def gathered(self):
        """Every optimizer's full state on every rank inside the block (collective); released again after."""
        with self.weights_gathered():
            self.gather()
            try:
                yield
            finally:
                self.release_all()

    @contextlib.contextmanager
    def restored(self):
        """Every released slot re-allocated (values undefined until assigned) inside the block, for a load
        that assigns them all; released again after (no communication: every rank loads the same values)."""
        for optimizer in self.optimizers():
            for slots in optimizer.__dict__[_SLOTS][1]:
                for slot in slots:
                    restore(slot)
        try:
            with self.weights_restored():
                yield
        finally:
            self.release_all()

    # -- one update

    def apply(self, optimizer, keras_apply, grads, variables):
        """Apply averaged ``grads`` (None: no gradient, or not this rank's) of ``variables`` with ``optimizer``:
        this rank's variables only, globals kept global, then every owner's variables broadcast."""
        from keras.src import backend as keras_backend  # name_scope(caller=): as Keras' apply() builds

        updating = getattr(optimizer, "inner_optimizer", None) or optimizer
        if not optimizer.built:  # built over every variable, as on one device, before any is left out
            with keras_backend.name_scope(optimizer.name, caller=optimizer), self.weights_gathered():
                optimizer.build(variables)
            optimizer.built = True
            self.broadcast_new()
        per_variable = self._slots(updating, variables)
        owner = self.owner_map(variables)
        # A split variable's gradient here is this rank's part of it (flat), updated in place of the whole.
        mine = [i for i, v in enumerate(variables) if owner[id(v)] in (self.rank, SPLIT) and grads[i] is not None]
        own_variables = [variables[i] for i in mine]
        self.applying = True  # shard="all": the owners read and write their own weights, held by them anyway
        try:
            with self._narrowed(optimizer, updating, own_variables, per_variable):
                if optimizer is updating:
                    updating.apply([grads[i] for i in mine], own_variables)
                else:
                    keras_apply([grads[i] for i in mine], own_variables)
        finally:
            self.applying = False
        if self.mode == "all":  # the owners updated their own weights; the others get them at their next use
            return
        broadcast_owned(self.groups(variables, owner), self.rank)

    @contextlib.contextmanager
    def _narrowed(self, optimizer, updating, own_variables, per_variable):
        """While ``updating`` updates ``own_variables`` only: EMA over them, global clipping and finite check,
        and an apply with nothing of its own that still counts the step."""
        saved = {name: updating.__dict__[name] for name in ("_trainable_variables", "_model_variables_moving_average")
                 if name in updating.__dict__}
        index = {id(v): i for i, v in enumerate(updating._trainable_variables)}
        # Instance attributes written into __dict__: the optimizer's __setattr__ would track the lists' variables.
        updating.__dict__["_trainable_variables"] = list(own_variables)
        owner = self.owner_map()
        split = {id(v): k for k, v in enumerate(v for v in self.model.trainable_variables if owner[id(v)] == SPLIT)}
        if updating.use_ema:
            averages = saved["_model_variables_moving_average"]
            updating.__dict__["_model_variables_moving_average"] = [averages[index[id(v)]] for v in own_variables]
        keras_apply = type(updating).apply.__get__(updating)
        clip = type(updating)._clip_gradients.__get__(updating)

        def apply(grads, trainable_variables=None):
            if len(grads):
                return keras_apply(grads, trainable_variables)
            # Nothing of this rank's: join the step's collectives and count it, as Keras' apply() would.
            steps = updating.gradient_accumulation_steps
            if not steps or (int(updating.iterations) + 1) % steps == 0:
                updating._clip_gradients([])
            updating.iterations.assign_add(1)

        def clip_gradients(grads):
            if updating.clipnorm and updating.clipnorm > 0 and split:
                # The grads of the variables Keras' apply kept (every one of ours has a gradient; those it
                # overwrites with their gradient are left out), as it passes them here.
                kept = [v for v in own_variables if not updating._overwrite_variable_with_gradient(v)]
                return clip_by_part_norms(grads, kept if grads else [], updating, split, self._device())
            if not (updating.global_clipnorm and updating.global_clipnorm > 0):
                return clip(grads) if grads else grads
            return clip_by_global_norm(grads, updating.global_clipnorm, self._device())

        def reset_gradient_accumulators():
            # Keras' torch optimizers reset every accumulator at an update step: here only this rank's own
            # (with the same multiply by zero), the others are released.
            with torch.no_grad():
                for variable in own_variables:
                    accumulator = updating._accumulated_gradients[updating._get_variable_index(variable)]
                    if accumulator is not None:
                        accumulator._value.mul_(0.0)

        hooks = [(updating, "apply", apply), (updating, "_clip_gradients", clip_gradients)]
        if updating.gradient_accumulation_steps:
            hooks.append((updating, "_backend_reset_gradient_accumulators", reset_gradient_accumulators))
        if optimizer is not updating:
            check = type(optimizer).check_finite.__get__(optimizer)
            hooks.append((optimizer, "check_finite", lambda grads: all_finite(check(grads), self._device())))
        # Set for the call only, over whatever the instance holds (the trainer's averaging apply), then put back.
        before = [(obj, name, obj.__dict__.get(name, _NONE)) for obj, name, _ in hooks]
        for obj, name, function in hooks:
            obj.__dict__[name] = function
        try:
            with self._parts_in_place([v for v in own_variables if id(v) in split], per_variable, index):
                yield
        finally:
            for obj, name, value in before:
                if value is _NONE:
                    obj.__dict__.pop(name, None)
                else:
                    obj.__dict__[name] = value
            updating.__dict__.update(saved)

    @contextlib.contextmanager
    def _parts_in_place(self, variables, per_variable, index):
        """Inside the block each split variable of ``variables``, and each of its slots, is this rank's part
        only: a flat variable of the part's length (its Keras ``_value`` and ``_shape``, privates, swapped for
        the block; Keras' optimizers read both through ``value`` and ``shape``, and find slots by the
        variable object's id, which stays). The part of a replicated weight is a view of its storage, the
        part of a sharded one (shard="all") and of a slot the storage kept for it (:func:`piece`)."""
        swapped = []
        try:
            for variable in variables:
                start, stop = self.own_part(variable)
                target = piece(variable)
                if target is None:
                    target = variable._value.data.view(-1)[start:stop]
                swapped.append(_swap(variable, target))
                for slot in per_variable[index[id(variable)]]:
                    swapped.append(_swap(slot, piece(slot)))
            yield
        finally:
            for variable, saved in reversed(swapped):
                variable.__class__ = saved[0]
                variable.__dict__["_value"], variable.__dict__["_shape"], variable.__dict__["_ndim"] = saved[1:]

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def reduce_to_owners(grads, variables, count, sharding, compression=None, drop=True):
    """ZeRO-1/2 without overlap: each variable's gradient averaged over the ranks (weighted by their ``count`` of
    samples, as :func:`~distkeras.backends.torch.collectives.average_gradients`) on its owner only (a split
    variable's parts each on its own rank, flat); None elsewhere, and for a variable without a gradient on
    any rank.

    One all-reduce of the has-gradient flags and the counts, then per owner and dtype one flat buffer of
    that owner's gradients (and parts), each already scaled by this rank's share (in the 16-bit wire dtype
    with ``compression``), sent to it (:class:`OwnerReduce`), all at once and then waited for (as
    :func:`broadcast_owned`, for the same reason: the owners' reduces use both directions of a link
    together). With ``drop`` (shard="gradients", "all") the gradients this rank doesn't own whole are
    dropped from their parameters once sent; shard="optimizer" keeps them (ZeRO-1 frees nothing early).
    """
    from .. import policies
    from .collectives import WIRE

    rank, world = sharding.rank, sharding.world
    owner = sharding.owner_map(variables)
    device = next((g.device for g in grads if g is not None), variables[0]._value.device)
    meta = torch.tensor([float(g is not None) for g in grads] + [float(count)], dtype=torch.float64, device=device)
    dist.all_reduce(meta)
    meta = meta.tolist()
    weight = policies.batch_share(count, meta[-1])
    averaged = [None] * len(variables)
    groups = {}
    for index, variable in enumerate(variables):
        if meta[index]:
            dtype = torch.float64 if variable._value.dtype == torch.float64 else torch.float32
            for dst, start, stop in sharding.parts(variable, owner):
                groups.setdefault((dst, dtype), []).append((index, start, stop))
    pending = []
    for (dst, dtype), entries in sorted(groups.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        flat = torch.empty(sum(stop - start for _, start, stop in entries), dtype=dtype, device=device)
        offset = 0
        for index, start, stop in entries:
            piece = flat[offset : offset + stop - start]
            if grads[index] is None or not weight:
                piece.zero_()
            else:
                torch.mul(grads[index].detach().reshape(-1)[start:stop], weight, out=piece)
            offset += stop - start
        wire = flat if compression is None else flat.to(WIRE[compression])
        work = OwnerReduce(wire, dst, rank, world)
        pending.append((dst, entries, flat, wire, work) if dst == rank else (dst, None, None, None, work))
        del flat, wire  # another owner's: the message holds it until it is sent
    for dst, entries, flat, wire, work in pending:
        work.wait()
        if dst != rank:
            continue
        if wire is not flat:
            flat.copy_(wire)
        offset = 0
        for index, start, stop in entries:
            variable = variables[index]
            part = flat[offset : offset + stop - start]
            if owner[id(variable)] != SPLIT:
                part = part.view(variable.shape)
            averaged[index] = part.to(variable._value.dtype)
            offset += stop - start
    if drop:
        for variable in variables:
            if owner[id(variable)] != rank:
                variable._value.grad = None  # sent: not kept here
    return averaged


class OwnerReduce(object):
    """A sum of ``flat`` over the ranks onto ``dst`` only, as point-to-point messages: every other rank sends
    its buffer to the owner, which sums them piece by piece as they arrive (``wait()`` waits for all of it).

    Why not ``dist.reduce``: gloo's reduce is a ring reduce-scatter followed by a gather to the root, so with
    every owner reducing at once each rank sends 1.5x its share of the gradients at N=2 (and more than
    (N-1)/N of them at any N). Sent directly, each rank sends exactly the gradients it doesn't own and
    receives (N-1) copies of the ones it owns: the bytes of a ring reduce-scatter, both ways at once.

    The owner never holds those copies whole: each arrives in pieces (:meth:`messages.Links.recv`'s
    ``on_piece``), and once every rank's piece at an offset is in, they are summed in rank order into ``flat``
    (the same sum however they arrived) and dropped: (N-1) copies of a few pieces, not of the buffer. A
    rank ahead of the others waits once :data:`AHEAD` of its pieces wait for theirs (its stream posts no
    more receives meanwhile): the held pieces stay bounded, however unequal the ranks' pace.
    """

    def __init__(self, flat, dst, rank, world, group=None):
        self.flat, self.rank, self.world, self.sending = flat, rank, world, None
        self.arrived = {}  # piece offset -> {src: buffer}, until all are in
        self.lock = threading.Condition()
        link = messages.links(group)
        if dst != rank:
            self.sent = [link.send(flat, dst)]
            self.flat = None  # the message holds it until it is sent
            storage = flat.untyped_storage()
            self.sending = (storage.data_ptr(), storage.nbytes())  # (for Buckets.held_storages; no reference kept)
        else:
            self.sent = [link.recv(flat, src, on_piece=functools.partial(self._arrived, src))
                         for src in range(world) if src != rank]

    def _arrived(self, src, start, buffer):
        with self.lock:
            pieces = self.arrived.setdefault(start, {})
            pieces[src] = buffer
            if len(pieces) < self.world - 1:
                # On src's stream thread: it waits while src is AHEAD pieces ahead (a failed message, a peer gone,
                # ends the wait: its error is raised by wait()).
                while (sum(src in waiting for waiting in self.arrived.values()) > AHEAD
                       and not any(message.error for message in getattr(self, "sent", ()))):
                    self.lock.wait(1.0)
                return
            del self.arrived[start]
            self.lock.notify_all()
        mine = self.flat[start : start + buffer.numel()]
        pieces[self.rank] = mine
        order = sorted(pieces)  # rank order, as one all-reduce of the whole buffers would add them
        total = pieces[order[0]]  # summed in place (a received piece, or this rank's own slice)
        for other in order[1:]:
            total.add_(pieces[other])
        if total is not mine:
            mine.copy_(total)

    def held_storages(self):
        """Received pieces, waiting for the other ranks' pieces at their offset or still arriving, ``{data_ptr:
        bytes}``."""
        with self.lock:
            buffers = [b.untyped_storage() for pieces in self.arrived.values() for b in pieces.values()]
        held = {storage.data_ptr(): storage.nbytes() for storage in buffers}
        if self.flat is not None:  # the owner: also the pieces posted and not arrived yet
            held.update(messages.Links.posted(self.sent))
        return held

    def wait(self):
        messages.wait(self.sent)


def _swap(variable, target):
    saved = (variable.__class__, variable.__dict__["_value"], variable.__dict__["_shape"], variable.__dict__["_ndim"])
    if is_released(variable):
        variable.__class__ = type(variable)._distkeras_base
    variable.__dict__["_value"], variable.__dict__["_shape"], variable.__dict__["_ndim"] = target, (target.numel(),), 1
    return variable, saved


def clip_by_part_norms(grads, variables, optimizer, split, device):
    """Keras' ``clipnorm`` (each gradient scaled to a norm of at most ``clipnorm``) where some of ``grads``
    are this rank's parts of split variables (``split``: id -> position among the model's split variables):
    their squares summed over the ranks (one all-reduce, every rank, also one with no gradient), then Keras'
    formula (``BaseOptimizer._clip_by_norm``) with the whole variable's norm; the others are Keras' own."""
    squares = torch.zeros(len(split), dtype=torch.float64, device=device)
    for grad, variable in zip(grads, variables):
        if grad is not None and id(variable) in split:
            squares[split[id(variable)]] += torch.sum(torch.square(grad.detach().to(torch.float64)))
    dist.all_reduce(squares)
    clip_norm = optimizer.clipnorm
    clipped = []
    for grad, variable in zip(grads, variables):
        if grad is None or id(variable) not in split:
            clipped.append(grad if grad is None else optimizer._clip_by_norm(grad))
            continue
        l2sum = squares[split[id(variable)]].to(torch.float32)
        l2norm = torch.sqrt(l2sum) if float(l2sum) > 0 else l2sum
        clipped.append(grad * clip_norm / torch.maximum(l2norm, torch.tensor(clip_norm, dtype=torch.float32)).to(grad.dtype))
    return clipped


def clip_by_global_norm(grads, clip_norm, device):
    """Keras' ``clip_by_global_norm`` over every rank's part of the gradients: the squares summed over the
    ranks (one all-reduce), then Keras' own formula (a non-finite norm makes every gradient NaN)."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        if grad is not None:
            squares += torch.sum(torch.square(grad.detach().to(torch.float64)))
    dist.all_reduce(squares)
    norm = torch.sqrt(squares).to(torch.float32)
    scale = clip_norm * torch.minimum(1.0 / norm, torch.tensor(1.0 / clip_norm)) + (norm - norm)
    return [g * scale.to(g.dtype) if g is not None else g for g in grads]


def all_finite(local, device):
    """A LossScaleOptimizer's finite check, agreed by every rank: finite only where every part is."""
    flag = torch.tensor([0.0 if bool(local) else 1.0], dtype=torch.float32, device=device)
    dist.all_reduce(flag)
    return torch.tensor(not flag.item())


def install(sharding):
    """The model's ``save``/``save_weights`` gather the optimizer state first, ``load_weights`` restores every
    slot to load into (instance hooks over the ones already set: rank 0's writes)."""
    model = sharding.model
    names = [("save", sharding.gathered), ("save_weights", sharding.gathered), ("load_weights", sharding.restored)]
    if sharding.mode == "all":
        names += [("get_weights", sharding.weights_gathered), ("set_weights", sharding.weights_restored)]
    for name, block in names:
        keras_model.hook(model, name, _within(getattr(model, name), block))
    keras_model.hook(model, _SHARDING, sharding)
    sharding.prepare_weights()


def uninstall(model):
    """Give back every optimizer's full state (and with "all" every weight) on every rank (collective) and forget
    the sharding."""
    sharding = model.__dict__.get(_SHARDING)
    if sharding is None:
        return
    sharding.gather()
    sharding.unshard_weights()
    for optimizer in sharding.optimizers():
        optimizer.__dict__.pop(_SLOTS)
    keras_model.unhook(model, _SHARDING)


def _within(method, block):
    @functools.wraps(method)
    def call(*args, **kwargs):
        with block():
            return method(*args, **kwargs)

    return call
