"""``python -m benchmarks``: measure distkeras against plain Keras, native code and make_parallel.

    python -m benchmarks run [options]          measure; write results.json, results.md, throughput.png
    python -m benchmarks report results.json    write the table and plot again from a results file
    python -m benchmarks report a.json b.json --out DIR    one table and plot from several results files
    python -m benchmarks hosts measure [options]   across network-namespace hosts over shaped links
    python -m benchmarks hosts summary a.json b.json --out DIR   their table and plot (benchmarks/hosts.py)
    python -m benchmarks memory [options]       per-rank bytes of sharded training state (benchmarks/memory.py)
    python -m benchmarks shard-cost [options]   step time of each shard mode against unsharded (benchmarks/shard_cost.py)

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
    again = commands.add_parser("report", help="write results.md and throughput.png again from a results.json, "
                                               "or from several merged into one")
    again.add_argument("results", nargs="+", help="results.json files written by `run` (several: merged, e.g. a "
                                                  "Keras 3 run and a keras-mxnet run)")
    again.add_argument("--out", default=None, help="folder for the files (default, for one results file: its folder)")
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["hosts"]:  # its own options: benchmarks/hosts.py
        from . import hosts

        return hosts.main(argv[1:])
    if argv[:1] == ["memory"]:  # its own options: benchmarks/memory.py
        from . import memory

        return memory.main(argv[1:])
    if argv[:1] == ["collectives"]:  # its own options: benchmarks/collectives.py
        from . import collectives

        return collectives.main(argv[1:])
    if argv[:1] == ["shard-cost"]:  # its own options: benchmarks/shard_cost.py
        from . import shard_cost

        return shard_cost.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "run":
        args.command_line = "python -m benchmarks " + " ".join(shlex.quote(a) for a in argv)
        return run.main(args)
    folders = {os.path.dirname(os.path.abspath(path)) for path in args.results}
    if len(args.results) > 1 and (args.out is None or os.path.abspath(args.out) in folders):
        print("benchmarks: error: merging {} results files needs --out, a folder other than theirs".format(
            len(args.results)), file=sys.stderr)
        return 2
    sources = []
    for path in args.results:
        with open(path) as handle:
            sources.append(json.load(handle))
    results = report.add_scaling_against_one_device(sources[0] if len(sources) == 1 else report.merge(sources))
    for path in report.write(results, args.out or folders.pop()):
        print("wrote " + path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
