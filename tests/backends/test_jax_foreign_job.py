"""A JAX job distkeras did not form: two processes whose jax.distributed was started by someone else, with no
variables distkeras reads (what Ray Train's JaxTrainer does), get a ClusterError from distribute(), never a
silent run alone."""

import os
import socket
import subprocess
import sys

from tests.backends.harness import BACKEND, keras  # noqa: F401  (skips this module off the JAX suite)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = """
import sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]),
                           initialization_timeout=60)
import distkeras, keras
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
try:
    distkeras.distribute(model)
except distkeras.errors.ClusterError as exc:
    print("ClusterError:", exc)
    sys.exit(3)
print("trained alone")
"""


def test_jax_distributed_started_elsewhere_is_a_cluster_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTKERAS_", "JAX_")) and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), KERAS_BACKEND="jax",
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, "127.0.0.1:{}".format(port), str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, output in zip(procs, outputs):
        assert p.returncode == 3, output[-3000:]
        assert "jax.distributed already joined to 2 processes" in output, output[-3000:]
        assert "prepare_jax()" in output
