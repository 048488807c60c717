"""Sharded training state on PyTorch (ZeRO stages 1, 2 and 3): ``distribute(model, shard="optimizer" | "gradients" | "all")``.

- **Ownership by whole variables** (:func:`owners`): each trainable variable has one owner rank, chosen
  greedily by bytes (largest first, to the least-loaded rank, ties to the lower rank; the same on every rank),
  as ``torch.distributed.optim.ZeroRedundancyOptimizer`` partitions parameters. Whole variables, not flat
  1/N slices: the optimizer then runs its own per-variable math on full shapes (Adafactor's factored
  moments, anything shape-dependent stay exact), and its structure stays the single-device one. The cost:
  the balance is limited by the largest variable.
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
- **"gradients"** (ZeRO-2): the gradients travel to their owner only (``dist.reduce``, one flat buffer
  per owner and dtype; in the overlapped buckets one bucket holds one owner's variables), and a rank drops
  the gradients it does not own as soon as they are sent. Bytes moved per step: the gradients once
  (reduce) and the weights once (broadcast), as one all-reduce.
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
  weight and its layer (a layer reading another layer's weight, as tied weights do, a regularizer, a
  callback computing with ``layer.kernel``): the same error on every rank, so none waits for the
  others. ``model.get_weights()``, ``save()``, ``save_weights()`` gather every weight on every rank
  (collective), ``set_weights()``/``load_weights()`` re-allocate them all and free again after;
  ``predict()``/``evaluate()`` gather per layer as the forward pass does.
"""

import contextlib
import functools
import math

import torch
import torch.distributed as dist

from ...errors import ShardError
from .. import keras_model

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
            if state.gathered or state.sharding.applying:
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
    """``groups``: per rank, the variables it owns (same order on every rank). Each owner's values reach every
    rank: one broadcast per owner and (dtype, device), flattened."""
    for owner, variables in enumerate(groups):
        by_kind = {}
        for variable in variables:
            value = variable._value
            by_kind.setdefault((value.dtype, value.device), []).append(variable)
        for (dtype, device), group in by_kind.items():
            if owner == rank:
                flat = torch.cat([v._value.detach().reshape(-1) for v in group])
            else:
                flat = torch.empty(sum(int(math.prod(v.shape)) for v in group), dtype=dtype, device=device)
            dist.broadcast(flat, src=owner)
            if owner != rank:
                offset = 0
                with torch.no_grad():  # .data: no autograd version bump on the weights
                    for variable in group:
                        size = int(math.prod(variable.shape))
                        variable._value.data.copy_(flat[offset : offset + size].view(variable._value.shape))
                        offset += size


