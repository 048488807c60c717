"""Pipeline parallelism on PyTorch: the stages and schedule of :mod:`distkeras.parallel.pipeline` over torch.distributed.

Process ``r * S + s`` of a job of R replicas x S stages runs stage ``s`` of replica ``r``. Every process holds
the whole Keras model (its stage's layers are what it computes and trains); a stage is a Keras ``Model`` over
the original layers (``keras.Model(tensor_in, tensor_out)`` on the model's graph, sharing the variables).

- **Backward primitive**: torch autograd. A stage's forward keeps, per micro-batch, its input (a leaf that
  requires a gradient) and its output; the backward is ``torch.autograd.backward`` from the output with the
  gradient the next stage sent (and, on the last stage, from the micro-batch's loss), which accumulates the
  stage's variables' ``.grad`` and leaves the input's gradient to send back.
- **Wire**: ``torch.distributed`` ``isend``/``recv`` between neighbouring stages of one replica (gloo on CPU,
  NCCL on GPUs); sends are waited for at the end of the step. The shape of what crosses is known from the
  model's symbolic shapes and the micro-batch sizes (every stage reads the same global batch); where a
  dimension is free (a sequence length), a small shape header goes first.
- **Loss**: each micro-batch's mean loss is weighed by its share of the batch (``pipeline.weights``), so the
  summed gradients are one device's at the global batch; layer losses (regularizers) are added by the stage
  that owns the layer, weighed the same way. The step's loss is the sum over the stages (one all-reduce of a
  scalar), the metrics are the last stage's, copied to every stage, so ``fit()``'s History is alike on every
  process.
- **Optimizer**: built over every variable of the model (so a save holds the whole optimizer state), applied
  by each stage to its own variables.
- **Saving**: ``save``/``save_weights``/``get_weights`` first give every process each stage's current
  variables and optimizer slots (one broadcast per stage from its owner), so any process writes the plain model.
- **Random draws** (Dropout...): each micro-batch draws what one device draws for its rows of the global batch
  (:func:`distkeras.backends.torch.random.global_draws` with the micro-batch's rows), and every stage's seed
  generators are put back before each micro-batch, so they advance once per step, as on one device.
"""



import keras
import torch
import torch.distributed as dist

from ...parallel import pipeline
from ...errors import OptionError
from .. import keras_model
from . import random as torch_random

#: The plan's attribute on a model split into stages.
PLAN = pipeline.PLAN


class Plan(object):
    """This process' stage of a model cut into ``parts``: its index, its replica's ranks (global), the groups."""

    def __init__(self, model, parts, rank, world, microbatches, schedule, group, data_group):
        self.model, self.parts = model, parts
        self.stages = len(parts)
        self.replicas = world // self.stages
        self.replica, self.index = pipeline.stage_of(rank, self.stages)
        self.ranks = [self.replica * self.stages + s for s in range(self.stages)]
        self.microbatches, self.schedule = microbatches, schedule
        self.group, self.data_group = group, data_group
        part = parts[self.index]
        self.stage = pipeline.stage_model(model, part)
        self.owned = [_variables(p.layers) for p in parts]
        self.trainable = [v for v in self.owned[self.index] if v.trainable]

    @property
    def first(self):
        return self.index == 0

    @property
    def last(self):
        return self.index == self.stages - 1


def _variables(layers):
    seen, out = set(), []
    for layer in layers:
        for variable in getattr(layer, "variables", ()):  # an operation (x + y) has none
            if id(variable) not in seen:
                seen.add(id(variable))
                out.append(variable)
    return out


