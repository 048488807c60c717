"""CNTK adapter: Keras 2.3.1 on CNTK 2.7, one device per process, the processes being MPI ranks.

CNTK's recipe (SCENARIOS.md, scenario 1) makes Keras build its train function, wraps its CNTK Trainer's
learner in ``data_parallel_distributed_learner``, installs a new Trainer, partitions the data by
``Communicator.rank()`` and finalizes MPI at the end. The adapter does that and closes the recipe's gaps:

- **Sum, not mean.** ``DataParallelDistributedLearner::Update`` (CNTK 2.7) sums the workers' gradients,
  and the loss and evaluation values they report, in place. Keras' learner is a ``universal_learner``
  running Keras' optimizer graph (keras 2.3.1 ``cntk_backend.Function``), which holds the learning rate;
  dividing that by the W workers would be exact for SGD only (RMSprop or Adam steps hardly depend on the
  gradients' scale). Instead each worker's trainer optimises Keras' loss times 1/W: the summed gradient
  and loss are the mean ones, for any optimizer, regularization included.
- **The global batch.** ``fit()`` gives each worker its part of every global batch (``sharding.batch_rows``).
- **Metrics.** Keras 2.3.1's metrics are stateful; the workers' states are summed after every step.
- **Initial weights.** CNTK does not synchronise them; every worker takes rank 0's weights and optimizer
  state through :meth:`CNTKAdapter.all_sum`, an all-reduce built from the same distributed learner.

- **evaluate, predict and fit()'s validation** on arrays are split as one process batches them: each worker
  computes its rows ``[rank::workers]`` of every global batch (:class:`_TestStep`, :class:`_PredictStep`) and
  one all-reduce per step adds up the losses times their rows and the metric states (evaluate: one process's
  values), or the predictions each worker wrote into zeros at its rows (predict: the whole output, in order,
  on every worker, exactly). Every worker must make the same calls; ones that differ in samples or batch
  size raise ShardError on every worker. Tensors, generators and ``steps`` run whole on every worker.

Only rank 0 prints and saves.
Python 3.6 compatible: CNTK 2.7 runs on CPython 3.5/3.6 only.
"""

import atexit
import functools
import logging
import os
from typing import Mapping

from ... import sharding
from ...cluster import Cluster
from ...devices import Device
from ...errors import ClusterError, DeviceSpecError, ModelError, OptionError
from .. import policies
from ..base import Adapter

logger = logging.getLogger("distkeras")

#: How CNTK 2.7 refuses quantization without 1-bit SGD: ``QuantizedMPICommunicator``'s LogicError,
#: which its SWIG layer raises as RuntimeError.
_NO_QUANTIZATION = ("1BitSGD", "not supported for this build")


def check_joinable(cluster: Cluster, env: Mapping[str, str]) -> None:
    """Raise ClusterError when this process is one of several workers that MPI doesn't know: CNTK's
    distributed learner all-reduces through MPI, so its workers must be MPI ranks (mpiexec, which
    ``distkeras launch --backend cntk`` runs). Slurm's tasks pass where srun gave them MPI ranks (``--mpi``:
    PMI_RANK / PMIX_RANK); CNTK's MPI then checks the ranks agree. Pure: tests pass the environment."""
    if not cluster.is_multi_worker or cluster.source == "mpi":
        return
    if cluster.source == "slurm" and any(name in env for name in ("PMI_RANK", "PMIX_RANK")):
        return
    where = ("inside the allocation, run `mpiexec -n N python script.py` (Open MPI reads Slurm's allocation) "
             "or, on one node, `distkeras launch --backend cntk --nproc-per-node N script.py`."
             if cluster.source == "slurm" else
             "start the workers with `distkeras launch --backend cntk --nproc-per-node N script.py` on one "
             "host, or `mpiexec -n N --hostfile hosts python script.py` across hosts.")
    raise ClusterError(
        "This process is rank {} of {} ({}: {}), but CNTK's workers must be MPI ranks: its distributed learner "
        "all-reduces through MPI, which {} doesn't start. Instead {}".format(
            cluster.rank, cluster.world_size, cluster.source,
            ", ".join("{}={}".format(k, v) for k, v in sorted((cluster.variables or {}).items())) or "no variables",
            cluster.source, where))


