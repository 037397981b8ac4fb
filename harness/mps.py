"""CUDA MPS for the worker processes on a GPU (``harness run --mps``, ``harness sweep --mps``,
``benchmarks/throughput.py --mps``).

Without MPS, processes on one GPU take turns on it in time slices: a worker's many small kernels wait while another
process holds the GPU. Measured on an H200 (``harness-out/gpu106.sh``: ``benchmarks/throughput.py --profile gpu
--device cuda --properties outputs --modes decode --backends sglang.flashinfer flashinfer --shared --cases 60
--warmup 2``, every batch in one kernel variant, the daemon started by the script itself): 4 workers checked 158.7
cases/s with the GPU busy 90% of the time, 8 workers 179.8 at 98%; under an MPS daemon, whose clients' kernels run
side by side, 200.8 and 358.8, the GPU busy 29% and 45%.

What a search must then guard against: a fatal GPU fault in one client (a kernel under test reading an illegal
address) is reported to every client of the daemon that shares the GPU, and the daemon takes no new client until
they have all exited (NVIDIA's MPS documentation, "Error containment", Volta and later). So under MPS a case that
failed with a CUDA error is replayed alone, outside MPS, before it is reported (``search.search_row.confirm_alone``;
one that passes there is counted as ``mps-fault``, its case kept under ``passed-alone/``, and when no case reproduced
the fault alone the sweep reports one error naming them all: ``Sweep.unreproduced_fault``); every worker whose context
the fault reached exits (a lost context, as without MPS), and a worker started after it waits until the daemon takes
clients again (``harness.sweep_worker.await_mps_daemon``).

A daemon the user runs (``CUDA_MPS_PIPE_DIRECTORY`` set) is used as it is; otherwise a private one is started with its
pipe and log folders under a temporary folder and without ``CUDA_VISIBLE_DEVICES`` (a daemon started with it numbers
the devices anew, and clients pinned by the physical numbers would fail), its clients are the processes started
inside :func:`mps_daemon`, and it is told to quit at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from search.outcome import MPS_PIPE as PIPE

CONTROL = "nvidia-cuda-mps-control"
LOG = "CUDA_MPS_LOG_DIRECTORY"
TIMEOUT_S = 30


def _control(control: str, env: dict[str, str], root: str, args: list[str], stdin: str | None) -> str | None:
    """Run the control program; None if it succeeded, else why not (one line). Its output goes to a file of its own
    per call: the daemon it starts keeps the descriptors it inherits, and a pipe would never reach its end."""
    try:
        with open(os.path.join(root, f"control{''.join(args) or '-quit'}.out"), "w+", errors="replace") as out:
            done = subprocess.run([control, *args], input=stdin, stdout=out, stderr=subprocess.STDOUT, text=True,
                                  stdin=None if stdin is not None else subprocess.DEVNULL,
                                  env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | env,
                                  timeout=TIMEOUT_S)
            out.seek(0)
            said = out.read().strip().splitlines()
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if done.returncode == 0 else (said[0] if said else f"exit status {done.returncode}")


@contextmanager
def mps_daemon(wanted: bool, say: Callable[[str], None]) -> Iterator[bool]:
    """While inside, processes started get an MPS daemon when ``wanted``; yields whether they do. Each outcome is
    said in one line (``say``); an MPS that cannot start leaves the workers time-slicing, as without it."""
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
    why = _control(control, env, root, ["-d"], None)
    if why is not None:
        shutil.rmtree(root, ignore_errors=True)
        say(f"MPS: the daemon did not start ({why}): the workers take turns on the GPU")
        yield False
        return
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)  # the workers' environment is copied from this process's when each starts
        say(f"MPS: started a daemon for the workers ({env[PIPE]})")
        yield True
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        why = _control(control, env, root, [], "quit\n")
        if why is None:
            shutil.rmtree(root, ignore_errors=True)
        else:  # its pipe folder kept: the only way to reach it
            say(f"MPS: the daemon did not quit ({why}); stop it with `echo quit | {PIPE}={env[PIPE]} {CONTROL}`")