class _Layer(object):
    """A layer whose own trainable variables shard="all" gathers around its call."""

    def __init__(self, layer, sharding):
        self.layer, self.sharding = layer, sharding
        self.variables, self.handles = [], []
        self.gathered = True  # until prepare_weights() releases them
        self.uses = 0  # calls in flight (a layer whose call calls itself)
        self.pending = None  # in a backward pass: ids of the weights whose gradients are still to come


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
        self._layout_ids, self._owner = None, {}
        self._layers = {}  # shard="all": id(layer) -> its _Layer (the weights it gathers around its call)
        self._weights_ids = None  # the trainable variables prepare_weights() last sharded
        self._pinned = 0  # depth of weights_gathered() blocks: every weight held, no layer releases
        self.applying = False  # the owners' update of their own weights in flight: readable there

    # -- ownership

    def owner_map(self, variables=None):
        """id(variable) -> owner rank, over the model's trainable variables (and ``variables`` beyond them)."""
        trainable = self.model.trainable_variables
        ids = tuple(id(v) for v in trainable)
        if ids != self._layout_ids:
            self._layout_ids = ids
            self._owner = dict(zip(ids, owners([nbytes(v) for v in trainable], self.world)))
        extra = [v for v in variables or () if id(v) not in self._owner]
        if extra:  # variables outside the model's trainable ones: placed on top of the model's loads
            loads = [0] * self.world
            for variable in trainable:
                loads[self._owner[id(variable)]] += nbytes(variable)
            self._owner.update(zip((id(v) for v in extra), owners([nbytes(v) for v in extra], self.world, loads)))
        return self._owner

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
        @functools.wraps(call)
        def hooked(*args, **kwargs):
            if _symbolic():  # shapes only (compute_output_spec): released weights give meta stubs
                return call(*args, **kwargs)
            self._gather_layer(state)
            state.uses += 1
            try:
                outputs = call(*args, **kwargs)
            finally:
                state.uses -= 1
            if torch.is_grad_enabled():
                needing = [t for t in _tensors(outputs) if t.requires_grad]
                if needing:
                    # Before this call's part of the backward pass runs, its weights are gathered again (autograd
                    # saved the Parameters themselves, whose storage is refilled in place); once their gradients
                    # are accumulated (_accumulated), released again. FSDP1's pre-backward hook, per call.
                    torch.autograd.graph.register_multi_grad_hook(
                        needing, lambda grads: self._gather_backward(state), mode="any")
            if not state.uses:
                self._release_layer(state)
            return outputs

        return hooked

    def _gather_layer(self, state):
        """The layer's weights on every rank (collective; nothing when they are held already)."""
        if state.gathered:
            return
        owner = self.owner_map()
        groups = [[] for _ in range(self.world)]
        for variable in state.variables:
            alloc_storage(variable)
            groups[owner[id(variable)]].append(variable)
        state.gathered = True
        broadcast_owned(groups, self.rank)

    def _gather_backward(self, state):
        self._gather_layer(state)
        state.pending = {id(v) for v in state.variables if v._value.requires_grad}

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
            if owner[id(variable)] != self.rank:
                free_storage(variable)
        state.gathered, state.pending = False, None

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
            owner = self.owner_map()
            groups = [[] for _ in range(self.world)]
            for state in self._layers.values():
                if not state.gathered:
                    for variable in state.variables:
                        alloc_storage(variable)
                        groups[owner[id(variable)]].append(variable)
                    state.gathered = True
            broadcast_owned(groups, self.rank)
        self._pinned += 1
        try:
            yield
        finally:
            self._pinned -= 1
            if not self._pinned:
                self.release_weights()

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
            self._pinned -= 1
            if not self._pinned:
                self.release_weights()

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
            self._layers = {}
            for layer in keras_model.layers_of(self.model):
                keras_model.unhook(layer, "_track_variables")
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
            if owner.get(id(variable), self.rank) != self.rank:
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
            groups = [[] for _ in range(self.world)]
            for variable, slots in zip(trainable, per_variable):
                for slot in slots:
                    restore(slot)
                groups[owner.get(id(variable), self.rank)].extend(slots)
            broadcast_owned(groups, self.rank)

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
        mine = [i for i, v in enumerate(variables) if owner[id(v)] == self.rank and grads[i] is not None]
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
        groups = [[] for _ in range(self.world)]
        for variable in variables:
            groups[owner[id(variable)]].append(variable)
        broadcast_owned(groups, self.rank)

    @contextlib.contextmanager
    def _narrowed(self, optimizer, updating, own_variables, per_variable):
        """While ``updating`` updates ``own_variables`` only: EMA over them, global clipping and finite check,
        and an apply with nothing of its own that still counts the step."""
        saved = {name: updating.__dict__[name] for name in ("_trainable_variables", "_model_variables_moving_average")
                 if name in updating.__dict__}
        index = {id(v): i for i, v in enumerate(updating._trainable_variables)}
        # Instance attributes written into __dict__: the optimizer's __setattr__ would track the lists' variables.
        updating.__dict__["_trainable_variables"] = list(own_variables)
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
            yield
        finally:
            for obj, name, value in before:
                if value is _NONE:
                    obj.__dict__.pop(name, None)
                else:
                    obj.__dict__[name] = value
            updating.__dict__.update(saved)

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def reduce_to_owners(grads, variables, count, owner, rank, compression=None):
    """ZeRO-2 without overlap: each variable's gradient averaged over the ranks (weighted by their ``count`` of
    samples, as :func:`~distkeras.backends.torch.collectives.average_gradients`) on its owner only; None
    elsewhere, and for a variable without a gradient on any rank.

    One all-reduce of the has-gradient flags and the counts, then per owner and dtype one ``reduce`` of a
    flat buffer of that owner's gradients, each already scaled by this rank's share (in the 16-bit wire dtype
    with ``compression``). The gradients this rank doesn't own are dropped from their parameters once sent.
    """
    from .. import policies
    from .collectives import WIRE

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
            groups.setdefault((owner[id(variable)], dtype), []).append(index)
    for (dst, dtype), indices in sorted(groups.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        sizes = [int(math.prod(variables[i].shape)) for i in indices]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        offset = 0
        for index, size in zip(indices, sizes):
            piece = flat[offset : offset + size]
            if grads[index] is None or not weight:
                piece.zero_()
            else:
                torch.mul(grads[index].detach().reshape(-1), weight, out=piece)
            offset += size
        wire = flat if compression is None else flat.to(WIRE[compression])
        dist.reduce(wire, dst=dst)
        if dst != rank:
            for index in indices:
                variables[index]._value.grad = None  # sent: not kept here
            continue
        if wire is not flat:
            flat.copy_(wire)
        offset = 0
        for index, size in zip(indices, sizes):
            variable = variables[index]
            averaged[index] = flat[offset : offset + size].view(variable.shape).to(variable._value.dtype)
            offset += size
    return averaged


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
