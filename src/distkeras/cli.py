"""The ``distkeras`` command: ``demo``, ``launch`` and ``info``."""

import argparse
import difflib
import json
import os
import re
import sys
import textwrap
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from . import __version__
from .errors import DistKerasError

LAUNCH_EXAMPLES = """\
examples:
  # 2 processes on this host (one per device)
  distkeras launch --nproc-per-node 2 train.py --epochs 10
  # a module, as python -m runs it: the arguments after it are the module's
  distkeras launch --nproc-per-node 2 -m mypackage.train --epochs 10
  # two hosts, 4 processes each: run one line on each host; node rank 0 (10.0.0.1) coordinates
  distkeras launch --nproc-per-node 4 --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:29500 train.py
  distkeras launch --nproc-per-node 4 --nnodes 2 --node-rank 1 --coordinator 10.0.0.1:29500 train.py
  # under Slurm: one launcher a node; the nodes, node rank and coordinator come from the job step
  srun -N2 --ntasks-per-node=1 distkeras launch --nproc-per-node 4 train.py
  # with the job's secret in a token file, the same on every host (made once, copied to each host)
  python -c "import secrets; print(secrets.token_hex(32))" > job.token
  distkeras launch --nproc-per-node 4 --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:29500 --token-file job.token train.py
"""


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """``"did you mean 'x'?"`` (or ``'x' or 'y'``) for the ``candidates`` close to a misspelt ``word`` (difflib's
    ratio >= 0.6, closest first); empty when none is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.6)
    return "did you mean {}?".format(" or ".join(repr(m) for m in matches)) if matches else ""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors suggest the closest command (``distkeras lauch``: did you mean 'launch'?) and
    the closest option to a misspelt one (``--nprocs-per-node``: did you mean '--nproc-per-node'?), also where
    argparse stops first at the option the misspelling left missing."""

    #: The arguments being parsed, for :meth:`error`.
    words = ()  # type: Sequence[str]

    def parse_known_args(self, args=None, namespace=None):
        self.words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def add_subparsers(self, **kwargs):
        self.commands = super().add_subparsers(**kwargs)
        return self.commands

    def error(self, message):
        if "did you mean" not in message and "maybe you meant" not in message:  # Python 3.14 may suggest itself
            choice = re.search(r"invalid choice: '([^']*)' \(choose from ([^)]*)\)", message)
            if choice:
                suggestion = did_you_mean(choice.group(1), [c.strip(" '\"") for c in choice.group(2).split(",")])
                message += "; " + suggestion if suggestion else ""
            else:
                message += "".join("; {}: {}".format(flag, suggestion) for flag, suggestion in self.misspelt())
        super().error(message)

    def misspelt(self) -> List[Tuple[str, str]]:
        """``(flag, "did you mean '--x'?")`` for each word parsed that looks like an option this parser doesn't take
        (not even abbreviated) and is close to one it does; up to a ``--``, after which the words are the script's."""
        options = [o for action in self._actions for o in action.option_strings]
        found = []  # type: List[Tuple[str, str]]
        for word in self.words:
            if word == "--":
                break
            flag = word.partition("=")[0]
            if not flag.startswith("-") or flag[1:2].isdigit() or any(o.startswith(flag) for o in options):
                continue
            suggestion = did_you_mean(flag, options)
            if suggestion and (flag, suggestion) not in found:
                found.append((flag, suggestion))
        return found


def _demo(args):
    from . import demo

    demo.run(devices=args.devices, epochs=args.epochs, per_device_batch=args.per_device_batch, out_dir=args.out)
    return 0


def _launch(args):
    from . import backends
    from .launch import command as launch

    backend = args.backend or backends.active_name()
    args.nnodes, args.node_rank, args.coordinator = launch.from_scheduler(args.nnodes, args.node_rank, args.coordinator)
    script = list(args.script)
    if script and script[0] == "--":
        script = script[1:]
    if args.module:
        if not script:
            raise launch.LaunchError("-m needs a module to run: distkeras launch --nproc-per-node N -m pkg.module [args]")
        script = ["-m"] + script
    launch.check_script(script)
    own = backends.adapter_class(backend).launch_command(script, args.nproc_per_node, args.nnodes, dict(os.environ))
    if own is not None:  # the backend's engine starts its workers itself (CNTK: mpiexec)
        commands, envs, ranks = own
        return launch.Launcher(commands, envs, ranks,
                               stop_timeout=args.stop_timeout or launch.DEFAULT_STOP_TIMEOUT, log_dir=args.log_dir,
                               show=launch.parse_ranks(args.ranks, args.nnodes * args.nproc_per_node)).run()
    return launch.run_job(
        script, args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank, coordinator=args.coordinator,
        backend=backend, hosts=[h.strip() for h in args.hosts.split(",")] if args.hosts else None,
        interface=args.interface, stop_timeout=args.stop_timeout, join_timeout=args.join_timeout,
        peer_timeout=args.peer_timeout, token_file=args.token_file, log_dir=args.log_dir, ranks=args.ranks)


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


