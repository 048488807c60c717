"""Tensor parallelism on PyTorch: the layers a layout splits hold only their shard, Megatron-style.

Every process of a model group runs the whole model on the same batch, but each split layer keeps only its
part of the kernel, as an ordinary Keras variable of the local shape (the optimizer then makes its slots
that shape too: the optimizer state is split for free). The layers' calls are replaced on the instance
(:func:`distkeras.backends.keras_model.hook`), so the classes, configs and saves stay the user's:

- **Dense and EinsumDense**, read as an einsum (Dense is ``...i,io->...o``). The kernel axis the layout
  puts on ``model`` is either kept in the output (a *column* split: each process computes its slice of the
  output; its input passes through :class:`Copy`, identity forward and all-reduce backward) or contracted
  (a *row* split: each process multiplies its slice of the input by its rows and the partial sums are
  all-reduced, :class:`Reduce`; the bias is added after). A column layer whose output feeds only a row layer
  split along the same axis hands its slice straight on (Megatron's pair: one all-reduce forward, one
  backward); otherwise a column layer gathers its output (:class:`Gather`) and a row layer takes its slice
  of a whole input (:class:`Scatter`), so any layer split either way computes one device's values.
- **MultiHeadAttention**, split by heads: query, key and value by columns, the output projection by rows,
  the heads in between never leave their process.
- **Embedding**, split by vocabulary (each process looks up the ids in its range, the rest are zero, one
  all-reduce) or by feature (each its columns, gathered).

What isn't split stays replicated: every process computes it alike on the same batch, so its gradients are
alike too and need no all-reduce. ``save``/``save_weights``/``get_weights`` put the whole variables back for
the call (one all-gather each) and the shards after, so what is written is the plain model.

Collectives run on the job's process group (``torch.distributed``, gloo or NCCL). The autograd functions
are public torch (``torch.autograd.Function``); the variables' storage is Keras' private ``_value`` and
``_shape`` (as :func:`distkeras.backends.torch.adapter.place` does; tests/backends/test_torch_tensor.py pins
them).
"""

import contextlib
import re

import keras
import torch
import torch.distributed as dist

from ...parallel import layouts
from ...errors import OptionError
from .. import keras_model

#: The instance attribute holding a model's splits (read by describe()).
SPLITS = "_distkeras_splits"


class Copy(torch.autograd.Function):
    """Identity forward; the gradient all-reduced backward (the input of a column split)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Reduce(torch.autograd.Function):
    """The partial sums all-reduced forward; identity backward (the output of a row split)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Gather(torch.autograd.Function):
    """Every process' slice along ``axis`` concatenated forward; this process' slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis, rank, world, group):
        ctx.axis, ctx.rank, ctx.world = axis, rank, world
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=axis)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.world, dim=ctx.axis)[ctx.rank].contiguous(), None, None, None, None


class Scatter(torch.autograd.Function):
    """This process' slice along ``axis`` forward; the gradients' slices gathered backward."""

    @staticmethod
    def forward(ctx, x, axis, rank, world, group):
        ctx.axis, ctx.rank, ctx.world, ctx.group = axis, rank, world, group
        return x.chunk(world, dim=axis)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(ctx.world)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=ctx.axis), None, None, None, None


class Split(object):
    """How one layer is split: its variables' split axes, its role, and whether it pairs with its neighbour."""

    def __init__(self, layer, kind, variables, rank, world, group=None):
        self.layer = layer
        self.group = group  # the model shards' process group (None: every process)
        self.kind = kind  # "column", "row", "heads", "vocab", "feature"
        self.variables = variables  # [(variable, axis)], the axis of each that is split
        self.rank, self.world = rank, world
        self.paired_out = False  # a column split whose output goes, split, to a row split
        self.paired_in = False  # a row split whose input comes split from a column split
        self.out_axis = None  # column: the output axis that is split
        self.in_axis = None  # row: the input axis that is split


# ---- reading a layer as an einsum


def _einsum_of(layer):
    """``(input spec, kernel spec, output spec)`` of a Dense or EinsumDense layer, ``...`` kept."""
    if isinstance(layer, keras.layers.EinsumDense):
        inputs, rest = layer.equation.split(",")
        kernel, output = rest.split("->")
        return inputs, kernel, output
    return "...i", "io", "...o"


def _axis(spec, letter):
    """The axis of ``letter`` in an einsum operand ``spec`` (negative when ``spec`` starts with ``...``)."""
    position = spec.index(letter)
    if spec.startswith("..."):
        return position - len(spec)
    return position


