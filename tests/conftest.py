"""Suite-wide setup: 8 fake CPU devices (must be set before jax is imported), a
persistent XLA compilation cache shared by the pytest-xdist workers of one run, the
hypothesis profiles, and the ``gpu`` marker's skip.

Hypothesis: the ``ci`` profile (chosen when ``$CI`` is set) is ``derandomize=True``:
every run draws the same examples, so a CI failure reproduces anywhere. The ``dev``
profile (otherwise) draws new examples each run and keeps the failing ones in
``.hypothesis/`` (replayed first next time); both print the ``@reproduce_failure``
blob of a failure. ``HYPOTHESIS_PROFILE`` picks one explicitly.

``@pytest.mark.gpu`` tests need JAX's GPU backend; they are skipped on any other
(the suite defaults ``JAX_PLATFORMS=cpu``: set ``JAX_PLATFORMS=cuda`` to run them).

The cache directory is ``$DTARL_TEST_JAX_CACHE`` when set (kept after the run, so
it also serves later runs), else a fresh temporary directory that the controller
creates, hands to its workers through that variable, and removes at the end.
``DTARL_TEST_JAX_CACHE=off`` disables the cache. JAX keys entries by the program,
its compile options and the JAX/XLA versions, and writes them atomically, so
concurrent workers can share a directory.

A worker runs hundreds of test files in one process, and every program XLA compiles
for the CPU keeps its code mapped (several memory maps each) while JAX caches it. A
worker reached Linux's default limit of 65530 maps (``vm.max_map_count``) late in the
run, and XLA then crashed in a compile (a segfault in ``test_bench_darts``). So after
a test file, when the worker holds more than ``_MAPS_LIMIT`` maps, its compiled
programs are dropped (``jax.clear_caches``); a later test that needs one compiles it
again, from the persistent cache.
"""

import gc
import os
import shutil
import tempfile

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
settings.register_profile("dev", print_blob=True)  # default database: .hypothesis/
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# LLVM's optimisation level 0: the suite's programs are tiny and compile-bound (a DFS
# program compiled in half the time, ran no slower, and gave bit-identical values).
# Not used: --xla_cpu_use_fusion_emitters=false (XLA's older CPU fusion emitters)
# compiles about 35% faster (tests/engines/test_loss_fn.py: 194 -> 119 CPU seconds),
# but rounds differently enough that test_decoder's remat-gradient comparison fails
# its 1e-5 tolerance; the scheduler and copy-insertion flags tried did not change a
# DFS program's compile time.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_CACHE_ENV = "DTARL_TEST_JAX_CACHE"
_owned_cache: str | None = None
_MAPS_LIMIT = 20000  # of the kernel's default 65530; one test file added up to ~30000


def pytest_configure(config):
    global _owned_cache
    if not hasattr(config, "workerinput") and _CACHE_ENV not in os.environ:
        # The controller (or a run without xdist): workers inherit the variable.
        _owned_cache = tempfile.mkdtemp(prefix="dtarl-jax-cache-")
        os.environ[_CACHE_ENV] = _owned_cache
    cache_dir = os.environ[_CACHE_ENV]
    if cache_dir == "off":
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # Tiny CPU programs compile in well under the default 1 s threshold.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import jax

    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(
            reason=f"needs a CUDA GPU (JAX backend is {jax.default_backend()!r}; "
            "set JAX_PLATFORMS=cuda on a GPU machine)"
        )
        for item in gpu:
            item.add_marker(skip)


def pytest_unconfigure(config):
    if _owned_cache is not None:
        shutil.rmtree(_owned_cache, ignore_errors=True)


def _maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to stay under
        return 0


@pytest.fixture
def store(tmp_path):
    """dtarl's program store enabled for one test only (the process-wide one is
    restored after)."""
    from dtarl import aot

    before = aot.program_store()
    yield aot.enable_program_store(tmp_path / "programs")
    if before is None:
        aot.disable_program_store()
    else:
        aot.enable_program_store(before.path)


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_programs():
    """After each test file: drop the compiled programs when the process holds more
    than ``_MAPS_LIMIT`` memory maps (module docstring)."""
    yield
    if _maps() > _MAPS_LIMIT:
        import jax

        jax.clear_caches()
        gc.collect()