def report(environ: Optional[Mapping[str, str]] = None) -> Dict[str, object]:
    """What ``distkeras info`` prints: the distkeras and Python versions, the active backend (and where it was
    chosen), its devices, the versions of Keras and each framework, CUDA/NCCL/MPI, and the cluster environment.
    Only the active backend's framework is imported (for its devices); the others' versions come from metadata.
    The cluster environment is read from ``environ`` (default: ``os.environ``)."""
    from . import backends, info

    found = {"distkeras": __version__, "python": "{}.{}.{}".format(*sys.version_info[:3])}
    try:
        found["backend"] = backends.active_name()
    except DistKerasError as exc:
        found["backend"], found["backend_error"] = None, "{}: {}".format(type(exc).__name__, exc)
    found["backend_from"] = backends.active_source()
    found["devices"] = []
    if found["backend"]:
        try:
            found["devices"] = [str(d) for d in backends.get(found["backend"]).list_devices()]
        except DistKerasError as exc:
            found["devices_error"] = "{}: {}".format(type(exc).__name__, exc)
    found["versions"] = info.versions()
    found["native"] = info.native(torch_version=found["versions"]["torch"])
    found["cluster"] = environment_report(environ)
    return found


def _info(args):
    from . import info

    found = report()
    print(json.dumps(found, indent=2) if args.json else info.format_report(found))
    return 0


#: torchrun's names for options of `distkeras launch` that it spells otherwise.
TORCHRUN_NAMES = {"--rdzv-endpoint": "--coordinator"}


def torchrun_spellings(parser, words):
    """``words`` (a command's arguments) with torchrun's spellings of its options in this parser's: ``--two_words``
    for ``--two-words`` (``--nproc_per_node``), ``--rdzv_endpoint`` for ``--coordinator``. Only the launcher's own
    options, before the script: the script's own arguments are never touched."""
    takes_value = {o: a.nargs is None and a.const is None for a in parser._actions for o in a.option_strings}
    words, out, i = list(words), [], 0
    while i < len(words):
        word = words[i]
        if word == "--" or not word.startswith("-"):
            return out + words[i:]
        flag, equals, value = word.partition("=")
        dashed = flag[:2] + flag[2:].replace("_", "-") if flag.startswith("--") else flag
        dashed = TORCHRUN_NAMES.get(dashed, dashed)
        if dashed in takes_value:
            flag = dashed
        out.append(flag + equals + value)
        if takes_value.get(flag) and not equals and i + 1 < len(words):
            out.append(words[i + 1])
            i += 1
        i += 1
    return out


def build_parser():
    parser = Parser(prog="distkeras", description="Data-parallel Keras on any backend.",
                    epilog="`distkeras COMMAND --help` shows a command's options.")
    parser.add_argument("--version", action="version", version="distkeras " + __version__)
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    demo = commands.add_parser("demo", help="train an MLP on scikit-learn's digits, data-parallel, save and reload it")
    demo.add_argument("--devices", type=int, default=2, help="number of devices (virtual CPU devices without GPUs)")
    demo.add_argument("--epochs", type=int, default=30)
    demo.add_argument("--per-device-batch", type=int, default=32)
    demo.add_argument("--out", default=None, help="folder for the saved model (default: a temporary folder)")
    demo.set_defaults(func=_demo)

    launch = commands.add_parser(
        "launch", help="start this host's workers for a multi-process job",
        description=textwrap.fill(
            "Start N workers of SCRIPT on this host with the variables the backend's own distributed engine "
            "reads; prefix their output with the rank; stop them all when one fails.", 100),
        epilog=LAUNCH_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    launch.add_argument("--log-dir", default=None, metavar="DIR",
                        help="also write each rank's whole output to DIR/rank<N>.log (progress bars collapsed to their "
                             "final state, no colour codes; DIR made if missing)")
    launch.add_argument("--ranks", default=None, metavar="LIST",
                        help="show only these ranks' output, comma-separated (e.g. 0 or 0,2; default: every rank); the "
                             "others still go to --log-dir, and a failing one's last lines are shown")
    launch.add_argument("--token-file", default=None,
                        help="several hosts: a file holding the job's secret, the same on every host; the launchers "
                             "prove to each other that they know it and refuse anyone who doesn't (also "
                             "DISTKERAS_TOKEN_FILE, or the secret itself in DISTKERAS_TOKEN). Make one with: python -c "
                             "\"import secrets; print(secrets.token_hex(32))\" > job.token")
    # A flag, with the module as SCRIPT: `-m pkg.mod --flag` then hands --flag to the module, as python -m does.
    launch.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module, run as python -m SCRIPT")
    launch.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args...], or with -m: module [args...]")
    launch.set_defaults(func=_launch)

    info = commands.add_parser(
        "info", help="print the active backend, its devices, the framework, CUDA, NCCL and MPI versions, and the "
                     "cluster environment",
        description="Print the distkeras and Python versions, the active Keras backend and its devices, the versions "
                    "of Keras and of each framework (read from package metadata, importing none), CUDA, NCCL and MPI "
                    "where found, and the cluster environment: the one found, the variables it read, rank, workers, "
                    "coordinator, and the environments present but ignored (with why).")
    info.add_argument("--json", action="store_true", help="print it as JSON (for scripts and bug reports)")
    info.set_defaults(func=_info)
    return parser


def main(argv=None):
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        argv = ["launch"] + torchrun_spellings(parser.commands.choices["launch"], argv[1:])
    args, extras = parser.parse_known_args(argv)
    if extras:
        (parser.commands.choices.get(args.command) or parser).error("unrecognized arguments: " + " ".join(extras))
    if args.command is None:  # bare `distkeras`: what it can do
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except DistKerasError as exc:
        # The command's usage line first, as argparse's own errors have it.
        command = parser.commands.choices.get(args.command) if getattr(parser, "commands", None) else None
        print("{}distkeras: error: {}".format((command or parser).format_usage(), exc), file=sys.stderr, end="\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
