"""Pipeline parallelism, written once: where a Keras model can be cut, how the cut is balanced, the schedules
(GPipe, 1F1B) and the loop that runs one schedule over a backend's primitives.

A pipeline puts contiguous **stages** of a model on different processes: stage ``s`` computes its layers on what
stage ``s - 1`` sends it and sends its output on; in the backward pass each stage receives the gradient of its
output, back-propagates through its own layers (accumulating its own variables' gradients) and sends the
gradient of its input back. A global batch is cut into ``microbatches`` so the stages work at once; the idle
share of a step (the "bubble") is ``(S - 1) / (M + S - 1)`` for S stages and M micro-batches.

What differs per backend is only the backward primitive (torch autograd, TensorFlow's ``GradientTape`` with
``output_gradients``, ``jax.vjp``) and the wire (the engine's own send/recv); both are handed to :func:`run` as
a :class:`Stage` object. What doesn't is here:

- :func:`plan` reads a built Functional or Sequential model's graph (Keras' node history, the same
  ``_keras_history`` / ``_inbound_nodes`` attributes Keras' own ``Function`` walks) and cuts it at layer
  boundaries where exactly **one** tensor crosses, balanced by parameter count, or after the layers the user
  names; anything else is an :class:`~distkeras.errors.OptionError` naming why and where it could be cut.
- :func:`schedule` gives each stage its order of forward and backward passes; :func:`run` drives it.
- :func:`microbatch_sizes` cuts a batch of n rows into M parts that differ by at most one row, and
  :func:`weights` gives each part's share n_m / n: a micro-batch's mean loss times its share, summed, is the
  global batch's mean loss, so the step is one device's step (uneven micro-batches included).
"""

from typing import NamedTuple, Optional, Tuple

from ..errors import OptionError

SCHEDULES = ("gpipe", "1f1b")
#: The instance attribute of a model cut into stages, on every backend: its backend's plan.
PLAN = "_distkeras_pipeline"
FORWARD = "forward"
BACKWARD = "backward"


class Part(NamedTuple):
    """One stage of a cut model: its layers (in the model's order), the tensor it receives (None: the model's
    inputs) and the one tensor it gives (the model's output for the last stage), and its parameter count."""

    index: int
    layers: Tuple[object, ...]
    input: Optional[object]
    output: object
    parameters: int


# ---------------------------------------------------------------------------------------------- the graph


def _history(tensor):
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        return None, None
    operation, node_index = history[0], history[1]
    return operation, operation._inbound_nodes[node_index]


def _nodes(model):
    """The model's nodes from its inputs to its outputs, topologically sorted (InputLayers left out), as Keras'
    ``Function`` sorts them (a depth-first walk back from the outputs). Each is (operation, input tensors,
    output tensors)."""
    inputs = {id(t) for t in model.inputs}
    order, done, active = [], set(), set()

    def visit(tensor):
        if id(tensor) in inputs:
            return
        operation, node = _history(tensor)
        if node is None or id(node) in done:
            return
        if id(node) in active:
            raise OptionError("the model's graph has a cycle at {!r}".format(operation.name))
        active.add(id(node))
        ins = list(node.input_tensors)
        for tensor_in in ins:
            visit(tensor_in)
        active.discard(id(node))
        done.add(id(node))
        if not getattr(node, "is_input", False):
            order.append((operation, ins, list(node.outputs)))

    for output in model.outputs:
        visit(output)
    return order


def _parameters(operation):
    return int(sum(int(_size(w.shape)) for w in getattr(operation, "weights", [])))


def _size(shape):
    total = 1
    for dim in shape:
        total *= int(dim)
    return total


