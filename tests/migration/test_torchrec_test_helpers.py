"""TorchRec's ``torchrec.test_utils`` helpers at their path (issue 43: TorchRec's own tests import them)."""

from __future__ import annotations

import socket
import unittest

import pytest
import torch

from lightning_shardrec.test_utils import (
    assert_state_buffers_parameters_equal,
    get_free_port,
    is_asan_or_tsan,
    seed_and_log,
    skip_if_asan,
    skip_if_asan_class,
)


def test_a_free_port_can_be_bound() -> None:
    port = get_free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
    assert 0 < port < 65536


def test_the_sanitizer_skips_pass_through_without_a_sanitizer() -> None:
    assert not is_asan_or_tsan()
    assert skip_if_asan(lambda x: x + 1)(1) == 2

    @skip_if_asan_class
    class Case(unittest.TestCase):
        def test_x(self) -> None:
            pass

    assert not getattr(Case, "__unittest_skip__", False)


def test_seed_and_log_seeds_torch_before_each_call(capsys: pytest.CaptureFixture[str]) -> None:
    drawn = seed_and_log(lambda: torch.rand(1))()
    seed = int(capsys.readouterr().out.split("Using random seed: ")[1])
    torch.manual_seed(seed)
    assert torch.equal(drawn, torch.rand(1))


def test_models_with_other_keys_are_named() -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, bias=False)
    assert_state_buffers_parameters_equal(a, torch.nn.Linear(3, 3))  # keys only, as TorchRec's
    named = r"named_parameters keys differ: only in model_1 \['bias'\], only in model_2 \[\]"
    with pytest.raises(AssertionError, match=named):
        assert_state_buffers_parameters_equal(a, b)
    assert_state_buffers_parameters_equal(a, b, check_named_parameters=False, check_state_dict=False)
