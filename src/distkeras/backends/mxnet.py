"""MXNet adapter: keras-mxnet 2.2.4.3 (Keras 2) training data-parallel over MXNet contexts.

keras-mxnet already trains over several contexts: its Model binds one MXNet module over all of them,
splits every batch along the first axis and adds the contexts' gradients in a KVStore. That is what
``multi_gpu_model`` switches on. Used as it is, it has three gaps, which the adapter closes:

- It *sums* the contexts' mean-loss gradients, so every step on N contexts is N times the one-context
  step. The adapter weighs each context's gradient by its share of the batch before the sum (a
  multiply on the gradient arrays between backward and update), which is exact for uneven splits too
  and leaves the optimizer as the user configured it.
- It reports the loss and metrics as the plain mean over contexts; the adapter weighs them the same
  way, so the reported values are the global batch's.
- It fails on any batch MXNet can't split without leaving a context empty ("Too many slices"): a
  last batch with fewer rows than contexts, and a few sizes MXNet's rounding trips on (6 rows on 4
  contexts). The adapter pads such a batch with copies of its first row until the real rows fill
  whole contexts; the padding contexts get weight 0 and their predictions are cut off.

The user's model itself is distributed, in place: its contexts are set and it is compiled again with
its own loss, metrics and an optimizer of the same configuration (keras-mxnet binds its MXNet module,
and with it the contexts, when it compiles; it drops the optimizer's state on every compile anyway).
Nothing is rebuilt from a config, and ``save()`` writes the plain model. MXNet runs one module per
process; multi-worker training (KVStore ``dist_*``) is not supported in this version.

The per-step code talks to keras-mxnet's Model internals (``_adjust_module``, ``_module``,
``_update``...), as keras-mxnet's own train/test/predict functions do: it has no public hook between
backward and update. Those functions are replaced per model through the ``_make_*_function`` methods
Keras calls before every fit/evaluate/predict; they are instance attributes and nothing of them is saved.
"""

import functools

from ..devices import Device
from ..errors import DistKerasError, OptionError
from .base import Adapter

_KVSTORES = ("device", "local")
#: MXNet hyper-parameters that keras-mxnet's optimizers take but leave out of get_config()
#: (``clipnorm`` becomes ``clip_gradient``; ``wd`` and the rest come in through ``**kwargs``).
_OPTIMIZER_EXTRAS = ("clip_gradient", "wd", "rescale_grad", "multi_precision")


class MXNetAdapter(Adapter):
    name = "mxnet"
    framework = "mxnet"
    install_hint = "mxnet==1.9.1 keras-mxnet==2.2.4.3 'numpy<1.24'"
    options = {
        "kvstore": "where the contexts' gradients are added: 'device' (default, on the GPUs) or 'local' (CPU)",
        "compression": "'2bit': MXNet's KVStore gradient compression (2-bit quantization with error feedback, "
        "threshold 0.5), or {'type': '2bit', 'threshold': t}; kvstore='device' only. MXNet has no 16-bit all-reduce",
    }

    def __init__(self):
        self._cpu_devices = 1

    def list_devices(self):
        """Every GPU MXNet sees, then the CPU devices: ``cpu(0)`` .. ``cpu(N-1)``, N from :meth:`set_cpu_devices`."""
        import mxnet as mx

        gpus = [Device("gpu", i) for i in range(mx.context.num_gpus())]
        return gpus + [Device("cpu", i) for i in range(self._cpu_devices)]

    def set_cpu_devices(self, count):
        """Use ``count`` CPU contexts. MXNet takes any ``cpu(i)`` at any time, so this is never too late."""
        self._cpu_devices = count

    def distribute(self, model, devices, cluster, kvstore="device", compression=None):
        """``model`` itself, made to train data-parallel over ``devices`` (see the module docstring).

        Args:
            model: a built keras-mxnet model, compiled or not.
            devices: the devices to replicate over; ``gpu:i`` becomes ``mx.gpu(i)``, ``cpu:i`` ``mx.cpu(i)``.
            cluster: the job; only a one-process job is supported.
            kvstore: where MXNet adds the contexts' gradients, ``"device"`` or ``"local"``.
            compression: ``"2bit"`` or ``{"type": "2bit", "threshold": t}``: MXNet's own gradient
                compression in the KVStore (:func:`_compression_params`).

        Returns:
            ``model``.

        Raises:
            DistKerasError: a multi-worker job, or a ``dist_*`` KVStore.
            OptionError: an unknown ``kvstore`` or ``compression``.
        """
        import mxnet as mx

        if cluster.is_multi_worker or str(kvstore).startswith("dist"):
            raise DistKerasError(
                "This process is rank {} of {} workers ({}), kvstore={!r}: multi-worker MXNet training (KVStore "
                "'dist_*') is not supported in this version of distkeras. Run one process per host and "
                "distribute over its devices.".format(cluster.rank, cluster.world_size, cluster.source, kvstore)
            )
        if kvstore not in _KVSTORES:
            raise OptionError("Expected kvstore in {}. Received: kvstore={!r}".format(_KVSTORES, kvstore))
        # keras-mxnet reads the contexts from Model._context when it builds its modules (in compile(),
        # and in predict() before any compile). Its public set_mxnet_context() is no use: it maps
        # 'cpu(1)' to cpu(0) and refuses a single context.
        model._context = [mx.gpu(d.index) if d.kind == "gpu" else mx.cpu(d.index) for d in devices]
        model._kvstore = kvstore
        model._distkeras_compression = _compression_params(compression, kvstore)
        _compile_again(model)
        # Keras calls these before every fit/evaluate/predict; they install the steps below.
        model._make_train_function = functools.partial(_install, model, "train_function", _train_step)
        model._make_test_function = functools.partial(_install, model, "test_function", _test_step)
        model._make_predict_function = functools.partial(_install, model, "predict_function", _predict_step)
        return model


