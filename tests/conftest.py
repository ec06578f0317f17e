"""Shared pytest set-up: persistent multi-rank worker groups and hypothesis profiles."""

from __future__ import annotations

import os

import pytest
from dist_harness import shutdown_all
from hypothesis import settings

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Multi-rank property tests run few, reproducible examples; deadlines are meaningless on a loaded box.
settings.register_profile("ci", deadline=None, derandomize=True, max_examples=25, print_blob=True)
settings.load_profile("ci")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_all()