class CNTKAdapter(Adapter):
    name = "cntk"
    framework = "cntk"
    install_hint = "cntk==2.7.post2 keras==2.3.1 (CPython 3.5/3.6, Open MPI; scripts/cntk-env.sh builds such an environment)"
    shard_unsupported = (
        "CNTK's data_parallel_distributed_learner keeps the whole model on every MPI rank")
    options = {
        "num_quantization_bits": "bits per gradient value in the all-reduce, 1..32 (default 32; fewer: quantized SGD)",
        "distributed_after": "samples each worker trains alone before aggregation starts; only 0 (the default)",
        "compression": "'1bit': CNTK's 1-bit SGD (num_quantization_bits=1, error feedback); CNTK has no 16-bit "
        "all-reduce",
    }

    @classmethod
    def launch_command(cls, script_args, nproc_per_node, nnodes, environ):
        """``mpiexec -n N python script.py``: the workers are MPI ranks (:func:`.launch.launch_command`)."""
        from .launch import launch_command

        return launch_command(script_args, nproc_per_node, nnodes, environ)

    def __init__(self):
        self._started_mpi = False
        self._finalized = False
        self._sums = {}  # vector length -> (Keras function, its variable): the all-reduce helpers

    def list_devices(self):
        """The one device CNTK computes on in this process (``cntk.device.use_default_device()``)."""
        import cntk

        device = cntk.device.use_default_device()
        return [Device("cpu", 0)] if device.type() == 0 else [Device("gpu", device.id())]

    def set_cpu_devices(self, count):
        if count != 1:
            raise DeviceSpecError(
                "CNTK computes on one device per process, so the CPU can't be split into {0} devices. Run {0} "
                "processes instead: distkeras launch --backend cntk --nproc-per-node {0} script.py".format(count))

    def check_data(self, model, mode, rank, workers):
        """The data check across the MPI ranks: the arrays of every ``fit``/``evaluate``/``predict`` compared before
        its first step (:func:`~distkeras.backends.policies.check_arrays`), summed through :meth:`all_sum`;
        generators and tensors pass through unchecked, as they pass through whole."""
        state = getattr(model, "_distkeras_cntk", None)
        if state is None or state.workers == 1:
            return super(CNTKAdapter, self).check_data(model, mode, rank, workers)
        state.watch = policies.array_watch(mode, rank, workers, self.all_sum, self.name)
        model._distkeras_data_watch = state.watch

    def distribute(self, model, devices, cluster, num_quantization_bits=32, distributed_after=0, compression=None):
        """Make ``model`` train data-parallel over the job's MPI ranks (in place; it is returned).

        Args:
            model: a built Keras 2.3.1 model, compiled or not.
            devices: this process' one device (:meth:`list_devices`).
            cluster: the job, as the MPI launcher's variables describe it.
            num_quantization_bits: bits per gradient value in CNTK's all-reduce, 1..32.
            distributed_after: must be 0: with more, CNTK trains each worker alone for that many samples
                and does not synchronise their weights when aggregation starts.
            compression: ``"1bit"``, CNTK's own gradient compression: ``num_quantization_bits=1``.

        Returns:
            ``model``; every worker now holds rank 0's weights. Called again on the same model, the new
            options replace the first call's (the trainer is distributed again from Keras' own learners).

        Raises:
            OptionError: a bad option, or fewer than 32 bits on a CNTK build without 1-bit SGD.
            ClusterError: CNTK's MPI disagrees with the launch environment about rank or size.
            ModelError: the model has nothing to train.
        """
        num_quantization_bits = _quantization_bits(compression, num_quantization_bits)
        _check_options(num_quantization_bits, distributed_after)
        check_joinable(cluster, os.environ)  # after the options: a bad option is reported wherever it runs
        from cntk.train.distributed import Communicator

        rank, workers = Communicator.rank(), Communicator.num_workers()  # starts MPI: finalize at exit
        if not self._started_mpi:
            atexit.register(self.shutdown)
            self._started_mpi = True
        if (rank, workers) != (cluster.rank, cluster.world_size):
            raise ClusterError(
                "The launch environment ({}) says rank {} of {}, but CNTK's MPI says rank {} of {}. Start the "
                "workers with `distkeras launch --backend cntk --nproc-per-node N` or with mpiexec.".format(
                    cluster.source, cluster.rank, cluster.world_size, rank, workers))
        if workers == 1:
            logger.warning("one CNTK worker: the distributed learner trains it alone, as local training would")
        if getattr(model, "_distkeras_cntk", None) is not None:
            return self._redistribute(model, num_quantization_bits)
        model._distkeras_cntk = _Replica(self, rank, workers, num_quantization_bits)
        weights = model.get_weights()
        model.set_weights(_unflat(self.all_sum(_flat(weights, rank)), weights))
        policies.rank0_speaks_and_writes(model, rank)
        model._make_train_function = functools.partial(_make_train_function, model, model._make_train_function)
        # Keras calls these before every evaluate/predict (and fit()'s validation); they wrap its functions in
        # steps that keep this worker's rows of every global batch while the calls below are under way.
        model._make_test_function = functools.partial(_make_split_function, model, model._make_test_function,
                                                      "test_function", _TestStep)
        model._make_predict_function = functools.partial(_make_split_function, model, model._make_predict_function,
                                                         "predict_function", _PredictStep)
        model.fit = functools.partial(_fit, model, model.fit)
        model.evaluate = functools.partial(_evaluate, model, model.evaluate)
        model.predict = functools.partial(_predict, model, model.predict)
        if getattr(model, "optimizer", None) is not None:
            model._make_train_function()
        return model

    def _redistribute(self, model, bits):
        """A second ``distribute()`` of ``model``: its options replace the first call's, as on the other backends.

        The first call's hooks stay (they read the options from the model's ``_Replica``, updated here); every
        worker takes rank 0's weights again; a train function already made gets a new CNTK Trainer whose learners
        are Keras' own, wrapped again with the new ``num_quantization_bits`` (:func:`_distribute_trainer`), so the
        optimizer's state is kept. A train function made later (after ``compile()``) takes them too.
        """
        state = model._distkeras_cntk
        weights = model.get_weights()
        model.set_weights(_unflat(self.all_sum(_flat(weights, state.rank)), weights))
        if bits != state.bits:
            state.bits = bits
            step = getattr(model, "train_function", None)
            if isinstance(step, _Step):
                _distribute_trainer(step.function, bits)
        return model

    def all_sum(self, vector):
        """The sum over all workers of ``vector`` (1-D, float32): the same array on every worker.

        Every worker must call it, in the same order as every other collective. CNTK 2.7's Python API
        has no all-reduce, but its data-parallel learner sums gradients: a Keras function whose loss is
        ``sum(v * x)`` has gradient ``x`` for its variable ``v``, the learner sums the workers' ``x``,
        and the function's update assigns that sum to ``v`` (exactly: no arithmetic but the sum).
        """
        import numpy as np
        from keras import backend as K

        size = len(vector)
        if size == 0:
            return vector
        if size not in self._sums:
            total = K.variable(np.zeros(size, "float32"), name="distkeras_sum")
            part = K.placeholder(shape=(None, size), name="distkeras_part")
            loss = K.sum(total * part)
            function = K.function([part], [loss], updates=[(total, K.gradients(loss, [total])[0])])
            _distribute_trainer(function, 32)
            self._sums[size] = (function, total)
        function, total = self._sums[size]
        function([vector.reshape(1, size)])
        return K.get_value(total)

    def shutdown(self):
        """``Communicator.finalize()``, once, if this process started MPI (mpiexec fails a job that doesn't);
        registered to run at exit. No collective may follow."""
        if self._started_mpi and not self._finalized:
            from cntk.train.distributed import Communicator

            self._finalized = True
            Communicator.finalize()