def _fresh_optimizer(optimizer):
    fresh = type(optimizer).from_config(optimizer.get_config())
    for name in _OPTIMIZER_EXTRAS:
        if hasattr(optimizer, name):
            setattr(fresh, name, getattr(optimizer, name))
    return fresh


def _compile_again(model):
    """Compile ``model`` again as it was compiled, so keras-mxnet binds it to the contexts now set.

    With a fresh optimizer of the same configuration: the optimizer's state (momenta, moments, step
    count) lives in the model's MXNet module, which keras-mxnet drops on every compile() (and never saves).
    """
    if getattr(model, "optimizer", None) is None:
        return
    model.compile(
        optimizer=_fresh_optimizer(model.optimizer),
        loss=model.loss,
        metrics=model.metrics,
        loss_weights=model.loss_weights,
        sample_weight_mode=model.sample_weight_mode,
        weighted_metrics=model.weighted_metrics,
    )


def _compression_params(compression, kvstore):
    """MXNet's ``compression_params`` for the ``compression`` option, or None.

    MXNet 1.9 compresses gradients one way, 2-bit quantization with error feedback, in its 'device' and
    'dist_*' KVStores: every value a context pushes becomes +threshold, -threshold or 0, and what that drops
    is kept and added to the next step's gradient. It is a different trade from the 16-bit all-reduce of the
    other backends (far fewer bits, a much larger error per step, corrected over steps), so 'bf16'/'fp16' are
    refused rather than mapped onto it.
    """
    if compression is None:
        return None
    params = {"type": compression} if isinstance(compression, str) else compression
    threshold = params.get("threshold", 0.5) if isinstance(params, dict) else None
    if (not isinstance(params, dict) or params.get("type") != "2bit" or set(params) - {"type", "threshold"}
            or isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 0):
        raise OptionError(
            "Expected compression to be None, '2bit' or {{'type': '2bit', 'threshold': t}} with t > 0 on MXNet: its "
            "KVStore compresses gradients by 2-bit quantization only ('bf16'/'fp16' are TensorFlow's, JAX's and "
            "PyTorch's). Received: compression={!r}".format(compression))
    if kvstore != "device":
        raise OptionError("MXNet compresses gradients in its 'device' KVStore, not in {!r}. Received: kvstore={!r}, "
                          "compression={!r}".format(kvstore, kvstore, compression))
    return {"type": "2bit", "threshold": float(threshold)}


def _install(model, attribute, step):
    """Set ``model.<attribute>`` (``train_function``...) to ``step`` bound to ``model``.

    Also hands the compression parameters to the model's MXNet module while it is not bound yet: its
    KVStore is made when the module binds, and takes them then (``Module._compression_params``, which
    ``mx.mod.Module(compression_params=...)`` sets; keras-mxnet makes the module without it, in compile())."""
    module = getattr(model, "_module", None)
    params = getattr(model, "_distkeras_compression", None)
    if params is not None and module is not None and not module.binded:
        module._compression_params = params
    setattr(model, attribute, functools.partial(step, model))


