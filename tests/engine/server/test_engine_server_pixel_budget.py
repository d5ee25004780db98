"""PixelBudget units: reservations in one piece, FIFO waiting within bounds, refusals that
change nothing, and a heap trim when the last reservation ends."""

from __future__ import annotations

import threading

import pytest
from test_engine_http_fixtures import wait_until

from engine.contract import pixel_budget
from engine.contract.pixel_budget import PixelBudget, PixelBudgetBusy, PixelBudgetTooSmall


def test_reservations_add_up_and_end():
    budget = PixelBudget(10)
    budget.acquire(4)
    budget.acquire(6)
    assert budget.in_use == 10 and budget.peak == 10
    budget.release(4)
    budget.release(6)
    assert budget.in_use == 0


def test_more_than_the_whole_budget_is_refused_at_once_and_changes_nothing():
    budget = PixelBudget(10)
    with pytest.raises(PixelBudgetTooSmall, match="11 pixels"):
        budget.acquire(11)
    assert budget.in_use == 0 and budget.refused == 0


def test_a_full_budget_refuses_after_the_wait_and_changes_nothing():
    budget = PixelBudget(10, wait_s=0.05)
    budget.acquire(8)
    with pytest.raises(PixelBudgetBusy, match="held the budget"):
        budget.acquire(3)
    assert budget.in_use == 8 and budget.refused == 1 and not budget._queue


def test_no_more_than_max_waiting_wait():
    budget = PixelBudget(10, wait_s=30, max_waiting=0)
    budget.acquire(10)
    with pytest.raises(PixelBudgetBusy, match="already waiting"):
        budget.acquire(1)
    assert budget.in_use == 10


def test_waiters_are_served_first_come_first_served():
    budget = PixelBudget(10, wait_s=30)
    budget.acquire(6)
    order = []

    def take(pixels):
        budget.acquire(pixels)
        order.append(pixels)

    big = threading.Thread(target=take, args=(8,))
    big.start()
    wait_until(lambda: len(budget._queue) == 1, 10, "the big request to wait")
    small = threading.Thread(target=take, args=(3,))  # would fit now, but arrives after the big one
    small.start()
    wait_until(lambda: len(budget._queue) == 2, 10, "the small request to wait")
    assert order == [] and budget.in_use == 6
    budget.release(6)
    big.join(10)
    assert order == [8] and budget.in_use == 8  # 8 + 3 > 10: the small one still waits
    budget.release(8)
    small.join(10)
    assert order == [8, 3] and budget.in_use == 3
    assert budget.in_use <= budget.max_pixels and budget.peak == 8


def test_the_heap_is_trimmed_when_the_last_reservation_ends(monkeypatch):
    trims = []
    monkeypatch.setattr(pixel_budget, "trim_heap", lambda: trims.append(1) or True)
    budget = PixelBudget(10)
    budget.acquire(3)
    budget.acquire(3)
    budget.release(3)
    assert trims == []
    budget.release(3)
    assert trims == [1]


def test_trim_heap_calls_malloc_trim_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    assert pixel_budget.trim_heap() is True


@pytest.mark.parametrize("kwargs", [{"max_pixels": 0}, {"max_pixels": 5, "wait_s": -1}])
def test_bad_settings_are_value_errors_naming_the_value(kwargs):
    with pytest.raises(ValueError, match=r"-1|0"):
        PixelBudget(**kwargs)