def _quantization_bits(compression, bits):
    """``num_quantization_bits`` for the ``compression`` option: CNTK's compression is quantized SGD (1-bit SGD
    with error feedback at 1 bit), a different trade from the 16-bit all-reduce of the other backends, so
    'bf16'/'fp16' are refused rather than mapped onto it."""
    if compression is None:
        return bits
    if compression != "1bit":
        raise OptionError(
            "Expected compression to be None or '1bit' on CNTK: it compresses gradients by quantization "
            "(num_quantization_bits=1..31), not in 16-bit floats ('bf16'/'fp16' are TensorFlow's, JAX's and "
            "PyTorch's). Received: compression={!r}".format(compression))
    if bits not in (1, 32):
        raise OptionError("compression='1bit' is num_quantization_bits=1. Received: compression='1bit', "
                          "num_quantization_bits={!r}".format(bits))
    return 1


def _check_options(bits, after):
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 32:
        raise OptionError("Expected num_quantization_bits as an int in 1..32. Received: num_quantization_bits={!r}".format(bits))
    if after != 0 or isinstance(after, bool):
        raise OptionError(
            "Expected distributed_after=0. Received: distributed_after={!r}. With more, CNTK trains each worker alone "
            "for that many samples and does not synchronise their weights when aggregation starts, so the workers "
            "end up with different models.".format(after))


