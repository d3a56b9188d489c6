"""tests/helpers.py's forked children: a child of the test process that garbage-collects what the
parent left behind can hang (a Gloo process group from a DDP test: its destructor waits on worker
threads that a fork does not copy; the plugin tests hung so on every full run on the 2-core CI
machine). The parent collects before it forks and the child never collects what it inherited."""

from __future__ import annotations

import gc
import os
import time

from helpers import forked_run


class Owned:
    """An object whose destructor belongs to the process that made it: elsewhere it blocks, as
    ~ProcessGroupGloo did in a forked child."""

    deaths: list[int] = []

    def __init__(self, owner: int):
        self.owner = owner
        self.cycle = self  # only the garbage collector frees it

    def __del__(self):
        Owned.deaths.append(os.getpid())
        if os.getpid() != self.owner:
            time.sleep(600)


def test_a_forked_child_leaves_the_parents_objects_to_the_parent():
    parent = os.getpid()
    gc.disable()  # nothing collects the garbage below before the fork
    try:
        Owned(parent)  # garbage in a cycle, not yet collected
        kept = [Owned(parent)]  # alive at the fork; the child drops its copy

        def child():
            kept.clear()
            gc.collect()  # the child's own collections must not reach it
            print("collected", flush=True)

        Owned.deaths.clear()
        done = forked_run(child, timeout=30)
        assert done.returncode == 0 and done.stdout == "collected\n", done.stderr
        assert Owned.deaths == [parent]  # the garbage died in the parent, before the fork
    finally:
        gc.enable()
