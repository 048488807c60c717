"""This worker's place in MXNet's parameter-server job (``distkeras launch --backend mxnet``): its ``dist_sync``
KVStore, one per process (:class:`_Job`), which sums what the workers push and gives every worker the sum; the
wait for MXNet's scheduler before ps-lite connects (:func:`wait_for_scheduler`); and the reseeding of MXNet's random
generators by rank (:func:`_seed_by_rank`). What goes through the KVStore at each step is :mod:`.steps`' business;
whether a model joins a job at all, :mod:`.adapter`'s.
"""

import atexit
import os
import socket
import time

from ...errors import ClusterError, DistKerasError, NetworkError

#: Seconds a worker waits for MXNet's scheduler to listen before it gives up.
SCHEDULER_TIMEOUT = 60.0


class _Job(object):
    """This worker's ``dist_sync`` KVStore and the keys the adapter made in it."""

    def __init__(self, kvstore, cluster):
        import mxnet as mx

        env = os.environ
        if env.get("DMLC_ROLE") != "worker" or not env.get("DMLC_PS_ROOT_URI") or not env.get("DMLC_PS_ROOT_PORT"):
            raise DistKerasError(
                "This process is rank {} of {} workers ({}), but not a worker of an MXNet parameter-server job: "
                "DMLC_ROLE={!r}, DMLC_PS_ROOT_URI={!r}, DMLC_PS_ROOT_PORT={!r}. Start the job with `distkeras launch "
                "--backend mxnet --nproc-per-node N script.py`, which starts MXNet's scheduler and servers too.".format(
                    cluster.rank, cluster.world_size, cluster.source, env.get("DMLC_ROLE"),
                    env.get("DMLC_PS_ROOT_URI"), env.get("DMLC_PS_ROOT_PORT")))
        wait_for_scheduler(env["DMLC_PS_ROOT_URI"], int(env["DMLC_PS_ROOT_PORT"]),
                           float(env.get("DISTKERAS_SCHEDULER_TIMEOUT", SCHEDULER_TIMEOUT)))
        self.kv = mx.kv.create(kvstore)  # ps-lite starts; returns once every process of the job is connected
        self.rank, self.workers = cluster.rank, cluster.world_size
        if self.kv.num_workers != cluster.world_size:
            raise ClusterError("The launch environment ({}) says {} workers, but MXNet's KVStore has {} "
                               "(DMLC_NUM_WORKER={}).".format(cluster.source, cluster.world_size, self.kv.num_workers,
                                                             env.get("DMLC_NUM_WORKER")))
        self.modules = 0
        self.sizes = set()
        atexit.register(self.close)

    def key(self, *parts):
        return "/".join(str(p) for p in parts)

    def init(self, key, value):
        """``kv.init`` of a new key (every worker, same order): allocates it on the servers."""
        self.kv.init(key, value)

    def sum(self, key, value, out):
        """Push ``value`` (one array, or one per context) under ``key``; ``out`` gets the job's sum."""
        self.kv.pushpull(key, value, out=out)

    def all_sum(self, vector):
        """The sum over the workers of a float32 numpy ``vector`` (every worker calls it, in the same order)."""
        import mxnet as mx

        key = self.key("sum", len(vector))
        array = mx.nd.array(vector, dtype="float32")
        if len(vector) not in self.sizes:
            self.sizes.add(len(vector))
            self.init(key, array)
        self.sum(key, array, array)
        return array.asnumpy()

    def close(self):
        if getattr(self, "kv", None) is not None:
            kv, self.kv = self.kv, None
            del kv  # the KVStore's destructor: a barrier of every worker, then the servers stop


#: The seed keras-mxnet gives MXNet's generators whenever it builds a Dropout layer given no seed (its
#: ``backend.dropout`` calls ``mx.random.seed(seed or int(10e6))``).
_KERAS_MXNET_DROPOUT_SEED = int(10e6)


def _seed_by_rank(rank):
    """Reseed MXNet's random generators on every worker but rank 0 by its rank.

    keras-mxnet reseeds MXNet's generators whenever it builds a Dropout layer (``mx.random.seed(seed or 10e6)``), the
    same on every worker: each would draw the same dropout masks for its rows as the others. The model is built
    before distribute(), so reseeding here, after it, makes the workers draw independent masks; rank 0 keeps the
    seed it had (a one-process run's). Not one process's masks: MXNet draws a batch's masks in one stream, which no
    split of the batch repeats. The spacing of 1000 keeps apart the streams of MXNet's per-device generators, which
    it seeds from the seed and the device id."""
    import mxnet as mx

    if rank:
        mx.random.seed(_KERAS_MXNET_DROPOUT_SEED + 1000 * rank)


def wait_for_scheduler(host, port, timeout):
    """Return once MXNet's scheduler accepts connections at ``host:port``; raise a clear error after ``timeout`` s.

    ps-lite itself would retry the connection forever, with nothing said.
    """
    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError as exc:
            if time.time() > deadline:
                raise NetworkError(
                    "MXNet's scheduler at {}:{} (DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT) can't be reached after {:.0f} s "
                    "({}). Start the job with `distkeras launch --backend mxnet`, whose node rank 0 runs the "
                    "scheduler, and check that this host reaches that address.".format(host, port, timeout, exc))
            time.sleep(0.2)