def _flat(arrays, rank, base=None):
    """``arrays`` as one float32 vector on rank 0; elsewhere that minus ``base`` (a vector), or zeros."""
    import numpy as np

    flat = np.concatenate([np.ravel(a).astype("float32") for a in arrays]) if len(arrays) else np.zeros(0, "float32")
    if rank == 0:
        return flat
    return flat - base if base is not None else np.zeros_like(flat)


def _unflat(flat, like):
    """``flat`` cut into arrays shaped and typed like those of ``like``: the inverse of :func:`_flat`."""
    arrays, start = [], 0
    for array in like:
        arrays.append(flat[start:start + array.size].reshape(array.shape).astype(array.dtype))
        start += array.size
    return arrays


def _distribute_trainer(function, bits):
    """Give Keras' ``function`` a ``cntk.Trainer(model, criterion, parameter_learners)`` with its trainer's
    model, loss and evaluation functions and its learners wrapped in data-parallel ones. Keras' Function
    (keras 2.3.1 ``cntk_backend``) calls ``self.trainer.train_minibatch`` in every step. Keras' own trainer is
    kept on the function, so a later call (a second ``distribute()`` with other options) wraps Keras' learners
    again, never the data-parallel ones."""
    import cntk
    from cntk.train.distributed import data_parallel_distributed_learner

    trainer = getattr(function, "_distkeras_keras_trainer", None) or function.trainer
    function._distkeras_keras_trainer = trainer
    if trainer is None:
        raise ModelError("The model has no trainable weights, so there is nothing to train data-parallel.")
    learners = list(trainer.parameter_learners)
    if len(learners) > 1:
        logger.warning("the CNTK trainer has %d learners; each is wrapped in its own data-parallel learner", len(learners))
    wrapped = []
    for learner in learners:
        try:
            wrapped.append(data_parallel_distributed_learner(learner, distributed_after=0, num_quantization_bits=bits))
        except RuntimeError as exc:
            if bits == 32 or not any(text in str(exc) for text in _NO_QUANTIZATION):
                raise
            raise OptionError(
                "num_quantization_bits={} needs a CNTK build with 1-bit SGD, and this one has none (CNTK says: {}). "
                "Use num_quantization_bits=32, or install a CNTK build with 1-bit SGD.".format(bits, str(exc).strip()))
    evaluation = trainer.evaluation_function
    criterion = (trainer.loss_function,) if evaluation is None else (trainer.loss_function, evaluation)
    function.trainer = cntk.Trainer(trainer.model, criterion, wrapped)


