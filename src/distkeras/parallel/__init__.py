"""The plans of model parallelism, written once for every backend and framework-free: what each backend's
tensor and pipeline parallelism follows.

- :mod:`~distkeras.parallel.layouts`: tensor parallelism's layout API: the device mesh (``model_shards=``), the
  rules from variable paths to the axes they are split on (``layout=``, a dict or Keras' ``LayoutMap``), and the
  default rules.
- :mod:`~distkeras.parallel.pipeline`: pipeline parallelism: where a model is cut into stages, the micro-batches,
  the GPipe and 1F1B schedules, and how a loss adds up over micro-batches.

The mechanisms live in each backend's package (``backends/<name>/pipeline.py``, ``tensor.py``, ``shard.py``).
Data sharding, which users call in their own loops, is :mod:`distkeras.sharding`, at the top with the public API.
"""
