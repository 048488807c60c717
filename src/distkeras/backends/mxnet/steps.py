"""The per-step functions of a distributed keras-mxnet model: keras-mxnet's own train, test and predict steps,
with padding and per-context weights (see :mod:`.adapter`'s docstring for why each is exact).

A batch MXNet can't split over the contexts is padded with copies of its first row (:func:`_pad`); each context's
gradient is weighed in place by its share of the batch between backward and update, and the loss and metrics
reported are the contexts' values weighed alike (:func:`_weighted_outputs`, :func:`_counted_by_samples`). In a
worker of a multi-worker job (:mod:`.job`) the steps keep the worker's rows of each global batch
(:func:`_my_rows`), push and pull the gradients and counts through the job's KVStore themselves
(:func:`_train_step_in_job`) and give every new array of the module rank 0's values first
(:func:`_start_from_rank0`). The adapter installs :func:`_train_step`, :func:`_test_step` and
:func:`_predict_step` on the model; the private keras-mxnet names they use are commented where they are used, and
pinned by tests/mxnet/test_internals.py.
"""

from ...errors import ShardError
from .. import policies


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


def _sample_weight_positions(model):
    """Where the sample weights are in the inputs of a step: Keras feeds x..., y..., sample weights..., [phase].

    Keras 2's ``_feed_*`` lists are what its fit loop builds those inputs from; nothing public counts them."""
    first = len(model._feed_inputs) + len(model._feed_targets)
    return range(first, first + len(model._feed_sample_weights))


def _context_counts(model, inputs, batch):
    """Each context's count of samples: its real rows with nonzero sample weight (padding rows count 0)."""
    import numpy as np

    # The executor group's slices: which rows of the batch each context got (MXNet's _split_input_slice).
    slices = model._module._curr_module._exec_group.slices
    positions = _sample_weight_positions(model)
    index = positions[0] if len(positions) else len(inputs)
    weights = inputs[index] if len(inputs) > index and getattr(inputs[index], "ndim", 0) else np.ones(batch)
    return [int(np.count_nonzero(weights[s])) if s.start < batch else 0 for s in slices]


def _unweighted_output(model, inputs, batch):
    """Where a context of this step has rows of nonzero sample weight for one output and none for another: a
    sentence saying so, else None. Keras 2 divides each context's loss of an output by its count of nonzero sample
    weights, so that loss is 0/0 (NaN) there, its gradient NaN, and no weighing of the contexts' values repairs it
    (one device divides by the whole batch's count)."""
    import numpy as np

    names = [name for name, fn in zip(model.output_names, model.loss_functions) if fn is not None]
    positions = _sample_weight_positions(model)
    if len(positions) < 2 or len(names) != len(positions) or len(inputs) < positions[-1] + 1:
        return None
    slices = model._module._curr_module._exec_group.slices
    counts = [[int(np.count_nonzero(inputs[i][s])) if s.start < batch else 0 for s in slices] for i in positions]
    for context, per_output in enumerate(zip(*counts)):
        if any(per_output) and not all(per_output):
            return ("context {} ({}) has rows of nonzero sample weight for output {!r} but none for output {!r}".format(
                context, model._context[context], names[per_output.index(max(per_output))], names[per_output.index(0)]))
    return None


def _unweighted_output_error(where):
    return ShardError(
        "The sample weights of this step leave an output without any sample of nonzero weight on one replica while "
        "another output has some there ({}). Keras 2 computes that replica's loss of the output as 0/0 (NaN), and "
        "its gradient would turn the weights into NaN. Give every output its zero sample weights in the same rows, "
        "or choose a batch size where every replica gets rows of nonzero weight for every output.".format(where))


def _context_rows(model, batch, real=None):
    """Each context's count of real rows: padding rows count 0, and every row where ``real`` is 0 (a worker's
    step on a copy of a row, weighted 0, because the global batch had no row for it)."""
    slices = model._module._curr_module._exec_group.slices
    if real == 0:
        return [0] * len(slices)
    return [max(0, min(s.stop, batch) - s.start) for s in slices]


def _context_weights(model, inputs, batch):
    """Each context's share of the batch (:func:`~distkeras.backends.policies.batch_shares`): its rows with
    nonzero sample weight over the batch's.

    Keras divides each context's weighted loss by its own count of nonzero sample weights, so these
    shares make the weighted sum of the contexts' losses and gradients the single-device ones.
    """
    counts = _context_counts(model, inputs, batch)
    if not sum(counts):  # every sample weight is 0: fall back to row counts
        return policies.batch_shares(_context_rows(model, batch), batch)
    return policies.batch_shares(counts)


