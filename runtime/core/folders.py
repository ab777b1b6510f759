"""The names of what a run keeps beside the processes' replica folders (``/dev/shm/...``, ``--replica-dir``).

Here, not with the code that fills them, because the controller names and removes them and must not import
that code's JAX: JAX's compile cache (``runtime/core/compile_cache.py``) and the workers' kept programs
(``runtime/core/programs.py``), one folder per controller.
"""

__all__ = ["COMPILE_CACHE_FOLDER", "PROGRAMS_PREFIX"]

COMPILE_CACHE_FOLDER = "xla-cache"
PROGRAMS_PREFIX = "programs-"
