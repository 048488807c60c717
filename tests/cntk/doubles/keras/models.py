"""Stand-in for Keras 2.3.1's ``Sequential`` on CNTK: Dense layers, MSE, L2, stateful MAE, SGD/RMSprop.

Training follows Keras 2.3.1: ``compile`` sets ``total_loss`` (per-sample MSE weighted by the sample
weights and summed over the batch size, plus regularization, then ``K.mean``) and ``train_function =
None``; ``_make_train_function`` builds ``K.function(inputs, [total_loss] + metric results, updates=
optimizer updates + metric updates)`` once; ``fit`` runs ``training_arrays.fit_loop``: metrics reset at
every epoch, Keras' own shuffle (``np.random.shuffle`` of the index array), batches from ``make_batches``,
the loss averaged over the epoch weighted by batch size, stateful metrics at their last value, then
validation through the test function.
"""

import json
import sys

import numpy as np

from . import backend as K
from . import layers as layers_module
from . import optimizers as optimizers_module


class Callback(object):
    def set_model(self, model):
        self.model = model

    def on_epoch_end(self, epoch, logs=None):
        pass


class History(Callback):
    def __init__(self):
        self.epoch, self.history = [], {}

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(float(value))


class MeanAbsoluteError(object):
    """A stateful metric (``keras.metrics.MeanMetricWrapper``): ``total``/``count`` variables, updated
    by assign ops that read the inputs; its result reads the variables."""

    name = "mean_absolute_error"

    def __init__(self):
        self.total, self.count = K.zeros(()), K.zeros(())
        self.weights = [self.total, self.count]

    def __call__(self, y_true, y_pred):
        values = K.mean(K.abs(y_pred - y_true), axis=-1)
        self.updates = [K.update_add(self.total, K.sum(values)), K.update_add(self.count, K.batch_size(values))]
        return self.total / self.count

    def reset_states(self):
        K.batch_set_value([(v, 0.0) for v in self.weights])


