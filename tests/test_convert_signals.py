"""A conversion stopped by SIGTERM (Kubernetes deleting the Job) removes its temp directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent


def write_medium_gptj(path: Path) -> None:
    """A ~230 MB fp16 GPT-J (zeros): big enough that converting it takes a noticeable time."""
    h, inter, vocab, layers = 1024, 4096, 8192, 8
    tensors = {
        "transformer.wte.weight": np.zeros((vocab, h), np.float16),
        "transformer.ln_f.weight": np.ones(h, np.float16),
        "transformer.ln_f.bias": np.zeros(h, np.float16),
        "lm_head.weight": np.zeros((vocab, h), np.float16),
        "lm_head.bias": np.zeros(vocab, np.float16),
    }
    for i in range(layers):
        p = f"transformer.h.{i}."
        for name in ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight",
                     "attn.out_proj.weight"):  # fmt: skip
            tensors[p + name] = np.zeros((h, h), np.float16)
        tensors[p + "ln_1.weight"] = np.ones(h, np.float16)
        tensors[p + "ln_1.bias"] = np.zeros(h, np.float16)
        tensors[p + "mlp.fc_in.weight"] = np.zeros((inter, h), np.float16)
        tensors[p + "mlp.fc_in.bias"] = np.zeros(inter, np.float16)
        tensors[p + "mlp.fc_out.weight"] = np.zeros((h, inter), np.float16)
        tensors[p + "mlp.fc_out.bias"] = np.zeros(h, np.float16)
    path.mkdir()
    save_file(tensors, path / "model.safetensors")
    config = {"model_type": "gptj", "n_embd": h, "n_head": 8, "n_layer": layers, "n_inner": inter,
              "vocab_size": vocab, "rotary_dim": 64, "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.slow
def test_sigterm_mid_conversion_leaves_no_output_and_no_temp_dir(tmp_path):
    src = tmp_path / "src"
    write_medium_gptj(src)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loader", "convert", str(src), str(out), "--tp-size", "2",
         "--dtype", "fp32", "--workers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".2-gpu.partial-") for p in out.iterdir()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the conversion never started writing"
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err  # 128 + SIGTERM, the same for every command
    assert "terminated (SIGTERM)" in err
    assert "Traceback" not in err
    assert list(out.iterdir()) == []


class _Stop(Exception):
    """What the test's SIGUSR1 handler raises in the main thread."""


def test_a_stop_signal_a_worker_thread_got_ends_the_conversions_wait_at_once():
    """The kernel may hand SIGTERM or Ctrl-C to a worker thread; Python runs the handler in the
    main thread, and only once that thread wakes: the conversion's wait wakes in steps, so the
    stop does not wait for the conversion's end. Here the worker converts until released, and
    the signal goes to the worker itself."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from loader.waits import wait_in_steps

    release = threading.Event()

    def worker() -> None:
        time.sleep(1)  # the main thread is in its wait by then (and inside pytest.raises anyway)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # to this worker thread
        release.wait(60)

    def handler(signum, frame):
        raise _Stop

    previous = signal.signal(signal.SIGUSR1, handler)
    released_late = threading.Timer(30, release.set)  # the wait's end without the steps
    released_late.start()
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(worker)
            with pytest.raises(_Stop):
                wait_in_steps([future])
            assert not release.is_set(), "the wait ended only with the conversion"
            release.set()
    finally:
        release.set()
        released_late.cancel()
        signal.signal(signal.SIGUSR1, previous)
