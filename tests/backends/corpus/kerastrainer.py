"""Keras' own trainer tests (github.com/keras-team/keras, ``keras/src/trainers/trainer_test.py``): each test's
model, ``compile()`` and fit/evaluate/predict (or ``*_on_batch``) calls, written with the public API where the
test mixes a layer with the backend's private Trainer (its ``ExampleModel``: a bias-free ``Dense`` of ones), on
generated data at a global batch of 12 (the tests' batches of 1, 2 or 16 do not split over replicas)."""

import types

import numpy as np

from tests.backends.corpus.common import ALL, BATCH, backend, distribute, evaluate, fit, keras, merged, predict, \
    result, rng

#: Keras' own trainer tests.
TR = "keras:keras/src/trainers/trainer_test.py"
SUM = ("not-one-device: add_loss(ops.sum(x)) sums each replica's own rows, so the loss and its gradient are half "
       "one device's (TensorFlow: loss -5.74 against -11.48, Adam momentum 0.6 against 1.2): a sum written by hand, "
       "which the one-device check catches at the first step")


def _xy(seed, n, features, out):
    r = rng(seed)
    return r.random((n, features)).astype("float32"), r.random((n, out)).astype("float32")


def trainer_internal_only_loss(devices):
    """keras/src/trainers/trainer_test.py, test_internal_only_loss: a layer's ``add_loss(ops.sum(x))`` is the
    only loss (compile without one)."""
    k = keras()
    ops, layers = k.ops, k.layers
    k.utils.set_random_seed(85)

    class LossLayer(layers.Layer):
        def call(self, x):
            self.add_loss(ops.sum(x))
            return x

    model = k.Sequential([k.Input((2,)), layers.Dense(2), LossLayer(), layers.Dense(1)])
    model.compile(optimizer="adam")
    x, y = _xy(86, 24, 2, 1)
    model = distribute(model, devices)
    history = fit(model, x, y)
    return result(model, history)


def trainer_constraints_are_applied(devices):
    """test_constraints_are_applied: a ``non_neg`` kernel constraint, RMSprop."""
    k = keras()
    k.utils.set_random_seed(87)
    model = k.Sequential([k.Input((3,)), k.layers.Dense(2, kernel_constraint="non_neg")])
    model.compile(optimizer="rmsprop", loss="mse")
    x, y = _xy(88, 24, 3, 2)
    model = distribute(model, devices)
    history = fit(model, x, y)
    assert np.min(np.asarray(model.layers[0].kernel)) >= 0.0
    return result(model, history)


def _compute_loss_model(metric_of, regularized):
    k = keras()

    class MyModel(k.Model):
        def __init__(self):
            super().__init__()
            self.custom_metric = k.metrics.Mean(name="custom")
            self.dense = k.layers.Dense(2, activity_regularizer="l2" if regularized else None)

        def call(self, x):
            return self.dense(x)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training)
            self.custom_metric.update_state(metric_of(self, loss))
            return loss

    return MyModel()


def trainer_metric_update_in_compute_loss(devices):
    """test_metric_update_in_compute_loss: a ``compute_loss`` override updates a Mean of ``loss * 4``."""
    k = keras()
    k.utils.set_random_seed(89)
    model = _compute_loss_model(lambda model, loss: loss * 4, False)
    model.compile(optimizer="sgd", loss="mse")
    x, y = _xy(90, 24, 4, 2)
    model = distribute(model, devices)
    history = fit(model, x, y * 2)
    np.testing.assert_allclose(history.history["custom"][0], history.history["loss"][0] * 4, rtol=1e-5)
    return result(model, history, evaluated=evaluate(model, x, y * 2))


def trainer_fwd_pass_loss_presence_in_compute_loss(devices):
    """test_fwd_pass_loss_presence_in_compute_loss: an ``activity_regularizer``'s loss read in ``compute_loss``
    (``sum(self.losses)``) into a custom Mean."""
    k = keras()
    k.utils.set_random_seed(91)
    model = _compute_loss_model(lambda model, loss: sum(model.losses), True)
    model.compile(optimizer="sgd", loss="mse")
    x, y = _xy(92, 24, 4, 2)
    model = distribute(model, devices)
    history = fit(model, x, y * 2)
    assert history.history["custom"][0] > 0.0
    return result(model, history)


