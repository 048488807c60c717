"""``cntk.train.distributed`` (CNTK 2.7, ``bindings/python/cntk/train/distributed.py``)."""

import os

from .. import _mpi
from ..learners import Learner

#: Every data_parallel_distributed_learner call, as (learner, keyword arguments): not CNTK API, the
#: double's record for tests.
_calls = []


class Communicator(object):
    """``cntk.train.distributed.Communicator``: the static ``rank()``, ``num_workers()`` and ``finalize()``."""

    @staticmethod
    def rank():
        """Rank of the current process (``cntk_py.worker_global_rank()``); starts MPI."""
        _mpi.WORLD.start()
        return _mpi.WORLD.rank

    @staticmethod
    def num_workers():
        """Number of MPI workers (``cntk_py.number_of_workers()``); starts MPI."""
        _mpi.WORLD.start()
        return _mpi.WORLD.size

    @staticmethod
    def finalize():
        """Should be called when all communication is finished; no communication may follow."""
        _mpi.WORLD.finalize()


class _MinibatchInfo(object):
    """CNTK's ``MinibatchInfo``: the sample count, training loss and evaluation value of one minibatch."""

    def __init__(self, samples, loss, evaluation):
        self.samples, self.loss, self.evaluation = samples, loss, evaluation


class DistributedLearner(Learner):
    """``cntk.train.distributed.DistributedLearner``, as ``DataParallelDistributedLearner::Update`` works:
    from ``distributed_after`` samples on, the gradients, the evaluation value, the training loss and
    the sample count are summed over every worker *in place*, then the local learner updates (unless no
    worker had samples)."""

    def __init__(self, learner, distributed_after, num_quantization_bits):
        super(DistributedLearner, self).__init__(learner.parameters)
        self._learner = learner
        self._distributed_after = distributed_after
        self._bits = num_quantization_bits  # the sums are exact: the double does not model quantization error
        self._sample_count = 0

    def _update_distributed(self, gradients, info):
        if self._sample_count >= self._distributed_after:
            order = list(self.parameters)
            sums = _mpi.WORLD.all_sum([gradients[p] for p in order] + [info.evaluation, info.loss, float(info.samples)])
            for parameter, total in zip(order, sums):
                gradients[parameter] = total
            info.evaluation, info.loss, info.samples = sums[-3], sums[-2], int(sums[-1])
        self._sample_count += info.samples
        if info.samples == 0:
            return False
        return self._learner._update(gradients, info.samples)


def data_parallel_distributed_learner(learner, distributed_after=0, num_quantization_bits=32,
                                      use_async_buffered_parameter_update=False):
    """Creates a data parallel distributed learner (CNTK 2.7 signature).

    ``num_quantization_bits`` < 32 asks for the quantized communicator, which builds without 1-bit SGD
    refuse (``FAKE_CNTK_NO_1BIT=1`` makes the double such a build) with CNTK's LogicError, a
    RuntimeError in Python.
    """
    _calls.append((learner, dict(distributed_after=distributed_after, num_quantization_bits=num_quantization_bits,
                                 use_async_buffered_parameter_update=use_async_buffered_parameter_update)))
    if num_quantization_bits < 32 and os.environ.get("FAKE_CNTK_NO_1BIT"):
        raise RuntimeError("Quantized MPI Communicator is not supported for this build. The 1BitSGD build is needed, "
                           "see CNTK wiki for details.")
    if use_async_buffered_parameter_update:
        raise RuntimeError("Asynchronous parameter update is not yet supported for the DataParallelDistributedLearner.")
    _mpi.WORLD.start()  # cntk_py.mpicommunicator()
    return DistributedLearner(learner, distributed_after, num_quantization_bits)
