"""Shared test settings.

Hypothesis profiles: ``ci`` (default) keeps the suite bounded on a 2-core
machine; ``long`` explores far more (``JAXKV_HYPOTHESIS=long pytest -m slow``).
"""

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=30, stateful_step_count=60, **_COMMON)
settings.register_profile("long", max_examples=400, stateful_step_count=100, **_COMMON)
settings.load_profile(os.environ.get("JAXKV_HYPOTHESIS", "ci"))