def boundaries(model):
    """Where ``model`` can be cut: ``{position: tensor}`` for each position p (cut after the p-th node) where
    exactly one tensor crosses, no layer is on both sides and the model's inputs are used before only; and the
    sorted nodes."""
    if not getattr(model, "built", False) or not _is_graph(model):
        raise OptionError(_not_a_graph(model))
    nodes = _nodes(model)
    if len(model.outputs) != 1:
        raise OptionError("pipeline stages need a model with one output; {!r} has {}".format(
            model.name, len(model.outputs)))
    model_inputs = {id(t) for t in model.inputs}
    last_use, first_node, last_node = {}, {}, {}
    for position, (operation, ins, _) in enumerate(nodes):
        for tensor in ins:
            last_use[id(tensor)] = position
        first_node.setdefault(id(operation), position)
        last_node[id(operation)] = position
    for tensor in model.outputs:
        last_use[id(tensor)] = len(nodes)
    spanned = set()  # positions a layer used by several nodes spans
    for key, first in first_node.items():
        spanned.update(range(first + 1, last_node[key] + 1))
    found = {}
    live = {id(t): t for t in model.inputs}  # tensors made so far and used later
    for position, (_, _, outs) in enumerate(nodes[:-1], start=1):
        for tensor in outs:
            live[id(tensor)] = tensor
        live = {key: t for key, t in live.items() if last_use.get(key, -1) >= position}
        if len(live) == 1 and position not in spanned and not set(live) & model_inputs:
            found[position] = next(iter(live.values()))
    return found, nodes


def _is_graph(model):
    try:
        return bool(model.inputs) and bool(model.outputs)
    except (AttributeError, ValueError):
        return False


def _not_a_graph(model):
    return ("pipeline stages cut a model's graph of layers, and {!r} ({}) has none to read: a subclassed model's "
            "call() is free-form Python. Build it as a Functional or Sequential model (its blocks may be "
            "subclassed layers), with an Input, before distribute().".format(
                getattr(model, "name", model), type(model).__name__))


def _layer_name(nodes, position):
    return nodes[position - 1][0].name


def plan(model, stages):
    """Cut ``model`` into pipeline stages: ``stages`` an int (balanced by parameter count) or a list of layer
    names to cut after. A list of :class:`Part`."""
    found, nodes = boundaries(model)
    names = [_layer_name(nodes, p) for p in sorted(found)]
    if isinstance(stages, bool) or not isinstance(stages, (int, list, tuple)):
        raise OptionError("Expected pipeline_stages as a number of stages or a list of layer names to cut after. "
                          "Received: pipeline_stages={!r}".format(stages))
    if isinstance(stages, int):
        if stages < 1:
            raise OptionError("Expected pipeline_stages >= 1. Received: pipeline_stages={}".format(stages))
        if stages - 1 > len(found):
            blocked = [p for p in range(1, len(nodes)) if p not in found]
            raise OptionError(
                "{!r} can be cut in {} place(s) only (after {}), so into at most {} stages; pipeline_stages={} "
                "asked for more. Cut places are layer boundaries that exactly one tensor crosses{}".format(
                    model.name, len(found), _listed(names), len(found) + 1, stages,
                    ": not after {}.".format("; ".join("{!r} ({})".format(_layer_name(nodes, p), _why_not(
                        model, nodes, p)) for p in blocked[:3]) + ("; ..." if len(blocked) > 3 else ""))
                    if blocked else "."))
        cuts = _balanced(nodes, sorted(found), stages)
    else:
        cuts = []
        by_name = {}
        for position, (operation, _, _) in enumerate(nodes, start=1):
            by_name[operation.name] = position
        for name in stages:
            if name not in by_name:
                raise OptionError("pipeline_stages names layer {!r}, which {!r} doesn't have (it has {})".format(
                    name, model.name, _listed([op.name for op, _, _ in nodes])))
            position = by_name[name]
            if position not in found:
                raise OptionError("{!r} can't be cut after {!r}: {}. It can be cut after {}.".format(
                    model.name, name, _why_not(model, nodes, position), _listed(names)))
            cuts.append(position)
        if cuts != sorted(set(cuts)):
            raise OptionError("pipeline_stages must name layers in the model's order, each once. Received: {}; the "
                              "order is {}".format(list(stages), _listed(names)))
    return _parts(model, nodes, cuts, found)


def _listed(names):
    return ", ".join(repr(n) for n in names) if names else "nowhere"


