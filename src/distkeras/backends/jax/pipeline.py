"""Pipeline parallelism on JAX, in one process: the stages and schedules of :mod:`distkeras.parallel.pipeline` over several
devices of this process (``distribute(model, ["gpu:0", "gpu:1"], pipeline_stages=2)``), with replicas of the
pipeline when there are stages x replicas devices.

Stage ``s`` is a Keras ``Model`` over the original layers (``keras.Model(tensor_in, tensor_out)`` on the model's
graph, sharing the variables); its variables, and the optimizer slots made from them, live on its devices (one per
replica: replica ``r``'s stage ``s`` is device ``r * S + s``), and its computation runs there: every stage's
functions are jitted, and JAX runs a jitted function where its arguments are.

- **Replicas**: a stage's variables are one array with a copy on each of its devices (a replicated
  ``NamedSharding``) and each micro-batch is split by rows over them (``PartitionSpec("batch")``), so XLA computes
  each replica's rows on its device and sums the variables' gradients across them (its own all-reduce). A
  micro-batch whose rows don't divide evenly (the epoch's last, smaller batch) is given whole to every replica
  of the stage, which compute the same values.

- **Backward primitive**: ``jax.vjp`` of the stage's ``stateless_call``, inside the stage's jitted forward, which
  returns the pull-back (a pytree of residuals, held on the stage's device) with the output. A stage holds the
  pull-backs of the micro-batches its schedule holds (GPipe: all of them; 1F1B: at most ``S - s``); its backward
  applies one to the gradient of the output and adds the variables' gradients to the stage's sums.
- **Wire**: ``jax.device_put`` of an activation to the next stage's device, of a gradient to the previous one's.
- **One loop, every stage**: the stages' action lists (:func:`distkeras.parallel.pipeline.schedule`) are interleaved in an
  order that respects their dependencies (:func:`distkeras.parallel.pipeline.interleave`: every stage takes its next action
  as soon as its input has been made). JAX dispatches asynchronously, so the devices compute at once while Python
  runs ahead.
- **Loss**: each micro-batch's mean loss is weighed by its share of the batch (``pipeline.weights``), and each stage
  adds its own layers' losses (regularizers) weighed the same way, so the summed gradients are one device's at the
  global batch. The reported loss is the sum of the stages' parts; the metrics are computed on the last stage, on
  the whole batch's predictions.
- **Optimizer**: built over every variable of the model and applied once per step, stage by stage: each stage's
  apply runs on its device, on its variables and slots, with its own copy of the optimizer's shared scalars (the
  iteration count, the learning rate), which every stage advances alike. ``global_clipnorm``: the stages' parts
  of the global norm are added up first and each stage's gradients scaled as Keras' ``clip_by_global_norm``
  scales them. Optimizer features that read every variable at once in other ways (``use_ema``,
  ``gradient_accumulation_steps``, a ``LossScaleOptimizer``) are refused in this version.
- **Random draws** (Dropout, GaussianNoise, ``keras.random`` in a layer): one device's. Every micro-batch starts
  from the seed-generator states the step found, draws the global batch's shape and keeps its own rows; the states
  advance once per step, as on one device. A draw is taken for a per-row one when its leading dimension is the
  micro-batch's row count.
- **BatchNormalization**: normalises by each micro-batch's statistics and updates its moving statistics once per
  micro-batch (GPipe's choice), so a model with BatchNormalization trains close to, not exactly as, one device.
- **Saving**: every variable is one array on one device, which Keras reads to the host as it saves: ``save()``
  writes the plain model.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np

from ...parallel import pipeline
from ...errors import OptionError
from .. import keras_model
from ..base import swapped

#: The plan's attribute on a model split into stages.
PLAN = pipeline.PLAN


class Plan(object):
    """A model cut into ``parts``, one per device list of ``devices`` (a stage's devices, one per replica): the stage
    models, and where each variable goes."""

    def __init__(self, model, parts, devices, microbatches, schedule):
        self.model, self.parts, self.devices = model, parts, [list(d) for d in devices]
        self.stages, self.replicas = len(parts), len(self.devices[0])
        meshes = [jax.sharding.Mesh(np.array(d), ("batch",)) for d in self.devices]
        #: Per stage: its variables' sharding (a copy on each of its devices) and its micro-batches' (split by rows).
        self.replicated = [jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec()) for m in meshes]
        self.batched = [jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec("batch")) for m in meshes]
        #: Per stage: (device ids, rows per device) of the outputs it computed, read from JAX (the arrays' shardings).
        self.ran = [set() for _ in parts]
        self.microbatches, self.schedule = microbatches, schedule
        self.models = [pipeline.stage_model(model, p) for p in parts]
        self.index()
        self.functions = {}  # the jitted stage functions, by kind and stage (see steps())
        self.compiled = None  # the optimizer, compiled loss and metrics they were traced with

    def index(self):
        """Where each stage's variables are in the model's lists (again after a compile(): a layer made
        non-trainable since moves from one list to the other)."""
        model = self.model
        trainable = {id(v): i for i, v in enumerate(model.trainable_variables)}
        non_trainable = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        #: Per stage: the indices, in the model's lists, of the stage model's variables, in the stage's order.
        self.trainable = [[trainable[id(v)] for v in m.trainable_variables] for m in self.models]
        self.non_trainable = [[non_trainable[id(v)] for v in m.non_trainable_variables] for m in self.models]
        #: Per stage: the positions, in its non-trainable list, of seed-generator states.
        self.seeds = [[i for i, v in enumerate(m.non_trainable_variables) if id(v) in {id(state) for state in pipeline.seed_states(m)}]
                      for m in self.models]
        self.stage_of_trainable = {i: s for s, ids in enumerate(self.trainable) for i in ids}
        self.stage_of_non_trainable = {i: s for s, ids in enumerate(self.non_trainable) for i in ids}

    @property
    def last(self):
        return self.stages - 1

    def put_rows(self, value, s):
        """Batch arrays (rows first) on stage ``s``'s devices: split by rows over its replicas where the row count
        divides evenly (XLA then computes each part on its device and sums the variables' gradients over them),
        else a copy on each (every replica computes every row: the same values, no split)."""
        def put(t):
            if t is None:
                return None
            rows = int(t.shape[0]) if len(t.shape) else 0
            return jax.device_put(t, self.batched[s] if rows and rows % self.replicas == 0 else self.replicated[s])

        return keras.tree.map_structure(put, value)


# ---------------------------------------------------------------------------------------------- the optimizer


def check_optimizer(model):
    """An OptionError where the model's optimizer reads every variable at once (see the module docstring)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    found = []
    if getattr(optimizer, "inner_optimizer", None) is not None:
        found.append("{} (loss scaling checks every gradient at once)".format(type(optimizer).__name__))
    for name in ("use_ema", "gradient_accumulation_steps"):
        if getattr(optimizer, name, None):
            found.append("{}={!r}".format(name, getattr(optimizer, name)))
    if found:
        raise OptionError(
            "pipeline_stages on JAX applies the optimizer stage by stage, each on its device's variables, and {}'s "
            "optimizer has {}, which reads every variable at once: not supported with pipeline stages in this version. "
            "Train without it, or without pipeline_stages.".format(
                model.name, ", ".join(found)))


def _slot_owners(optimizer, variables):
    """``{id(optimizer variable): index in variables}`` for the slots Keras made from a variable
    (``add_variable_from_reference``: named ``<the variable's path, "/" as "_">_<slot>``, of its shape)."""
    by_name = {v.path.replace("/", "_"): i for i, v in enumerate(variables)}
    owners = {}
    for slot in optimizer.variables:
        name = slot.path.partition("/")[2] if "/" in slot.path else slot.name
        matches = [key for key in by_name if name.startswith(key + "_")]
        if matches:
            index = by_name[max(matches, key=len)]
            if tuple(variables[index].shape) == tuple(slot.shape):
                owners[id(slot)] = index
    return owners


# ---------------------------------------------------------------------------------------------- placement


class Layout(object):
    """Where each state array of the model goes: the device of each trainable, non-trainable, optimizer and
    metrics variable, in the orders of Keras' JAX state (``model.trainable_variables`` ...)."""

    def __init__(self, plan):
        model = self.model = plan.model
        devices, last = plan.replicated, plan.replicated[-1]
        self.trainable = [devices[plan.stage_of_trainable.get(i, 0)] for i in range(len(model.trainable_variables))]
        self.non_trainable = [devices[plan.stage_of_non_trainable.get(i, 0)]
                              for i in range(len(model.non_trainable_variables))]
        optimizer = getattr(model, "optimizer", None)  # None until compile()
        self.slots = {}  # stage -> indices in optimizer.variables of the slots of its variables
        self.shared = []  # indices of the optimizer's variables made from no model variable (iterations, ...)
        self.optimizer = []
        if optimizer is not None and optimizer.built:
            owners = _slot_owners(optimizer, model.trainable_variables)
            for i, variable in enumerate(optimizer.variables):
                owner = owners.get(id(variable))
                if owner is None:
                    self.shared.append(i)
                    self.optimizer.append(devices[0])
                else:
                    stage = plan.stage_of_trainable.get(owner, 0)
                    self.slots.setdefault(stage, []).append(i)
                    self.optimizer.append(devices[stage])
        self.metrics = [last] * len(model.metrics_variables)

    def groups(self):
        model = self.model
        return ((model.trainable_variables, self.trainable), (model.non_trainable_variables, self.non_trainable),
                (model.optimizer.variables if self.optimizer else [], self.optimizer),
                (model.metrics_variables, self.metrics))


def place(plan):
    """Every variable of the model (its optimizer's and metrics' too) on its stage's device; the layout."""
    plan.index()
    layout = Layout(plan)
    for variables, shardings in layout.groups():
        for variable, sharding in zip(variables, shardings):
            value = variable.value
            if value is not None and getattr(value, "sharding", None) != sharding:
                variable.assign(jax.device_put(value, sharding))
    return layout


def _put(values, devices):
    return [jax.device_put(v, d) for v, d in zip(values, devices)]


# ---------------------------------------------------------------------------------------------- random draws

#: Keras' JAX random module (a private: the one place its JAX backend draws random numbers; the layers'
#: ``backend.random`` and ``keras.random`` call through its attributes, swapped while a stage is traced).
_PRIVATE_RANDOM = "keras.src.backend.jax.random"
_SHAPED = ("normal", "uniform", "truncated_normal", "randint")


@contextlib.contextmanager
def _global_draws(count, total, offset):
    """While a stage's micro-batch of ``count`` rows (at ``offset``, traced) of a batch of ``total`` is traced, a
    draw whose leading dimension is ``count`` is drawn at the global batch's shape and sliced to those rows."""
    import importlib

    module = importlib.import_module(_PRIVATE_RANDOM)
    if count == total:
        yield
        return
    originals = {name: getattr(module, name) for name in _SHAPED + ("dropout",)}

    def rows(value):
        return jax.lax.dynamic_slice_in_dim(value, offset, count, axis=0)

    def shaped(original):
        def draw(shape, *args, **kwargs):
            shape = tuple(shape)
            if not shape or shape[0] != count:
                return original(shape, *args, **kwargs)
            return rows(original((total,) + shape[1:], *args, **kwargs))

        return draw

    def dropout(inputs, rate, noise_shape=None, seed=None):
        noise = list(module._get_concrete_noise_shape(inputs, noise_shape))
        if rate in (0.0, 1.0) or not noise or noise[0] != count:
            return originals["dropout"](inputs, rate, noise_shape=noise_shape, seed=seed)
        # Keras' JAX dropout, with the mask drawn for the global batch and this micro-batch's rows kept.
        keep = 1.0 - rate
        mask = jax.random.bernoulli(module.jax_draw_seed(seed), p=keep, shape=[total] + noise[1:])
        mask = jnp.broadcast_to(rows(mask), inputs.shape)
        return jax.lax.select(mask, inputs / keep, jnp.zeros_like(inputs))

    try:
        for name in _SHAPED:
            setattr(module, name, shaped(originals[name]))
        module.dropout = dropout
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


# ---------------------------------------------------------------------------------------------- stage functions


def _forward_function(plan, s, training, total):
    """Stage ``s``'s jitted forward of one micro-batch (its rows at ``offset`` of a batch of ``total``): (output,
    weighted loss, new non-trainable values, new metrics values, the pull-back (training) or None). ``total`` is
    None for a stage that draws nothing at random (one trace for every batch size)."""
    key = ("forward", s, training, total)
    if key in plan.functions:
        return plan.functions[key]
    model, stage = plan.model, plan.models[s]
    first, last = s == 0, s == plan.last

    def compute(tv, ntv, x, y, sample_weight, metrics, share, offset):
        count = int(next(t for t in keras.tree.flatten(x) if t is not None).shape[0])
        with _global_draws(count, total or count, offset):
            output, ntv, losses = stage.stateless_call(tv, ntv, x, training=training, return_losses=True)
        parts = [model._aggregate_additional_loss(loss) for loss in losses]  # as Trainer.compute_loss adds them
        if last and y is not None:
            mapping = list(zip(model.metrics_variables, metrics))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                # The compiled loss alone (each stage adds its own layers' losses): CompileLoss, a Keras private,
                # called as Trainer.compute_loss calls it.
                compiled = model._compile_loss(y, output, sample_weight)
            metrics = [_current(scope, v, value) for v, value in mapping]
        else:
            compiled = None
        # share: (the micro-batch's rows over the batch's, its compiled loss' factor): the layers' losses weighed
        # by rows, the compiled loss by its reduction's factor (pipeline.loss_factors).
        weighed = ([share[0] * sum(parts)] if parts else []) + ([share[1] * compiled] if compiled is not None else [])
        loss = sum(weighed) if weighed else jnp.zeros((), "float32")
        # The last stage's output is no other stage's input: only its loss is differentiated.
        return (loss if last else (output, loss)), (output, ntv, metrics)

    def forward(tv, ntv, x, y, sample_weight, metrics, share, offset):
        arguments = (y, sample_weight, metrics, share, offset)
        if not training:
            loss, (output, ntv, metrics) = compute(tv, ntv, x, *arguments)
            return output, (loss if last else loss[1]), ntv, metrics, None
        if first:
            values, pullback, (output, ntv, metrics) = jax.vjp(
                lambda tv: compute(tv, ntv, x, *arguments), tv, has_aux=True)
        else:
            values, pullback, (output, ntv, metrics) = jax.vjp(
                lambda tv, x: compute(tv, ntv, x, *arguments), tv, x, has_aux=True)
        return output, (values if last else values[1]), ntv, metrics, pullback

    function = plan.functions[key] = jax.jit(forward)
    return function


def _current(scope, variable, value):
    new = scope.get_current_value(variable)
    return value if new is None else new


def _backward_function(plan, s):
    """Stage ``s``'s jitted backward: the pull-back applied to the output's gradient (and 1 for the stage's loss),
    the variables' gradients added to ``sums``; and the gradient of the stage's input (None on the first stage)."""
    key = ("backward", s)
    if key in plan.functions:
        return plan.functions[key]

    def backward(pullback, output_gradient, loss, sums):
        one = jnp.ones_like(loss)
        gradients = pullback(one if output_gradient is None else (output_gradient, one))
        variables = gradients[0]
        if sums is not None:
            variables = [a + b for a, b in zip(sums, variables)]
        return variables, (gradients[1] if s > 0 else None)

    function = plan.functions[key] = jax.jit(backward)
    return function


def _square_function(plan, s):
    """Stage ``s``'s jitted sum of its gradients' squares (for ``global_clipnorm``: the global norm's part)."""
    key = ("square", s)
    if key not in plan.functions:
        plan.functions[key] = jax.jit(lambda gradients: sum(jnp.sum(jnp.square(g)) for g in gradients))
    return plan.functions[key]


def _global_clip_scales(plan, optimizer, sums):
    """``global_clipnorm``: every stage's gradients' share of the global norm added up on stage 0, and Keras'
    scale (``clip_by_global_norm``: clip x min(1 / norm, 1 / clip), NaN when the norm isn't finite) copied to each
    stage; None without ``global_clipnorm``."""
    clip = getattr(optimizer, "global_clipnorm", None)
    if not clip or clip <= 0:
        return None
    squares = [jax.device_put(_square_function(plan, s)(sums[s]), plan.replicated[0])
               for s in range(plan.stages) if sums[s]]
    norm = jnp.sqrt(functools.reduce(lambda a, b: a + b, squares))
    scale = clip * jnp.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
    return [jax.device_put(scale, plan.replicated[s]) for s in range(plan.stages)]


def _without_global_clip(optimizer):
    """The optimizer's own ``global_clipnorm`` off while a stage's apply is traced: the stage's gradients come
    scaled by the global norm's scale (:func:`_global_clip_scales`), which the stage alone can't compute."""
    return swapped(optimizer, "global_clipnorm", None)


def _apply_function(plan, s, layout):
    """Stage ``s``'s jitted optimizer step on its variables, slots and its copy of the shared optimizer state."""
    key = ("apply", s)
    if key in plan.functions:
        return plan.functions[key]
    model = plan.model
    optimizer = model.optimizer
    variables = [model.trainable_variables[i] for i in plan.trainable[s]]
    slots = [optimizer.variables[i] for i in layout.slots.get(s, [])]
    shared = [optimizer.variables[i] for i in layout.shared]

    def apply(values, gradients, slot_values, shared_values, scale):
        mapping = list(zip(variables, values)) + list(zip(slots, slot_values)) + list(zip(shared, shared_values))
        if scale is not None:
            gradients = [g * scale for g in gradients]
        with keras.StatelessScope(state_mapping=mapping) as scope, _without_global_clip(optimizer):
            optimizer.apply(gradients, variables)
        return ([_current(scope, v, x) for v, x in zip(variables, values)],
                [_current(scope, v, x) for v, x in zip(slots, slot_values)],
                [_current(scope, v, x) for v, x in zip(shared, shared_values)])

    function = plan.functions[key] = jax.jit(apply)
    return function


def _metrics_function(plan):
    key = ("metrics",)
    if key not in plan.functions:
        # Keras' JAX trainer's own update of the loss tracker and compiled metrics (a private), on the last stage.
        plan.functions[key] = jax.jit(plan.model._update_metrics_variables)
    return plan.functions[key]


# ---------------------------------------------------------------------------------------------- the step


class Step(object):
    """One batch through the stages (training or not) on the state arrays of Keras' JAX trainer."""

    def __init__(self, plan, layout, training, x, y, sample_weight, trainable, non_trainable, metrics):
        self.plan, self.layout, self.training = plan, layout, training
        devices = plan.replicated
        self.total = int(next(t for t in keras.tree.flatten(x) if t is not None).shape[0])
        self.sizes = pipeline.microbatch_sizes(self.total, plan.microbatches)
        self.shares = pipeline.weights(self.sizes)
        self.offsets = [sum(self.sizes[:m]) for m in range(len(self.sizes))]
        self.factors = self.shares
        if y is not None:  # the compiled loss' factors follow its reduction (pipeline.loss_rule)
            self.factors = keras_model.pipeline_loss_factors(plan.model, self.sizes, sample_weight)[0]
        self.x = jax.device_put(x, devices[0])
        self.y = None if y is None else jax.device_put(y, devices[-1])
        self.sample_weight = None if sample_weight is None else jax.device_put(sample_weight, devices[-1])
        self.trainable = [_put([trainable[i] for i in ids], [devices[s]] * len(ids))
                          for s, ids in enumerate(plan.trainable)]
        self.non_trainable = [_put([non_trainable[i] for i in ids], [devices[s]] * len(ids))
                              for s, ids in enumerate(plan.non_trainable)]
        self.start = [list(values) for values in self.non_trainable]  # seed states as the step found them
        self.metrics = None if metrics is None else _put(metrics, layout.metrics)
        self.held, self.wire, self.outputs, self.losses = {}, {}, {}, []
        self.sums = [None] * plan.stages

    def rows(self, value, m, s):
        """Micro-batch ``m``'s rows of ``value``, on stage ``s``'s devices (:meth:`Plan.put_rows`)."""
        start, stop = self.offsets[m], self.offsets[m] + self.sizes[m]
        return self.plan.put_rows(keras.tree.map_structure(lambda t: None if t is None else t[start:stop], value), s)

    def forward(self, s, m):
        plan = self.plan
        last = s == plan.last
        x = self.rows(self.x, m, s) if s == 0 else self.wire.pop((pipeline.FORWARD, s, m))
        ntv = list(self.non_trainable[s])
        for i in plan.seeds[s]:  # every micro-batch draws from the step's random state
            ntv[i] = self.start[s][i]
        function = _forward_function(plan, s, self.training, self.total if plan.seeds[s] else None)
        metrics = self.metrics if last and self.metrics is not None else []
        share = jax.device_put(jnp.asarray([self.shares[m], self.factors[m]], "float32"), plan.replicated[s])
        offset = jax.device_put(jnp.asarray(self.offsets[m], "int32"), plan.replicated[s])
        output, loss, ntv, metrics, pullback = function(
            self.trainable[s], ntv, x, self.rows(self.y, m, s) if last else None,
            self.rows(self.sample_weight, m, s) if last else None, metrics, share, offset)
        first = keras.tree.flatten(output)[0]
        plan.ran[s].add((tuple(sorted(d.id for d in first.sharding.device_set)),
                         int(first.sharding.shard_shape(first.shape)[0])))
        self.non_trainable[s] = ntv
        if last:
            if self.metrics is not None:
                self.metrics = metrics
            self.outputs[m] = output
        else:
            self.wire[(pipeline.FORWARD, s + 1, m)] = plan.put_rows(output, s + 1)
        self.losses.append(loss)
        if self.training:
            self.held[(s, m)] = (pullback, loss)

    def backward(self, s, m):
        pullback, loss = self.held.pop((s, m))
        gradient = None if s == self.plan.last else self.wire.pop((pipeline.BACKWARD, s, m))
        self.sums[s], back = _backward_function(self.plan, s)(pullback, gradient, loss, self.sums[s])
        if s > 0:
            self.wire[(pipeline.BACKWARD, s - 1, m)] = self.plan.put_rows(back, s - 1)

    def run(self):
        plan, count = self.plan, len(self.sizes)
        if self.training:
            schedules = [pipeline.schedule(plan.schedule, plan.stages, s, count) for s in range(plan.stages)]
        else:
            schedules = [[(pipeline.FORWARD, m) for m in range(count)]] * plan.stages
        for s, kind, m in pipeline.interleave(schedules):
            (self.forward if kind == pipeline.FORWARD else self.backward)(s, m)

    def loss(self):
        last = self.plan.replicated[-1]
        return functools.reduce(lambda a, b: a + b, [jax.device_put(v, last) for v in self.losses])

    def prediction(self):
        outputs = [self.outputs[m] for m in range(len(self.sizes))]
        return outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs)

    def state(self, trainable, non_trainable):
        """The model's state lists with each stage's new values."""
        trainable, non_trainable = list(trainable), list(non_trainable)
        for s in range(self.plan.stages):
            for i, value in zip(self.plan.trainable[s], self.trainable[s]):
                trainable[i] = value
            for i, value in zip(self.plan.non_trainable[s], self.non_trainable[s]):
                non_trainable[i] = value
        return trainable, non_trainable


def _logs(plan, step):
    """The step's logs and new metrics values, on the last stage: the loss tracker takes the sum of every stage's
    share, the compiled metrics the whole batch's predictions."""
    prediction = step.prediction()
    # Keras reads only the batch size from x here (and a Functional model's compute_metrics ignores x): the
    # predictions, already on the last stage's device, stand in for the input, which lives on the first.
    return _metrics_function(plan)(step.metrics, step.loss(), prediction, step.y, prediction, step.sample_weight)


def steps(plan):
    """The state functions Keras' JAX trainer calls (``train_step(state, data)`` ...), driving the stages."""
    model = plan.model

    def train_step(state, data):
        trainable, non_trainable, optimizer_values, metrics = state
        layout = plan.layout
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = Step(plan, layout, True, x, y, sample_weight, trainable, non_trainable, metrics)
        step.run()
        optimizer_values = list(optimizer_values)
        shared_new = None
        scales = _global_clip_scales(plan, model.optimizer, step.sums)
        for s in range(plan.stages):
            device = plan.replicated[s]
            slots = layout.slots.get(s, [])
            values, slot_values, shared = _apply_function(plan, s, layout)(
                step.trainable[s], step.sums[s], _put([optimizer_values[i] for i in slots], [device] * len(slots)),
                _put([optimizer_values[i] for i in layout.shared], [device] * len(layout.shared)),
                None if scales is None else scales[s])
            step.trainable[s] = values
            for i, value in zip(slots, slot_values):
                optimizer_values[i] = value
            if shared_new is None:
                shared_new = shared  # every stage advanced its copy alike; stage 0's (on the shared device) stays
        for i, value in zip(layout.shared, shared_new or []):
            optimizer_values[i] = value
        trainable, non_trainable = step.state(trainable, non_trainable)
        logs, metrics = _logs(plan, step)
        return logs, (trainable, non_trainable, optimizer_values, metrics)

    def test_step(state, data):
        trainable, non_trainable, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = Step(plan, plan.layout, False, x, y, sample_weight, trainable, non_trainable, metrics)
        step.run()
        trainable, non_trainable = step.state(trainable, non_trainable)
        logs, metrics = _logs(plan, step)
        return logs, (trainable, non_trainable, metrics)

    def predict_step(state, data):
        trainable, non_trainable = state
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        step = Step(plan, plan.layout, False, x, None, None, trainable, non_trainable, None)
        step.run()
        trainable, non_trainable = step.state(trainable, non_trainable)
        return step.prediction(), (trainable, non_trainable)

    def maker(name, step, concatenate=False):
        attribute = name.replace("make_", "")

        def make(force=False):
            current = getattr(model, attribute)
            if current is not None and not force:
                return current
            if name == "make_train_function":
                check_optimizer(model)
            compiled = (getattr(model, "optimizer", None), getattr(model, "_compile_loss", None),
                        getattr(model, "_compile_metrics", None))
            if plan.compiled is None or any(a is not b for a, b in zip(plan.compiled, compiled)):
                plan.functions.clear()  # traced with an earlier compile()'s loss and optimizer
                plan.compiled = compiled
            plan.layout = place(plan)  # the optimizer and metrics Keras built since
            # Keras' JAX trainer's loop over steps_per_execution batches (a private), around our Python step.
            function = model._make_function(step, concatenate_outputs=concatenate)
            setattr(model, attribute, function)
            return function

        return make

    return {"make_train_function": maker("make_train_function", train_step),
            "make_test_function": maker("make_test_function", test_step),
            "make_predict_function": maker("make_predict_function", predict_step, concatenate=True)}


def install(model, plan):
    """Hook the model's step makers (instance attributes, see :func:`keras_model.hook`) and place its variables."""
    plan.layout = place(plan)
    for name, make in steps(plan).items():
        keras_model.hook(model, name, make)
    keras_model.hook(model, PLAN, plan)
    model.train_function = model.test_function = model.predict_function = None
