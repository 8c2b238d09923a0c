"""Test-session setup.

Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors; the variable
must be set before any kernel module is imported. ``bench/gpu_check.sh`` sets
``TRITON_INTERPRET=0`` to run the same tests compiled on CUDA.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

# Interpreted kernels are slow per call: no deadline, and CI gets a fixed, derandomized budget.
settings.register_profile(
    "ci", deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_codec_backend():
    """qcomm.compress chooses a backend once per device type and keeps it; tests that set
    QCOMM_BACKEND (monkeypatch) get a fresh choice, and leave none behind."""
    from qcomm.kernels.backend import reset_backends

    reset_backends()
    yield
    reset_backends()


@pytest.fixture(scope="session")
def device() -> str:
    """Where kernel tests put tensors: CUDA when a GPU runs compiled Triton, else CPU tensors
    under the Triton interpreter."""
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "cuda"
    return "cpu"


@pytest.fixture(scope="session")
def gloo():
    """Gloo worlds kept for the whole session, one per world size:
    ``gloo.run(fn, world_size, args=(...))`` runs ``fn(rank, world_size, *args)`` on every rank
    of it (see :class:`qcomm.testing.multiprocess.WorldPools`). A body that fails breaks its
    world, and the next test of that size gets a fresh one."""
    from qcomm.testing.multiprocess import WorldPools

    pools = WorldPools()
    yield pools
    pools.close()
