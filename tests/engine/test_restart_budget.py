"""The engine process's restart budget: a few restarts in a sliding window, then none."""

import pytest

from qasr.engine.restart_budget import RestartBudget


def test_restarts_are_allowed_up_to_the_limit_within_the_window_and_again_as_it_slides():
    now = [0.0]
    budget = RestartBudget(2, 10.0, clock=lambda: now[0])
    assert budget.take()
    now[0] = 5.0
    assert budget.take()
    assert not budget.take()  # a third within 10 s
    now[0] = 9.9
    assert not budget.take()
    now[0] = 10.0  # the first has left the window, the second not
    assert budget.take() and not budget.take()


def test_zero_never_restarts_and_bad_limits_are_refused():
    assert not RestartBudget(0, 1.0).take()
    with pytest.raises(ValueError, match="max_restarts >= 0 and window_s > 0"):
        RestartBudget(-1, 1.0)
    with pytest.raises(ValueError, match="window_s > 0"):
        RestartBudget(1, 0)