class Sequential(object):
    def __init__(self, layers, input_dim):
        self.layers = list(layers)
        self.input_dim = input_dim
        self.input = K.placeholder(shape=(None, input_dim), name="input")
        x, width = self.input, input_dim
        for layer in self.layers:
            x, width = layer(x, fan_in=width), layer.units
        self.output = x
        self.built = True
        self.optimizer = None
        self.train_function = self.test_function = self.predict_function = None

    @property
    def weights(self):
        return [w for layer in self.layers for w in layer.weights]

    @property
    def losses(self):
        return [loss for layer in self.layers for loss in layer.losses]

    def get_weights(self):
        return K.batch_get_value(self.weights)

    def set_weights(self, weights):
        K.batch_set_value(list(zip(self.weights, weights)))

    def compile(self, optimizer, loss="mse", metrics=None):
        self.optimizer = optimizers_module.get(optimizer)
        self.target = K.placeholder(shape=(None, self.output_dim), name="target")
        self.sample_weight = K.placeholder(shape=(None,), name="sample_weight")
        per_sample = K.mean(K.square(self.output - self.target), axis=-1)
        total_loss = K.sum(self.sample_weight * per_sample) / K.batch_size(per_sample)
        for loss_tensor in self.losses:
            total_loss = total_loss + loss_tensor
        self.total_loss = K.mean(total_loss)
        self.metrics = [MeanAbsoluteError() for name in (metrics or []) if name in ("mae", "mean_absolute_error")]
        self.metrics_tensors = [m(self.target, self.output) for m in self.metrics]
        self.metrics_names = ["loss"] + [m.name for m in self.metrics]
        self.train_function = self.test_function = None

    @property
    def output_dim(self):
        return self.layers[-1].units

    def _get_training_eval_metrics(self):
        return list(self.metrics)

    def reset_metrics(self):
        for metric in self.metrics:
            metric.reset_states()

    def _feed(self):
        return [self.input, self.target, self.sample_weight]

    def _make_train_function(self):
        if self.train_function is None:
            updates = self.optimizer.get_updates(loss=self.total_loss, params=self.weights)
            metric_updates = [u for m in self.metrics for u in m.updates]
            self.train_function = K.function(self._feed(), [self.total_loss] + self.metrics_tensors,
                                             updates=updates + metric_updates, name="train_function")

    def _make_test_function(self):
        if self.test_function is None:
            metric_updates = [u for m in self.metrics for u in m.updates]
            self.test_function = K.function(self._feed(), [self.total_loss] + self.metrics_tensors,
                                            updates=metric_updates, name="test_function")

    def _inputs(self, x, y, sample_weight):
        x = np.asarray(x, dtype="float32")
        y = np.asarray(y, dtype="float32")
        weights = np.ones(len(x), "float32") if sample_weight is None else np.asarray(sample_weight, "float32")
        return [x, y, weights]

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose=1, callbacks=None, validation_split=0.,
            validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
            steps_per_epoch=None, validation_steps=None, validation_freq=1, max_queue_size=10, workers=1,
            use_multiprocessing=False, **kwargs):
        batch_size = batch_size or 32
        ins = self._inputs(x, y, sample_weight)
        if validation_data is None and 0. < validation_split < 1.:
            split_at = int(len(ins[0]) * (1. - validation_split))
            validation_data = tuple(a[split_at:] for a in ins)
            ins = [a[:split_at] for a in ins]
        self._make_train_function()
        history = History()
        callbacks = list(callbacks or []) + [history]
        for callback in callbacks:
            callback.set_model(self)
        index_array = np.arange(len(ins[0]))
        for epoch in range(initial_epoch, epochs):
            self.reset_metrics()
            if shuffle:
                np.random.shuffle(index_array)
            totals, seen, outs = {}, 0, []
            for start in range(0, len(index_array), batch_size):
                batch = index_array[start:start + batch_size]
                outs = self.train_function([a[batch] for a in ins])
                seen += len(batch)
                totals["loss"] = totals.get("loss", 0.0) + float(outs[0]) * len(batch)
            logs = {"loss": totals["loss"] / seen}
            logs.update((name, float(value)) for name, value in zip(self.metrics_names[1:], outs[1:]))
            if validation_data is not None:
                values = self.evaluate(*validation_data[:2], sample_weight=(validation_data[2] if len(validation_data) > 2 else None),
                                       batch_size=batch_size, verbose=0)
                logs.update(("val_" + name, value) for name, value in zip(self.metrics_names, np.atleast_1d(values)))
            if verbose:
                sys.stdout.write("Epoch {}/{} - {}\n".format(epoch + 1, epochs, " - ".join(
                    "{}: {:.4f}".format(k, v) for k, v in sorted(logs.items()))))
            for callback in callbacks:
                callback.on_epoch_end(epoch, logs)
        return history

    def train_on_batch(self, x, y, sample_weight=None):
        self._make_train_function()
        outs = self.train_function(self._inputs(x, y, sample_weight))
        return [float(o) for o in outs] if len(outs) > 1 else float(outs[0])

    def evaluate(self, x=None, y=None, batch_size=None, verbose=1, sample_weight=None, steps=None, callbacks=None,
                 max_queue_size=10, workers=1, use_multiprocessing=False):
        batch_size = batch_size or 32
        ins = self._inputs(x, y, sample_weight)
        self._make_test_function()
        self.reset_metrics()
        total, outs = 0.0, []
        for start in range(0, len(ins[0]), batch_size):
            outs = self.test_function([a[start:start + batch_size] for a in ins])
            total += float(outs[0]) * len(ins[0][start:start + batch_size])
        results = [total / len(ins[0])] + [float(o) for o in outs[1:]]
        if verbose:
            sys.stdout.write("evaluate: {}\n".format(results))
        return results if len(results) > 1 else results[0]

    def predict(self, x, batch_size=None, verbose=0, steps=None, callbacks=None, max_queue_size=10, workers=1,
                use_multiprocessing=False):
        return self.output.eval({self.input: np.asarray(x, dtype="float32")})

    def get_config(self):
        return {"input_dim": self.input_dim, "layers": [layer.get_config() for layer in self.layers]}

    def save(self, filepath, overwrite=True, include_optimizer=True):
        with open(filepath, "w") as handle:
            json.dump({"config": self.get_config(), "weights": [w.tolist() for w in self.get_weights()]}, handle)

    def save_weights(self, filepath, overwrite=True):
        with open(filepath, "w") as handle:
            json.dump([w.tolist() for w in self.get_weights()], handle)


def load_model(filepath):
    with open(filepath) as handle:
        saved = json.load(handle)
    model = Sequential([layers_module.Dense.from_config(c) for c in saved["config"]["layers"]], saved["config"]["input_dim"])
    model.set_weights([np.asarray(w, "float32") for w in saved["weights"]])
    return model
