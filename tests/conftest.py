import os

from hypothesis import HealthCheck, settings

# CI: reproducible examples, no per-example deadline (2-core machines vary).
settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=80,
    suppress_health_check=[HealthCheck.too_slow],
)
# Before closing an issue: seed-varying, longer runs (KVSERVE_HYPOTHESIS=soak).
settings.register_profile(
    "soak", derandomize=False, deadline=None, max_examples=2000,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("KVSERVE_HYPOTHESIS", "ci"))
