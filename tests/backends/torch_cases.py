"""Cases and worker bodies of the PyTorch "any Keras model, unchanged" tests (``test_torch.py``).

``build(case)`` makes a case's compiled model (from a fixed seed), its data and its fit() arguments.
:func:`reference` trains it on one device, in the test process; :func:`train` runs on every rank of a job
(``harness.job(n).run``), starts from the reference's initial weights (copied, not only seeded alike),
distributes the very same object and trains it. Bodies return plain data, never a model.
"""

import os

import numpy as np


def _data(samples, shape=(5,), seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples,) + tuple(shape)).astype("float32")
    y = rng.normal(size=(samples, 3)).astype("float32")
    return x, y


def tokens(samples, seed=1):
    """Token ids (0: padding, at the end of half the rows) and a class per position (0: ignored, about a third):
    every row keeps another number of entries, so the ranks' shares of the kept entries are not their row shares."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 6, size=(samples, 4)).astype("int32")
    x[:, -1] = np.where(rng.random(samples) < 0.5, 0, x[:, -1])
    y = rng.integers(1, 4, size=(samples, 4)).astype("int32")
    y[rng.random((samples, 4)) < 0.3] = 0
    return x, y


def masked(keras, how):
    """A per-position classifier whose loss averages over kept entries only: ``ignore_class=0`` or the Embedding's
    ``mask_zero`` mask carried to the predictions (issue 52). Also used by test_tensorflow_realcode.py."""
    inputs = keras.Input((4,), dtype="int32")
    hidden = keras.layers.Embedding(6, 4, mask_zero=how == "mask")(inputs)
    outputs = keras.layers.Dense(4)(keras.layers.Dense(8, activation="tanh")(hidden))
    model = keras.Model(inputs, outputs)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0 if how == "ignore_class" else None)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    return model


def _mlp(keras, optimizer, **dense):
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3, **dense)]
    )
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def _conv(keras, optimizer):
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3),
        keras.layers.BatchNormalization(),
        keras.layers.Activation("relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def _compiled(keras, model, optimizer=None):
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def _with_policy(keras, policy, build):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return build()
    finally:
        keras.config.set_dtype_policy(previous)


def _layer_argument(keras):
    from tests.backends import torch_models

    model = torch_models.WithLayerArgument(keras.layers.Dense(8), squash=keras.ops.tanh)
    model(keras.ops.zeros((2, 5)))
    return _compiled(keras, model)


def _configured(keras):
    from tests.backends import torch_models

    model = torch_models.Configured(8)
    model(keras.ops.zeros((2, 5)))
    return _compiled(keras, model)


def _nested(keras):
    from tests.backends import torch_models

    return _compiled(keras, torch_models.nested())


def _guide(keras, batchnorm):
    from tests.backends import torch_models

    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8)(inputs)
    if batchnorm:
        hidden = keras.layers.BatchNormalization()(hidden)
    outputs = keras.layers.Dense(3)(keras.layers.Activation("tanh")(hidden))
    return _compiled(keras, torch_models.GuideStep(inputs, outputs), keras.optimizers.SGD(0.1, momentum=0.5))


def _unused(keras):
    from tests.backends import torch_models

    model = torch_models.WithUnused()
    model(keras.ops.zeros((2, 5)))
    return _compiled(keras, model, keras.optimizers.SGD(0.1, momentum=0.5))


def _transformed(keras, kind):
    from tests.backends import torch_models

    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs))
    model = torch_models.TransformedStep(inputs, outputs)
    model.kind = kind
    return _compiled(keras, model, keras.optimizers.SGD(0.05))


def _mixed(keras, policy):
    # The output layer in float32, as Keras' mixed-precision guide advises.
    return _with_policy(keras, policy, lambda: _mlp(keras, keras.optimizers.Adam(0.05), dtype="float32"))


def _optimizer(make):
    """A case that is the plain MLP with the optimizer ``make(keras)``."""
    return lambda keras: _mlp(keras, make(keras))


_TEN = dict(batch_size=10, epochs=2)
_TWELVE = dict(batch_size=12, epochs=2)

#: name -> (build(keras), samples, input shape, fit() arguments). 40 samples at a global batch of 10 split
#: 5+5 on 2 processes and 4+3+3 on 3; 48 at 12 split evenly on both.
CASES = {
    "layer_argument": (_layer_argument, 40, (5,), _TEN),
    "configured": (_configured, 40, (5,), _TEN),
    "nested": (_nested, 40, (5,), _TEN),
    "clipnorm": (_optimizer(lambda k: k.optimizers.SGD(0.1, clipnorm=0.05)), 40, (5,), _TEN),
    "global_clipnorm": (_optimizer(lambda k: k.optimizers.SGD(0.1, global_clipnorm=0.1)), 40, (5,), _TEN),
    "clipvalue": (_optimizer(lambda k: k.optimizers.SGD(0.1, clipvalue=0.02)), 40, (5,), _TEN),
    "accumulation": (
        _optimizer(lambda k: k.optimizers.Adam(0.01, gradient_accumulation_steps=3)), 40, (5,), dict(_TEN, epochs=3)
    ),
    "adamw": (_optimizer(lambda k: k.optimizers.AdamW(0.01, weight_decay=0.5)), 40, (5,), _TEN),
    "ema": (
        _optimizer(lambda k: k.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=3)),
        40, (5,), _TEN,
    ),
    "schedule": (
        _optimizer(lambda k: k.optimizers.SGD(k.optimizers.schedules.ExponentialDecay(0.3, 2, decay_rate=0.5))),
        40, (5,), _TEN,
    ),
    "mixed_float16": (lambda k: _mixed(k, "mixed_float16"), 40, (5,), _TEN),
    "mixed_bfloat16": (lambda k: _mixed(k, "mixed_bfloat16"), 40, (5,), _TEN),
    "batchnorm": (lambda k: _conv(k, k.optimizers.SGD(0.05, momentum=0.5)), 40, (8, 8, 1), _TEN),
    "batchnorm_batch1": (lambda k: _conv(k, k.optimizers.SGD(0.05)), 5, (8, 8, 1), dict(batch_size=1, epochs=2)),
    "guide_step": (lambda k: _guide(k, False), 48, (5,), _TWELVE),
    "guide_step_batchnorm": (lambda k: _guide(k, True), 48, (5,), _TWELVE),
    # A last batch of 1: the ranks without a sample run the custom step on a stand-in.
    "guide_step_tail": (lambda k: _guide(k, True), 49, (5,), _TWELVE),
    # A layer never called: its variables have no gradient on any rank, and keep None.
    "unused_variable": (_unused, 40, (5,), _TEN),
    # A mean over each rank's kept entries: the ranks weighed by their shares of the kept entries, not of the rows.
    "masked_ignore_class": (lambda k: masked(k, "ignore_class"), 40, "tokens", _TEN),
    "masked_mask_zero": (lambda k: masked(k, "mask"), 40, "tokens", _TEN),
    # A last batch of 1: the ranks without a row run the step on a stand-in, whose entries must not count.
    "masked_tail": (lambda k: masked(k, "ignore_class"), 41, "tokens", _TEN),
}
#: Custom steps whose gradients are not the backward pass' .grad tensors as they were (see TransformedStep):
#: the overlapped all-reduce falls back. Not in CASES: one run each is enough.
TRANSFORMED = {
    "transformed_" + kind: (lambda k, kind=kind: _transformed(k, kind), 40, (5,), _TEN)
    for kind in ("scaled", "in_place", "autograd", "twice")
}


def build(case):
    """The case's compiled model (seeded), data and fit() arguments."""
    import keras

    make, samples, shape, fit = CASES[case] if case in CASES else TRANSFORMED[case]
    keras.utils.set_random_seed(0)
    data = tokens(samples) if shape == "tokens" else _data(samples, shape)
    return make(keras), data, dict(fit, shuffle=False, verbose=0)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def reference(case):
    """One device: (initial weights, final weights, history)."""
    model, (x, y), fit = build(case)
    initial = _weights(model)
    history = model.fit(x, y, **fit)
    return initial, _weights(model), history.history


