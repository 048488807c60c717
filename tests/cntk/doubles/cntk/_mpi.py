"""The double's MPI: this process' rank and size, and a sum over the ranks ("all-reduce") through files.

Not CNTK API; it stands in for Open MPI under CNTK. The rank and size come from the variables Open MPI
(``OMPI_COMM_WORLD_RANK``/``SIZE``) or MPICH (``PMI_RANK``/``SIZE``) give each rank; without them the
process is the only worker, as CNTK runs outside mpiexec. Collectives go through ``FAKE_MPI_DIR``, which
the fake ``bin/mpiexec`` creates: each rank writes its arrays for collective number k, waits until every
rank has written, and adds them up in rank order, so every rank gets the same sum (real MPI does too).
A rank that waits ``FAKE_MPI_TIMEOUT`` seconds (default 60) raises: in real MPI that would hang.

MPI starts on first use (CNTK's ``MPIWrapper`` starts it the first time it is asked for a rank or a
communicator) and must be finalized before the process exits, or ``mpiexec`` fails the job; the markers
``started.<rank>``/``finalized.<rank>`` in the folder let the fake mpiexec check that. Every finalize is
logged on stderr ("fake MPI: rank R finalize"), so tests can count them.
"""

import os
import sys
import time

import numpy as np


class World(object):
    def __init__(self, environ):
        for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
            if rank_var in environ and size_var in environ:
                self.rank, self.size = int(environ[rank_var]), int(environ[size_var])
                break
        else:
            self.rank, self.size = 0, 1
        self.directory = environ.get("FAKE_MPI_DIR")
        self.timeout = float(environ.get("FAKE_MPI_TIMEOUT", "60"))
        self.started = False
        self.finalized = False
        self.collectives = 0

    def _marker(self, name):
        if self.directory:
            with open(os.path.join(self.directory, "{}.{}".format(name, self.rank)), "w"):
                pass

    def start(self):
        if self.finalized:
            raise RuntimeError("fake MPI: MPI was used after MPI_Finalize (rank {})".format(self.rank))
        if not self.started:
            if self.size > 1 and not self.directory:
                raise RuntimeError("fake MPI: {} ranks but no FAKE_MPI_DIR; start them with the fake mpiexec".format(self.size))
            self.started = True
            self._marker("started")

    def finalize(self):
        sys.stderr.write("fake MPI: rank {} finalize\n".format(self.rank))
        sys.stderr.flush()
        if self.started and not self.finalized:
            self.finalized = True
            self._marker("finalized")

    def all_sum(self, arrays):
        """The sum over every rank of each array in ``arrays`` (same shapes and dtypes on every rank)."""
        self.start()
        arrays = [np.asarray(a) for a in arrays]
        if self.size == 1:
            return [a.copy() for a in arrays]
        number = self.collectives
        self.collectives += 1
        mine = os.path.join(self.directory, "c{:07d}.r{}.npz".format(number, self.rank))
        with open(mine + ".tmp", "wb") as handle:
            np.savez(handle, *arrays)
        os.replace(mine + ".tmp", mine)
        paths = [os.path.join(self.directory, "c{:07d}.r{}.npz".format(number, r)) for r in range(self.size)]
        deadline = time.time() + self.timeout
        while not all(os.path.exists(p) for p in paths):
            if time.time() > deadline:
                missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
                raise RuntimeError("fake MPI: rank {} waited {:.0f} s in collective #{} for ranks {}, which never "
                                   "joined it (real MPI would hang here)".format(self.rank, self.timeout, number, missing))
            time.sleep(0.001)
        parts = []
        for path in paths:
            with np.load(path) as loaded:
                parts.append([loaded["arr_{}".format(i)] for i in range(len(loaded.files))])
        for rank, part in enumerate(parts):
            if [(p.shape, p.dtype) for p in part] != [(a.shape, a.dtype) for a in arrays]:
                raise RuntimeError("fake MPI: collective #{}: rank {} sent {}, rank {} sent {}".format(
                    number, self.rank, [(a.shape, str(a.dtype)) for a in arrays], rank, [(p.shape, str(p.dtype)) for p in part]))
        sums = [p.copy() for p in parts[0]]
        for part in parts[1:]:
            for total, value in zip(sums, part):
                total += value
        if number:  # every rank has read collective number-1 once it wrote this one: drop my part of it
            previous = os.path.join(self.directory, "c{:07d}.r{}.npz".format(number - 1, self.rank))
            if os.path.exists(previous):
                os.remove(previous)
        return sums


WORLD = World(os.environ)
