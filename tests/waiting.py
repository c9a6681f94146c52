"""The tests' one poll: wait for a condition instead of sleeping for a guess of how long it takes."""

import time


def wait_for(predicate, timeout=10.0, interval=0.05):
    """Call `predicate` until it returns a true value or `timeout` seconds have passed; returns its last
    value (so `assert wait_for(...)` fails with the condition still false)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