def _bias_axis(layer, letter):
    bias = getattr(layer, "bias", None)
    if bias is None:
        return None
    if isinstance(layer, keras.layers.EinsumDense):
        axes = layer.bias_axes or ""
        return axes.index(letter) if letter in axes else None
    return 0


def _check_plain(layer):
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        raise OptionError("strategy='model' can't split {} ({}): it has LoRA or quantization on. Leave it out of "
                          "layout_map or turn that off.".format(layer.path, type(layer).__name__))


def _dense_split(layer, axes, rank, world):
    _check_plain(layer)
    in_spec, kernel_spec, out_spec = _einsum_of(layer)
    index = layouts.model_axis(axes)
    letter = kernel_spec[index]
    variables = [(layer.kernel, index)]
    if letter in out_spec.replace("...", ""):
        split = Split(layer, "column", variables, rank, world)
        split.out_axis = _axis(out_spec, letter)
        bias_axis = _bias_axis(layer, letter)
        if bias_axis is not None:
            split.variables.append((layer.bias, bias_axis))
    elif letter in in_spec:
        split = Split(layer, "row", variables, rank, world)
        split.in_axis = _axis(in_spec, letter)
    else:
        raise OptionError("strategy='model' can't split {} along kernel axis {} ('{}' of {}): it is in neither its "
                          "input nor its output.".format(layer.kernel.path, index, letter, layer.equation))
    return split


def _embedding_split(layer, axes, rank, world):
    index = layouts.model_axis(axes)
    return Split(layer, "vocab" if index == 0 else "feature", [(layer.embeddings, index)], rank, world)


def _attention_split(layer, rank, world):
    """A MultiHeadAttention split by heads: query/key/value kernels on their heads axis, the output's too."""
    parts = {"query": layer._query_dense, "key": layer._key_dense, "value": layer._value_dense,
             "output": layer._output_dense}  # Keras' own sub-layers (privates; pinned by the tests)
    if layer._dropout:
        raise OptionError("strategy='model' can't split {} by heads with dropout={}: each process would draw the "
                          "attention dropout of its heads only, not one device's. Use dropout=0 in the attention "
                          "layer (a Dropout layer after it is fine) or leave it out of layout_map.".format(
                              layer.path, layer._dropout))
    if layer._num_heads % world:
        raise OptionError("strategy='model' can't split {} by heads: {} heads over {} processes. Choose "
                          "model_shards dividing the heads.".format(layer.path, layer._num_heads, world))
    variables = []
    for name, dense in parts.items():
        heads = 1 if name != "output" else 0  # kernels (model, heads, key_dim) and (heads, key_dim, model)
        variables.append((dense.kernel, heads))
        if dense.bias is not None and name != "output":
            variables.append((dense.bias, 0))
    split = Split(layer, "heads", variables, rank, world)
    split.parts = parts
    return split


# ---- choosing what to split


def plan(model, table, rank, world, group=None):
    """The splits of ``model``'s layers under ``table`` (``{regex: axes}``, checked against the variables), with
    column/row pairs found in the model's graph: this process is ``rank`` of the ``world`` model shards of
    ``group`` (None: every process).

    Raises:
        OptionError: the layout splits a variable of a layer this version can't split (named), or splits a
            layer along an axis it can't.
    """
    grid = layouts.Mesh(1, world)
    variables = [(v.path, tuple(v.shape)) for v in model.weights]
    assigned = layouts.assign(variables, table, grid)
    splits = []
    covered = set()
    inside = set()  # the sub-layers of an attention layer split by heads
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.MultiHeadAttention):
            if any(layouts.model_axis(assigned.get(v.path)) is not None for v in layer.weights):
                splits.append(_attention_split(layer, rank, world))
                covered.update(v.path for v in layer.weights)  # split by heads, whatever axes were named
                inside.update(id(sub) for sub in splits[-1].parts.values())
            continue
        if id(layer) in inside:
            continue
        if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
            axes = assigned.get(layer.kernel.path)
            if layouts.model_axis(axes) is not None:
                splits.append(_dense_split(layer, axes, rank, world))
                covered.add(layer.kernel.path)
        elif isinstance(layer, keras.layers.Embedding):
            axes = assigned.get(layer.embeddings.path)
            if layouts.model_axis(axes) is not None:
                splits.append(_embedding_split(layer, axes, rank, world))
                covered.add(layer.embeddings.path)
    for split in splits:
        covered.update(v.path for v, _ in split.variables)
    left = [path for path, axes in assigned.items() if layouts.model_axis(axes) is not None and path not in covered]
    if left:
        raise OptionError("strategy='model' on PyTorch splits the kernels of Dense, EinsumDense and "
                          "MultiHeadAttention layers and Embedding tables; layout_map splits {}, which it can't. "
                          "Leave {} out of layout_map.".format(", ".join(left), "them" if len(left) > 1 else "it"))
    _pair(model, splits)
    for split in splits:
        split.group = group
    return splits