def _counted_by_samples(model, count):
    """For each of the ``count`` values a step reports (``[loss] + metrics_tensors``): True where Keras 2 divides
    it by the batch's count of nonzero sample weights (the loss, each output's loss, ``weighted_metrics``),
    False where by its rows (``metrics``: they ignore sample weights). So a value of several contexts or workers
    is their values weighed by sample counts or by rows. The order is compile()'s: the loss, the outputs'
    losses (more than one output), then per output with a loss its metrics and then its weighted metrics."""
    from keras.engine.training_utils import collect_metrics  # compile()'s own grouping of metrics per output

    live = [i for i, fn in enumerate(model.loss_functions) if fn is not None]
    kinds = [True] + ([True] * len(live) if len(model.outputs) > 1 else [])
    plain = collect_metrics(model.metrics, model.output_names)
    weighted = collect_metrics(model.weighted_metrics, model.output_names)
    for i in live:
        kinds += [False] * len(plain[i]) + [True] * len(weighted[i])
    return (kinds + [True] * count)[:count]


def _batch(model, inputs, phase):
    import mxnet as mx
    from keras import backend

    backend.set_model(model)  # keras-mxnet reads variables back from the model last set here, as its steps do
    data, label, _, data_shapes, label_shapes = model._adjust_module(inputs, phase)
    if getattr(model, "_distkeras_job", None) is not None:
        _start_from_rank0(model)
    return mx.io.DataBatch(data=data, label=label, bucket_key=phase, provide_data=data_shapes, provide_label=label_shapes)


def _weighted_outputs(model, count, inputs, batch):
    """The step's ``count`` values of the whole batch: the contexts' values weighed by their shares of the
    batch's samples or rows (:func:`_counted_by_samples`)."""
    by_samples = _context_weights(model, inputs, batch)
    by_rows = policies.batch_shares(_context_rows(model, batch), batch)
    outputs = model._module.get_outputs(merge_multi_context=False)[:count]
    # A context with nothing to count (all its sample weights 0) has a value of 0/0 in Keras: left out, as NaN * 0
    # would be NaN.
    return [sum(w * float(out.asnumpy().mean()) for w, out in zip(by_samples if kind else by_rows, per_context) if w)
            for kind, per_context in zip(_counted_by_samples(model, count), outputs)]


def _keys(model):
    """The adapter's keys of the model's MXNet module in the job's KVStore: ``{name: key}`` of the arrays
    already synchronised, under a prefix of its own (a module of a model compiled again gets new keys)."""
    module, job = model._module, model._distkeras_job
    if getattr(module, "_distkeras_prefix", None) is None:
        job.modules += 1
        module._distkeras_prefix = job.key("module", job.modules)
        module._distkeras_keys = {}
    return module._distkeras_keys


def _start_from_rank0(model):
    """Give the arrays of the module's current bucket that no step has seen yet rank 0's values, on every
    worker: rank 0 pushes them, the others zeros, and every context pulls the sum. Every worker binds the
    same buckets in the same order (the same fit/evaluate/predict calls), so the keys agree."""
    import mxnet as mx

    module, job = model._module, model._distkeras_job
    if not module.optimizer_initialized:  # a predict-only binding: nothing trains, nothing to agree on
        return
    keys = _keys(model)
    # The executor group holds, per parameter (param_names) and auxiliary state (aux_names), one array per
    # context: param_arrays/aux_arrays are what the contexts compute with; no public API writes them in place.
    group = module._curr_module._exec_group
    new = sorted((kind, name, arrays) for kind, names, all_arrays in (("param", group.param_names, group.param_arrays),
                                                                     ("aux", group.aux_names, group.aux_arrays))
                 for name, arrays in zip(names, all_arrays) if (kind, name) not in keys)
    if not new:
        return
    names = [job.key(module._distkeras_prefix, kind, name) for kind, name, _ in new]
    values = [arrays[0].copy() if job.rank == 0 else mx.nd.zeros_like(arrays[0]) for _, _, arrays in new]
    job.init(names, values)
    job.sum(names, values, [arrays for _, _, arrays in new])
    for (kind, name, _), key in zip(new, names):
        keys[kind, name] = key
    # Module.get_params() returns a cached copy unless _params_dirty; a BucketingModule hands its own flag to
    # its current module, so both are set. keras-mxnet's get_weights() reads the module only if _weights_dirty.
    module._params_dirty = module._curr_module._params_dirty = True
    model._weights_dirty = True