def train(case, devices, initial, **options):
    """On every rank: the case's model from ``initial``, distributed in place and trained. What ran where,
    read from torch and the OS (not from distkeras): world size, pid; the weights and history; and the
    all-reduces of one more epoch of one step (``(elements, async_op)`` each, in launch order)."""
    import torch.distributed as dist

    import distkeras

    model, (x, y), fit = build(case)
    model.set_weights(initial)
    same = distkeras.distribute(model, devices=devices, **options) is model
    history = model.fit(x, y, **fit)
    weights = _weights(model)
    events = _traced(lambda: model.fit(x[:10], y[:10], **dict(fit, batch_size=10, epochs=1)))
    return {
        "all_reduces": [event[1:] for event in events if event[0] == "all_reduce"],
        "same_object": same,
        "world": dist.get_world_size(),
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "optimizer": type(model.optimizer).__name__,
        "weights": weights,
        "history": history.history,
    }


#: The events list of the :func:`_traced` call in progress.
_events = [[]]


def _traced(step, parameters=()):
    """Run ``step()``; what torch saw, in order: ``("all_reduce", elements, async_op)`` for every
    all-reduce, ``("grad", i)`` whenever the backward pass has accumulated ``parameters[i].grad`` (a torch
    hook of this function's own), and ``("apply",)`` when Keras' own ``optimizer.apply`` starts (where
    :func:`_marking_apply` is in place)."""
    import torch.distributed as dist

    events, real = [], dist.all_reduce
    _events[0] = events

    def counted(tensor, *args, **kwargs):
        events.append(("all_reduce", tensor.numel(), bool(kwargs.get("async_op"))))
        return real(tensor, *args, **kwargs)

    def hook(index):
        return lambda parameter: events.append(("grad", index))

    handles = [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(parameters)]
    dist.all_reduce = counted
    try:
        step()
    finally:
        dist.all_reduce = real
        _events[0] = []
        for handle in handles:
            handle.remove()
    return events


