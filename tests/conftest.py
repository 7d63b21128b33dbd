import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def factory():
    """Track tiers a test makes, and close them all when it ends."""
    made = []

    def track(t):
        made.append(t)
        return t

    yield track
    for t in made:
        t.close()