def _my_rows(model, inputs, weighted=True):
    """This worker's rows ``[rank::workers]`` of the global batch Keras' fit loop gathered, and their count.

    A worker with no row in a short last batch takes a copy of its first row, with sample weight 0 and
    counted as no row, so that every worker takes every step (the KVStore's rounds are collective)."""
    import numpy as np

    rank, workers = model._distkeras_shard
    size = len(inputs[0])
    real = len(range(rank, size, workers))
    weights = _sample_weight_positions(model) if weighted else ()  # predict() feeds x alone
    mine = []
    for index, value in enumerate(inputs):  # arrays of the batch; the learning-phase flag is a scalar
        if getattr(value, "ndim", 0) and len(value) == size:
            value = value[rank::workers] if real else (np.zeros_like(value[:1]) if index in weights else value[:1])
        mine.append(value)
    return mine, real


def _train_step_in_job(model, inputs):
    """One step of a multi-worker job: the gradient of the global batch, summed through the KVStore.

    In ``fit()`` on arrays (:func:`_fit`) Keras' loop gathers the global batch, in the order of its own
    shuffle, and this worker trains on its rows of it (:func:`_my_rows`); otherwise on all it is given."""
    import mxnet as mx

    real = None
    if getattr(model, "_distkeras_shard", None) is not None:
        inputs, real = _my_rows(model, inputs)
    inputs, batch = _pad(model, inputs)
    model._module.forward_backward(_batch(model, inputs, "train"))
    module, job = model._module, model._distkeras_job
    counts = _context_counts(model, inputs, batch)
    rows = _context_rows(model, batch, real)
    outputs = module.get_outputs(merge_multi_context=False)[: model._ntrain]
    kinds = _counted_by_samples(model, len(outputs))
    # What each value adds to the job's: its contexts' values weighed by their counts of samples or of rows
    # (_counted_by_samples). A context with nothing to count has a loss of 0/0 in Keras: left out, its
    # gradient zeroed (not multiplied: NaN * 0).
    unweighted = _unweighted_output(model, inputs, batch)
    stats = [float(sum(counts)), float(sum(rows))] + [
        sum(c * float(out.asnumpy().mean()) for c, out in zip(counts if kind else rows, per) if c)
        for kind, per in zip(kinds, outputs)] + [float(bool(unweighted))]  # last: how many workers hit that
    # grad_arrays: per parameter, each context's gradient after backward; module.update() applies them as they
    # are then, so weighing them in place here is the hook between backward and update keras-mxnet lacks.
    group = module._curr_module._exec_group
    keys = _keys(model)
    names, grads = [], []
    for name, per_context in zip(group.param_names, group.grad_arrays):
        if per_context[0] is None:  # a weight that doesn't train
            continue
        for grad, count in zip(per_context, counts):
            if count:
                grad *= count
            else:
                grad[:] = 0
        names.append(keys["param", name])
        grads.append(per_context)
    stats_key = job.key(module._distkeras_prefix, "stats")
    totals = mx.nd.array(stats, dtype="float32")
    if ("stats", len(stats)) not in keys:
        job.init(stats_key, totals)
        keys["stats", len(stats)] = stats_key
    job.sum(names + [stats_key], grads + [totals], None)  # in place: the job's sums
    totals = totals.asnumpy()
    if totals[-1]:  # on every worker, before update(): nothing is applied
        raise _unweighted_output_error(unweighted or "on {:.0f} other worker(s)".format(totals[-1]))
    for per_context in grads:
        for grad in per_context:
            grad /= float(totals[0])
    module.update()  # no KVStore in the module: each context's optimizer applies the summed gradient
    model._update(model._train_updates)  # keras-mxnet's own step does these two: state updates (BatchNorm)
    model._weights_dirty = True  # and get_weights() reads the module again
    return [float(value) / float(totals[0 if kind else 1]) for kind, value in zip(kinds, totals[2:])]


