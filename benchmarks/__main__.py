"""``python -m benchmarks``: measure distkeras against plain Keras, native code and make_parallel.

    python -m benchmarks run [options]          measure; write results.json, results.md, throughput.png
    python -m benchmarks report results.json    write the table and plot again from a results file

See benchmarks/README.md.
"""

import argparse
import json
import os
import shlex
import sys

from . import report, run


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0][len("``python -m benchmarks``: "):])
    commands = parser.add_subparsers(dest="command", required=True)
    measure = commands.add_parser("run", help="measure, with one worker process per backend and device count")
    run.add_arguments(measure)
    again = commands.add_parser("report", help="write results.md and throughput.png again from a results.json")
    again.add_argument("results", help="a results.json written by `run`")
    again.add_argument("--out", default=None, help="folder for the files (default: the results file's folder)")
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "run":
        args.command_line = "python -m benchmarks " + " ".join(shlex.quote(a) for a in argv)
        return run.main(args)
    with open(args.results) as handle:
        results = report.add_scaling_against_one_device(json.load(handle))
    for path in report.write(results, args.out or os.path.dirname(os.path.abspath(args.results))):
        print("wrote " + path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
