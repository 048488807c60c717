"""The one-device check's switch, comparison and message (no framework)."""

import numpy as np
import pytest

from distkeras.verify import check as verify
from distkeras.errors import OptionError, VerifyError


@pytest.mark.parametrize("option, environ, expected", [
    (None, {}, None), (None, {"DISTKERAS_VERIFY": "1"}, "raise"), (None, {"DISTKERAS_VERIFY": "warn"}, "warn"),
    (None, {"DISTKERAS_VERIFY": "0"}, None), (True, {}, "raise"), ("warn", {"DISTKERAS_VERIFY": "1"}, "warn"),
    (False, {"DISTKERAS_VERIFY": "1"}, None), ("raise", {}, "raise"),
])
def test_mode_from_option_then_environment(option, environ, expected):
    assert verify.mode(option, environ) == expected


@pytest.mark.parametrize("option, environ", [("loud", {}), (2, {}), (None, {"DISTKERAS_VERIFY": "maybe"})])
def test_bad_mode_is_an_option_error(option, environ):
    with pytest.raises(OptionError, match="Received"):
        verify.mode(option, environ)


def test_tolerance():
    assert verify.tolerance(None) == (verify.RTOL, verify.ATOL)
    assert verify.tolerance((1e-3, 0)) == (1e-3, 0.0)
    for bad in ((1,), "ab", (-1, 0)):
        with pytest.raises(OptionError, match="verify_tolerance"):
            verify.tolerance(bad)


def test_differences_name_what_differs_and_where():
    entries = [
        ("dense/kernel", "weight", np.ones((2, 2)), np.ones((2, 2)) + 1e-7),
        ("adam/momentum", "optimizer", np.array([0.0, 0.5]), np.array([0.0, 0.25])),
        ("loss", "log", 1.0, float("nan")),
        ("b", "weight", np.zeros(3), np.zeros(2)),
    ]
    found = verify.differences(entries, 1e-4, 1e-5)
    assert [d.name for d in found] == ["adam/momentum", "loss", "b"]
    assert found[0].max_abs == pytest.approx(0.25) and "(1,)" in found[0].where
    assert found[2].max_abs == float("inf")


def test_check_raises_or_warns_once_with_the_names(caplog):
    entries = [("dense/kernel", "weight", np.array([1.0]), np.array([2.0]))]
    check = verify.Check("raise", "tensorflow", 2)
    with pytest.raises(VerifyError, match="dense/kernel") as info:
        check.judge(entries)
    assert isinstance(info.value, AssertionError) and verify.DOCS in str(info.value)
    assert not check.due
    warned = verify.Check("warn", "torch", 2)
    assert warned.judge(entries) and "dense/kernel" in caplog.text
    assert verify.Check("raise", "jax", 2).judge([("x", "log", 1.0, 1.0 + 1e-9)]) == []


def test_a_log_only_one_side_returned_is_a_difference():
    found = verify.differences(verify.log_pairs({"loss": 1.0, "extra": 2.0}, {"loss": 1.0}), 1e-4, 1e-5)
    assert [d.name for d in found] == ["extra"]


def _adam_entries(bias_slots_gap):
    """A kernel and a bias with Adam's slots, as the check names them: the bias 2e-3 apart after one step."""
    return [
        ("dense/kernel", "weight", [1.0, 2.0], [1.0, 2.0]),
        ("dense/bias", "weight", [0.001], [-0.001]),
        ("adam/dense_kernel_momentum", "optimizer", [0.1, 0.2], [0.1, 0.2]),
        ("adam/dense_kernel_velocity", "optimizer", [0.01, 0.04], [0.01, 0.04]),
        ("adam/dense_bias_momentum", "optimizer", [1e-10], [-1e-10 + bias_slots_gap]),
        ("adam/dense_bias_velocity", "optimizer", [1e-21], [1e-21]),
        ("adam/iterations", "optimizer", 1, 1),
    ]


def test_a_weight_difference_its_agreeing_slots_explain_is_not_reported():
    entries = _adam_entries(0.0)
    found = verify.differences(entries, verify.RTOL, verify.ATOL)
    assert [d.name for d in found] == ["dense/bias"]
    assert verify.explained_by_slots(found, entries, verify.RTOL) == found
    check = verify.Check("raise", "tensorflow", 2)
    assert check.judge(entries) == [] and [d.name for d in check.explained] == ["dense/bias"]


def test_a_weight_whose_slot_differs_or_that_has_no_slots_is_reported():
    entries = _adam_entries(0.005)  # the gradient itself differs: 5e-3 in a momentum whose largest value is 0.2
    found = verify.differences(entries, verify.RTOL, verify.ATOL)
    assert verify.explained_by_slots(found, entries, verify.RTOL) == []
    with pytest.raises(VerifyError, match="dense/bias"):
        verify.Check("raise", "tensorflow", 2).judge(entries)
    plain = [e for e in _adam_entries(0.0) if e[1] == "weight"]  # SGD: no slots
    with pytest.raises(VerifyError, match="dense/bias"):
        verify.Check("raise", "tensorflow", 2).judge(plain)


def test_slots_belong_to_the_longest_weight_path_they_start_with():
    entries = [("d/b", "weight", 0, 0), ("d/b_x", "weight", 0, 0), ("opt/d_b_x_momentum", "optimizer", 0, 0),
               ("opt/d_b_momentum", "optimizer", 0, 0)]
    assert verify._slot_owners(entries) == {"d/b_x": [2], "d/b": [3]}
