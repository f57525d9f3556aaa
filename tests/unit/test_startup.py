"""kvkeeper.startup.paused_gc: start-up without the cyclic garbage collector, and the collector back on after.

* inside the block the collector is off; after it, it is on again (if it was) and what existed is frozen;
* a block inside another leaves the outer block's collector off; with the collector off before, it stays off;
* ``import kvkeeper`` (a fresh interpreter) leaves the collector on, with PyTorch's objects frozen.
"""

import gc

from kvkeeper.startup import paused_gc


def test_the_collector_is_off_inside_and_back_on_after():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with paused_gc():
            assert not gc.isenabled()
            with paused_gc():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the inner block does not turn it on under the outer one
            keep = [object() for _ in range(10)]  # noqa: F841  (tracked? objects of the start-up)
            keep_lists = [[] for _ in range(10)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(keep_lists)
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_collector_turned_off_before_stays_off():
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