def _why_not(model, nodes, position):
    if position == len(nodes):
        return "it is the last layer"
    ops = {id(op) for op, _, _ in nodes[:position]}
    shared = [op.name for op, _, _ in nodes[position:] if id(op) in ops]
    if shared:
        return "layer {!r} is used on both sides".format(shared[0])
    used_later = set()
    for _, ins, _ in nodes[position:]:
        used_later.update(id(t) for t in ins)
    used_later.update(id(t) for t in model.outputs)
    crossing = [t for t in model.inputs if id(t) in used_later]
    for _, _, outs in nodes[:position]:
        crossing += [t for t in outs if id(t) in used_later]
    described = ", ".join("the output of {!r}".format(_history(t)[0].name) if _history(t)[0] is not None and
                          id(t) not in {id(i) for i in model.inputs} else "the model's input" for t in crossing)
    return "{} tensors cross there ({}): a skip connection spans the cut".format(len(crossing), described)


def _balanced(nodes, candidates, stages):
    """The cut positions (a subset of ``candidates``) minimising the largest stage's parameter count (ties: the
    most even node counts)."""
    prefix, seen = [0], set()
    for operation, _, _ in nodes:  # a layer used by several nodes holds its weights once
        prefix.append(prefix[-1] + (0 if id(operation) in seen else _parameters(operation)))
        seen.add(id(operation))
    memo = {}

    def best(start, left):  # -> (cost, node spread, cuts) covering nodes[start:] with ``left`` stages
        key = (start, left)
        if key in memo:
            return memo[key]
        if left == 1:
            result = (prefix[len(nodes)] - prefix[start], 0, ())
        else:
            result = None
            for end in candidates:
                if end <= start:
                    continue
                rest = best(end, left - 1)
                if rest is None:
                    continue
                cost = max(prefix[end] - prefix[start], rest[0])
                spread = max(abs((end - start) - len(nodes) / float(stages)), rest[1])
                option = (cost, spread, (end,) + rest[2])
                if result is None or option[:2] < result[:2]:
                    result = option
        memo[key] = result
        return result

    found = best(0, stages)
    return list(found[2])


def _parts(model, nodes, cuts, found):
    parts, start = [], 0
    for index, end in enumerate(list(cuts) + [len(nodes)]):
        layers = []
        for operation, _, _ in nodes[start:end]:
            if all(operation is not other for other in layers):
                layers.append(operation)
        parts.append(Part(index, tuple(layers), None if start == 0 else found[start],
                          model.outputs[0] if end == len(nodes) else found[end],
                          sum(_parameters(op) for op in layers)))
        start = end
    return parts


def describe(parts):
    """One line per stage: its layers and parameters."""
    return "; ".join("stage {}: {} ({} parameters)".format(
        p.index, ", ".join(layer.name for layer in p.layers) if len(p.layers) <= 4 else "{} .. {} ({} layers)".format(
            p.layers[0].name, p.layers[-1].name, len(p.layers)), p.parameters) for p in parts)


# ---------------------------------------------------------------------------------------------- the schedule


def check_schedule(name):
    if name not in SCHEDULES:
        raise OptionError("Expected schedule in {}. Received: schedule={!r}".format(SCHEDULES, name))
    return name


