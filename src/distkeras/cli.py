"""The ``distkeras`` command: ``demo`` and ``info``."""

import argparse
import json
import sys

from .errors import DistKerasError


def _demo(args):
    from . import demo

    demo.run(devices=args.devices, epochs=args.epochs, per_device_batch=args.per_device_batch, out_dir=args.out)
    return 0


def _info(args):
    import distkeras
    from . import backends

    name = backends.active_name()
    adapter = backends.get(name)
    print(json.dumps({
        "distkeras": distkeras.__version__,
        "backend": name,
        "devices": [str(d) for d in adapter.list_devices()],
        "cluster": distkeras.cluster.describe(distkeras.cluster.from_env()),
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