# ---- the per-step functions: keras-mxnet's, with padding and per-context weights


def _split(rows, contexts):
    """MXNet's own split of ``rows`` over ``contexts``, or None where it refuses (a context left empty)."""
    from mxnet.executor_manager import _split_input_slice  # what the module's executor group calls

    try:
        return _split_input_slice(rows, [1] * contexts)
    except ValueError:
        return None


def _rows_to_feed(batch, contexts):
    """The smallest row count >= ``batch`` that MXNet splits so the ``batch`` real rows fill whole contexts."""
    rows = batch
    while True:
        slices = _split(rows, contexts)
        if slices is not None and any(s.stop == batch for s in slices):
            return rows
        rows += 1


def _pad(model, inputs):
    """``inputs`` padded to a size MXNet can split (see :func:`_rows_to_feed`); returns it and the real size."""
    import numpy as np

    batch = len(inputs[0])
    rows = _rows_to_feed(batch, len(model._context))
    if rows == batch:
        return inputs, batch
    padded = []
    for value in inputs:  # arrays of the batch; the learning-phase flag Keras appends is a scalar
        if getattr(value, "ndim", 0) and len(value) == batch:
            value = np.concatenate([value, np.repeat(value[:1], rows - batch, axis=0)])
        padded.append(value)
    return padded, batch


def _context_weights(model, inputs, batch):
    """Each context's share of the batch: its rows with nonzero sample weight over the batch's.

    Keras divides each context's weighted loss by its own count of nonzero sample weights, so these
    shares make the weighted sum of the contexts' losses and gradients the single-device ones.
    """
    import numpy as np

    slices = model._module._curr_module._exec_group.slices
    index = len(model.inputs) + len(model.outputs)  # inputs are x..., y..., sample weights..., [phase]
    weights = inputs[index] if len(inputs) > index and getattr(inputs[index], "ndim", 0) else np.ones(batch)
    counts = [np.count_nonzero(weights[s]) if s.start < batch else 0 for s in slices]
    total = float(sum(counts))
    if total == 0:  # every sample weight is 0: fall back to row counts
        counts = [max(0, min(s.stop, batch) - s.start) for s in slices]
        total = float(batch)
    return [count / total for count in counts]


def _batch(model, inputs, phase):
    import mxnet as mx
    from keras import backend

    backend.set_model(model)  # keras-mxnet reads variables back from the model last set here, as its steps do
    data, label, _, data_shapes, label_shapes = model._adjust_module(inputs, phase)
    return mx.io.DataBatch(data=data, label=label, bucket_key=phase, provide_data=data_shapes, provide_label=label_shapes)


def _weighted_outputs(model, count, weights):
    outputs = model._module.get_outputs(merge_multi_context=False)[:count]
    return [sum(w * float(out.asnumpy().mean()) for w, out in zip(weights, per_context)) for per_context in outputs]


def _train_step(model, inputs):
    model._check_trainable_weights_consistency()
    inputs, batch = _pad(model, inputs)
    model._module.forward_backward(_batch(model, inputs, "train"))
    weights = _context_weights(model, inputs, batch)
    for per_context in model._module._curr_module._exec_group.grad_arrays:
        for grad, weight in zip(per_context, weights):
            grad *= weight
    model._module.update()
    model._update(model._train_updates)
    model._weights_dirty = True
    return _weighted_outputs(model, model._ntrain, weights)


def _forward(model, inputs, phase):
    """A forward pass without training, then the state updates, as keras-mxnet's test and predict do."""
    inputs, batch = _pad(model, inputs)
    model._module.forward(_batch(model, inputs, phase), is_train=False)
    if model._test_updates:
        model._update(model._test_updates)
        model._weights_dirty = True
    return inputs, batch


def _test_step(model, inputs):
    inputs, batch = _forward(model, inputs, "test")
    return _weighted_outputs(model, model._ntrain, _context_weights(model, inputs, batch))


def _predict_step(model, inputs):
    if not model.compiled:  # as keras-mxnet does: predict without compile builds a predict-only module
        model._num_data = len(model.inputs)
        model._num_label = len(model.outputs) + len(model.output_names)
        model._create_predict_module()
        model._module = model._predict_only_module
    _, batch = _forward(model, inputs, "pred")
    return [out.asnumpy()[:batch] for out in model._module.get_outputs()[: model._npred]]