class _Replica(object):
    """One model's data-parallel state on this worker."""

    def __init__(self, adapter, rank, workers, bits):
        self.adapter, self.rank, self.workers, self.bits = adapter, rank, workers, bits
        self.split = False  # True while evaluate(), predict() or fit() on arrays runs: the steps keep their rows
        self.watch = None  # the data check (policies.array_watch), set by check_data in a job of several ranks

    def broadcast(self, variables):
        """Give Keras ``variables`` rank 0's values on every worker."""
        from keras import backend as K

        values = K.batch_get_value(variables)
        K.batch_set_value(list(zip(variables, _unflat(self.adapter.all_sum(_flat(values, self.rank)), values))))


def _make_train_function(model, make):
    """Keras' ``_make_train_function``, with the worker's loss weighed 1/workers and the trainer distributed."""
    state = model._distkeras_cntk
    if isinstance(getattr(model, "train_function", None), _Step):
        return
    model.train_function = None  # one Keras made before distribute() has the plain loss: make it anew
    total_loss = model.total_loss
    model.total_loss = total_loss * policies.even_share(state.workers)  # the trainer's; evaluate() keeps Keras' own
    try:
        make()
    finally:
        model.total_loss = total_loss
    _distribute_trainer(model.train_function, state.bits)
    model.train_function = _Step(model.train_function, state, [w for m in model._get_training_eval_metrics() for w in m.weights])
    state.broadcast(model.optimizer.weights)


class _Step(object):
    """Keras' train function on one worker, reporting global values: after each step the workers' metric
    states are summed (each adds what its step added), and the evaluation value CNTK summed over the
    workers (equal, as their states are) is divided by their number."""

    def __init__(self, function, state, metric_states):
        self.function, self.state, self.metric_states = function, state, metric_states

    def __call__(self, inputs):
        from keras import backend as K

        state = self.state
        before = K.batch_get_value(self.metric_states)
        outputs = list(self.function(inputs))
        if self.metric_states and state.workers > 1:
            after = K.batch_get_value(self.metric_states)
            total = state.adapter.all_sum(_flat(after, state.rank, base=_flat(before, 0)))
            K.batch_set_value(list(zip(self.metric_states, _unflat(total, after))))
        if self.function.trainer.evaluation_function is not None and len(outputs) > 1:
            outputs[1] = outputs[1] / state.workers
        return outputs


def _make_split_function(model, make, name, step):
    """Keras' ``_make_test_function`` or ``_make_predict_function``, its function then wrapped in ``step``."""
    make()
    function = getattr(model, name)
    if function is not None and not isinstance(function, step):
        setattr(model, name, step(function, model))


def _mine(inputs, rank, workers):
    """This worker's rows ``[rank::workers]`` of the global batch in ``inputs`` (Keras' arrays of one step; a
    learning-phase flag, a scalar, passes as it is), and how many there are: 0 in a batch smaller than the
    number of workers, for the last ranks."""
    size = len(inputs[0])
    mine = [value[rank::workers] if getattr(value, "ndim", 0) and len(value) == size else value for value in inputs]
    return mine, len(range(rank, size, workers))


