"""Sharded training on PyTorch: a split Dense kernel computed one owner's part at a time, never whole
(:class:`_Tiler`, ZeRO-Infinity's memory-centric tiling), forward and backward.

The module docstring of :mod:`~distkeras.backends.torch.shard` says when a layer is tiled.
"""

import torch

from . import messages
from .shard_layout import SPLIT
from .shard_storage import _source


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