def make_plan(model, stages, microbatches, schedule, rank, world):
    """Cut ``model`` (:func:`distkeras.parallel.pipeline.plan`) and make the process groups (every process makes every
    group, in the same order: torch's rule)."""
    parts = pipeline.plan(model, stages)
    if len(parts) < 2:
        raise OptionError("pipeline_stages={!r} gives one stage: nothing to pipeline. Give 2 or more.".format(stages))
    replicas = pipeline.check_world(world, len(parts))
    if getattr(model, "_compile_loss", None) is None:
        raise OptionError("pipeline stages train a compiled model: compile({!r}) with a loss first".format(model.name))
    pipelines, data = pipeline.groups(world, len(parts))
    group = data_group = None
    if replicas > 1:
        for ranks in pipelines:
            made = dist.new_group(ranks)
            group = made if rank in ranks else group
        for ranks in data:
            made = dist.new_group(ranks)
            data_group = made if rank in ranks else data_group
    microbatches = 2 * len(parts) if microbatches is None else microbatches
    return Plan(model, parts, rank, world, microbatches, schedule, group, data_group)


# ---------------------------------------------------------------------------------------------- the stage


def _rows(value, start, count):
    if value is None:
        return None
    return keras.tree.map_structure(lambda t: t[start:start + count], value)


def _rows_of_batch(x):
    return next(int(t.shape[0]) for t in keras.tree.flatten(x) if t is not None)


def _torch_dtype(name):
    return getattr(torch, keras.backend.standardize_dtype(name))


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _across_replicas(plan, factors, rows, weight):
    """A replica's ``"weighted"`` factors (of its own rows' sample weights) made the global batch's: the replicas'
    gradients are combined weighed by their rows (n_r / N, as data parallelism combines them), where one device
    weighs the replica's part by its sample weights (W_r / W). One all-reduce of (rows, weight) over the stage's
    replicas; every stage with targets computes it, in the same step."""
    both = torch.tensor([float(rows), float(weight)], dtype=torch.float64, device=_device())
    dist.all_reduce(both, group=plan.data_group)
    total_rows, total_weight = float(both[0]), float(both[1])
    if weight <= 0 or total_weight <= 0:
        return factors
    scale = (weight / total_weight) / (rows / total_rows)
    return [factor * scale for factor in factors]