def trainer_loss_weights(devices):
    """test_loss_weights' dict-output case, written with the public API: two inputs and outputs, an MSE each,
    ``loss_weights={"y_one": 0.1, "y_two": 0.2}``, per-output metrics, SGD."""
    k = keras()
    k.utils.set_random_seed(93)
    x_one, x_two = k.Input((4,), name="x_one"), k.Input((4,), name="x_two")
    y_one = k.layers.Dense(3, use_bias=False, name="y_one")(x_one)
    y_two = k.layers.Dense(3, use_bias=False, name="y_two")(x_two)
    model = k.Model({"x_one": x_one, "x_two": x_two}, {"y_one": y_one, "y_two": y_two})
    model.compile(optimizer=k.optimizers.SGD(),
                  loss={"y_one": k.losses.MeanSquaredError(), "y_two": k.losses.MeanSquaredError()},
                  metrics={"y_one": k.metrics.MeanSquaredError(), "y_two": k.metrics.MeanSquaredError()},
                  loss_weights={"y_one": 0.1, "y_two": 0.2})
    r = rng(94)
    x = {"x_one": r.random((24, 4)).astype("float32"), "x_two": r.random((24, 4)).astype("float32")}
    y = {"y_one": r.random((24, 3)).astype("float32"), "y_two": r.random((24, 3)).astype("float32")}
    model = distribute(model, devices)
    history = fit(model, x, y, epochs=3)
    return result(model, history, evaluated=evaluate(model, x, y))


def trainer_partial_loss_partial_label(devices):
    """test_partial_loss_partial_label: three outputs, a loss on the first only (``loss=["mse", None, None]``);
    fit as well as the test's evaluate."""
    k = keras()
    k.utils.set_random_seed(95)
    inputs = k.Input((2,))
    x = k.layers.Dense(3)(inputs)
    model = k.Model(inputs, [x, x, x])
    model.compile(optimizer="sgd", loss=["mse", None, None])
    data, labels_ = _xy(96, 24, 2, 3)
    model = distribute(model, devices)
    history = fit(model, data, labels_)
    return result(model, history, evaluated=evaluate(model, data, labels_))


def _example_model(units, base=None):
    """The tests' ``ExampleModel``: ``Dense(units, use_bias=False, kernel_initializer=Ones())`` that is a model."""
    k = keras()

    class ExampleModel(base or k.Model):
        def __init__(self, units):
            super().__init__()
            self.dense = k.layers.Dense(units, use_bias=False, kernel_initializer=k.initializers.Ones())

        def call(self, x):
            return self.dense(x)

    return ExampleModel(units)


def _custom_step_base():
    """``CustomTrainTestStepModel`` (``JaxCustomTrainTestStepModel`` on JAX): ``super()``'s steps, plus a constant
    ``my_custom_metric`` in their logs."""
    k = keras()
    if backend() == "jax":
        class CustomTrainTestStepModel(k.Model):
            def train_step(self, state, data):
                logs, state = super().train_step(state, data)
                logs["my_custom_metric"] = 10.0
                return logs, state

            def test_step(self, state, data):
                logs, state = super().test_step(state, data)
                logs["my_custom_metric"] = 5.0
                return logs, state
    else:
        class CustomTrainTestStepModel(k.Model):
            def train_step(self, data):
                logs = super().train_step(data)
                logs["my_custom_metric"] = 10.0
                return logs

            def test_step(self, data):
                logs = super().test_step(data)
                logs["my_custom_metric"] = 5.0
                return logs

    return CustomTrainTestStepModel


def trainer_custom_train_test_step(devices):
    """test_fit_with_custom_train_step and test_evaluate_with_custom_test_step: ``train_step``/``test_step``
    overrides that call ``super()`` and add a constant to the logs; SGD, MSE, an MSE metric."""
    k = keras()
    k.utils.set_random_seed(97)
    model = _example_model(3, _custom_step_base())
    model.compile(optimizer=k.optimizers.SGD(), loss=k.losses.MeanSquaredError(),
                  metrics=[k.metrics.MeanSquaredError()])
    x, y = _xy(98, 36, 4, 3)
    model = distribute(model, devices)
    history = fit(model, x, y, epochs=1)
    assert "loss" in history.history and "mean_squared_error" in history.history
    np.testing.assert_allclose(history.history["my_custom_metric"], 10.0)
    evaluated = evaluate(model, x, y)
    assert len(evaluated) == 3
    np.testing.assert_allclose(evaluated["my_custom_metric"], 5.0)
    return result(model, history, evaluated=evaluated)


def _on_batch_logs(logs, out, prefix):
    for key, value in (logs.items() if isinstance(logs, dict) else enumerate(logs)):
        out.setdefault("{}/{}".format(prefix, key), []).append(float(value))


