"""CUDA MPS for the worker processes that share a GPU (``--mps``).

Without MPS, processes on one GPU take turns on it in time slices: a worker's many small kernels wait while another
process holds the GPU. Measured on an H200 (``harness-out/gpu106.sh``: ``benchmarks/throughput.py --profile gpu
--device cuda --properties outputs --modes decode --backends sglang.flashinfer flashinfer --shared --cases 60
--warmup 2``, one kernel variant): 4 workers checked 158.7 cases/s with the GPU busy 90% of the time, 8 workers 179.8 at
98%; under an MPS daemon, whose clients' kernels run side by side, 200.8 and 358.8, the GPU busy 29% and 45%.

It is asked for, not the default: under MPS a fatal GPU fault in one client (an illegal address in a kernel under
test) is reported to every client of the daemon (NVIDIA's MPS documentation, Volta and later), so it ends every
worker's context at once, not one; the sweep then restarts them all, and each reads as a lost context.

A daemon the user runs (``CUDA_MPS_PIPE_DIRECTORY`` set) is used as it is; otherwise a private one is started with
its pipe and log folders under a temporary folder, its clients are the worker processes started inside
:func:`mps_daemon`, and it is told to quit at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

CONTROL = "nvidia-cuda-mps-control"
PIPE, LOG = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"


@contextmanager
def mps_daemon(wanted: bool, say: Callable[[str], None]) -> Iterator[bool]:
    """While inside, processes started get an MPS daemon when ``wanted``; yields whether they do. Each outcome is
    said in one line (``say``); an MPS that cannot start leaves the workers time-slicing, as without ``--mps``."""
    if not wanted:
        yield False
        return
    if os.environ.get(PIPE):
        say(f"MPS: the workers are clients of the daemon at {os.environ[PIPE]}")
        yield True
        return
    control = shutil.which(CONTROL)
    if control is None:
        say(f"MPS: asked for, but {CONTROL} is not on PATH: the workers take turns on the GPU")
        yield False
        return
    root = tempfile.mkdtemp(prefix="harness-mps-")
    env = {PIPE: os.path.join(root, "pipe"), LOG: os.path.join(root, "log")}
    for folder in env.values():
        os.makedirs(folder)
    try:
        started = subprocess.run([control, "-d"], env=os.environ | env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        started = subprocess.CompletedProcess([control], 1, "", str(e))
    if started.returncode != 0:
        why = (started.stderr or started.stdout or f"exit status {started.returncode}").strip().splitlines()[0]
        say(f"MPS: the daemon did not start ({why}): the workers take turns on the GPU")
        shutil.rmtree(root, ignore_errors=True)
        yield False
        return
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the workers' environment is copied from this process's when each starts
    say(f"MPS: started a daemon for the workers ({env[PIPE]})")
    try:
        yield True
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            subprocess.run([control], input="quit\n", env=os.environ | env, capture_output=True, text=True,
                           timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            say(f"MPS: the daemon did not quit ({e}); stop it with `echo quit | {PIPE}={env[PIPE]} {CONTROL}`")
        shutil.rmtree(root, ignore_errors=True)
