import os

# The Triton kernel runs under the interpreter on CPU; triton reads this when a kernel
# module is imported, so it must be set before any test file imports one (whatever the
# order pytest collects them in).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
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


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A tiny-qwen2 checkpoint (random weights), written once per session; a module may
    define its own ``ckpt`` for another shape."""
    from kvserve.model.init import init_model

    return init_model(tmp_path_factory.mktemp("m") / "tiny-qwen2", "tiny-qwen2")
