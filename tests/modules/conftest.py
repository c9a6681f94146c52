"""Fixtures of the module tests; the helpers live in module_runner."""

import pytest
from module_runner import Processes


@pytest.fixture
def processes():
    """Processes a test starts, killed by pid at the end of the test."""
    started = Processes()
    yield started
    started.cleanup()
