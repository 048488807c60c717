"""Stand-in for ``keras.layers.Dense`` (Keras 2.3.1): glorot-uniform kernel drawn from numpy's global
generator, as Keras' CNTK backend seeds its initialisers, zero bias, optional ReLU and L2 penalty."""

import numpy as np

from . import backend as K


class Dense(object):
    def __init__(self, units, activation=None, input_dim=None, kernel_regularizer=None):
        self.units, self.activation, self.input_dim, self.kernel_regularizer = units, activation, input_dim, kernel_regularizer
        self.weights, self.losses = [], []

    def __call__(self, x, fan_in=None):
        fan_in = self.input_dim or fan_in
        limit = np.sqrt(6.0 / (fan_in + self.units))
        self.kernel = K.variable(np.random.uniform(-limit, limit, (fan_in, self.units)), name="kernel")
        self.bias = K.variable(np.zeros(self.units), name="bias")
        self.weights = [self.kernel, self.bias]
        if self.kernel_regularizer:
            self.losses = [self.kernel_regularizer * K.sum(K.square(self.kernel))]
        y = K.dot(x, self.kernel) + self.bias
        return K.relu(y) if self.activation == "relu" else y

    def get_config(self):
        return {"units": self.units, "activation": self.activation, "input_dim": self.input_dim,
                "kernel_regularizer": self.kernel_regularizer}

    @classmethod
    def from_config(cls, config):
        return cls(**config)
