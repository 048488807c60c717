"""Stand-in for Keras 2.3.1's ``SGD`` (with momentum) and ``RMSprop``: ``get_updates`` builds assign ops
on gradient placeholders from ``K.gradients``, which the universal learner runs (``keras/optimizers.py``)."""

from . import backend as K


class Optimizer(object):
    def __init__(self, **config):
        self.config = config
        self.iterations = K.variable(0, name="iterations")
        self.weights = []

    def get_config(self):
        return dict(self.config)


class SGD(Optimizer):
    def __init__(self, learning_rate=0.01, momentum=0.0):
        super(SGD, self).__init__(learning_rate=learning_rate, momentum=momentum)
        self.learning_rate, self.momentum = learning_rate, momentum

    def get_updates(self, loss, params):
        grads = K.gradients(loss, params)
        self.updates = [K.update_add(self.iterations, 1)]
        moments = [K.zeros(p.shape) for p in params]
        self.weights = [self.iterations] + moments
        for p, g, m in zip(params, grads, moments):
            v = self.momentum * m - self.learning_rate * g
            self.updates.append(K.update(m, v))
            self.updates.append(K.update(p, p + v))
        return self.updates


class RMSprop(Optimizer):
    def __init__(self, learning_rate=0.001, rho=0.9, epsilon=1e-7):
        super(RMSprop, self).__init__(learning_rate=learning_rate, rho=rho, epsilon=epsilon)
        self.learning_rate, self.rho, self.epsilon = learning_rate, rho, epsilon

    def get_updates(self, loss, params):
        grads = K.gradients(loss, params)
        accumulators = [K.zeros(p.shape) for p in params]
        self.weights = [self.iterations] + accumulators
        self.updates = [K.update_add(self.iterations, 1)]
        for p, g, a in zip(params, grads, accumulators):
            new_a = self.rho * a + (1. - self.rho) * K.square(g)
            self.updates.append(K.update(a, new_a))
            self.updates.append(K.update(p, p - self.learning_rate * g / (K.sqrt(new_a) + self.epsilon)))
        return self.updates


def get(identifier):
    return {"sgd": SGD, "rmsprop": RMSprop}[identifier]() if isinstance(identifier, str) else identifier
