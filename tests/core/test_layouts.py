"""The layout API written once (distkeras.parallel.layouts): options read and checked, axes matched as Keras' LayoutMap
matches them, the default layout; no framework."""

import pytest

from distkeras.parallel import layouts
from distkeras.errors import OptionError

VARIABLES = [("dense/kernel", (8, 16)), ("dense/bias", (16,)), ("dense_1/kernel", (16, 8)), ("norm/gamma", (8,))]


class Layout(object):  # what Keras' TensorLayout offers: axes
    def __init__(self, axes):
        self.axes = axes


def test_the_mesh_splits_devices_into_replicas_and_model_shards():
    assert layouts.mesh(4, 2) == layouts.Mesh(2, 2) and layouts.mesh(4, None) == layouts.Mesh(1, 4)
    assert layouts.describe(layouts.mesh(4, 2)) == {"replicas": 2, "model_shards": 2}
    for bad in (3, 0, True, "2"):
        with pytest.raises(OptionError, match="model_shards to be a positive int that divides the 4 devices"):
            layouts.mesh(4, bad)


def test_rules_take_dicts_and_layout_objects_and_refuse_anything_else():
    table = layouts.rules({"dense/kernel": (None, "model"), "dense_1/.*": Layout(["model", None])})
    assert table == {"dense/kernel": (None, "model"), "dense_1/.*": ("model", None)}
    for bad, message in ((["x"], "to be a dict"), ({"(": (None,)}, "is not a regex"),
                         ({"x": ("model", "model")}, "names a mesh axis twice"), ({"x": ("rows",)}, "to be axes")):
        with pytest.raises(OptionError, match=message):
            layouts.rules(bad)


def test_axes_match_as_keras_layout_map_does():
    table = {"dense/kernel": (None, "model"), "dense.*": ("model",), ".*kernel": ("model", None)}
    assert layouts.axes_of("dense/kernel", table) == (None, "model")  # the exact key wins
    assert layouts.axes_of("dense/bias", table) == ("model",)
    assert layouts.axes_of("norm/gamma", table) is None
    with pytest.raises(OptionError, match="dense_1/kernel matches more than one layout_map key"):
        layouts.axes_of("dense_1/kernel", table)


def test_assign_checks_rank_divisibility_and_unused_keys():
    grid = layouts.mesh(2, 2)
    assert layouts.assign(VARIABLES, {"dense/kernel": (None, "model"), "dense_1/kernel": ("model", None)}, grid) == {
        "dense/kernel": (None, "model"), "dense_1/kernel": ("model", None)}
    with pytest.raises(OptionError, match=r"Expected 1 axes for dense/bias of shape \(16,\)"):
        layouts.assign(VARIABLES, {"dense/bias": (None, "model")}, grid)
    with pytest.raises(OptionError, match="Expected the 'model' axis \\(3 devices\\) to divide dense/kernel"):
        layouts.assign(VARIABLES, {"dense/kernel": ("model", None)}, layouts.mesh(3, 3))
    with pytest.raises(OptionError, match="'nothing/.*' match no variable. The model's variables: dense/kernel"):
        layouts.assign(VARIABLES, {"nothing/.*": (None,)}, grid)


def test_the_default_splits_kernels_by_their_last_axis():
    assert layouts.default_rules(VARIABLES, 2) == {"dense/kernel": (None, "model"), "dense_1/kernel": (None, "model")}
    with pytest.raises(OptionError, match="found nothing to shard"):
        layouts.default_rules(VARIABLES, 5)
    assert layouts.model_axis((None, "model")) == 1 and layouts.model_axis(("batch", None)) is None
