"""``cntk.cntk_py`` (the SWIG module): only ``universal_learner``, which Keras 2.3.1's Function calls."""

from .learners import Learner


class _UniversalLearner(Learner):
    def __init__(self, parameters, gradients, update_function):
        super(_UniversalLearner, self).__init__(parameters)
        self._gradients = list(gradients)
        self._update_function = update_function

    def _update(self, gradients, training_sample_count, is_sweep_end=False):
        # CNTK binds each parameter's gradient to its gradient placeholder and evaluates the update
        # function, whose assign ops (Keras' optimizer updates) change the parameters.
        for parameter, placeholder in zip(self._parameters, self._gradients):
            placeholder.value = gradients[parameter]
        self._update_function._forward_backward({}, [self._update_function], ())
        return True


def universal_learner(parameters, gradients, update_function):
    """``cntk.cntk_py.universal_learner(parameters, gradients, update_func)``: a learner that runs
    ``update_function`` with ``gradients`` (placeholders, one per parameter) bound to the gradients."""
    return _UniversalLearner(parameters, gradients, update_function)