class _TestStep(object):
    """Keras' test function (``evaluate()``, and the validation of ``fit()``) on one worker. While the adapter
    splits a call (``_Replica.split``), each worker evaluates its rows ``[rank::workers]`` of every global
    batch, then one all-reduce adds up, over the workers: the loss times the rows it averages (Keras' loss
    is a mean over the rows plus the regularization, so the sum over the global batch's rows is the global
    batch's), and what each added to the metrics' states; and every worker takes rank 0's metric values
    (rank 0 always has rows). Keras on CNTK computes those before the step's update of the states (CNTK has
    no control dependencies), from states every worker holds alike: the global ones. So every step returns,
    and leaves, what one process's does. Keras' loop weighs each step's loss by the global batch's rows."""

    def __init__(self, function, model):
        self.function, self.state = function, model._distkeras_cntk
        metrics = model._get_training_eval_metrics()
        self.metric_states = [w for m in metrics for w in m.weights]
        self.values = len([m for m in metrics if hasattr(m, "_call_result")])  # Keras' outputs after the loss

    def __call__(self, inputs):
        import numpy as np
        from keras import backend as K

        state = self.state
        if not state.split or state.workers == 1:
            return self.function(inputs)
        mine, real = _mine(inputs, state.rank, state.workers)
        before = K.batch_get_value(self.metric_states)
        values = np.zeros(1 + self.values, "float32")
        if real:
            outputs = self.function(mine)
            values[0] = float(outputs[0]) * real
            if state.rank == 0:
                values[1:] = [float(value) for value in outputs[1:]]
        after = K.batch_get_value(self.metric_states)
        total = state.adapter.all_sum(np.concatenate([values, _flat(after, state.rank, base=_flat(before, 0))]))
        if self.metric_states:
            K.batch_set_value(list(zip(self.metric_states, _unflat(total[1 + self.values:], after))))
        return [np.float32(total[0] / len(inputs[0]))] + [np.float32(value) for value in total[1:1 + self.values]]


class _PredictStep(object):
    """Keras' predict function on one worker. While the adapter splits a call (``_Replica.split``), each
    worker predicts its rows ``[rank::workers]`` of the global batch and writes them at their places in zeros
    shaped like the global batch's prediction; the all-reduce of those is that prediction, in order, on
    every worker, exactly (each value is added to zeros). A worker with no row in a batch smaller than the
    number of workers computes nothing (where an output's shape has an unknown dimension past the batch, it
    predicts the batch's first row to learn it) and writes nothing."""

    def __init__(self, function, model):
        from keras import backend as K

        self.function, self.state = function, model._distkeras_cntk
        self.shapes = [tuple(K.int_shape(output)[1:]) for output in model.outputs]

    def __call__(self, inputs):
        import numpy as np

        state = self.state
        if not state.split or state.workers == 1:
            return self.function(inputs)
        size = len(inputs[0])
        mine, real = _mine(inputs, state.rank, state.workers)
        if real:
            outputs = [np.asarray(out) for out in self.function(mine)]
        elif all(None not in shape for shape in self.shapes):
            outputs = [np.zeros((0,) + shape, "float32") for shape in self.shapes]
        else:
            outputs = [np.asarray(out)[:0] for out in self.function(_mine(inputs, 0, size)[0])]
        full = [np.zeros((size,) + out.shape[1:], "float32") for out in outputs]
        if real:
            for whole, out in zip(full, outputs):
                whole[state.rank::state.workers] = out
        summed = state.adapter.all_sum(np.concatenate([whole.ravel() for whole in full]))
        return [whole.astype(out.dtype, copy=False) for whole, out in zip(_unflat(summed, full), outputs)]


def _evaluate(model, evaluate, *args, **kwargs):
    """Keras' ``evaluate`` on arrays, as one process runs it at ``batch_size``, each worker evaluating its rows
    of every global batch (:class:`_TestStep`). Tensors and ``steps`` pass through, whole on every worker."""
    return _split(model, "evaluate", evaluate, args, kwargs)


def _predict(model, predict, *args, **kwargs):
    """Keras' ``predict`` on arrays: each worker predicts its rows of every global batch, and every worker gets
    the whole prediction, in order (:class:`_PredictStep`). Tensors and ``steps`` pass through, whole."""
    return _split(model, "predict", predict, args, kwargs)


