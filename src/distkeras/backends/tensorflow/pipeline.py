"""Pipeline parallelism on TensorFlow, in one process: the stages and schedules of :mod:`distkeras.parallel.pipeline` over
several devices of this process (``distribute(model, ["gpu:0", "gpu:1"], pipeline_stages=2)``), with replicas of
the pipeline when there are stages x replicas devices.

Stage ``s`` is a Keras ``Model`` over the original layers (``keras.Model(tensor_in, tensor_out)`` on the model's
graph, sharing the variables); its devices are one per replica (replica ``r``'s stage ``s`` is device
``r * S + s``), its variables live on the first (their storage re-created there) and its forward and backward run
under ``tf.device`` of each.

- **Replicas**: each micro-batch is split by rows over the stage's devices (:func:`distkeras.parallel.pipeline.replica_rows`);
  each part's forward and backward run on its device, reading the stage's variables from the first device
  (TensorFlow copies them), and the parts' gradients are added there, so the step applies one device's gradient.
  The parts travel to the next stage part by part (replica r's stage s feeds replica r's stage s + 1).

- **Backward primitive**: a ``tf.GradientTape`` per stage and micro-batch, kept from the forward until the
  backward, which is ``tape.gradient([output, stage loss], stage variables + [input], output_gradients=[g, 1])``
  (the last stage from its loss only); each stage adds its variables' gradients to its sums.
- **Wire**: TensorFlow's own copy: a stage's output, used under the next stage's ``tf.device``, is copied there
  by the engine (and a gradient back); no transport of distkeras'.
- **Order**: the stages' action lists (:func:`distkeras.parallel.pipeline.schedule`, GPipe or 1F1B) run in one loop, each
  action after what it needs (:func:`distkeras.parallel.pipeline.interleave`).
- **Traced per batch shape**: Keras' loop over a call's batches runs in Python (its train, test and predict
  functions are made as with ``run_eagerly=True``) and each step is a ``tf.function`` traced for its batch's
  shape (XLA off: one program over several devices), so the micro-batch sizes are ints when it is traced, an
  uneven batch is cut as :func:`distkeras.parallel.pipeline.microbatch_sizes` says and no micro-batch is ever empty; a
  fit() traces twice (its full batches, its last smaller one). ``run_eagerly=True`` runs the step eagerly.
- **Loss**: each micro-batch's mean loss is weighed by its share of the batch (``pipeline.weights``), and each
  stage adds its own layers' losses (regularizers) weighed the same way, so the summed gradients are one
  device's at the global batch. The logged loss is the sum of the parts; metrics are computed on the last
  stage's device on the whole batch's predictions.
- **Optimizer**: built over every variable of the model and applied once per step to every gradient (each
  variable's update runs where the variable lives), so ``global_clipnorm``, EMA and accumulation see the global
  gradient as on one device.
- **Random draws** (Dropout, GaussianNoise, ``keras.random`` in a layer): one device's. Before each micro-batch
  a stage's seed-generator states are put back to where the step found them, and each draw whose leading
  dimension is the micro-batch's rows is drawn at the global batch's shape and sliced to its rows
  (:func:`distkeras.backends.tensorflow.steps.draw_like_one_device`); the states advance once per step.
- **BatchNormalization**: normalises by each micro-batch's statistics and updates its moving statistics once per
  micro-batch (GPipe's choice): a model with BatchNormalization trains close to, not exactly as, one device.
- **Saving**: every variable is one ``tf.Variable`` on one device: ``save()`` writes the plain model.
"""

import contextlib

import keras
import tensorflow as tf

from ...parallel import pipeline
from .. import keras_model
from . import steps as tensorflow_steps

#: The plan's attribute on a model split into stages (read by name by the adapter's ``model_shards``).
PLAN = pipeline.PLAN
#: The step makers :func:`install` hooks.
_MAKERS = ("make_train_function", "make_test_function", "make_predict_function")


class Plan(object):
    """A model cut into ``parts``, one per list of ``devices``: a stage's device names (``"/device:CPU:1"``), one
    per replica; its variables live on the first."""

    def __init__(self, model, parts, devices, microbatches, schedule):
        self.model, self.parts, self.devices = model, parts, [list(d) for d in devices]
        self.stages, self.replicas = len(parts), len(self.devices[0])
        self.microbatches, self.schedule = microbatches, schedule
        self.models = [pipeline.stage_model(model, p) for p in parts]
        #: Per stage: the seed-generator state variables of its layers.
        self.seeds = [pipeline.seed_states(m) for m in self.models]
        #: Per stage: the device of its first replica's last output, read from TensorFlow (``tensor.device``: where it
        #: was computed, eagerly; the device its op was placed on, traced); and every device its outputs came from.
        self.placed = [None] * self.stages
        self.ran = [set() for _ in parts]
        self.traced, self.eager = {}, set()  # the traced steps by name, the names run eagerly (see traced())

    @property
    def last(self):
        return self.stages - 1


