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
Nothing is rebuilt from a config, and ``save()`` writes the plain model.

**Across processes** (``distkeras launch --backend mxnet``, which also starts MXNet's scheduler and servers
with the ``DMLC_*`` variables) each worker's module adds its contexts' gradients and the other workers' in
one ``dist_sync`` KVStore per process (:class:`.job._Job`): the servers sum what the workers push, every worker
pulls the sum and applies the same update with its own copy of the optimizer. The optimizer can't run on
the servers: keras-mxnet's optimizers are classes local to a function, which MXNet can't pickle to them.
The module itself is bound without a KVStore (``model._kvstore = None``) and the train step pushes and
pulls; so the keys are the adapter's, one set per module (a model compiled again gets new ones, where MXNet
refuses a second ``init`` of a key), and

- each context's gradient is weighed by its count of samples (nonzero sample weights), the sums divided by
  the job's count of the step, pulled in the same round: the gradient of the global batch, exactly, also
  for uneven last batches and sample weights. The loss and metrics reported are the global batch's too
  (the loss and weighted metrics weighed by samples, the metrics, which ignore sample weights, by rows).
- ``fit()`` on arrays runs Keras' own loop over the global arrays at the global ``batch_size`` on every
  worker, with rank 0's NumPy random state at every epoch's start, so every worker shuffles alike; the
  train step keeps the worker's rows ``[r::W]`` of each global batch Keras gathers (a worker with no row of
  a short last batch takes one with sample weight 0, so every worker takes the same steps). Keras' epoch
  averages, weighing each step by the rows it gathered, are one process's.
- every module starts from rank 0's weights (parameters and auxiliary states): rank 0 pushes them, the
  others zeros, and all pull the sum. The KVStore's own ``init`` would take those of whichever worker
  ps-lite numbered 0, which need not be distkeras' rank 0.

- ``evaluate()`` on arrays and ``fit()``'s validation (``validation_split``, ``validation_data``) run Keras' loop
  over the global arrays on every worker too; the test step keeps the worker's rows ``[r::W]`` of each global
  batch and the job sums every worker's counts and weighted values in one round: one process's values, sample
  weights, uneven last batches and batches smaller than W included. ``predict()`` on arrays: each worker
  predicts its rows of each batch into zeros of the global batch's shape, and the job's sum (exact: each value
  is added to zeros) is the whole prediction, in order, on every worker. Every worker must call them alike:
  their samples and batch size are compared first (a ``ShardError`` on every worker, where a mismatch would
  hang). Tensors and ``steps`` pass through, whole on every worker.
- ``distribute()`` reseeds MXNet's random generators on every worker but rank 0 by its rank (keras-mxnet
  reseeds them alike on every worker whenever it builds a Dropout layer), so dropout masks are drawn
  independently per worker rather than alike. Not one process's masks: MXNet's generators draw a batch's masks
  in one stream, which no split of the batch repeats. The contexts of one process draw independently too (the
  CPU contexts from one generator in turn).

Rank 0 alone prints and saves.

A loss function returning one number for the batch (a mean over everything) is exact, also over workers: Keras
2 gives each context that number for its rows, weighed like a mean loss. With sample weights Keras multiplies it
by the batch's mean sample weight, a product of two batch means that no weighted sum over contexts gives:
approximate then. Embedding gradients (a gather) are dense arrays per context, summed densely: exact with Adam.
Sample weights that give a context (or worker) of a step rows of nonzero weight for one output and none for
another make Keras 2 compute that output's loss there as 0/0 (NaN gradient, NaN weights): the step raises a
``ShardError`` before it updates anything, on every worker of a job.

The per-step code (:mod:`.steps`) talks to keras-mxnet's Model internals (``_adjust_module``, ``_module``,
``_update``...), as keras-mxnet's own train/test/predict functions do: it has no public hook between
backward and update. Those functions are replaced per model through the ``_make_*_function`` methods
Keras calls before every fit/evaluate/predict; they are instance attributes and nothing of them is saved.
Each private name used is commented where it is used, and pinned by tests/mxnet/test_internals.py.