def _split(model, call, method, args, kwargs):
    state = model._distkeras_cntk
    bound, samples = sharding.on_arrays(method, args, kwargs)
    if samples is None or state.workers == 1:
        return method(*bound.args, **bound.kwargs)
    _check_same_everywhere(state, call, policies.array_call_values(samples, bound.arguments["batch_size"]))
    policies.check_arrays(state.watch, call, tuple(
        bound.arguments.get(name) for name in ("x", "y", "sample_weight")), bound.arguments["batch_size"])
    return _splitting(state, method, bound.args, bound.kwargs)


def _splitting(state, method, args, kwargs):
    """``method(*args, **kwargs)`` with the test and predict steps keeping this worker's rows."""
    before, state.split = state.split, True
    try:
        return method(*args, **kwargs)
    finally:
        state.split = before


def _weighted(sample_weight, weights, rows, outputs):
    """The user's sample weights (None, an array, or one per output) for ``rows``, times ``weights``."""
    if weights is None:
        return None if sample_weight is None else sharding.select(sample_weight, rows)
    if sample_weight is None:
        return weights if outputs == 1 else [weights] * outputs
    chosen = sharding.select(sample_weight, rows)
    scaled = [a * weights.reshape((-1,) + (1,) * (a.ndim - 1)) for a in sharding.parts(chosen)]
    return dict(zip(chosen, scaled)) if isinstance(chosen, dict) else scaled if isinstance(chosen, (list, tuple)) else scaled[0]


def _fit(model, fit, *args, **kwargs):
    """Keras' ``fit``, each worker on its ``sharding.batch_rows``; generators and tensors pass through."""
    import numpy as np

    state = model._distkeras_cntk
    bound, data = sharding.fit_on_arrays(fit, args, kwargs)
    if data is None:
        return fit(*bound.args, **bound.kwargs)  # each worker trains on what it is given, weighed 1/workers
    given = bound.arguments
    batch = given["batch_size"] or policies.DEFAULT_BATCH_SIZE
    n = sharding.num_samples([part for part in data if part is not None])
    split = given["validation_split"]
    if given["validation_data"] is None and 0.0 < split < 1.0:  # as Keras 2.3.1 splits: the last rows
        cut = int(n * (1.0 - split))
        given["validation_data"] = tuple(sharding.select(part, slice(cut, None)) for part in data if part is not None)
        data, n = [None if part is None else sharding.select(part, slice(0, cut)) for part in data], cut
    validation = given["validation_data"]
    arrays = isinstance(validation, (list, tuple)) and all(
        isinstance(a, np.ndarray) for part in validation if part is not None for a in sharding.parts(part))
    if state.workers > 1:
        _check_same_everywhere(state, "fit", [("samples", n), ("batch_size", batch), ("epochs", given["epochs"])] + (
            [("validation_samples", sharding.num_samples([p for p in validation if p is not None]))] if arrays else []))
        policies.check_arrays(state.watch, "fit", data, batch)
    rows, weights = sharding.batch_rows(n, batch, state.rank, state.workers)
    weights = None if weights is None else np.asarray(weights, dtype="float32")
    given.update(x=sharding.select(data[0], rows), y=None if data[1] is None else sharding.select(data[1], rows),
                 sample_weight=_weighted(data[2], weights, rows, len(getattr(model, "outputs", [None]))),
                 batch_size=batch // state.workers, validation_split=0.0)
    if validation is None or not arrays:
        return fit(*bound.args, **bound.kwargs)
    return _splitting(state, fit, bound.args, bound.kwargs)  # the validation, each worker its rows (_TestStep)


def _check_same_everywhere(state, call, values):
    """:func:`~distkeras.backends.policies.check_same_everywhere` over this job's workers."""
    policies.check_same_everywhere(state.adapter.all_sum, state.rank, state.workers, call, values)
