"""shardtune.cli.startup_heap_frozen: what a launch's checks and imports build is frozen once they pass (later
collections skip it), nothing when they refuse, and the collector is left as it was."""

from __future__ import annotations

import gc

import pytest

from shardtune.cli import startup_heap_frozen


def tracked_ids(objects: list) -> set[int]:
    """The ids of `objects` that the collector's generations hold now (frozen objects are in none of them)."""
    wanted = {id(item) for item in objects}
    return {id(item) for item in gc.get_objects() if id(item) in wanted}


@pytest.fixture
def unfrozen():
    """Whatever a test froze is handed back to the collector at its end."""
    yield
    gc.unfreeze()


def test_a_passed_start_up_freezes_what_it_built_and_collects_again(unfrozen):
    with startup_heap_frozen():
        assert not gc.isenabled()  # no collection while the imports run
        built = [[index] for index in range(1000)]  # lists of lists: tracked by the collector
    assert gc.isenabled()
    assert all(gc.is_tracked(item) for item in built)
    assert not tracked_ids(built)  # frozen: no generation holds them
    gc.unfreeze()
    assert len(tracked_ids(built)) == len(built)


def test_a_refused_start_up_freezes_nothing(unfrozen):
    with pytest.raises(SystemExit), startup_heap_frozen():
        built = [[index] for index in range(1000)]
        raise SystemExit(2)
    assert gc.isenabled()
    assert len(tracked_ids(built)) == len(built)


def test_a_collector_turned_off_before_stays_off(unfrozen):
    gc.disable()
    try:
        with startup_heap_frozen():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
