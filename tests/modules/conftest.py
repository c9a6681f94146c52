"""Fixtures of the module tests; the helpers live in module_runner."""

import pytest
from module_runner import Processes, Run


@pytest.fixture
def processes():
    """Processes a test starts, killed by pid at the end of the test."""
    started = Processes()
    yield started
    started.cleanup()


@pytest.fixture
def run(tmp_path, processes):
    """One run's paths and the training_run calls on it (module_runner.Run)."""
    return Run(tmp_path, processes)