# ---------------------------------------------------------------------------------------------- placement


def place(plan):
    """Each stage's variables (and the optimizer slots made from them, when built) re-created on its device.

    Keras' TensorFlow ``Variable`` keeps its storage in the private ``_value`` (a ``tf.Variable``) and makes it in
    ``_initialize(value)``; no public API moves a variable (the data-parallel path does the same under a strategy).
    The optimizer indexes its variables by their storage, so its index is rebuilt after."""
    model = plan.model
    owner = {}
    for s, stage in enumerate(plan.models):
        for variable in stage.variables:
            owner.setdefault(id(variable), s)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        by_path = {v.path.replace("/", "_"): owner[id(v)] for v in model.trainable_variables if id(v) in owner}
        for slot in optimizer.variables:
            name = slot.path.partition("/")[2] if "/" in slot.path else slot.name
            matches = [key for key in by_path if name.startswith(key + "_")]
            if matches:
                owner[id(slot)] = by_path[max(matches, key=len)]
    variables = list(model.variables) + (list(optimizer.variables) if optimizer is not None else [])
    with tf.init_scope():
        for variable in variables:
            s = owner.get(id(variable))
            storage = getattr(variable, "_value", None)
            if s is None or storage is None or _same_device(storage.device, plan.devices[s][0]):
                continue
            value = storage.read_value()
            flag = variable.trainable
            variable.trainable = bool(getattr(storage, "trainable", flag))  # as the data-parallel path keeps it
            try:
                with tf.device(plan.devices[s][0]):
                    variable._initialize(tf.identity(value))
            finally:
                variable.trainable = flag
    if optimizer is not None and getattr(optimizer, "built", False) and hasattr(optimizer, "_trainable_variables"):
        optimizer._trainable_variables_indices = {  # Keras' index by storage (a private), rebuilt
            optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)}


def _same_device(found, wanted):
    return tf.DeviceSpec.from_string(found or "").to_string().lower().endswith(
        tf.DeviceSpec.from_string(wanted).to_string().lower())


# ---------------------------------------------------------------------------------------------- the step


def _rows(value, start, count):
    return tf.nest.map_structure(lambda t: None if t is None else t[start:start + count], value)


