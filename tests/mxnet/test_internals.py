"""The keras-mxnet 2.2.4.3 and MXNet 1.9 internals the MXNet adapter relies on, one test each: that each
exists and behaves as the comments of src/distkeras/backends/mxnet/ (adapter.py, steps.py) say. A new keras-mxnet
or MXNet that changes one fails here, by name, before the training tests fail by a number.
"""

import mxnet as mx
import numpy as np
import pytest

from tests.mxnet.harness import keras  # noqa: F401 (skips without keras-mxnet)

from distkeras.backends.mxnet import steps

BATCH = 6


def _bound(kvstore="device", contexts=2):
    """A compiled Dense-BatchNorm-Dense model on ``contexts`` CPU contexts, its module bound by one step."""
    model = keras.models.Sequential([keras.layers.Dense(4, input_shape=(3,)), keras.layers.BatchNormalization(),
                                     keras.layers.Dense(2)])
    model._context = [mx.cpu(i) for i in range(contexts)]
    model._kvstore = kvstore
    model.compile(optimizer=keras.optimizers.SGD(lr=0.1), loss="mse")
    x, y = np.ones((BATCH, 3), "float32"), np.zeros((BATCH, 2), "float32")
    model.train_on_batch(x, y)
    return model, x, y


def _group(model):
    return model._module._curr_module._exec_group


def test_model_context_set_before_compile_is_what_the_module_binds():
    model, _, _ = _bound(contexts=2)
    assert [str(c) for c in model._module._curr_module._context] == ["cpu(0)", "cpu(1)"]
    assert len(_group(model).execs) == 2


def test_model_kvstore_none_binds_the_module_without_a_kvstore():
    model, _, _ = _bound(kvstore=None)
    module = model._module._curr_module
    assert module._kvstore is None and not module._update_on_kvstore


def test_exec_group_arrays_are_per_parameter_lists_of_per_context_arrays():
    model, _, _ = _bound()
    group = _group(model)
    assert len(group.param_arrays) == len(group.grad_arrays) == len(group.param_names) == 6  # 2 + 2 (BN) + 2
    assert len(group.aux_arrays) == len(group.aux_names) == 2  # BatchNormalization's moving mean and variance
    for arrays in group.param_arrays + group.grad_arrays + group.aux_arrays:
        assert len(arrays) == 2 and all(isinstance(a, mx.nd.NDArray) for a in arrays)
    assert [(s.start, s.stop) for s in group.slices] == [(0, 3), (3, 6)]


def test_grad_arrays_changed_in_place_are_what_update_applies():
    model, x, y = _bound(kvstore=None)
    module = model._module
    before = module.get_params()[0]
    data, label, _, data_shapes, label_shapes = model._adjust_module([x, y, np.ones(BATCH, "float32")], "train")
    module.forward_backward(mx.io.DataBatch(data=data, label=label, bucket_key="train", provide_data=data_shapes,
                                            provide_label=label_shapes))
    for per_context in _group(model).grad_arrays:
        for grad in per_context:
            grad[:] = 0
    module.update()
    after = module.get_params()[0]
    for name in before:  # SGD without momentum or decay: a zero gradient moves nothing
        np.testing.assert_array_equal(after[name].asnumpy(), before[name].asnumpy(), err_msg=name)


def test_params_dirty_makes_get_params_read_the_contexts_again():
    model, _, _ = _bound()
    module, group = model._module, _group(model)
    name = group.param_names[0]
    module.get_params()  # reads the contexts after the step's update, and clears the flags
    for array in group.param_arrays[0]:
        array[:] = 7.0
    assert not (module.get_params()[0][name].asnumpy() == 7.0).all()  # the module's cached copy
    # The BucketingModule hands its own flag to its current module in get_params(): both are set.
    module._params_dirty = module._curr_module._params_dirty = True
    assert (module.get_params()[0][name].asnumpy() == 7.0).all()