def trainer_on_batch_methods(devices):
    """test_on_batch_methods: ``train_on_batch``/``test_on_batch`` (as a list and as a dict) and
    ``predict_on_batch``, then with sample weights, then with class weights; and a fit() epoch after, which the
    test has not, for the batch logs the corpus compares."""
    k = keras()
    k.utils.set_random_seed(99)
    model = _example_model(3)
    x = rng(100).random((BATCH, 4)).astype("float32")
    y = np.zeros((BATCH, 3), dtype="float32")
    sw = np.arange(BATCH).reshape((BATCH,)).astype("float32") / 6.0
    model.compile(optimizer=k.optimizers.SGD(), loss=k.losses.MeanSquaredError(),
                  metrics=[k.metrics.MeanSquaredError()])
    model = distribute(model, devices)
    logs = {}
    first = model.train_on_batch(x, y)
    assert isinstance(first, list) and len(first) == 2
    _on_batch_logs(first, logs, "train")
    _on_batch_logs(model.train_on_batch(x, y, return_dict=True), logs, "train")
    _on_batch_logs(model.test_on_batch(x, y), logs, "test")
    _on_batch_logs(model.test_on_batch(x, y, return_dict=True), logs, "test")
    logs["predict"] = [float(v) for v in np.asarray(model.predict_on_batch(x))[0]]
    _on_batch_logs(model.train_on_batch(x, y, sw), logs, "train_sw")
    _on_batch_logs(model.test_on_batch(x, y, sw), logs, "test_sw")
    _on_batch_logs(model.train_on_batch(x, y, class_weight={1: 0.3, 0: 0.2}), logs, "train_cw")
    history = fit(model, x, y, epochs=1)
    predicted = model.predict_on_batch(x)
    assert isinstance(predicted, np.ndarray)
    return result(model, merged(history, types.SimpleNamespace(history=logs)), predicted=predicted)


def trainer_nested_inputs(devices):
    """test_nested_inputs: ``ListInputModel``, a model called on a list of two inputs (``dense_1(x[0]) +
    dense_2(x[1])``); fit, train_on_batch, evaluate, test_on_batch, predict, predict_on_batch."""
    k = keras()
    k.utils.set_random_seed(102)

    class ListInputModel(k.Model):
        def __init__(self, units):
            super().__init__()
            self.dense_1 = k.layers.Dense(units, use_bias=False, kernel_initializer=k.initializers.Ones())
            self.dense_2 = k.layers.Dense(units, use_bias=False, kernel_initializer=k.initializers.Ones())

        def call(self, x):
            if not isinstance(x, (list, tuple)):
                raise ValueError("x must be a list or tuple")
            return self.dense_1(x[0]) + self.dense_2(x[1])

    model = ListInputModel(units=2)
    r = rng(103)
    x = [r.random((24, 2)).astype("float32"), r.random((24, 3)).astype("float32")]
    y = r.random((24, 2)).astype("float32")
    model.compile(optimizer="sgd", loss="mse", metrics=["mse"])
    model = distribute(model, devices)
    history = fit(model, x, y, epochs=1)
    logs = {}
    _on_batch_logs(model.train_on_batch([x[0][:BATCH], x[1][:BATCH]], y[:BATCH]), logs, "train")
    evaluated = evaluate(model, x, y)
    _on_batch_logs(model.test_on_batch([x[0][:BATCH], x[1][:BATCH]], y[:BATCH]), logs, "test")
    predicted = predict(model, x)
    assert predicted.shape == (24, 2)
    assert model.predict_on_batch([x[0][:BATCH], x[1][:BATCH]]).shape == (BATCH, 2)
    return result(model, merged(history, types.SimpleNamespace(history=logs)), evaluated=evaluated,
                  predicted=predicted)


