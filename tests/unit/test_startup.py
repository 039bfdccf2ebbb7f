"""shardtune.cli.startup_heap_frozen: the objects a launch's checks and imports build are frozen once they pass
(later collections skip them), not when they refuse, and the collector runs again either way."""

from __future__ import annotations

import gc

import pytest

from shardtune.cli import startup_heap_frozen


def test_a_passed_start_up_freezes_what_it_built_and_collects_again():
    frozen_before = gc.get_freeze_count()
    try:
        with startup_heap_frozen():
            assert not gc.isenabled()  # no collection while the imports run
            built = [{"layer": index} for index in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(built)
    finally:
        gc.unfreeze()


def test_a_refused_start_up_freezes_nothing():
    frozen_before = gc.get_freeze_count()
    with pytest.raises(SystemExit), startup_heap_frozen():
        raise SystemExit(2)
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen_before
