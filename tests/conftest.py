"""Suite-wide setup: 8 fake CPU devices (must be set before jax is imported) and a
persistent XLA compilation cache shared by the pytest-xdist workers of one run.

The cache directory is ``$DTARL_TEST_JAX_CACHE`` when set (kept after the run, so
it also serves later runs), else a fresh temporary directory that the controller
creates, hands to its workers through that variable, and removes at the end.
``DTARL_TEST_JAX_CACHE=off`` disables the cache. JAX keys entries by the program,
its compile options and the JAX/XLA versions, and writes them atomically, so
concurrent workers can share a directory.
"""

import os
import shutil
import tempfile

# LLVM's optimisation level 0: the suite's programs are tiny and compile-bound (a DFS
# program compiled in half the time, ran no slower, and gave bit-identical values).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_CACHE_ENV = "DTARL_TEST_JAX_CACHE"
_owned_cache: str | None = None


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


def pytest_unconfigure(config):
    if _owned_cache is not None:
        shutil.rmtree(_owned_cache, ignore_errors=True)