class TorchStage(pipeline.Stage):
    """One step's micro-batches on this process' stage (see :class:`distkeras.parallel.pipeline.Stage`)."""

    def __init__(self, plan, x, y, sample_weight, training):
        self.plan, self.x, self.y, self.sample_weight, self.training = plan, x, y, sample_weight, training
        self.first, self.last = plan.first, plan.last
        self.total = _rows_of_batch(x)
        self.sizes = pipeline.microbatch_sizes(self.total, plan.microbatches)
        self.shares = pipeline.weights(self.sizes)
        self.offsets = [sum(self.sizes[:m]) for m in range(len(self.sizes))]
        self.factors = self.shares
        if y is not None:  # the compiled loss' factors follow its reduction (a sum's micro-batches add up as they are)
            self.factors, weight = keras_model.pipeline_loss_factors(plan.model, self.sizes, sample_weight)
            if weight is not None and plan.replicas > 1:
                self.factors = _across_replicas(plan, self.factors, self.total, weight)
        self.saved, self.sends, self.outputs = {}, [], {}
        self.loss = torch.zeros((), dtype=torch.float64)
        self.seeds = _seed_states(plan.stage)
        self.rng_sent = False

    # -- compute

    def forward(self, m, inputs):
        plan, start, count = self.plan, self.offsets[m], self.sizes[m]
        if self.first:
            inputs = _rows(self.x, start, count)
        elif self.training:
            inputs.requires_grad_(True)
        _restore(self.seeds)  # every micro-batch draws from the step's random state (see the module docstring)
        with torch.set_grad_enabled(self.training), torch_random.global_draws(0, 2, count, self.total,
                                                                              rows=slice(start, start + count)):
            output = plan.stage(inputs, training=self.training)
            losses = [] if self.y is None else [plan.model._aggregate_additional_loss(loss) for loss in
                                                plan.stage.losses]
            if self.last and self.y is not None:
                # The compiled loss alone (Keras' Trainer.compute_loss adds every layer's losses; here each stage
                # adds its own layers'): CompileLoss, a Keras private, called as compute_loss calls it.
                compiled = plan.model._compile_loss(_rows(self.y, start, count), output,
                                                    _rows(self.sample_weight, start, count))
            else:
                compiled = None
            # The layers' losses (a regularizer's, a batch mean's) weighed by the micro-batch's rows; the compiled
            # loss by its reduction's factor (pipeline.loss_factors).
            parts = ([self.shares[m] * sum(losses)] if losses else []) + (
                [self.factors[m] * compiled] if compiled is not None else [])
            loss = sum(parts) if parts else None
        if loss is not None:
            self.loss += loss.detach().to(torch.float64).cpu()
        if self.last:
            self.outputs[m] = output.detach()
        if self.training:
            optimizer = plan.model.optimizer
            if loss is not None and optimizer is not None:  # a LossScaleOptimizer's scale, as Keras' train_step
                loss = optimizer.scale_loss(loss)  # (the gradient the next stage sends back is scaled alike)
            self.saved[m] = (inputs, output, loss)
        return output.detach()

    def backward(self, m, gradient):
        inputs, output, loss = self.saved.pop(m)
        tensors, gradients = [], []
        if gradient is not None:
            tensors.append(output)
            gradients.append(gradient)
        if loss is not None and loss.requires_grad:
            tensors.append(loss)
            gradients.append(torch.ones_like(loss))
        if tensors:
            torch.autograd.backward(tensors, gradients)
        if self.first:
            return None
        return inputs.grad if inputs.grad is not None else torch.zeros_like(inputs)

    # -- the wire

    def _peer(self, kind):
        step = 1 if kind == pipeline.FORWARD else -1
        return self.plan.ranks[self.plan.index + step]

    def _symbolic(self, kind):
        part = self.plan.parts[self.plan.index]
        return part.input if kind == pipeline.FORWARD else part.output  # what arrives: an input or an output gradient

    def send(self, kind, m, value):
        part = self.plan.parts[self.plan.index]
        symbolic = part.output if kind == pipeline.FORWARD else part.input
        value = value.contiguous()
        peer = self._peer(kind)
        tag = 2 * m + (kind == pipeline.BACKWARD)
        if not _static(symbolic):
            header = torch.tensor(list(value.shape), dtype=torch.int64, device=value.device)
            self.sends.append((dist.isend(header, dst=peer, group=self.plan.group, tag=tag), header))
        self.sends.append((dist.isend(value, dst=peer, group=self.plan.group, tag=tag), value))
        if kind == pipeline.FORWARD and not self.rng_sent:
            # torch's generator as this stage's first micro-batch left it: where one device's next layer draws from.
            state = _rng_get().to(value.device)
            self.sends.append((dist.isend(state, dst=peer, group=self.plan.group, tag=_RNG_TAG), state))
            self.rng_sent = True

    def receive(self, kind, m):
        symbolic = self._symbolic(kind)
        peer = self.plan.ranks[self.plan.index + (-1 if kind == pipeline.FORWARD else 1)]
        tag = 2 * m + (kind == pipeline.BACKWARD)
        device = _device()
        if _static(symbolic):
            shape = [self.sizes[m]] + [int(d) for d in symbolic.shape[1:]]
        else:
            header = torch.empty(len(symbolic.shape), dtype=torch.int64, device=device)
            dist.recv(header, src=peer, group=self.plan.group, tag=tag)
            shape = header.tolist()
        buffer = torch.empty(shape, dtype=_torch_dtype(symbolic.dtype), device=device)
        dist.recv(buffer, src=peer, group=self.plan.group, tag=tag)
        if kind == pipeline.FORWARD and "received" not in self.seeds:
            state = torch.empty_like(_rng_get()).to(device)
            dist.recv(state, src=peer, group=self.plan.group, tag=_RNG_TAG)
            self.seeds["torch"] = state.cpu()
            self.seeds["received"] = True
        return buffer

    def flush(self):
        for work, _ in self.sends:
            work.wait()
        self.sends = []
        _advance(self.seeds)


#: The tag of torch's generator state, sent once per step with the first activation.
_RNG_TAG = 1 << 20


def _rng_get():
    """torch's generator that Dropout draws from on this device (the CUDA one on a GPU), as bytes."""
    if dist.get_backend() == "nccl":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _rng_set(state):
    if dist.get_backend() == "nccl":
        torch.cuda.set_rng_state(state.cpu())
    else:
        torch.set_rng_state(state.cpu())