class Step(object):
    """One batch through the stages, eagerly: training (with the backward) or not. Each micro-batch is split by
    rows over a stage's replicas (:func:`distkeras.parallel.pipeline.replica_rows`), each part computed on its device."""

    def __init__(self, plan, training, x, y, sample_weight):
        self.plan, self.training = plan, training
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.total = int(next(t for t in tf.nest.flatten(x) if t is not None).shape[0])
        self.sizes = pipeline.microbatch_sizes(self.total, plan.microbatches)
        self.offsets = [sum(self.sizes[:m]) for m in range(len(self.sizes))]
        #: Per micro-batch: (offset in the batch, rows) of each replica's part.
        self.parts = []
        for offset, size in zip(self.offsets, self.sizes):
            rows = pipeline.replica_rows(size, plan.replicas)
            self.parts.append([(offset + sum(rows[:r]), rows[r]) for r in range(len(rows))])
        # The compiled loss' rule (pipeline.loss_rule): a part's compiled loss is weighed by _factor, not its rows.
        self.rule = "mean" if y is None else keras_model.pipeline_loss_rule(plan.model)
        self.weight_total = None
        if self.rule == "weighted" and sample_weight is not None:
            pipeline.refuse_weights_per_output(tf.nest.is_nested(sample_weight), plan.model.name)
            self.weight_total = tf.reduce_sum(tf.cast(sample_weight, "float32"))  # a tensor: the step may be traced
        self.start = [[s.value.read_value() for s in seeds] for seeds in plan.seeds]  # the states the step found
        self.tapes, self.wire, self.outputs, self.losses = {}, {}, {}, []
        self.variables = [m.trainable_variables for m in plan.models]
        self.sums = [None] * plan.stages

    def _factor(self, start, count):
        """The factor of the compiled loss of the batch's rows ``start:start + count`` (pipeline.loss_factors)."""
        rows = pipeline.loss_factors(self.rule, [count, self.total - count])[0]
        if self.weight_total is None:
            return rows
        # pipeline.loss_factors' "weighted" rule in TensorFlow ops (the sums are tensors in a traced step): the
        # part's sample weights over the batch's, by rows where they are all 0.
        part = tf.reduce_sum(tf.cast(_rows(self.sample_weight, start, count), "float32"))
        return tf.where(self.weight_total > 0, tf.math.divide_no_nan(part, self.weight_total), rows)

    @contextlib.contextmanager
    def _part(self, s, start, count):
        """Stage ``s`` drawing the rows ``start:start + count`` of the global batch's draws, from the step's seed
        states."""
        for state, value in zip(self.plan.seeds[s], self.start[s]):
            state.assign(value)
        rows = tensorflow_steps.Rows(tf.constant(count, tf.int32), tf.constant(start, tf.int32),
                                     tf.constant(self.total, tf.int32), False)
        with tensorflow_steps.holding_rows(rows):
            yield

    def forward(self, s, m):
        plan = self.plan
        outputs = []
        for r, (start, count) in enumerate(self.parts[m]):
            outputs.append(self._forward(s, m, r, start, count))
        if s == plan.last:
            self.outputs[m] = outputs

    def _forward(self, s, m, r, start, count):
        plan, model = self.plan, self.plan.model
        last = s == plan.last
        with tf.device(plan.devices[s][r]):
            x = _rows(self.x, start, count) if s == 0 else tf.identity(self.wire.pop((pipeline.FORWARD, s, m, r)))
            tape = tf.GradientTape() if self.training else contextlib.nullcontext()
            with tape:
                if self.training and s > 0:
                    tape.watch(x)
                with self._part(s, start, count):
                    output = plan.models[s](x, training=self.training)
                # Each stage adds its own layers' losses (regularizers), as Trainer.compute_loss adds the model's;
                # _aggregate_additional_loss is Keras' private for that sum.
                parts = [model._aggregate_additional_loss(loss) for loss in plan.models[s].losses] \
                    if self.y is not None else []
                if last and self.y is not None:
                    # The compiled loss alone (CompileLoss, a Keras private, called as Trainer.compute_loss calls
                    # it): every stage's layer losses are added by their stage.
                    compiled = model._compile_loss(_rows(self.y, start, count), output,
                                                   _rows(self.sample_weight, start, count))
                else:
                    compiled = None
                # The part's share of the batch: the layers' losses weighed by its rows, the compiled loss by its
                # reduction's factor, so the parts sum to the global batch's.
                share = count / float(self.total)
                weighed = ([share * tf.add_n([tf.cast(p, "float32") for p in parts])] if parts else []) + (
                    [self._factor(start, count) * tf.cast(compiled, "float32")] if compiled is not None else [])
                loss = tf.add_n(weighed) if weighed else None
                scaled = None
                if loss is not None and self.training and model.optimizer is not None:
                    scaled = model.optimizer.scale_loss(loss)
        if r == 0:
            plan.placed[s] = output.device
        plan.ran[s].add(output.device)
        if loss is not None:
            self.losses.append(loss)
        if not last:
            self.wire[(pipeline.FORWARD, s + 1, m, r)] = output
        if self.training:
            self.tapes[(s, m, r)] = (tape, x, output, scaled)
        return output

    def backward(self, s, m):
        for r in range(len(self.parts[m])):
            self._backward(s, m, r)

    def _backward(self, s, m, r):
        plan = self.plan
        tape, x, output, loss = self.tapes.pop((s, m, r))
        with tf.device(plan.devices[s][r]):
            if s == plan.last:
                targets, gradients = [loss], None
            else:
                gradient = tf.identity(self.wire.pop((pipeline.BACKWARD, s, m, r)))
                targets, gradients = [output], [gradient]
                if loss is not None:
                    targets.append(loss)
                    gradients.append(tf.ones_like(loss))
            sources = list(self.variables[s]) + ([x] if s > 0 else [])
            found = tape.gradient(targets, sources, output_gradients=gradients,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        mine = found[:len(self.variables[s])]
        with tf.device(plan.devices[s][0]):  # the replicas' gradients summed where the variables live
            self.sums[s] = mine if self.sums[s] is None else [_add(tf, a, b) for a, b in zip(self.sums[s], mine)]
        if s > 0:
            self.wire[(pipeline.BACKWARD, s - 1, m, r)] = found[-1]

    def run(self):
        plan, count = self.plan, len(self.sizes)
        if self.training:
            schedules = [pipeline.schedule(plan.schedule, plan.stages, s, count) for s in range(plan.stages)]
        else:
            schedules = [[(pipeline.FORWARD, m) for m in range(count)]] * plan.stages
        for s, kind, m in pipeline.interleave(schedules):
            (self.forward if kind == pipeline.FORWARD else self.backward)(s, m)

    def loss(self):
        with tf.device(self.plan.devices[-1][0]):
            return tf.add_n([tf.identity(v) for v in self.losses]) if self.losses else tf.zeros((), "float32")

    def prediction(self):
        with tf.device(self.plan.devices[-1][0]):
            outputs = [part for m in range(len(self.sizes)) for part in self.outputs[m]]
            return outputs[0] if len(outputs) == 1 else tf.nest.map_structure(
                lambda *parts: tf.concat(parts, 0), *outputs)


def _logs(plan, step, x, y, sample_weight):
    """Keras' TF trainer's logs: the loss tracker takes the step's loss (weighed by the batch's rows), the
    compiled metrics the whole batch's predictions; on the last stage's device."""
    model = plan.model
    prediction = step.prediction()
    with tf.device(plan.devices[-1][0]):
        # Keras' Trainer's loss Mean (a private), updated as its TF train_step updates it.
        model._loss_tracker.update_state(step.loss(), sample_weight=step.total)
        return model.compute_metrics(x, y, prediction, sample_weight=sample_weight)


def steps(plan):
    """The model's train_step, test_step and predict_step, driving the stages."""
    model = plan.model

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = Step(plan, True, x, y, sample_weight)
        step.run()
        variables = [v for vs in step.variables for v in vs]
        gradients = [g for gs in step.sums for g in gs]
        model.optimizer.apply(gradients, variables)
        return _logs(plan, step, x, y, sample_weight)

    def test_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = Step(plan, False, x, y, sample_weight)
        step.run()
        return _logs(plan, step, x, y, sample_weight)

    def predict_step(data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        step = Step(plan, False, x, None, None)
        step.run()
        return step.prediction()

    return {"train_step": train_step, "test_step": test_step, "predict_step": predict_step}


def _maker(model, plan, name):
    """Keras' own ``make_*_function``, made with ``run_eagerly`` on (the loop over a call's batches is Python), its
    step traced by :func:`traced` unless the user asked for ``run_eagerly``. ``_run_eagerly`` is the private behind
    Keras' ``run_eagerly`` property, set for the making only so the user's setting and compile config stay."""
    keras_make = getattr(type(model), name)
    attribute, step = name.replace("make_", ""), name.replace("make_", "").replace("function", "step")

    def make(force=False):
        current = getattr(model, attribute)
        if current is not None and not force:
            return current
        outer = model._run_eagerly
        plan.traced.pop(step, None)  # a new function (after compile(): its loss and optimizer): traced again
        (plan.eager.add if outer else plan.eager.discard)(step)
        optimizer = getattr(model, "optimizer", None)
        if name == "make_train_function" and optimizer is not None and not optimizer.built:
            with tf.init_scope():  # eagerly, before a trace: its slots next to their variables
                optimizer.build(model.trainable_variables)
        place(plan)  # what was made since (an optimizer built by Keras' symbolic build) to its stage's device
        model._run_eagerly = True
        try:
            return keras_make(model, force)
        finally:
            model._run_eagerly = outer

    return make


def traced(plan, name, step):
    """``step`` run as a ``tf.function`` of its batch's shapes (one trace per batch shape: the micro-batch sizes
    are ints when it is traced; XLA off, a program over several devices), or eagerly (``run_eagerly=True``)."""

    def run(data):
        if name in plan.eager:
            return step(data)
        if name not in plan.traced:
            plan.traced[name] = tf.function(step, autograph=False, jit_compile=False, reduce_retracing=False)
        return plan.traced[name](data)

    return run


def install(model, plan):
    """Place the variables and hook the model's steps and step makers (instance attributes, see
    :func:`keras_model.hook`). Keras' random functions draw one device's values for a micro-batch's rows."""
    place(plan)
    tensorflow_steps.draw_like_one_device(tf)
    tensorflow_steps.draw_tf_like_one_device(tf)
    for name, function in steps(plan).items():
        keras_model.hook(model, name, traced(plan, name, function))
    for name in _MAKERS:
        keras_model.hook(model, name, _maker(model, plan, name))
    keras_model.hook(model, PLAN, plan)
    model.train_function = model.test_function = model.predict_function = None


def _add(tf, a, b):
    """Two micro-batches' gradients of one variable summed. An Embedding's are ``IndexedSlices`` (the rows its
    ids looked up), which ``+`` doesn't add: their rows are concatenated, as one device's gradient over the whole
    batch lists every looked-up row (the optimizer adds repeated rows); a sparse one meeting a dense one is made
    dense."""
    sparse = (isinstance(a, tf.IndexedSlices), isinstance(b, tf.IndexedSlices))
    if all(sparse):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0),
                                a.dense_shape)
    if any(sparse):
        return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)
    return a + b
