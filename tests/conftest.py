"""Shared test settings.

Hypothesis profiles: ``ci`` (default) keeps the suite bounded on a 2-core
machine; ``long`` explores far more (``JAXKV_HYPOTHESIS=long pytest -m slow``).
"""

import os

# Compile time dominates this suite (hundreds of small XLA programs on a
# 2-core CPU): LLVM -O0 compiles about a third faster and the programs are
# too small for the slower code to matter. Read when JAX starts its backend,
# i.e. after this file; subprocesses (the examples) inherit it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=30, stateful_step_count=60, **_COMMON)
settings.register_profile("long", max_examples=400, stateful_step_count=100, **_COMMON)
settings.load_profile(os.environ.get("JAXKV_HYPOTHESIS", "ci"))


def _cuda_plugin() -> bool:
    from kernels_pallas._gpu import cuda_plugin_available

    return cuda_plugin_available()


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need a GPU JAX can run on; ``aot`` tests need the CUDA
    plugin (``pip install 'jax[cuda12]>=0.10,<0.11'``), no GPU. Without
    them, they skip and say why."""
    import jax
    import pytest

    wants_gpu = any("gpu" in item.keywords for item in items)
    has_gpu = wants_gpu and jax.default_backend() == "gpu"
    has_plugin = _cuda_plugin()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(
                reason=f"compiled GPU kernel: JAX's backend here is {jax.default_backend()!r}, not a GPU"))
        if "aot" in item.keywords and not has_plugin:
            item.add_marker(pytest.mark.skip(
                reason="compile for H100 without a GPU: needs pip install 'jax[cuda12]>=0.10,<0.11' "
                       "(see docs/kernels.md)"))


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test module ends. Each XLA:CPU
    executable holds its own memory mappings (the 19 tests of two modules
    leave ~8,000), and a worker that runs hundreds of modules' programs
    passes Linux's default ``vm.max_map_count`` (65,530): LLVM's next
    allocation fails and the worker dies in a compile (segfault / abort).
    Cleared between modules, a worker stays near 1,000 mappings; the cost is
    recompiling the few programs two modules share (each module builds its
    own models and keeps them in module-level caches)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