def _marking_apply(optimizer):
    """Mark ``("apply",)`` in the traced events whenever Keras' own apply() of ``optimizer`` starts (the one
    distkeras' averaging apply() hands the averages to): on the class, before distkeras wraps the instance."""
    real_apply = type(optimizer).apply

    class Marking(type(optimizer)):
        def apply(self, *args, **kwargs):
            _events[0].append(("apply",))
            return real_apply(self, *args, **kwargs)

    optimizer.__class__ = Marking


def launch_order(devices, bucket_mb):
    """The MLP distributed with buckets of ``bucket_mb`` MiB: what torch saw in two train steps (see
    :func:`_traced`), with hooks of this function's own on the variables' parameters, registered before
    distkeras' (so each variable's "grad" comes just before distkeras' hook for it); the variables' sizes."""
    import distkeras

    model, (x, y), fit = build("clipnorm")
    _marking_apply(model.optimizer)
    distkeras.distribute(model, devices=devices, bucket_mb=bucket_mb)
    parameters = [v.value for v in model.trainable_variables]
    steps = [_traced(lambda: model.train_on_batch(x[:10], y[:10]), parameters) for _ in range(2)]
    return {"steps": steps, "sizes": [p.numel() for p in parameters]}


def parameter_hooks(devices):
    """How many post-accumulate-grad hooks each parameter holds after distribute() with overlap, after one
    step, after a second distribute() and a step, and after distribute(overlap=False); and the all-reduces of
    a backward pass outside any train step. Reads torch's private ``Tensor._post_accumulate_grad_hooks``
    (the hooks' dict): torch has no public way to list a tensor's hooks."""
    import distkeras

    model, (x, y), fit = build("clipnorm")
    parameters = [v.value for v in model.trainable_variables]

    def hooks():
        return [len(p._post_accumulate_grad_hooks or {}) for p in parameters]

    got = {}
    distkeras.distribute(model, devices=devices)
    got["distributed"] = hooks()  # the layout is made by the first train step
    model.train_on_batch(x[:10], y[:10])
    got["trained"] = hooks()
    distkeras.distribute(model, devices=devices, bucket_mb=0.0001)
    model.train_on_batch(x[:10], y[:10])
    got["again"] = hooks()

    def backward():
        model.zero_grad()
        model.compute_loss(y=keras_tensor(y), y_pred=model(keras_tensor(x))).backward()

    got["outside_step"] = _traced(backward)
    distkeras.distribute(model, devices=devices, overlap=False)
    got["overlap_off"] = hooks()
    return got


def keras_tensor(array):
    import keras

    return keras.ops.convert_to_tensor(array)


def _count_all_reduces(step):
    """Run ``step()``; how many all-reduces it made."""
    import torch.distributed as dist

    calls, real = [], dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        step()
    finally:
        dist.all_reduce = real
    return len(calls)


