"""KerasHub's own task tests (github.com/keras-team/keras-hub, ``keras_hub/src/models/*/*_test.py``): each test's
tiny task, built from arguments as its ``setUp`` builds it (a vocabulary and merges written in code, a backbone of a
few units, no preset, nothing downloaded), trained the way ``TestCase.run_task_test`` trains it: ``fit()`` on raw
strings through the task's preprocessor, then on a ``tf.data`` pipeline the preprocessor maps ahead of the model
(``task.preprocessor = None``), and ``predict()``; at a global batch of 12 and on generated sentences of the
test's words."""

import numpy as np

from tests.backends.corpus.common import ALL, BATCH, distribute, evaluate, fit, keras, merged, predict, result, rng

H = "keras-hub:keras_hub/src/models/"


def _sentences(seed, words, samples, low=2, high=5):
    r = rng(seed)
    return [" ".join(r.choice(words, size=int(r.integers(low, high)))) for _ in range(samples)]


def _run_task(task, devices, x, y=None):
    """``run_task_test``'s training: fit on raw data through the preprocessor, then on a dataset the preprocessor
    maps (split preprocessing); predict on raw data."""
    import tensorflow as tf

    preprocessor = task.preprocessor
    task = distribute(task, devices)
    history = fit(task, x, y, epochs=1)
    ds = tf.data.Dataset.from_tensor_slices((x, y) if y is not None else (x,)).batch(BATCH)
    task.preprocessor = None
    split = task.fit(ds.map(preprocessor), epochs=1, verbose=0)
    task.preprocessor = preprocessor
    predicted = predict(task, x)
    return task, merged(history, split), predicted


def bert_text_classifier(devices):
    """bert/bert_text_classifier_test.py: a ``BertTextClassifier`` of two classes on a two-layer ``BertBackbone``
    (hidden 2, intermediate 4), its ``BertTextClassifierPreprocessor`` over the test's ten-word vocabulary; the
    task's default ``compile()``."""
    import keras_hub

    k = keras()
    k.utils.set_random_seed(130)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += ["the", "quick", "brown", "fox", "."]
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        keras_hub.models.BertTokenizer(vocabulary=vocab), sequence_length=5)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=preprocessor.tokenizer.vocabulary_size(), num_layers=2, num_heads=2, hidden_dim=2,
        intermediate_dim=4, max_sequence_length=preprocessor.sequence_length)
    task = keras_hub.models.BertTextClassifier(preprocessor=preprocessor, backbone=backbone, num_classes=2)
    x = np.array(_sentences(131, ["the", "quick", "slow", "brown", "fox", "fox."], 24))
    y = rng(132).integers(0, 2, size=(24,))
    task, history, predicted = _run_task(task, devices, x, y)
    assert predicted.shape == (24, 2)
    return result(task, history, evaluated=evaluate(task, x, y), predicted=predicted)


def gpt2_causal_lm(devices):
    """gpt2/gpt2_causal_lm_test.py: a ``GPT2CausalLM`` on a two-layer ``GPT2Backbone`` (hidden 4, intermediate 8),
    its ``GPT2CausalLMPreprocessor`` over the test's byte-pair vocabulary and merges (sequence length 8); the task's
    default ``compile()``; no labels (the preprocessor makes them)."""
    import keras_hub

    k = keras()
    k.utils.set_random_seed(133)
    merges = ["Ġ a", "Ġ t", "Ġ i", "Ġ b", "a i", "p l", "n e"]
    merges += ["Ġa t", "p o", "r t", "Ġt h", "ai r", "pl a", "po rt"]
    merges += ["Ġai r", "Ġa i", "pla ne"]
    vocab = []
    for merge in merges:
        a, b = merge.split(" ")
        vocab.extend([a, b, a + b])
    vocab += ["!", "<|endoftext|>"]
    vocab = sorted(set(vocab))  # Remove duplicates
    vocab = dict([(token, i) for i, token in enumerate(vocab)])
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        keras_hub.models.GPT2Tokenizer(vocabulary=vocab, merges=merges), sequence_length=8)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=preprocessor.tokenizer.vocabulary_size(), num_layers=2, num_heads=2, hidden_dim=4,
        intermediate_dim=8, max_sequence_length=preprocessor.sequence_length)
    task = keras_hub.models.GPT2CausalLM(preprocessor=preprocessor, backbone=backbone)
    x = np.array([" " + s for s in _sentences(134, ["airplane", "at", "airport", "a", "plane"], 24)])
    task, history, predicted = _run_task(task, devices, x)
    assert predicted.shape == (24, 8, preprocessor.tokenizer.vocabulary_size())
    return result(task, history, evaluated=evaluate(task, x), predicted=predicted)


PROGRAMS = {
    "bert_text_classifier": (H + "bert/bert_text_classifier_test.py", 1e-5, ALL, "slow", "pass"),
    "gpt2_causal_lm": (H + "gpt2/gpt2_causal_lm_test.py", 1e-5, ALL, "slow", "pass"),
}