def _train_step(model, inputs):
    model._check_trainable_weights_consistency()
    if getattr(model, "_distkeras_job", None) is not None:
        return _train_step_in_job(model, inputs)
    inputs, batch = _pad(model, inputs)
    model._module.forward_backward(_batch(model, inputs, "train"))
    unweighted = _unweighted_output(model, inputs, batch)
    if unweighted:  # before update(): nothing is applied
        raise _unweighted_output_error(unweighted)
    weights = _context_weights(model, inputs, batch)
    for per_context in model._module._curr_module._exec_group.grad_arrays:  # see _train_step_in_job
        if per_context[0] is None:  # a weight that doesn't train
            continue
        for grad, weight in zip(per_context, weights):
            if weight:
                grad *= weight
            else:  # a context with no sample of nonzero weight: Keras' loss there is 0/0, its gradient NaN
                grad[:] = 0
    model._module.update()
    model._update(model._train_updates)
    model._weights_dirty = True
    return _weighted_outputs(model, model._ntrain, inputs, batch)


def _forward(model, inputs, phase):
    """A forward pass without training, then the state updates, as keras-mxnet's test and predict do."""
    inputs, batch = _pad(model, inputs)
    model._module.forward(_batch(model, inputs, phase), is_train=False)
    if model._test_updates:
        model._update(model._test_updates)
        model._weights_dirty = True
    return inputs, batch


def _test_step(model, inputs):
    if getattr(model, "_distkeras_shard", None) is not None:
        return _test_step_in_job(model, inputs)
    inputs, batch = _forward(model, inputs, "test")
    unweighted = _unweighted_output(model, inputs, batch)
    if unweighted:
        raise _unweighted_output_error(unweighted)
    return _weighted_outputs(model, model._ntrain, inputs, batch)


def _test_step_in_job(model, inputs):
    """One test step of ``evaluate()`` or of ``fit()``'s validation on arrays in a multi-worker job: this worker
    evaluates its rows ``[rank::workers]`` of the global batch (:func:`_my_rows`), and the job adds every worker's
    values weighed by their counts of samples or rows, as the train step does: the global batch's values."""
    import numpy as np

    inputs, real = _my_rows(model, inputs)
    inputs, batch = _forward(model, inputs, "test")
    counts = _context_counts(model, inputs, batch)
    rows = _context_rows(model, batch, real)
    outputs = model._module.get_outputs(merge_multi_context=False)[: model._ntrain]
    kinds = _counted_by_samples(model, len(outputs))
    unweighted = _unweighted_output(model, inputs, batch)
    stats = [float(sum(counts)), float(sum(rows))] + [  # see _train_step_in_job
        sum(c * float(out.asnumpy().mean()) for c, out in zip(counts if kind else rows, per) if c)
        for kind, per in zip(kinds, outputs)] + [float(bool(unweighted))]
    totals = model._distkeras_job.all_sum(np.array(stats, "float32"))
    if totals[-1]:
        raise _unweighted_output_error(unweighted or "on {:.0f} other worker(s)".format(totals[-1]))
    return [float(value) / float(totals[0 if kind else 1]) for kind, value in zip(kinds, totals[2:])]


def _predict_step(model, inputs):
    if not model.compiled:  # as keras-mxnet does: predict without compile builds a predict-only module
        model._num_data = len(model.inputs)
        model._num_label = len(model.outputs) + len(model.output_names)
        model._create_predict_module()
        model._module = model._predict_only_module
    shard = getattr(model, "_distkeras_shard", None)
    if shard is None:
        _, batch = _forward(model, inputs, "pred")
        return [out.asnumpy()[:batch] for out in model._module.get_outputs()[: model._npred]]
    return _predict_step_in_job(model, inputs, shard)


def _predict_step_in_job(model, inputs, shard):
    """One step of ``predict()`` on arrays in a multi-worker job: this worker predicts its rows ``[rank::workers]``
    of the global batch and writes them at their places in zeros of the global batch's shape; the job's sum of
    those is the global batch's prediction, in order, on every worker (exact: each value is added to zeros)."""
    import numpy as np

    rank, workers = shard
    size = len(inputs[0])
    mine, real = _my_rows(model, inputs, weighted=False)
    _, batch = _forward(model, mine, "pred")
    outputs = [out.asnumpy()[:batch] for out in model._module.get_outputs()[: model._npred]]
    full = [np.zeros((size,) + out.shape[1:], "float32") for out in outputs]
    if real:
        for whole, out in zip(full, outputs):
            whole[rank::workers] = out
    summed = model._distkeras_job.all_sum(np.concatenate([whole.ravel() for whole in full]))
    result, start = [], 0
    for whole, out in zip(full, outputs):
        result.append(summed[start:start + whole.size].reshape(whole.shape).astype(out.dtype, copy=False))
        start += whole.size
    return result
