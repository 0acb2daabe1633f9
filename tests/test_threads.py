"""--threads and the default thread count."""

from __future__ import annotations

import os

import pytest
import torch

from moaspec import threads
from moaspec.cli import main
from moaspec.errors import UserError


def test_default_threads_counts_idle_cores():
    n = threads.default_threads()
    assert 1 <= n <= threads.usable_cores()
    idle = threads.idle_cores(0.05)
    assert idle is None or 0 <= idle <= (os.cpu_count() or 1) + 1e-6


def test_set_threads_checks_its_argument():
    before = torch.get_num_threads()
    try:
        assert threads.set_threads(1) == 1 and torch.get_num_threads() == 1
        for bad in (0, -1, 10_000, 1.5, "2"):
            with pytest.raises(UserError, match="threads must be"):
                threads.set_threads(bad)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["0", "x", "1000"])
def test_cli_refuses_bad_thread_counts(value, capsys):
    assert main(["generate", "--prompt", "hi", "--threads", value]) == 2
    assert "--threads" in capsys.readouterr().err