def trainer_callbacks_update_state_at_batch_boundary(devices):
    """test_callbacks_can_update_state_at_batch_boundary: a callback ``assign_add``s the model's own counter
    weights at every train, test and predict batch's end; ``run_eagerly=True``, validation data."""
    k = keras()
    k.utils.set_random_seed(104)

    class CounterModel(k.Model):
        def __init__(self):
            super().__init__()
            self.train_counter = self.add_weight(shape=(), initializer="zeros")
            self.test_counter = self.add_weight(shape=(), initializer="zeros")
            self.predict_counter = self.add_weight(shape=(), initializer="zeros")
            self.dense = k.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    class CounterCallback(k.callbacks.Callback):
        def __init__(self):
            self.eager_call_counter_train = 0
            self.eager_call_counter_test = 0
            self.eager_call_counter_predict = 0

        def on_train_batch_end(self, *args, **kwargs):
            self.model.train_counter.assign_add(1)
            self.eager_call_counter_train += 1

        def on_test_batch_end(self, *args, **kwargs):
            self.model.test_counter.assign_add(1)
            self.eager_call_counter_test += 1

        def on_predict_batch_end(self, *args, **kwargs):
            self.model.predict_counter.assign_add(1)
            self.eager_call_counter_predict += 1

    model = CounterModel()
    model.compile(optimizer="sgd", loss="mse", metrics=["mse"], run_eagerly=True)
    x, y = _xy(105, 24, 3, 3)
    x_val, y_val = _xy(106, 12, 3, 3)
    cbk = CounterCallback()
    model = distribute(model, devices)
    history = fit(model, x, y, epochs=3, callbacks=[cbk], validation_data=(x_val, y_val))
    assert cbk.eager_call_counter_train == 6 and float(np.asarray(model.train_counter)) == 6
    assert cbk.eager_call_counter_test == 3 and float(np.asarray(model.test_counter)) == 3
    predicted = predict(model, x, callbacks=[cbk])
    assert cbk.eager_call_counter_predict == 2 and float(np.asarray(model.predict_counter)) == 2
    return result(model, history, predicted=predicted)


def trainer_recompile(devices):
    """test_recompile: fit and evaluate, ``compile()`` again with another metric, fit and evaluate again; each
    run's logs name the metric of its compile()."""
    k = keras()
    k.utils.set_random_seed(107)
    model = _example_model(3)
    x, y = _xy(108, 24, 2, 3)
    model.compile(optimizer="sgd", loss="mse", metrics=["mean_squared_error"])
    model = distribute(model, devices)
    history_1 = fit(model, x, y, epochs=1)
    eval_out_1 = evaluate(model, x, y)
    model.compile(optimizer="sgd", loss="mse", metrics=["mean_absolute_error"])
    history_2 = fit(model, x, y, epochs=1)
    eval_out_2 = evaluate(model, x, y)
    assert sorted(history_1.history) == sorted(eval_out_1) == ["loss", "mean_squared_error"]
    assert sorted(history_2.history) == sorted(eval_out_2) == ["loss", "mean_absolute_error"]
    evaluated = dict(eval_out_2, **{"first/" + key: value for key, value in eval_out_1.items()})
    return result(model, merged(history_1, history_2), evaluated=evaluated)


def trainer_metric_tracking(devices):
    """test_metric_tracking's weighted case: a model that holds a metric of its own (``self.my_metric``), compiled
    with ``weighted_metrics`` and fit with a ``sample_weight``: three metrics (the loss tracker, the compiled
    metrics, its own)."""
    k = keras()
    k.utils.set_random_seed(109)

    class ModelWithMetric(k.Model):  # the ExampleModel below is one
        def __init__(self):
            super().__init__()
            self.my_metric = k.metrics.MeanSquaredError(name="my_metric")

    model = _example_model(3, ModelWithMetric)
    model.compile(optimizer=k.optimizers.SGD(), loss=k.losses.MeanSquaredError(),
                  weighted_metrics=[k.metrics.MeanSquaredError()])
    x, y = _xy(110, 24, 4, 3)
    sample_weight = rng(111).random((24,)).astype("float32")
    model = distribute(model, devices)
    history = fit(model, x, y, epochs=1, sample_weight=sample_weight)
    assert len(model.metrics) == 3
    return result(model, history, evaluated=evaluate(model, x, y, sample_weight=sample_weight))


class _StepCount:
    """The test file's ``StepCount`` callback: checks the batch index at each begin and end of an execution."""

    @staticmethod
    def make(steps_per_execution):
        k = keras()

        class StepCount(k.callbacks.Callback):
            def __init__(self, steps_per_execution=1):
                super().__init__()
                self.begin_count = self.end_count = self.epoch_begin_count = self.epoch_end_count = 0
                self.steps_per_execution = steps_per_execution

            def on_epoch_begin(self, epoch, logs=None):
                self.begin_count = 0
                self.end_count = 0
                self.epoch_begin_count += 1

            def on_epoch_end(self, epoch, logs=None):
                self.epoch_end_count += 1

            def on_batch_begin(self, batch, logs=None):
                if batch != self.begin_count * self.steps_per_execution:
                    raise ValueError("Batch index is not correct")
                self.begin_count += 1

            def on_batch_end(self, batch, logs=None):
                self.end_count += 1
                if batch != self.end_count * self.steps_per_execution - 1:
                    raise ValueError("Batch index is not correct")

        return StepCount(steps_per_execution)


