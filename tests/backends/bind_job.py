"""One worker of the test job of test_engine_binding.py, started by `distkeras launch --nproc-per-node 2`.

    python -m tests.backends.bind_job OUT_DIR

Every rank distributes a tiny model and trains a step (so its engine's rendezvous, collectives and servers are
all up), writes its pid to OUT_DIR/ready{R}, then stays alive until OUT_DIR/go exists (60 s at most) while
the test reads its listening sockets from /proc; then a last fit() step, so that no rank leaves before the
other was read.
"""

import os
import sys
import time

import distkeras  # first: a multi-worker engine starts before the backend's first op
import keras

from tests.backends import scenarios

#: Seconds a worker waits for the test to read its sockets.
WAIT = 60


def main(out_dir, rank):
    model = distkeras.distribute(scenarios.build(keras))
    x, y = scenarios.data(24)
    model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    ready = os.path.join(out_dir, "ready{}".format(rank))
    with open(ready + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(ready + ".tmp", ready)
    deadline = time.time() + WAIT
    while not os.path.exists(os.path.join(out_dir, "go")) and time.time() < deadline:
        time.sleep(0.05)
    model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)


if __name__ == "__main__":
    main(sys.argv[1], distkeras.cluster.from_env().rank)
