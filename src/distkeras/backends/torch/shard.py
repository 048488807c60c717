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

This module holds :class:`Sharding`, which joins four modules beside it, one idea each:
:mod:`~distkeras.backends.torch.shard_layout` (ownership: :func:`layout`, :func:`part_range`, :func:`elementwise`,
:func:`slot_lists`), :mod:`~distkeras.backends.torch.shard_storage` (the release and gather of storage:
:func:`piece`, :func:`release`, :func:`restore`), :mod:`~distkeras.backends.torch.shard_tiles` (:class:`_Tiler`)
and :mod:`~distkeras.backends.torch.shard_step` (the step's communication: :class:`OwnerReduce`,
:func:`clip_by_part_norms`).
"""

import contextlib
import functools
import math

import torch
import torch.distributed as dist

from ...errors import ShardError
from .. import keras_model
from .shard_layout import elementwise, layout, nbytes, owners, part_range, slot_lists, SPLIT
from .shard_step import all_finite, clip_by_global_norm, clip_by_part_norms
from .shard_storage import (
    alloc_storage, allocated, _bare_parameters, broadcast_owned, forget_piece, free_storage, _guarded_class,
    is_released, keep_piece, piece, release, release_part, restore, _symbolic,
)
from .shard_tiles import _tileable, _Tiler

#: The instance attribute of an optimizer that holds its :class:`_Slots`.
_SLOTS = "_distkeras_slots"
#: The model's instance attribute that holds its :class:`Sharding`.
_SHARDING = "_distkeras_sharding"
_NONE = object()


class _Layer(object):
    """A layer whose own trainable variables shard="all" gathers around its call."""

    def __init__(self, layer, sharding):
        self.layer, self.sharding = layer, sharding
        self.variables, self.handles = [], []
        self.gathered = True  # until prepare_weights() releases them
        self.uses = 0  # calls in flight (a layer whose call calls itself)
        self.pending = None  # in a backward pass: ids of the weights whose gradients are still to come
        self.tiled = None  # a Dense layer's split kernel computed part by part (_Tiler), never gathered whole


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


def _swap(variable, target):
    saved = (variable.__class__, variable.__dict__["_value"], variable.__dict__["_shape"], variable.__dict__["_ndim"])
    if is_released(variable):
        variable.__class__ = type(variable)._distkeras_base
    variable.__dict__["_value"], variable.__dict__["_shape"], variable.__dict__["_ndim"] = target, (target.numel(),), 1
    return variable, saved


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