def default_table(model, world):
    """The layout when none is given on PyTorch: Megatron's. Dense (and EinsumDense) layers whose output feeds
    only another such layer are split column then row; MultiHeadAttention by heads; the rest replicated.

    Raises:
        OptionError: nothing to split that way.
    """
    consumers = _consumers(model)
    table = {}
    taken = set()
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.MultiHeadAttention) and not layer._dropout and layer._num_heads % world == 0:
            table[re.escape(layer._query_dense.kernel.path)] = (None, layouts.MODEL, None)
            taken.update(id(sub) for sub in (layer._query_dense, layer._key_dense, layer._value_dense,
                                             layer._output_dense))
    for layer in model._flatten_layers(include_self=False):
        if type(layer) is not keras.layers.Dense or id(layer) in taken:
            continue
        following = consumers.get(id(layer), [])
        if len(following) != 1 or type(following[0]) is not keras.layers.Dense or id(following[0]) in taken:
            continue
        first, second = layer, following[0]
        if first.units % world or first.kernel.shape[-1] % world:
            continue
        table[re.escape(first.kernel.path)] = (None, layouts.MODEL)
        table[re.escape(second.kernel.path)] = (layouts.MODEL, None)
        taken.update((id(first), id(second)))
    if not table:
        raise OptionError(
            "strategy='model' found nothing to split on PyTorch: no Dense layer feeding only another Dense layer "
            "(with units divisible by model_shards={}) and no MultiHeadAttention with heads divisible by it. Pass "
            "layout_map={{path regex: axes}}, or use strategy='data'.".format(world))
    return table


def _consumers(model):
    """``{id(layer): [the layers its output goes to]}`` from the model's graph (functional and Sequential
    models; a subclassed one has none, so nothing pairs)."""
    out = {}
    for layer in model._flatten_layers(include_self=False):
        for node in getattr(layer, "_inbound_nodes", []):
            for tensor in getattr(node, "input_tensors", []) or []:
                history = getattr(tensor, "_keras_history", None)
                if history is not None:
                    out.setdefault(id(history.operation), []).append(layer)
    return out


def _pair(model, splits):
    consumers = _consumers(model)
    by_layer = {id(s.layer): s for s in splits}
    for split in splits:
        if split.kind != "column" or len(getattr(split.layer, "_inbound_nodes", [])) != 1:
            continue
        following = consumers.get(id(split.layer), [])
        if len(following) != 1:
            continue
        row = by_layer.get(id(following[0]))
        if row is None or row.kind != "row" or len(getattr(row.layer, "_inbound_nodes", [])) != 1:
            continue
        if split.out_axis == row.in_axis or (split.out_axis == -1 and row.in_axis == -1):
            split.paired_out = row.paired_in = True


# ---- the split itself


def _with_slots(model, split):
    """``split``'s variables with their axes, and the optimizer slots made from each (Adam's moments...): a slot
    of Keras' ``add_variable_from_reference`` is named after its variable's path, and has its shape."""
    found = list(split.variables)
    slots = [v for optimizer in keras_model.all_optimizers(model) for v in optimizer.variables]
    for variable, axis in split.variables:
        prefix = variable.path.replace("/", "_") + "_"
        found.extend((slot, axis) for slot in slots
                     if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(variable.shape))
    return found


def shard_all(model, splits):
    """Keep only this process' part of each split variable and of its optimizer slots (whole values)."""
    for split in splits:
        for variable, axis in _with_slots(model, split):
            # clone(): a chunk along the first axis is contiguous already, and contiguous() would keep it a view
            # holding the whole tensor's memory.
            _set(variable, variable._value.data.chunk(split.world, dim=axis)[split.rank].clone(
                memory_format=torch.contiguous_format))


