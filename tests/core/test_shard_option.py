"""The ``shard`` option's values and the error of the backends that can't shard, without importing a framework."""

import pytest

from distkeras import OptionError, backends
from distkeras.backends.base import SHARD_MODES, SHARDING_BACKENDS, check_shard


@pytest.mark.parametrize("mode", [None, "optimizer", "gradients", "all"])
def test_valid_modes(mode):
    assert check_shard(mode) == mode


@pytest.mark.parametrize("bad", ["Optimizer", "zero3", 3, True, "", ["all"]])
def test_a_bad_value_lists_the_valid_ones(bad):
    with pytest.raises(OptionError, match=r"Expected shard to be one of None, 'optimizer', 'gradients', 'all'. "
                                          r"Received: shard="):
        check_shard(bad)


def test_the_modes_are_zeros_stages():
    assert SHARD_MODES == ("optimizer", "gradients", "all")


@pytest.mark.parametrize("name", sorted(set(backends.REGISTRY) - set(SHARDING_BACKENDS)))
def test_backends_that_cant_shard_say_why_and_which_can(name):
    adapter = backends.adapter_class(name)()
    assert "shard" not in adapter.options and adapter.shard_unsupported
    adapter.check_options({"shard": None})  # the default is fine everywhere
    for mode in SHARD_MODES:
        with pytest.raises(OptionError) as info:
            adapter.check_options({"shard": mode})
        message = str(info.value)
        assert "shard={!r}".format(mode) in message and adapter.shard_unsupported in message
        assert "PyTorch and JAX" in message and "shard=None" in message
    with pytest.raises(OptionError, match="Expected shard to be one of"):
        adapter.check_options({"shard": "zero2"})


@pytest.mark.parametrize("name", SHARDING_BACKENDS)
def test_sharding_backends_take_the_option(name):
    adapter = backends.adapter_class(name)()
    assert "shard" in adapter.options and adapter.shard_unsupported is None



@pytest.mark.parametrize("name", sorted(set(backends.REGISTRY) - {"torch", "jax"}))
def test_backends_that_cant_split_a_model_say_why_and_which_can(name):
    """strategy='model' on TensorFlow, MXNet or CNTK: an OptionError with the backend's reason, not a list of
    unknown options; strategy='data' (the meaning of every backend) is accepted."""
    adapter = backends.adapter_class(name)()
    assert "strategy" not in adapter.options and adapter.model_parallel_unsupported
    adapter.check_options({"strategy": "data"})
    for options in ({"strategy": "model"}, {"layout_map": {"d/kernel": (None, "model")}}, {"model_shards": 2}):
        with pytest.raises(OptionError) as info:
            adapter.check_options(options)
        message = str(info.value)
        assert "the {} backend can't: {}".format(name, adapter.model_parallel_unsupported) in message, message
        assert "Model parallelism runs on the PyTorch and JAX backends" in message and "Unknown" not in message
    if name == "tensorflow":
        assert "places only the forward pass" in adapter.model_parallel_unsupported