def test_weights_dirty_makes_keras_read_the_weights_back_from_the_module():
    model, _, _ = _bound()
    module, group = model._module, _group(model)
    for array in group.param_arrays[0]:
        array[:] = 7.0
    module._params_dirty = module._curr_module._params_dirty = True
    model._weights_dirty = False
    assert not (model.get_weights()[0] == 7.0).all()  # keras-mxnet's own copy
    model._weights_dirty = True
    assert (model.get_weights()[0] == 7.0).all()


def test_split_input_slice_splits_as_the_executor_group_and_refuses_empty_contexts():
    from mxnet.executor_manager import _split_input_slice

    assert _split_input_slice(5, [1, 1]) == [slice(0, 2), slice(2, 5)]
    for rows, contexts in ((1, 2), (6, 4)):
        with pytest.raises(ValueError, match="Too many slices"):
            _split_input_slice(rows, [1] * contexts)


def test_module_takes_compression_params_as_an_attribute_before_bind():
    module = mx.mod.Module(mx.sym.Variable("data"), label_names=None, compression_params={"type": "2bit"})
    assert module._compression_params == {"type": "2bit"}


def test_fit_calls_make_train_function_and_feeds_x_y_then_sample_weights():
    inputs = keras.layers.Input((3,))
    model = keras.models.Model(inputs, [keras.layers.Dense(2, name="a")(inputs), keras.layers.Dense(1, name="b")(inputs)])
    model.compile(optimizer="sgd", loss="mse")
    fed = []

    def make_train_function():  # an instance attribute, as distribute() sets it: fit() calls it
        model.train_function = lambda ins: fed.append(ins) or [0.0] * len(model.metrics_names)

    model._make_train_function = make_train_function
    x, weights = np.ones((4, 3), "float32"), np.arange(1, 5, dtype="float32")
    model.fit(x, [np.zeros((4, 2)), np.zeros((4, 1))], sample_weight=[weights, 2 * weights], batch_size=4,
              shuffle=False, verbose=0)
    assert (len(model._feed_inputs), len(model._feed_targets), len(model._feed_sample_weights)) == (1, 2, 2)
    assert list(steps._sample_weight_positions(model)) == [3, 4]
    np.testing.assert_array_equal(fed[0][3], weights)
    np.testing.assert_array_equal(fed[0][4], 2 * weights)


def test_metrics_names_follow_compiles_order_of_losses_metrics_and_weighted_metrics():
    inputs = keras.layers.Input((3,))
    model = keras.models.Model(inputs, [keras.layers.Dense(2, name="a")(inputs), keras.layers.Dense(1, name="b")(inputs)])
    model.compile(optimizer="sgd", loss="mse", metrics={"a": ["mae"], "b": ["mae", "mse"]}, weighted_metrics=["mae"])
    names = model.metrics_names
    # Weighed by samples: the loss, the outputs' losses and the weighted metrics; by rows: the metrics.
    expected = [name == "loss" or name.endswith("_loss") or "_weighted_" in name for name in names]
    assert steps._counted_by_samples(model, len(names)) == expected
    assert expected.count(False) == 3 and expected.count(True) == 5, names


def test_embedding_gradients_are_dense_arrays_per_context():
    # keras-mxnet's Embedding looks rows up with a gather whose gradient MXNet writes as a dense array (storage
    # type 'default') per context: the weighing and the sums (KVStore, or in place) are dense, so Adam sees the
    # global gradient (tests/mxnet/test_compat.py::embedding_adam trains it against one context).
    model = keras.models.Sequential([keras.layers.Embedding(10, 4, input_length=3), keras.layers.Flatten(),
                                     keras.layers.Dense(2)])
    model._context = [mx.cpu(0), mx.cpu(1)]
    model._kvstore = "device"
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    model.train_on_batch(np.array([[1, 2, 1]] * 4, "float32"), np.zeros((4, 2), "float32"))
    group = _group(model)
    grads = dict(zip(group.param_names, group.grad_arrays))
    embedding = [name for name in grads if "embedding" in name]
    assert embedding, sorted(grads)
    for per_context in grads[embedding[0]]:
        assert per_context.stype == "default" and per_context.shape == (10, 4)
