"""Stand-in for ``keras.backend`` of Keras 2.3.1 with the CNTK backend (``keras/backend/cntk_backend.py``).

A small numpy graph engine plays CNTK's graph: ``variable`` is a parameter, ``constant`` a constant
whose value may be set, ``placeholder`` an input whose first axis is the batch. ``gradients`` returns
constants named ``keras_grad_placeholder``, registered in ``grad_parameter_dict``, as Keras' CNTK backend
does; :class:`Function` builds a universal learner and a ``cntk.Trainer`` from the updates as its
``Function`` does, and runs a step the same way: the trainer with the loss and the first metric, then
the other metrics, then the updates that read inputs (metric states).
"""

import numpy as np

import cntk

grad_parameter_dict = {}
_uids = [0]


def backend():
    return "cntk"


def floatx():
    return "float32"


class Node(object):
    """A tensor of the graph; ``output``/``outputs``/``arguments``/``find_all_with_name`` as CNTK's Function."""

    def __init__(self, kind, inputs=(), name="", forward=None, backward=None):
        self.kind, self.inputs, self.name = kind, list(inputs), name or kind
        self._forward, self._backward = forward, backward
        _uids[0] += 1
        self.uid = _uids[0]

    @property
    def output(self):
        return self

    @property
    def outputs(self):
        return (self,)

    def _walk(self):
        seen, order, stack = set(), [], [(self, False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.append(node)
            elif node.uid not in seen:
                seen.add(node.uid)
                stack.append((node, True))
                stack.extend((child, False) for child in reversed(node.inputs))
        return order

    @property
    def arguments(self):
        return [n for n in self._walk() if n.kind == "input"]

    def find_all_with_name(self, name):
        return [n for n in self._walk() if n.name == name]

    def _forward_backward(self, feed, fetch, wrt):
        """Values of ``fetch`` (nodes) given ``feed`` ({input: array}), and the gradients of ``self`` with
        respect to ``wrt``. Assign nodes write their values once everything is computed."""
        values, assigns = {}, []
        for root in fetch:
            for node in root._walk():
                if node in values:
                    continue
                if node.kind == "input":
                    values[node] = np.asarray(feed[node], dtype="float32")
                elif node.kind in ("parameter", "constant"):
                    values[node] = node.value
                else:
                    values[node] = node._forward(*[values[i] for i in node.inputs])
                    if node.kind == "assign":
                        assigns.append((node.inputs[0], values[node]))
        gradients = {}
        if wrt:
            grads = {self: np.ones_like(values[self])}
            for node in reversed(self._walk()):
                if node not in grads or node._backward is None:
                    continue
                for child, grad in zip(node.inputs, node._backward(grads[node], *[values[i] for i in node.inputs])):
                    if grad is not None:
                        grads[child] = grads[child] + grad if child in grads else grad
            gradients = {p: np.asarray(grads.get(p, np.zeros_like(p.value)), dtype="float32") for p in wrt}
        for ref, value in assigns:
            ref.value = np.asarray(value, dtype="float32").reshape(ref.value.shape)
        return values, gradients

    def eval(self, feed=None):
        return self._forward_backward(feed or {}, [self], ())[0][self]

    def __neg__(self):
        return _op("negate", self)

    __hash__ = object.__hash__


def _operator(kind, reflected=False):
    """A CNTK-style operator overload: ``x + y`` is ``plus(x, y)``, ``2 * x`` is ``element_times(2, x)``."""
    return (lambda self, other: _op(kind, other, self)) if reflected else (lambda self, other: _op(kind, self, other))


for _name, _kind in (("add", "plus"), ("sub", "minus"), ("mul", "element_times"), ("truediv", "element_divide")):
    setattr(Node, "__{}__".format(_name), _operator(_kind))
    setattr(Node, "__r{}__".format(_name), _operator(_kind, reflected=True))


class _Leaf(Node):
    def __init__(self, kind, value, name):
        super(_Leaf, self).__init__(kind, name=name)
        self._value = np.asarray(value, dtype="float32")

    @property
    def value(self):
        return self._value.copy()

    @value.setter
    def value(self, value):
        self._value = np.asarray(value, dtype="float32").reshape(self._value.shape)

    @property
    def shape(self):
        return self._value.shape


def _unbroadcast(grad, shape):
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


_OPS = {
    "plus": (lambda a, b: a + b, lambda g, a, b: (_unbroadcast(g, np.shape(a)), _unbroadcast(g, np.shape(b)))),
    "minus": (lambda a, b: a - b, lambda g, a, b: (_unbroadcast(g, np.shape(a)), _unbroadcast(-g, np.shape(b)))),
    "element_times": (lambda a, b: a * b, lambda g, a, b: (_unbroadcast(g * b, np.shape(a)), _unbroadcast(g * a, np.shape(b)))),
    "element_divide": (lambda a, b: a / b,
                       lambda g, a, b: (_unbroadcast(g / b, np.shape(a)), _unbroadcast(-g * a / (b * b), np.shape(b)))),
    "negate": (lambda a: -a, lambda g, a: (-g,)),
    "times": (lambda a, b: a.dot(b), lambda g, a, b: (g.dot(b.T), a.T.dot(g))),
    "relu": (lambda a: np.maximum(a, 0), lambda g, a: (g * (a > 0),)),
    "square": (lambda a: a * a, lambda g, a: (2 * g * a,)),
    "sqrt": (np.sqrt, None),
    "abs": (np.abs, lambda g, a: (g * np.sign(a),)),
    "reduce_sum": (lambda a: np.asarray(a.sum(), dtype="float32"), lambda g, a: (np.ones_like(a) * g,)),
    "reduce_sum_last": (lambda a: a.sum(axis=-1), lambda g, a: (np.ones_like(a) * g[..., None],)),
    "reduce_mean": (lambda a: np.asarray(a.mean(), dtype="float32"), lambda g, a: (np.ones_like(a) * g / a.size,)),
    "reduce_mean_last": (lambda a: a.mean(axis=-1), lambda g, a: (np.ones_like(a) * g[..., None] / a.shape[-1],)),
    "batch_size": (lambda a: np.asarray(len(a), dtype="float32"), lambda g, a: (None,)),
    "assign": (lambda ref, value: value, None),
    "combine": (lambda *values: values[0], None),
}


def _node(x):
    return x if isinstance(x, Node) else constant(x)


def _op(kind, *inputs):
    forward, backward = _OPS[kind]
    def compute(*values):
        with np.errstate(all="ignore"):  # 0/0 is NaN, as in CNTK
            return np.asarray(forward(*values), dtype="float32")

    return Node(kind, [_node(i) for i in inputs], forward=compute, backward=backward)


# ---- the keras.backend functions used by the stand-in model and by distkeras


def variable(value, dtype=None, name=None, constraint=None):
    return _Leaf("parameter", value, name or "variable")


def constant(value, dtype=None, shape=None, name=None):
    return _Leaf("constant", value * np.ones(shape or ()), name or "constant")


def zeros(shape, dtype=None, name=None):
    return variable(np.zeros(shape), name=name)


def placeholder(shape=None, ndim=None, dtype=None, sparse=False, name=None):
    node = Node("input", name=name or "placeholder")
    node.shape = tuple(shape[1:])
    return node


def sum(x, axis=None, keepdims=False):
    return _op("reduce_sum" if axis is None else "reduce_sum_last", x)


def mean(x, axis=None, keepdims=False):
    return _op("reduce_mean" if axis is None else "reduce_mean_last", x)


def square(x):
    return _op("square", x)


def sqrt(x):
    return _op("sqrt", x)


def abs(x):
    return _op("abs", x)


def relu(x):
    return _op("relu", x)


def dot(x, y):
    return _op("times", x, y)


def batch_size(x):
    return _op("batch_size", x)


def gradients(loss, variables):
    grads = []
    for v in variables:
        g = constant(np.zeros(v.shape), name="keras_grad_placeholder")
        grad_parameter_dict[g] = v
        grads.append(g)
    return grads


def update(x, new_x):
    return Node("assign", [x, _node(new_x)], forward=lambda ref, value: value)


def update_add(x, increment):
    return update(x, x + increment)


def get_value(x):
    return x.value


def set_value(x, value):
    x.value = np.full(x.shape, value, dtype="float32") if isinstance(value, (float, int)) else value


def batch_get_value(xs):
    return [x.value for x in xs]


def batch_set_value(tuples):
    for x, value in tuples:
        x.value = np.asarray(value)


def eval(x):
    return x.value if isinstance(x, _Leaf) else x.eval()


class Function(object):
    """What Keras 2.3.1's ``cntk_backend.Function`` does, on this engine (see the module docstring)."""

    def __init__(self, inputs, outputs, updates=(), **kwargs):
        self.placeholders = list(inputs)
        self.trainer = None
        self.unrelated_updates = None
        u_ops, unrelated = [], []
        for u in updates:
            u = update(*u) if isinstance(u, tuple) else u
            (unrelated if u.arguments else u_ops).append(u)
        if updates:
            self.loss = outputs[0]
            update_func = Node("combine", [u.output for u in u_ops], forward=lambda *v: v[0]) if u_ops else None
            grads = update_func.find_all_with_name("keras_grad_placeholder") if update_func else []
            if grads:
                learner = cntk.cntk_py.universal_learner([grad_parameter_dict[g] for g in grads], grads, update_func)
                criterion = (outputs[0], outputs[1]) if len(outputs) > 1 else (outputs[0],)
                self.trainer = cntk.Trainer(outputs[0], criterion, [learner])
                self.trainer_output = tuple(f.output for f in criterion)
            elif u_ops:
                unrelated.extend(u_ops)
            if unrelated:
                self.unrelated_updates = Node("combine", [u.output for u in unrelated], forward=lambda *v: v[0])
        if self.trainer is None:
            self.metrics_outputs = [f.output for f in outputs]
        else:
            self.metrics_outputs = [f.output for f in outputs[2:]]
        self.metrics_func = self.metrics_outputs or None

    def __call__(self, inputs):
        feed = dict(zip(self.placeholders, inputs))
        updated = []
        if self.trainer is not None:
            _, outputs = self.trainer.train_minibatch({a: feed[a] for a in self.loss.arguments}, self.trainer_output)
            updated.extend(outputs[o] for o in self.trainer_output)
        if self.metrics_func:
            values = self.metrics_outputs[0]._forward_backward(feed, self.metrics_outputs, ())[0]
            updated.extend(values[o] for o in self.metrics_outputs)
        if self.unrelated_updates is not None:
            self.unrelated_updates._forward_backward(feed, [self.unrelated_updates], ())
        return updated


def function(inputs, outputs, updates=[], **kwargs):
    return Function(inputs, outputs, updates=updates, **kwargs)