def _set(variable, data):
    # Keras' torch Variable: storage in _value (a Parameter), shape in _shape (privates, see the module doc).
    variable._value.data = data
    variable._shape = tuple(data.shape)


def _whole(variable, axis, split):
    """``variable``'s whole value from every model shard's part (one all-gather; collective)."""
    local = variable._value.data.contiguous()
    parts = [torch.empty_like(local) for _ in range(split.world)]
    dist.all_gather(parts, local, group=split.group)
    return torch.cat(parts, dim=axis)


def gather_all(model, splits):
    """Put every split variable's (and its optimizer slots') whole value back (one all-gather each; collective)."""
    for split in splits:
        for variable, axis in _with_slots(model, split):
            _set(variable, _whole(variable, axis, split))


@contextlib.contextmanager
def gathered(model, splits):
    """Every split variable (and its optimizer slots) whole inside the ``with`` block, on every process
    (collective, one all-gather each); after it, each process keeps its part of the whole value as it is then.

    The whole values live in new Parameters, and the split ones are put back after: the one-device check runs a
    backward pass on the whole model, and autograd keeps each leaf's gradient accumulator (with the shape it had)
    while that step's graph lives, so resizing the split Parameter in place (as :func:`gather_all` does for a
    save) made the next split step's backward fail ("returned an invalid gradient ... expected shape")."""
    held = []
    for split in splits:
        for variable, axis in _with_slots(model, split):
            own = variable._value
            whole = _whole(variable, axis, split)
            # Keras' torch Variable: storage in _value, shape in _shape (privates, see the module doc).
            variable._value = torch.nn.Parameter(whole, requires_grad=own.requires_grad)
            variable._shape = tuple(whole.shape)
            held.append((variable, own, axis, split))
    try:
        yield
    finally:
        for variable, own, axis, split in held:
            part = variable._value.data.chunk(split.world, dim=axis)[split.rank]
            own.data = part.clone(memory_format=torch.contiguous_format)
            variable._value = own
            variable._shape = tuple(own.shape)


#: Regularizers that add up over a variable's elements: each process' part then gives its part of the sum.
_ADDITIVE = ("L1", "L2", "L1L2")


def check_regularizers(splits):
    """A split variable's regularizer must add up over its elements (L1, L2, L1L2): each process computes it on
    its part, and the parts' sum is the whole's. Any other is refused, naming it."""
    for split in splits:
        for variable, _ in split.variables:
            regularizer = variable.regularizer
            if regularizer is not None and type(regularizer).__name__ not in _ADDITIVE:
                raise OptionError(
                    "Expected the regularizers of the variables strategy='model' splits to add up over their elements "
                    "({}). Received: {} on {!r}, split over {} model shards. Keep that variable whole (a layout_map "
                    "that doesn't name it), or use one of those regularizers.".format(
                        ", ".join(_ADDITIVE), type(regularizer).__name__, variable.path, split.world))


def sum_regularization(model, splits):
    """Hook ``model._get_regularization_losses`` (a Keras private: what ``model.losses``, and so fit()'s
    compute_loss, calls for every weight regularizer of the model; shard.py hooks the same method per layer) so
    that each split variable's loss, computed on this process' part, is summed over the model shards forward
    (:class:`Reduce`; identity backward, so each part's gradient stays its own): the loss logged is one device's,
    regularization included."""
    groups = {id(v): split.group for split in splits for v, _ in split.variables if v.regularizer is not None}
    if not groups:
        return
    own = type(model)._get_regularization_losses.__get__(model)

    def hooked():
        from keras.src import backend as keras_backend

        losses = own()
        weights = [v for v in model.trainable_weights if v.regularizer is not None]
        if len(losses) != len(weights) or keras_backend.in_stateless_scope():
            return losses
        return [Reduce.apply(loss, groups[id(v)])
                if id(v) in groups and isinstance(loss, torch.Tensor) and loss.device.type != "meta" else loss
                for v, loss in zip(weights, losses)]

    keras_model.hook(model, "_get_regularization_losses", hooked)


def install(splits):
    """Replace each split layer's call (an instance hook) by its split computation."""
    for split in splits:
        if split.kind in ("column", "row"):
            keras_model.hook(split.layer, "call", _dense_call(split))
            if split.paired_in:  # its input arrives split: Keras' check of the whole input's last axis is off
                split.layer.input_spec = None
        elif split.kind == "heads":
            for name, dense in split.parts.items():
                keras_model.hook(dense, "call", _head_call(dense, name == "output", split))
        else:
            keras_model.hook(split.layer, "call", _embedding_call(split))


