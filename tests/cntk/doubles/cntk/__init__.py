"""Test double of CNTK 2.7's Python API: the slice distkeras' CNTK adapter calls (see ../README.md).

Names and signatures are CNTK 2.7's (``bindings/python/cntk``): ``cntk.Trainer``, ``cntk.Communicator``
(also ``cntk.train.distributed.Communicator``), ``cntk.train.distributed.data_parallel_distributed_learner``,
``cntk.device.use_default_device``, and ``cntk.cntk_py.universal_learner``, which Keras 2.3.1's
``cntk_backend.Function`` builds its learner with. Values and gradients come from the graph objects it
is given (the Keras stand-in's, in place of CNTK's C++ graph engine); workers are processes (``_mpi``).
"""

from . import cntk_py, device, learners, train
from .train.distributed import Communicator
from .train.trainer import Trainer

__version__ = "2.7"
