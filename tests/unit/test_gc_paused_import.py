"""gc_paused_import: the collector off while an engine's library imports, on again (and the import frozen) after."""
import gc
import os
import weakref

import pytest
from batch_llm.engines.base import gc_paused_import

NOT_IMPORTED = "batch_llm_no_such_module"  # stands for a library this process has not imported yet


class _Node:
    def __init__(self):
        self.me = self  # a cycle: only the cyclic collector frees it


@pytest.fixture(autouse=True)
def _collector_restored():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if was else gc.disable()


def test_collector_off_inside_on_after_and_the_import_frozen():
    gc.enable()
    frozen = gc.get_freeze_count()
    with gc_paused_import(NOT_IMPORTED):
        assert not gc.isenabled()
        made = [_Node() for _ in range(1000)]  # what an import leaves behind: objects that stay
        left = weakref.ref(_Node())  # and an unreachable cycle of its own
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(made)
    gc.collect()
    assert left() is not None  # frozen: full collections no longer walk what the import made (the documented price)
    after = weakref.ref(_Node())
    gc.collect()
    assert after() is None  # what comes later is collected as before


def test_garbage_from_before_is_collected_not_frozen():
    gc.enable()
    before = weakref.ref(_Node())  # e.g. a failed engine's leftovers
    with gc_paused_import(NOT_IMPORTED):
        pass
    assert before() is None


def test_on_again_when_the_import_fails():
    gc.enable()
    with pytest.raises(ImportError), gc_paused_import(NOT_IMPORTED):
        import batch_llm_no_such_module  # noqa: F401
    assert gc.isenabled()


def test_nothing_done_once_the_library_is_imported():
    """A second start in one process (memory back-off, the probe): what is alive then stays collectable."""
    gc.enable()
    frozen = gc.get_freeze_count()
    with gc_paused_import("os"):
        assert gc.isenabled()
        left = weakref.ref(_Node())
    assert gc.get_freeze_count() == frozen
    gc.collect()
    assert left() is None


def test_left_alone_when_the_caller_paused_it():
    gc.disable()
    frozen = gc.get_freeze_count()
    with gc_paused_import(NOT_IMPORTED):
        _Node()
    assert not gc.isenabled()
    assert gc.get_freeze_count() == frozen


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_process_forked_after_the_import_collects():
    """vLLM forks its engine core after the import: it must not inherit a paused collector."""
    gc.enable()
    with gc_paused_import(NOT_IMPORTED):
        pass
    pid = os.fork()
    if pid == 0:
        os._exit(0 if gc.isenabled() else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