def trainer_steps_per_execution(devices):
    """test_steps_per_execution_steps_count: ``compile(steps_per_execution=3)`` (not on PyTorch, as the test
    skips it), fit with the ``StepCount`` callback, two epochs; then predict and evaluate."""
    k = keras()
    k.utils.set_random_seed(112)
    data_size, epochs, steps_per_execution = 72, 2, 3
    x, y = _xy(113, data_size, 4, 1)
    model = _example_model(1)
    model.compile(loss="mse", optimizer="sgd", steps_per_execution=steps_per_execution)
    step_count = _StepCount.make(steps_per_execution)
    model = distribute(model, devices)
    history = fit(model, x, y, epochs=epochs, callbacks=[step_count])
    assert step_count.begin_count == 1 + (data_size - 1) // (steps_per_execution * BATCH)
    assert step_count.end_count == step_count.begin_count and step_count.epoch_end_count == epochs
    return result(model, history, evaluated=evaluate(model, x, y), predicted=predict(model, x))


def _infinite_gen(seed, with_y=True):
    r = rng(seed)
    while True:
        x, y = r.random((BATCH, 2)).astype("float32"), r.random((BATCH, 3)).astype("float32")
        yield (x, y) if with_y else (x,)


def trainer_validation_data_infinite_generator(devices):
    """test_validation_data_infinite_generator: infinite Python generators for fit() and ``validation_data``, with
    ``steps_per_epoch=3`` and ``validation_steps=4``."""
    k = keras()
    k.utils.set_random_seed(114)
    model = _example_model(3)
    model.compile(optimizer="sgd", loss="mse", metrics=["mse"])

    class Recorder(k.callbacks.Callback):
        def __init__(self):
            self.train_counter = 0
            self.val_counter = 0

        def on_train_batch_end(self, *args, **kwargs):
            self.train_counter += 1

        def on_test_batch_end(self, *args, **kwargs):
            self.val_counter += 1

    recorder = Recorder()
    model = distribute(model, devices)
    history = model.fit(_infinite_gen(115), validation_data=_infinite_gen(116), steps_per_epoch=3,
                        validation_steps=4, epochs=1, shuffle=False, callbacks=[recorder], verbose=0)
    assert recorder.train_counter == 3 and recorder.val_counter == 4
    return result(model, history)


def trainer_stop_loop(devices):
    """test_stop_loop, its three cases in turn: a callback sets ``model.stop_training`` (fit),
    ``stop_evaluating`` (evaluate) and ``stop_predicting`` (predict) at the fifth batch of an infinite generator."""
    k = keras()
    k.utils.set_random_seed(117)
    model = _example_model(3)
    model.compile(optimizer="sgd", loss="mse", metrics=["mse"])

    class Stopper(k.callbacks.Callback):
        def __init__(self, stop_count, method_gerund, on_end_name):
            self.stop_count = stop_count
            self.counter = 0
            self.method_gerund = method_gerund
            setattr(self, "on_{}_batch_end".format(on_end_name), self.batch_end)

        def batch_end(self, *args, **kwargs):
            self.counter += 1
            if self.counter == self.stop_count:
                setattr(self.model, "stop_{}".format(self.method_gerund), True)

    model = distribute(model, devices)
    stopper = Stopper(5, "training", "train")
    history = model.fit(_infinite_gen(118), callbacks=[stopper], verbose=0)
    assert stopper.counter == 5
    stopper = Stopper(5, "evaluating", "test")
    evaluated = model.evaluate(_infinite_gen(119), callbacks=[stopper], verbose=0, return_dict=True)
    assert stopper.counter == 5
    stopper = Stopper(5, "predicting", "predict")
    predicted = model.predict(_infinite_gen(120, with_y=False), callbacks=[stopper], verbose=0)
    assert stopper.counter == 5
    return result(model, history, evaluated=evaluated, predicted=predicted)


PROGRAMS = {
    "trainer_internal_only_loss": (TR, 1e-5, ALL, "slow", {"tensorflow": SUM, "torch": SUM}),
    "trainer_constraints_are_applied": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_metric_update_in_compute_loss": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_fwd_pass_loss_presence_in_compute_loss": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_loss_weights": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_partial_loss_partial_label": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_custom_train_test_step": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_on_batch_methods": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_nested_inputs": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_callbacks_update_state_at_batch_boundary": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_recompile": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_metric_tracking": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_steps_per_execution": (TR, 1e-5, ("tensorflow", "jax"), "slow", "pass"),
    "trainer_validation_data_infinite_generator": (TR, 1e-5, ALL, "slow", "pass"),
    "trainer_stop_loop": (TR, 1e-5, ALL, "slow", "pass"),
}
