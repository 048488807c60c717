"""The distkeras benchmark harness: throughput, start-up, memory and communication of distkeras against
plain Keras on one device, hand-written native data parallelism, and the old make_parallel recipe.

Run it with ``python -m benchmarks run`` (see benchmarks/README.md). Importing this package imports
no framework; each backend is measured in worker processes of its own (:mod:`benchmarks.worker`).
"""
