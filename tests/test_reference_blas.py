"""loader.reference.blas: the CPU reference's processes compute on one BLAS thread each."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, numpy
from loader.reference.blas import limit_blas_threads, _loaded_openblas
before = len(_loaded_openblas())
print(json.dumps({"before": before, "set": limit_blas_threads(1), "again": limit_blas_threads(1)}))
"""


def test_every_loaded_openblas_is_set_to_one_thread_after_numpy_was_imported():
    """As in Triton, where the stub imports NumPy before the model: the wheel's OpenBLAS (64-bit
    symbols, ``openblas_set_num_threads64_``) is found in the process's maps and set to 1."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    report = json.loads(done.stdout)
    assert report["before"] >= 1  # NumPy's wheels bundle OpenBLAS
    assert report["set"] and set(report["set"].values()) == {1}
    assert report["again"] == report["set"]