This module distributes the model; the steps it installs are :mod:`.steps`, the multi-worker ``fit()``,
``evaluate()`` and ``predict()`` :mod:`.loops`, and this process's KVStore in the parameter-server job :mod:`.job`.
"""

import functools
import os
from typing import Mapping

from ...cluster import Cluster
from ...devices import Device
from ...errors import ClusterError, OptionError
from .. import policies
from ..base import Adapter
from . import job as mxnet_job
from . import loops as mxnet_loops
from . import steps as mxnet_steps

_KVSTORES = ("device", "local")
#: The KVStores of a multi-worker job: 'dist_sync' adds a worker's contexts on the CPU, 'dist_sync_device'
#: on its GPUs, before pushing to the servers.
_DIST_KVSTORES = ("dist_sync", "dist_sync_device")
#: MXNet hyper-parameters that keras-mxnet's optimizers take but leave out of get_config()
#: (``clipnorm`` becomes ``clip_gradient``; ``wd`` and the rest come in through ``**kwargs``).
_OPTIMIZER_EXTRAS = ("clip_gradient", "wd", "rescale_grad", "multi_precision")


def check_joinable(cluster: Cluster, env: Mapping[str, str]) -> None:
    """Raise ClusterError when this process is one of several workers but no worker of an MXNet
    parameter-server job -- started by Slurm's srun, torchrun, Ray, MPI, Kubernetes... which start workers
    but not MXNet's scheduler and servers, nor give the ``DMLC_*`` variables ps-lite reads. It would
    otherwise train alone, or wait for a scheduler nobody started. Pure: tests pass the environment."""
    if not cluster.is_multi_worker or env.get("DMLC_ROLE") == "worker":
        return
    instead = _MXNET_INSTEAD.get(cluster.source, _MXNET_INSTEAD[""])
    raise ClusterError(
        "This process is rank {} of {} ({}: {}), but not a worker of an MXNet parameter-server job: DMLC_ROLE={!r}. "
        "MXNet's workers need its scheduler and servers, which only `distkeras launch --backend mxnet` starts "
        "alongside them; {} can't. Instead {}".format(
            cluster.rank, cluster.world_size, cluster.source, _shown(cluster.variables), env.get("DMLC_ROLE"),
            cluster.source, instead))


def _shown(variables):
    return ", ".join("{}={}".format(k, v) for k, v in sorted((variables or {}).items())) or "no variables"


_MXNET_INSTEAD = {
    "slurm": "start one launcher per node inside the allocation: srun --ntasks-per-node=1 distkeras launch "
             "--backend mxnet --nproc-per-node N script.py.",
    "kubernetes": "run `distkeras launch --backend mxnet --nnodes PODS --node-rank $JOB_COMPLETION_INDEX "
                  "--coordinator <pod 0's host>:PORT --nproc-per-node N script.py` in every pod.",
    "kubeflow": "run `distkeras launch --backend mxnet --nnodes PODS --node-rank $RANK --coordinator "
                "$MASTER_ADDR:PORT --nproc-per-node N script.py` in every pod.",
    "": "start the job with `distkeras launch --backend mxnet --nproc-per-node N script.py` (across hosts "
        "with --nnodes, --node-rank and --coordinator on every host).",
}


class MXNetAdapter(Adapter):
    name = "mxnet"
    framework = "mxnet"
    install_hint = "mxnet==1.9.1 keras-mxnet==2.2.4.3 'numpy<1.24'"
    shard_unsupported = (
        "keras-mxnet's contexts each hold a full copy of the weights, and its KVStore holds whole arrays")
    options = {
        "kvstore": "where the contexts' gradients are added: 'device' (default, on the GPUs) or 'local' (CPU); in a "
        "multi-worker job 'dist_sync' (default) or 'dist_sync_device'",
        "compression": "'2bit': MXNet's KVStore gradient compression (2-bit quantization with error feedback, "
        "threshold 0.5), or {'type': '2bit', 'threshold': t}; kvstore='device' only. MXNet has no 16-bit all-reduce",
    }

    @classmethod
    def workers_env(cls, job, environ):
        """Each worker's ``DMLC_*`` variables: a worker of MXNet's parameter server (:mod:`.launch`)."""
        from .launch import dmlc_env

        host = job.addresses[job.node_rank] if job.nnodes > 1 else None
        return [dmlc_env("worker", job.engine, job.nnodes, job.nnodes * job.nproc_per_node, host)
                for _ in range(job.nproc_per_node)]

    @classmethod
    def launch_roles(cls, job, environ):
        """The parameter server's scheduler (node rank 0) and this host's server (:func:`.launch.ps_roles`)."""
        from .launch import ps_roles

        host = job.addresses[job.node_rank] if job.nnodes > 1 else None
        return ps_roles(job.engine, job.nnodes, job.node_rank, job.nnodes * job.nproc_per_node, host, environ=environ)

    def __init__(self):
        self._cpu_devices = 1
        self._job = None

    @property
    def kvstore(self):
        """The ``dist_sync`` KVStore of this worker's job (MXNet's own object), or None outside a job."""
        return None if self._job is None else self._job.kv

    def list_devices(self):
        """Every GPU MXNet sees, then the CPU devices: ``cpu(0)`` .. ``cpu(N-1)``, N from :meth:`set_cpu_devices`."""
        import mxnet as mx

        gpus = [Device("gpu", i) for i in range(mx.context.num_gpus())]
        return gpus + [Device("cpu", i) for i in range(self._cpu_devices)]

    def set_cpu_devices(self, count):
        """Use ``count`` CPU contexts. MXNet takes any ``cpu(i)`` at any time, so this is never too late."""
        self._cpu_devices = count

    def check_data(self, model, mode, rank, workers):
        """The data check across the job's workers: the arrays of every ``fit``/``evaluate``/``predict`` compared
        before its first step (:func:`~distkeras.backends.policies.check_arrays`); generators and tensors pass
        through unchecked, as they pass through whole."""
        job = getattr(model, "_distkeras_job", None)
        if job is None:
            return super(MXNetAdapter, self).check_data(model, mode, rank, workers)
        setattr(model, mxnet_loops.WATCH, policies.array_watch(mode, rank, workers, job.all_sum, self.name))

    def distribute(self, model, devices, cluster, kvstore=None, compression=None):
        """``model`` itself, made to train data-parallel over ``devices`` (see the module docstring).

        Args:
            model: a built keras-mxnet model, compiled or not.
            devices: the devices to replicate over; ``gpu:i`` becomes ``mx.gpu(i)``, ``cpu:i`` ``mx.cpu(i)``.
            cluster: the job: one process, or a worker of ``distkeras launch --backend mxnet``.
            kvstore: where MXNet adds the contexts' gradients, ``"device"`` (default) or ``"local"``; in a
                multi-worker job ``"dist_sync"`` (default) or ``"dist_sync_device"``.
            compression: ``"2bit"`` or ``{"type": "2bit", "threshold": t}``: MXNet's own gradient
                compression in the KVStore (:func:`_compression_params`).

        Returns:
            ``model``.

        Raises:
            OptionError: an unknown ``kvstore`` or ``compression``, a ``dist_*`` KVStore in one process, or
                compression in a multi-worker job.
            DistKerasError: a multi-worker job not started as MXNet's parameter-server job, or whose
                scheduler can't be reached.
        """
        import mxnet as mx

        if cluster.is_multi_worker:
            check_joinable(cluster, os.environ)
            return self._distribute_in_job(model, devices, cluster, kvstore or "dist_sync", compression)
        kvstore = kvstore or "device"
        if str(kvstore).startswith("dist"):
            raise OptionError(
                "kvstore={!r} needs MXNet's parameter-server job: start the workers with `distkeras launch --backend "
                "mxnet --nproc-per-node N script.py`. This process is alone ({}). Received: kvstore={!r}".format(
                    kvstore, cluster.source, kvstore))
        if kvstore not in _KVSTORES:
            raise OptionError("Expected kvstore in {}. Received: kvstore={!r}".format(_KVSTORES, kvstore))
        # keras-mxnet reads the contexts from Model._context when it builds its modules (in compile(),
        # and in predict() before any compile). Its public set_mxnet_context() is no use: it maps
        # 'cpu(1)' to cpu(0) and refuses a single context.
        model._context = [mx.gpu(d.index) if d.kind == "gpu" else mx.cpu(d.index) for d in devices]
        model._kvstore = kvstore  # keras-mxnet's init_optimizer(kvstore=Model._kvstore); it has no public setter
        model._distkeras_compression = _compression_params(compression, kvstore)
        _compile_again(model)
        _install_steps(model)
        policies.rank0_writes(model, cluster.rank)  # one process: its saves atomic
        return model

    def _distribute_in_job(self, model, devices, cluster, kvstore, compression):
        """:meth:`distribute` in a worker of a multi-worker job (see the module docstring)."""
        import mxnet as mx

        if kvstore not in _DIST_KVSTORES:
            raise OptionError("Expected kvstore in {} in a multi-worker job (rank {} of {}). Received: kvstore={!r}".format(
                _DIST_KVSTORES, cluster.rank, cluster.world_size, kvstore))
        if compression is not None:
            raise OptionError("compression is not supported across MXNet workers in this version of distkeras "
                              "(only within one process, kvstore='device'). Received: compression={!r}".format(compression))
        if self._job is None:
            self._job = mxnet_job._Job(kvstore, cluster)
        elif self._job.kv.type != kvstore:
            raise OptionError("This worker's job already uses kvstore={!r}; one KVStore per process. Received: "
                              "kvstore={!r}".format(self._job.kv.type, kvstore))
        model._context = [mx.gpu(d.index) if d.kind == "gpu" else mx.cpu(d.index) for d in devices]
        # keras-mxnet passes Model._kvstore to the module's init_optimizer() when it binds (compile() leaves it
        # alone): None binds no KVStore, so the module adds nothing and the train step pushes and pulls itself.
        model._kvstore = None
        model._distkeras_compression = None
        model._distkeras_job = self._job
        mxnet_job._seed_by_rank(cluster.rank)
        _compile_again(model)
        _install_steps(model)
        if not getattr(model, "_distkeras_fit", False):
            policies.rank0_speaks_and_writes(model, cluster.rank)  # first: it binds verbose in Keras' signature
            model.fit = functools.partial(mxnet_loops._fit, model, model.fit)
            model.evaluate = functools.partial(mxnet_loops._evaluate, model, model.evaluate)
            model.predict = functools.partial(mxnet_loops._predict, model, model.predict)
            model._distkeras_fit = True
        return model

    def shutdown(self):
        """End this worker's part in the job: free its KVStore, whose destructor waits for every worker and
        then (on ps-lite's rank 0) stops the servers. Registered to run at exit; no training may follow."""
        if self._job is not None:
            self._job.close()


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


def _install_steps(model):
    """Have Keras install the steps of :mod:`.steps` on ``model``: it calls these before every fit/evaluate/predict."""
    model._make_train_function = functools.partial(_install, model, "train_function", mxnet_steps._train_step)
    model._make_test_function = functools.partial(_install, model, "test_function", mxnet_steps._test_step)
    model._make_predict_function = functools.partial(_install, model, "predict_function", mxnet_steps._predict_step)


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
