"""Cluster environments, one module per scheduler or launcher, and the order that decides between them.

Filled in by the environments work of issue 22; :func:`distkeras.cluster.from_env` delegates here.
Part of the Python 3.6-compatible core.
"""