def history_of_a_model(devices, initial):
    """A model trained before distribute(), distributed twice, compiled again and distributed again.

    Returns what the optimizer held before and after distribute(), the all-reduces of one train step after
    each (re-)distribution, and the final weights; on one device (``devices=1``) the same calls without
    distribute() (the reference).
    """
    import keras

    import distkeras

    model, (x, y), fit = build("batchnorm")
    model.set_weights(initial)
    model.fit(x, y, **dict(fit, epochs=1))  # trained on one device before distribute()
    state = {
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "optimizer": [np.array(v) for v in model.optimizer.variables],
    }
    got = {"before": state}
    distribute = (lambda: distkeras.distribute(model, devices=devices)) if devices > 1 else (lambda: model)
    single = devices == 1

    def one_step():
        return model.train_on_batch(x[:10], y[:10])

    assert distribute() is model
    got["after"] = {
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "optimizer": [np.array(v) for v in model.optimizer.variables],
    }
    distribute()  # again: its hooks replace the first call's
    got["all_reduces"] = [None if single else _count_all_reduces(one_step)]
    if single:
        one_step()
    model.fit(x, y, **dict(fit, epochs=1))
    model.compile(optimizer=keras.optimizers.SGD(0.02, momentum=0.9), loss="mse", metrics=["mae"])
    distribute()
    got["all_reduces"].append(None if single else _count_all_reduces(one_step))
    if single:
        one_step()
    model.fit(x, y, **dict(fit, epochs=1))
    got["hooks"] = sorted(model.__dict__.get("_distkeras_hooks", []))
    got["weights"] = _weights(model)
    return got


def sync_batchnorm_off(devices, initial):
    """``sync_batchnorm=False`` after a distribute() that synchronized: no hook left on the layer; weights."""
    import distkeras

    model, (x, y), fit = build("batchnorm")
    model.set_weights(initial)
    distkeras.distribute(model, devices=devices)
    layer = model.layers[1]
    hooked = "_moments" in layer.__dict__
    distkeras.distribute(model, devices=devices, sync_batchnorm=False)
    model.fit(x, y, **fit)
    return {"hooked_first": hooked, "hooked_after": "_moments" in layer.__dict__, "weights": _weights(model)}


def by_hand(devices):
    """A custom train_step that changes the weights with no optimizer: the error, on every rank."""
    import keras

    import distkeras
    from tests.backends import torch_models

    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    model = torch_models.ByHand(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    distkeras.distribute(model, devices=devices)
    x, y = _data(20)
    try:
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    except distkeras.DistKerasError as exc:
        return str(exc)
    return None


def diffusion(keras):
    """A compiled model whose call() adds noise of 8 rows, the global batch it is trained at (a diffusion model's,
    issue 52); also used by test_tensorflow_realcode.py."""
    class Diffusion(keras.Model):
        def __init__(self):
            super().__init__()
            self.seed = keras.random.SeedGenerator(1)
            self.first, self.last = keras.layers.Dense(4), keras.layers.Dense(1)

        def call(self, x):
            return self.last(self.first(x) + keras.random.normal((8, 4), seed=self.seed))

    keras.utils.set_random_seed(0)
    model = Diffusion()
    model.compile(optimizer="sgd", loss="mse")
    return model


def split_batch(devices):
    """A model whose call() draws noise of a batch size fixed to the global batch (a diffusion model's, issue 52):
    the error on every rank, with the notes Python prints after it."""
    import keras

    import distkeras

    model = diffusion(keras)
    distkeras.distribute(model, devices=devices)
    x, y = _data(16)
    try:
        model.fit(x[:, :4], y[:, :1], batch_size=8, epochs=1, verbose=0)
    except Exception as exc:  # noqa: BLE001 - what the user sees
        return "\n".join([str(exc)] + list(getattr(exc, "__notes__", [])))
    return None


def fit_and_save(case, devices, initial, directory):
    """Train the case distributed, save it (``model.keras`` when it has a config, else only
    ``model.weights.h5``); the predictions of the distributed model on its data."""
    import distkeras

    model, (x, y), fit = build(case)
    model.set_weights(initial)
    distkeras.distribute(model, devices=devices)
    model.fit(x, y, **fit)
    if case == "configured":
        model.save(os.path.join(directory, "model.keras"))
    model.save_weights(os.path.join(directory, "model.weights.h5"))
    return model.predict(x, verbose=0)


# ---- the Keras examples' patterns that trained wrong when distributed (issue 21)


def _random_layers(keras):
    """RandomFlip, GaussianNoise and Dropout (unseeded: torch's global generator) in one model."""
    model = keras.Sequential([
        keras.Input((4, 4, 1)),
        keras.layers.RandomFlip("horizontal"),
        keras.layers.GaussianNoise(0.3),
        keras.layers.Flatten(),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(3),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def _vae(keras):
    from tests.backends import torch_models

    model = torch_models.VAE()
    model(keras.ops.zeros((2, 5)))
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def _gan(keras):
    from tests.backends import torch_models

    layers = keras.layers
    discriminator = keras.Sequential([keras.Input((5,)), layers.Dense(8, activation="tanh"), layers.Dense(1)])
    generator = keras.Sequential([keras.Input((2,)), layers.Dense(8, activation="tanh"), layers.Dense(5)])
    model = torch_models.GAN(discriminator, generator, latent_dim=2)
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.02),
                  keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def _loss_object(keras):
    from tests.backends import torch_models

    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs))
    model = torch_models.LossObjectStep(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5))
    return model


