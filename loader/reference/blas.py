"""One BLAS thread per process for the CPU reference model.

NumPy's wheels bundle OpenBLAS, which starts a thread per core and lets idle threads spin for a
while after each call. Triton runs every instance of the CPU reference model in a process of its
own, so with two instances on two cores four BLAS threads and two model threads compete for the
cores, and the spinning is charged to every matrix product: measured with ``py-spy`` and the
processes' CPU times on the serving benchmark, a batch of eight cost almost as much CPU per
request as one request alone. Triton's instances are the parallelism the CPU reference is meant
to have (FasterTransformer runs one instance per GPU), so each instance computes on one thread.

:func:`limit_blas_threads` sets the thread count of every OpenBLAS library loaded in this
process (found in ``/proc/self/maps``; the 64-bit-integer builds suffix their symbols with
``64_``), the way ``threadpoolctl`` does. It works after NumPy was imported, which matters in
Triton: the Python backend's stub imports NumPy before it loads a model. Depends on the standard
library only (the module is copied into CPU-reference repositories).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

_SETTERS = (
    "openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "scipy_openblas_set_num_threads64_",
)
_GETTERS = tuple(name.replace("_set_", "_get_") for name in _SETTERS)


def _loaded_openblas() -> list[str]:
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in lines if "/" in line}
    return sorted(p for p in paths if "openblas" in Path(p).name.lower())


def _function(library: ctypes.CDLL, names: tuple[str, ...]) -> object | None:
    return next((getattr(library, n) for n in names if hasattr(library, n)), None)


def limit_blas_threads(threads: int = 1) -> dict[str, int]:
    """Every loaded OpenBLAS computes on ``threads`` threads; returns ``{library: threads}``."""
    done = {}
    for path in _loaded_openblas():
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        setter, getter = _function(library, _SETTERS), _function(library, _GETTERS)
        if setter is None:
            continue
        setter(int(threads))
        done[path] = int(getter()) if getter is not None else int(threads)
    return done