def schedule(name, stages, stage, microbatches):
    """Stage ``stage``'s passes, in order: a list of (FORWARD or BACKWARD, micro-batch).

    - ``gpipe``: every micro-batch forward, then every one backward (M activations held per stage);
    - ``1f1b`` (PipeDream-flush): ``S - s - 1`` forwards to fill the pipe, then one forward and one backward in
      turn, then the remaining backwards (at most ``S - s`` activations held).
    Both give the same gradients; they differ in memory and, on real devices, time."""
    check_schedule(name)
    m = microbatches
    if name == "gpipe":
        return [(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    actions = [(FORWARD, i) for i in range(warm)]
    for i in range(m - warm):
        actions += [(FORWARD, warm + i), (BACKWARD, i)]
    actions += [(BACKWARD, i) for i in range(m - warm, m)]
    return actions


def in_flight(actions):
    """The most micro-batches whose activations a stage holds at once under ``actions``."""
    held = most = 0
    for kind, _ in actions:
        held += 1 if kind == FORWARD else -1
        most = max(most, held)
    return most


def bubble(stages, microbatches):
    """The idle share of a step, (S - 1) / (M + S - 1)."""
    return (stages - 1) / float(microbatches + stages - 1)


def microbatch_sizes(rows, microbatches):
    """``rows`` cut into at most ``microbatches`` parts, the first ones a row larger where it doesn't divide;
    never an empty part (fewer rows than micro-batches: one row each)."""
    count = max(1, min(microbatches, rows))
    base, extra = divmod(rows, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def weights(sizes):
    total = float(sum(sizes))
    return [size / total for size in sizes]


#: What a compiled loss of each Keras reduction is over a batch, and so how its micro-batches' values add up.
LOSS_RULES = {"sum_over_batch_size": "mean", "mean": "mean", "sum": "sum", "mean_with_sample_weight": "weighted"}


def loss_rule(reductions, model_name="the model"):
    """``"mean"``, ``"sum"`` or ``"weighted"``: the one rule the compiled losses' Keras ``reduction``s (one per
    output: a ``Loss`` object's, ``"sum_over_batch_size"`` for a name or a function) follow.

    Raises:
        OptionError: a reduction whose value over a batch isn't made of its micro-batches' (``"none"`` or None:
            the loss reduces itself, to a mean or a sum distkeras can't tell apart), or outputs whose losses reduce
            by different rules (one factor per micro-batch weighs the whole compiled loss).
    """
    rules = set()
    for reduction in reductions:
        rule = LOSS_RULES.get(reduction)
        if rule is None:
            raise OptionError(
                "pipeline stages split each batch into micro-batches and add up their losses, weighed as Keras "
                "reduces the loss over the batch; {}'s compiled loss has reduction={!r}, which hands back the loss "
                "as its function computes it, a mean or a sum that distkeras can't tell apart. Expected a reduction "
                "of {}. Give the loss reduction='sum_over_batch_size' (the default: the function returns one value "
                "per sample) or 'sum', or train without pipeline stages.".format(
                    model_name, reduction, ", ".join(repr(r) for r in LOSS_RULES)))
        rules.add(rule)
    if len(rules) > 1:
        raise OptionError(
            "pipeline stages weigh each micro-batch's compiled loss by one factor; {}'s outputs' losses reduce by "
            "different rules ({}). Expected one reduction for every output's loss. Received: {}".format(
                model_name, ", ".join(sorted(rules)), ", ".join(repr(r) for r in reductions)))
    return rules.pop() if rules else "mean"


def refuse_weights_per_output(nested, model_name):
    """Raise where ``"weighted"`` losses were given sample weights per output (``nested``): one factor per
    micro-batch can't weigh each output's rows by its own weights.

    Raises:
        OptionError: ``nested`` is true.
    """
    if nested:
        raise OptionError(
            "pipeline stages weigh each micro-batch's compiled loss by one factor; {}'s losses reduce by "
            "'mean_with_sample_weight' and fit() was given sample weights per output, which weigh each output's "
            "micro-batches differently. Expected one sample_weight array for every output, or another reduction "
            "('sum_over_batch_size', 'sum').".format(model_name))


def loss_factors(rule, sizes, weight_sums=None):
    """The factor of each micro-batch's compiled loss: the micro-batches' values times these add up to the loss
    one device computes over the whole batch.

    ``"mean"`` (a sum over the rows divided by their count): the micro-batch's rows over the batch's. ``"sum"``:
    1. ``"weighted"`` (a sum over the rows divided by the sum of their sample weights): the micro-batch's sum of
    sample weights (``weight_sums``) over the batch's; by rows where there are no sample weights (or all are 0).

    >>> loss_factors("mean", [3, 1]), loss_factors("sum", [3, 1]), loss_factors("weighted", [3, 1], [1.0, 3.0])
    ([0.75, 0.25], [1.0, 1.0], [0.25, 0.75])
    """
    if rule == "sum":
        return [1.0] * len(sizes)
    if rule == "weighted" and weight_sums is not None and float(sum(weight_sums)) > 0:
        total = float(sum(weight_sums))
        return [float(w) / total for w in weight_sums]
    return weights(sizes)


# ---------------------------------------------------------------------------------------------- the loop


class Stage(object):
    """A backend's primitives for one stage, which :func:`run` calls in the schedule's order.

    ``first`` / ``last``: whether this is stage 0 / stage S-1. ``forward(m, inputs)`` runs micro-batch ``m``
    through the stage's layers, keeping what its backward needs, and returns the output; on the first stage
    ``inputs`` is None (it reads its rows of the batch itself). On the last stage ``forward`` also computes the
    micro-batch's weighted loss. ``backward(m, gradient)`` back-propagates micro-batch ``m`` (``gradient``: that
    of the output; None on the last stage, which starts from its loss), accumulates the stage's variables'
    gradients and returns the gradient of the stage's input (None on the first stage).
    ``send(kind, m, value)`` / ``receive(kind, m)`` move an activation (FORWARD) to the next stage or a gradient
    (BACKWARD) to the previous one over the engine's own point-to-point calls; a send may return at once, and
    ``flush()`` waits for every send of the step."""

    first = last = False

    def forward(self, m, inputs):
        raise NotImplementedError

    def backward(self, m, gradient):
        raise NotImplementedError

    def send(self, kind, m, value):
        raise NotImplementedError

    def receive(self, kind, m):
        raise NotImplementedError

    def flush(self):
        pass


def run(actions, stage):
    """One training step's passes on this stage, in the order ``actions`` gives (:func:`schedule`)."""
    for kind, m in actions:
        if kind == FORWARD:
            inputs = None if stage.first else stage.receive(FORWARD, m)
            output = stage.forward(m, inputs)
            if not stage.last:
                stage.send(FORWARD, m, output)
        else:
            gradient = None if stage.last else stage.receive(BACKWARD, m)
            back = stage.backward(m, gradient)
            if not stage.first:
                stage.send(BACKWARD, m, back)
    stage.flush()


def forward_only(microbatches, stage):
    """Inference (evaluate, predict): every micro-batch forward, in order."""
    for m in range(microbatches):
        inputs = None if stage.first else stage.receive(FORWARD, m)
        output = stage.forward(m, inputs)
        if not stage.last:
            stage.send(FORWARD, m, output)
    stage.flush()


def check_microbatches(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError("Expected microbatches as a positive integer. Received: microbatches={!r}".format(value))
    return value


def model_inputs(model):
    """What a stage model that starts at the model's inputs is built on: ``model.input`` (one tensor, or the
    structure the model was built with), else its list of inputs."""
    try:
        return model.input
    except (AttributeError, ValueError):
        return model.inputs[0] if len(model.inputs) == 1 else model.inputs


def stage_model(model, part):
    """A Keras ``Model`` over ``part`` of ``model`` (its stage), sharing the original layers and variables: built on
    the tensor the part receives (Keras clones the graph's nodes from there), or on the model's inputs."""
    import keras  # here, not at import: this module is imported with distkeras, which imports no framework

    inputs = model_inputs(model) if part.input is None else part.input
    return keras.Model(inputs, part.output, name="{}_stage{}".format(model.name, part.index))


def seed_states(model):
    """The state variables of the seed generators of ``model``'s layers, nested ones included, each once: what a
    stage puts back before each micro-batch so that it draws as one device does."""
    found, seen = [], set()
    for layer in model._flatten_layers(include_self=False):  # Keras' walk of nested layers (a private)
        for generator in getattr(layer, "_seed_generators", None) or []:
            state = getattr(generator, "state", None)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                found.append(state)
    return found


def interleave(schedules):
    """One order of every stage's actions (``schedules[s]``: stage s's list of (kind, micro-batch)) for a pipeline
    whose stages all run in one process: each action comes after what it needs (a forward after the previous
    stage's forward of its micro-batch, a backward after the next stage's backward of it), each stage keeping its
    own order; stages take turns, one action each, so they advance together. A list of (stage, kind, micro-batch)."""
    stages = len(schedules)
    done, position, order = set(), [0] * stages, []
    while any(position[s] < len(schedules[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(schedules[s]):
                continue
            kind, m = schedules[s][position[s]]
            need = (s - 1, kind, m) if kind == FORWARD else (s + 1, kind, m)
            if 0 <= need[0] < stages and need not in done:
                continue
            order.append((s, kind, m))
            done.add((s, kind, m))
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("the pipeline schedules wait on each other: {}".format(schedules))
    return order


def plan_in_process(model, stages, microbatches, schedule, others, cluster, devices, backend):
    """Every check of a pipeline over the devices of one process (one stage per device), then its plan: the
    :class:`Part` list and the micro-batch count (default 2 x stages). ``others``: ``{option: (value, default)}``,
    the backend's other ways of splitting, refused unless at their defaults; ``backend``: its name in messages."""
    if stages is None:
        raise OptionError("microbatches and schedule apply to pipeline_stages only. Received: microbatches={!r}, "
                          "schedule={!r}".format(microbatches, schedule))
    check_schedule(schedule)
    if microbatches is not None:
        check_microbatches(microbatches)
    for name, (value, default) in sorted(others.items()):
        if value != default:
            raise OptionError("pipeline_stages runs each stage's layers whole on one device and doesn't combine with "
                              "{}={!r} in this version. Received: pipeline_stages={!r}, {}={!r}".format(
                                  name, value, stages, name, value))
    if cluster.is_multi_worker:
        raise OptionError("pipeline_stages on {} runs its stages on the devices of one process in this version; this "
                          "process is worker {} of {}. Run one process with a device per stage.".format(
                              backend, cluster.rank, cluster.world_size))
    parts = plan(model, stages)
    if len(parts) < 2:
        raise OptionError("pipeline_stages={!r} gives one stage: nothing to pipeline. Give 2 or more.".format(stages))
    if len(devices) % len(parts):
        raise OptionError(
            "pipeline_stages on {} puts each stage on one device per replica: {} stages need a multiple of {} devices "
            "(stages x replicas). Received: {} device(s) ({}). Give {} device(s) for one replica{}.".format(
                backend, len(parts), len(parts), len(devices), ", ".join(str(d) for d in devices), len(parts),
                "" if len(devices) < len(parts) else ", or {} for {}".format(
                    len(parts) * (len(devices) // len(parts)), len(devices) // len(parts))))
    return parts, 2 * len(parts) if microbatches is None else microbatches


def stage_devices(devices, stages):
    """The devices of each stage, one per replica: replica r's stage s is ``devices[r * stages + s]`` (stage-major
    within a replica, as :func:`stage_of` numbers processes)."""
    replicas = len(devices) // stages
    return [[devices[r * stages + s] for r in range(replicas)] for s in range(stages)]


def replica_rows(count, replicas):
    """A micro-batch of ``count`` rows split over a stage's replicas: each replica's row count (as even as can be,
    the first ones larger; none empty: fewer parts than replicas when ``count`` is smaller)."""
    parts = min(count, replicas)
    return [count // parts + (1 if r < count % parts else 0) for r in range(parts)]


def stage_of(rank, stages):
    """(replica, stage) of process ``rank`` in a job of replicas x stages processes: stage-major within a
    replica, so a replica's stages are neighbours (process r * S + s)."""
    return rank // stages, rank % stages


def groups(world, stages):
    """The process groups, as rank lists: each replica's pipeline (its S stages) and each stage's replicas."""
    replicas = world // stages
    pipelines = [[r * stages + s for s in range(stages)] for r in range(replicas)]
    data = [[r * stages + s for r in range(replicas)] for s in range(stages)]
    return pipelines, data


def check_world(world, stages):
    if world % stages:
        raise OptionError("pipeline_stages={} doesn't divide the job's {} processes: each replica of the pipeline "
                          "needs its {} stages (processes = stages x replicas).".format(stages, world, stages))
    return world // stages