def _static(symbolic):
    return all(d is not None for d in symbolic.shape[1:])


# ---------------------------------------------------------------------------------------------- random state


def _seed_states(stage):
    """The seed generators' states of ``stage``'s layers (and Keras' global one), as the step found them."""
    from keras.src.backend.common import global_state  # a Keras private: where the global seed generator lives

    states = list(pipeline.seed_states(stage))
    found = global_state.get_global_attribute("global_seed_generator")
    if found is not None and all(found.state is not state for state in states):
        states.append(found.state)
    states = {id(state): (state, state.value.detach().clone()) for state in states}
    return {"states": states, "torch": _rng_get(), "after": None}


def _restore(seeds):
    """Before a micro-batch: the states of the step's start. The states one micro-batch leaves (each micro-batch
    draws once per layer, as one device does per step) are kept to leave at the end (:func:`_advance`)."""
    if seeds["after"] is None and seeds.get("ran"):
        seeds["after"] = ({key: state.value.detach().clone() for key, (state, _) in seeds["states"].items()},
                          _rng_get())
    seeds["ran"] = True
    for state, value in seeds["states"].values():
        state.assign(value)
    _rng_set(seeds["torch"])


def _advance(seeds):
    if not seeds.get("ran"):
        return
    if seeds["after"] is None:  # one micro-batch: its states are the step's end
        return
    values, rng = seeds["after"]
    for key, (state, _) in seeds["states"].items():
        state.assign(values[key])
    _rng_set(rng)


# ---------------------------------------------------------------------------------------------- the steps


def check_optimizer(model):
    """An OptionError where the model's optimizer clips by the global norm: each stage applies it to its own
    variables, so it would clip by each stage's norm, not the model's (not one device's step)."""
    optimizer = getattr(model, "optimizer", None)
    clip = getattr(optimizer, "global_clipnorm", None)
    if clip:
        raise OptionError(
            "pipeline_stages on PyTorch applies the optimizer stage by stage, each process to its own stage's "
            "variables, and {}'s optimizer has global_clipnorm={!r}, which needs the norm over every stage: not "
            "supported with pipeline stages on PyTorch in this version (it would clip by each stage's norm). Use "
            "clipnorm= (per variable), or pipeline stages on JAX or TensorFlow, which clip by the global norm.".format(
                model.name, clip))