def _einsum(layer, x):
    if isinstance(layer, keras.layers.EinsumDense):
        return torch.einsum(layer.equation, x, layer.kernel.value)
    return torch.matmul(x, layer.kernel.value)


def _finish(layer, y, bias=True):
    if bias and getattr(layer, "bias", None) is not None:
        y = y + layer.bias.value
    if getattr(layer, "activation", None) is not None:
        y = keras.ops.convert_to_tensor(layer.activation(y))
    return y


def _symbolic(layer, x, dtype=None):
    """Keras' shape inference runs calls on "meta" tensors (no data, no collectives): the one-device output."""
    shape = tuple(int(d) for d in layer.compute_output_shape(tuple(x.shape)))
    return torch.empty(shape, dtype=dtype or x.dtype, device="meta")


def _dense_call(split):
    layer = split.layer

    def call(inputs, training=None, **kwargs):
        x = keras.ops.convert_to_tensor(inputs)
        if x.device.type == "meta":
            return _symbolic(layer, x)
        if split.kind == "column":
            y = _finish(layer, _einsum(layer, Copy.apply(x, split.group)))
            if not split.paired_out:
                y = Gather.apply(y, split.out_axis % y.dim(), split.rank, split.world, split.group)
            return y
        if not split.paired_in:
            x = Scatter.apply(x, split.in_axis % x.dim(), split.rank, split.world, split.group)
        return _finish(layer, Reduce.apply(_einsum(layer, x), split.group))

    return call


def _head_call(dense, output, split):
    def call(inputs, training=None, **kwargs):
        x = keras.ops.convert_to_tensor(inputs)
        if x.device.type == "meta":
            return _symbolic(dense, x)
        if output:
            return _finish(dense, Reduce.apply(_einsum(dense, x), split.group))
        return _finish(dense, _einsum(dense, Copy.apply(x, split.group)))

    return call


def _embedding_call(split):
    layer = split.layer
    table = layer.embeddings

    def call(inputs, reverse=False, **kwargs):
        if reverse:  # a ReversibleEmbedding (KerasHub, Keras) read backwards: hidden states to logits
            return _reverse(split, inputs)
        ids = keras.ops.convert_to_tensor(inputs)
        if ids.device.type == "meta":
            return _symbolic(layer, ids, table.value.dtype)
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.to(torch.int64)
        if split.kind == "feature":
            out = torch.nn.functional.embedding(ids, table.value)
            return Gather.apply(out, out.dim() - 1, split.rank, split.world, split.group)
        rows = table.value.shape[0]
        start = split.rank * rows
        inside = (ids >= start) & (ids < start + rows)
        local = torch.where(inside, ids - start, torch.zeros_like(ids))
        out = torch.nn.functional.embedding(local, table.value) * inside.unsqueeze(-1).to(table.value.dtype)
        return Reduce.apply(out, split.group)

    return call


def _reverse(split, inputs):
    """The logits of a ReversibleEmbedding with tied weights: ``inputs @ embeddings.T``, the table split. By
    vocabulary: each process its logits' columns, gathered; by feature: its slice of the inputs times its columns,
    the partial sums all-reduced."""
    layer = split.layer
    if not getattr(layer, "tie_weights", True):
        return type(layer).call(layer, inputs, reverse=True)  # its own reverse kernel: not split, whole
    x = keras.ops.convert_to_tensor(inputs)
    kernel = layer.embeddings.value
    if x.device.type == "meta":
        return torch.empty(tuple(x.shape[:-1]) + (layer.input_dim,), dtype=x.dtype, device="meta")
    if getattr(layer, "reverse_dtype", None) is not None:
        dtype = keras.backend.standardize_dtype(layer.reverse_dtype)
        x, kernel = keras.ops.cast(x, dtype), keras.ops.cast(kernel, dtype)
    if split.kind == "vocab":
        logits = torch.matmul(Copy.apply(x, split.group), kernel.t())
    else:
        part = Scatter.apply(x, x.dim() - 1, split.rank, split.world, split.group)
        logits = Reduce.apply(torch.matmul(part, kernel.t()), split.group)
    cap = getattr(layer, "logit_soft_cap", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    if split.kind == "vocab":
        logits = Gather.apply(logits, logits.dim() - 1, split.rank, split.world, split.group)
    return logits