def _add_loss(keras):
    from tests.backends import torch_models

    inputs = keras.Input((5,))
    hidden = torch_models.AddsLoss()(keras.layers.Dense(8, activation="tanh")(inputs))
    hidden = keras.layers.ActivityRegularization(l2=0.01)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    # A loss function that returns a scalar (its own mean over the batch).
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=lambda y, p: keras.ops.mean(keras.ops.square(y - p)),
                  metrics=["mae"])
    return model


def _sum_loss(keras):
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs)))
    # reduction="sum": one device's gradient is the sum over the global batch, not the mean.
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.MeanSquaredError(reduction="sum"),
                  metrics=["mae"])
    return model


def _unbuilt(keras):
    from tests.backends import torch_models

    model = torch_models.Unbuilt()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse", metrics=["mae"])
    return model


#: name -> (build(keras), samples, input shape, fit() arguments, with targets). 40 samples at a global batch of
#: 10: 5+5 on 2 processes, 4+3+3 on 3. The VAE and the GAN log Mean trackers of their rows' losses (scalar
#: updates, weighed by each rank's rows: one device's value also for unequal shares).
ISSUE21 = {
    "random_layers": (_random_layers, 40, (4, 4, 1), _TEN, True),
    "vae": (_vae, 40, (5,), _TEN, False),
    "gan": (_gan, 40, (5,), _TEN, False),
    "loss_object": (_loss_object, 40, (5,), _TEN, True),
    "add_loss": (_add_loss, 40, (5,), _TEN, True),
    "unbuilt": (_unbuilt, 40, (5,), _TEN, True),
    "sum_loss": (_sum_loss, 40, (5,), _TEN, True),
}


def issue21(case, devices, **options):
    """The case built with another seed on every rank (rank 0's is one device's), distributed when
    ``devices`` > 1 and trained: world size, weights, every optimizer's variables, History, evaluate() and
    predictions (10 rows at a batch of 4, 2 rows at a batch of 2, predict_on_batch of 5)."""
    import keras
    import torch.distributed as dist

    import distkeras

    make, samples, shape, fit, targets = ISSUE21[case]
    rank = int(os.environ["RANK"]) if devices > 1 else 0
    keras.utils.set_random_seed(0 if rank == 0 else 100 + rank)  # rank 0's state must reach the others
    model = make(keras)
    x, y = _data(samples, shape)
    if devices > 1:
        distkeras.distribute(model, devices=devices, **options)
    keras.utils.set_random_seed(1)
    data = (x, y) if targets else (x,)
    history = model.fit(*data, **dict(fit, shuffle=False, verbose=0))
    optimizers = [model.d_optimizer, model.g_optimizer] if case == "gan" else [model.optimizer]
    got = {
        "world": dist.get_world_size() if devices > 1 else 1,
        "weights": _weights(model),
        "optimizers": [[np.array(v) for v in o.variables] for o in optimizers],
        "history": history.history,
    }
    if case not in ("gan", "vae"):  # the GAN has no call(), and neither a test_step with a loss
        got["evaluate"] = model.evaluate(*data, batch_size=fit["batch_size"], verbose=0, return_dict=True)
    if case != "gan":
        got["predict"] = [model.predict(x[:10], batch_size=4, verbose=0), model.predict(x[:2], batch_size=2, verbose=0),
                          np.asarray(model.predict_on_batch(x[:5]))]
    return got


def own_optimizer_trains(devices):
    """A custom train_step that applies its gradients with an optimizer of its own (an attribute): weights."""
    import keras

    import distkeras
    from tests.backends import torch_models

    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    model = torch_models.OwnOptimizer(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    if devices > 1:
        distkeras.distribute(model, devices=devices)
    x, y = _data(20)
    model.fit(x, y, batch_size=10, epochs=2, verbose=0, shuffle=False)
    return _weights(model)
