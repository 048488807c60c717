"""The ``distkeras`` command: ``demo``, ``launch`` and ``info``."""

import argparse
import json
import os
import sys
from typing import Dict, Mapping, Optional

from .errors import DistKerasError


def _demo(args):
    from . import demo

    demo.run(devices=args.devices, epochs=args.epochs, per_device_batch=args.per_device_batch, out_dir=args.out)
    return 0


def _launch(args):
    from . import backends, launch

    backend = args.backend or backends.active_name()
    args.nnodes, args.node_rank, args.coordinator = launch.from_scheduler(args.nnodes, args.node_rank, args.coordinator)
    script = list(args.script)
    if script and script[0] == "--":
        script = script[1:]
    if args.module:
        if not script:
            raise launch.LaunchError("-m needs a module to run: distkeras launch --nproc-per-node N -m pkg.module [args]")
        script = ["-m"] + script
    own = backends.adapter_class(backend).launch_command(script, args.nproc_per_node, args.nnodes, dict(os.environ))
    if own is not None:  # the backend's engine starts its workers itself (CNTK: mpiexec)
        commands, envs, ranks = own
        return launch.Launcher(commands, envs, ranks,
                               stop_timeout=args.stop_timeout or launch.DEFAULT_STOP_TIMEOUT).run()
    return launch.run_job(
        script, args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank, coordinator=args.coordinator,
        backend=backend, hosts=[h.strip() for h in args.hosts.split(",")] if args.hosts else None,
        interface=args.interface, stop_timeout=args.stop_timeout, join_timeout=args.join_timeout,
        peer_timeout=args.peer_timeout, token_file=args.token_file)


def environment_report(environ: Optional[Mapping[str, str]] = None) -> Dict[str, object]:
    """The cluster environment as ``distkeras info`` shows it: the one found, the variables it read, the other
    environments that agreed, and those present but ignored as scheduler context (with why); or the error."""
    from . import cluster, environments

    try:
        found = environments.find(environ)
    except DistKerasError as exc:
        return {"error": "{}: {}".format(type(exc).__name__, exc)}
    report = {
        "environment": found.cluster.source,
        "variables": found.cluster.variables or {},
        "coordinator": found.cluster.coordinator,
    }
    report.update(cluster.describe(found.cluster))  # rank, workers (the count), local_rank, source
    report["worker_addresses"] = list(found.cluster.workers) if found.cluster.workers is not None else None
    if found.agreeing[1:]:
        report["also_read"] = {c.source: c.variables or {} for c in found.agreeing[1:]}
    if found.context:
        report["ignored"] = [{"environment": name, "variables": variables, "why": why}
                             for name, variables, why in found.context]
    if environments.missing():
        report["not_installed"] = environments.missing()
    return report


def _info(args):
    import distkeras

    from . import backends

    name = backends.active_name()
    adapter = backends.get(name)
    print(json.dumps({
        "distkeras": distkeras.__version__,
        "backend": name,
        "devices": [str(d) for d in adapter.list_devices()],
        "cluster": environment_report(),
    }, indent=2))
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="distkeras", description="Data-parallel Keras on any backend.")
    commands = parser.add_subparsers(dest="command")
    commands.required = True

    demo = commands.add_parser("demo", help="train an MLP on scikit-learn's digits, data-parallel, save and reload it")
    demo.add_argument("--devices", type=int, default=2, help="number of devices (virtual CPU devices without GPUs)")
    demo.add_argument("--epochs", type=int, default=30)
    demo.add_argument("--per-device-batch", type=int, default=32)
    demo.add_argument("--out", default=None, help="folder for the saved model (default: a temporary folder)")
    demo.set_defaults(func=_demo)

    launch = commands.add_parser(
        "launch", help="start this host's workers for a multi-process job",
        description="Start N workers of SCRIPT on this host with the variables the backend's own distributed engine "
                    "reads; prefix their output with the rank; stop them all when one fails.")
    launch.add_argument("--nproc-per-node", type=int, required=True, help="workers on this host (one per device)")
    launch.add_argument("--nnodes", type=int, default=None,
                        help="hosts in the job (default 1; inside `srun --ntasks-per-node=1`: the step's nodes)")
    launch.add_argument("--node-rank", type=int, default=None,
                        help="this host's index, 0..nnodes-1 (default 0; inside srun: SLURM_PROCID)")
    launch.add_argument("--coordinator", default=None,
                        help="HOST:PORT of node rank 0, the same on every host (inside srun: the step's first node "
                             "and a port derived from the job, or DISTKERAS_COORDINATOR_PORT). One host: the engine's rendezvous "
                             "(default 127.0.0.1 and a free port). Several hosts: the launchers meet at PORT and the "
                             "engines use PORT+1 (TensorFlow's workers PORT+1..PORT+nproc-per-node on every host)")
    launch.add_argument("--hosts", default=None,
                        help="several hosts: every host's address in node-rank order, comma-separated (default: each "
                             "host's address on the interface that reaches the coordinator)")
    launch.add_argument("--interface", default=None,
                        help="the network interface (or one of its addresses) the engines use; default: the one "
                             "that reaches the coordinator. Also DISTKERAS_INTERFACE")
    launch.add_argument("--backend", default=None, help="Keras backend (default: KERAS_BACKEND, keras.json, tensorflow)")
    launch.add_argument("--stop-timeout", type=float, default=None,
                        help="seconds between SIGTERM and SIGKILL when stopping workers after a failure (default 20; "
                             "also DISTKERAS_STOP_TIMEOUT)")
    launch.add_argument("--join-timeout", type=float, default=None,
                        help="several hosts: seconds the launchers wait for each other at the start (default 120; also "
                             "DISTKERAS_JOIN_TIMEOUT)")
    launch.add_argument("--peer-timeout", type=float, default=None,
                        help="several hosts: seconds of silence after which a host counts as lost and the job ends "
                             "(default 15; also DISTKERAS_PEER_TIMEOUT)")
    launch.add_argument("--token-file", default=None,
                        help="several hosts: a file holding the job's secret, the same on every host; the launchers "
                             "prove to each other that they know it and refuse anyone who doesn't (also "
                             "DISTKERAS_TOKEN_FILE, or the secret itself in DISTKERAS_TOKEN). Make one with: python -c "
                             "\"import secrets; print(secrets.token_hex(32))\" > job.token")
    # A flag, with the module as SCRIPT: `-m pkg.mod --flag` then hands --flag to the module, as python -m does.
    launch.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module, run as python -m SCRIPT")
    launch.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args...], or with -m: module [args...]")
    launch.set_defaults(func=_launch)

    info = commands.add_parser("info", help="print the active backend, its devices and the cluster environment")
    info.set_defaults(func=_info)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DistKerasError as exc:
        print("distkeras: error: {}".format(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