def steps(plan):
    """Keras' ``train_step``, ``test_step`` and ``predict_step`` of a model cut into stages, for this process."""
    model = plan.model

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        check_optimizer(model)  # compile() after distribute() may bring one
        for variable in plan.trainable:
            variable.value.grad = None
        stage = TorchStage(plan, x, y, sample_weight, training=True)
        pipeline.run(pipeline.schedule(plan.schedule, plan.stages, plan.index, len(stage.sizes)), stage)
        optimizer = model.optimizer
        if not optimizer.built:  # compile() after distribute(): as distribute() does
            optimizer.build(model.trainable_variables)
            release(plan)
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in plan.trainable], plan.trainable)
        return _logs(plan, stage, x, y, sample_weight)

    def test_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        stage = TorchStage(plan, x, y, sample_weight, training=False)
        pipeline.forward_only(len(stage.sizes), stage)
        return _logs(plan, stage, x, y, sample_weight)

    def predict_step(data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        stage = TorchStage(plan, x, None, None, training=False)
        pipeline.forward_only(len(stage.sizes), stage)
        return _from_last(plan, _prediction(plan, stage))

    return {"train_step": train_step, "test_step": test_step, "predict_step": predict_step}


def _prediction(plan, stage):
    if plan.last:
        return torch.cat([stage.outputs[m] for m in range(len(stage.sizes))])
    output = plan.parts[-1].output
    shape = [stage.total] + [int(d) if d is not None else -1 for d in output.shape[1:]]
    if -1 in shape:
        raise OptionError("predict() with pipeline stages needs the model's output shape fixed past the batch; "
                          "{!r} gives {}".format(plan.model.name, tuple(output.shape)))
    return torch.empty(shape, dtype=_torch_dtype(output.dtype), device=_device())


def _from_last(plan, value):
    dist.broadcast(value, src=plan.ranks[-1], group=plan.group)
    return value


def _logs(plan, stage, x, y, sample_weight):
    """The step's loss (every stage's share summed) and the last stage's metrics, alike on every stage."""
    model = plan.model
    # One device's generator after the step is the last stage's (every stage drew from where the one before
    # left it): every stage takes it, so the next step (and the next epoch's shuffle) draws alike everywhere.
    state = _rng_get().to(_device())
    dist.broadcast(state, src=plan.ranks[-1], group=plan.group)
    _rng_set(state)
    total = stage.loss.to(device=_device(), dtype=torch.float32)
    dist.all_reduce(total, group=plan.group)
    model._loss_tracker.update_state(total, sample_weight=stage.total)  # Keras' Trainer's loss Mean (a private)
    if plan.last:
        y_pred = torch.cat([stage.outputs[m] for m in range(len(stage.sizes))])
    else:  # builds and feeds the metrics as the last stage does; its values replace these below
        y_pred = _prediction(plan, stage).zero_()
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    states = [v for metric in model.metrics if metric is not model._loss_tracker for v in metric.variables]
    if states:
        flat = torch.cat([v.value.detach().reshape(-1).to(torch.float64) for v in states]).to(_device())
        dist.broadcast(flat, src=plan.ranks[-1], group=plan.group)
        offset = 0
        for variable in states:
            size = variable.value.numel()
            variable.assign(flat[offset:offset + size].reshape(variable.value.shape).to(variable.value.dtype))
            offset += size
        logs = model.get_metrics_result()
    return logs


# ---------------------------------------------------------------------------------------------- whole model


def _slots(model, variables):
    """The optimizer slots made from ``variables`` (Adam's moments...): a slot of Keras'
    ``add_variable_from_reference`` is named after its variable's path and has its shape."""
    slots = [v for optimizer in keras_model.all_optimizers(model) for v in optimizer.variables]
    found = []
    for variable in variables:
        prefix = variable.path.replace("/", "_") + "_"
        found.extend(slot for slot in slots if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(
            variable.shape))
    return found


def release(plan):
    """Free the storage of the variables (and optimizer slots) of the other stages: this process holds its own
    stage's state only. Their Keras shapes stay; :func:`gather` gives them values again for a save."""
    for index, owned in enumerate(plan.owned):
        if index == plan.index:
            continue
        for variable in owned + _slots(plan.model, owned):
            storage = variable._value  # Keras' torch Variable keeps its tensor here (a private; as tensor.py)
            if storage.numel():
                storage.data = torch.empty(0, dtype=storage.dtype, device=storage.device)


def gather(plan):
    """Every stage's variables and optimizer slots, from its owner to every process of the replica
    (collective): the whole current model on each, for a save, ``get_weights`` or a load; :func:`release`
    frees the other stages' again after."""
    for index, owned in enumerate(plan.owned):
        variables = owned + _slots(plan.model, owned)
        if not variables:
            continue
        if index != plan.index:
            for variable in variables:
                storage = variable._value
                shape = tuple(variable.shape)  # () for a scalar weight: 1 element, which release() freed too
                if storage.numel() == 0 and 0 not in shape:
                    storage.data = torch.empty(shape, dtype=storage.dtype, device=storage.device)
        by_dtype = {}
        for variable in variables:
            by_dtype.setdefault(variable.value.dtype, []).append(variable)
        for group in by_dtype.values():
            flat = torch.cat([v.value.detach().reshape(-1) for v in group]).to(_device())
            dist.broadcast(flat, src=plan.ranks[index], group=plan.group)
            offset = 0
            for variable in group:
                size = variable.value.numel()
                variable.assign(flat[offset:offset + size].reshape(variable.value.shape))
                offset += size


def describe(model):
    """(stages, microbatches, schedule) of a model cut by :func:`make_plan`, or None."""
    plan = model.__dict__.get(PLAN)
    return None if plan is None else (plan.stages, plan.microbatches, plan.schedule)



