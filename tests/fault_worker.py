"""A worker for the lifecycle tests: `python -m tests.fault_worker job.json` does what `job["do"]` says.

It runs through the real `worker_main` (parent-death signal, failure reports, rank records) without loading a
model, so the launcher's process handling is tested in seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from finetune_flows.errors import DataError
from finetune_flows.runtime.lifecycle import worker_main
from finetune_flows.runtime.processes import write_record


def _run(job: dict) -> dict | None:
    do = job["do"]
    workdir = Path(job["workdir"])
    if do == "result":
        return {"ok": True, "rank": os.environ.get("RANK")}
    if do == "describe":  # what the worker got: tests/test_lifecycle.py compares fresh and forked workers
        return {"pid": os.getpid(), "ppid": os.getppid(), "session": os.getsid(0), "cwd": os.getcwd(),
                "argv": sys.argv, "env": {k: os.environ.get(k) for k in job["keys"]}, "torch": "torch" in sys.modules,
                "stdin": os.readlink("/proc/self/fd/0")}
    if do == "exit":
        sys.stdout.flush()
        os._exit(int(job["code"]))
    if do == "compile":  # torch.compile on the CPU: inductor writes its kernels where the environment says
        import torch
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        fn = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1)
        return {"value": fn(torch.ones(4)).tolist(), "inductor": cache_dir()}
    if do == "leave":  # returns while a process it started still runs (as a compile-worker pool could)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        write_record(workdir / "left.pid", child.pid)
        time.sleep(2.5)  # the launcher notes the worker's processes every second
        return {"ok": True}
    if do == "user_error":
        raise DataError(f"rows.jsonl line 3: not valid JSON (rank {os.environ.get('RANK', 0)})")
    if do == "oom":
        raise MemoryError("out of host memory")
    if do == "crash":
        raise RuntimeError("something broke")
    if do == "hang":  # like torchrun: the real work runs in a child with a session of its own
        subprocess.Popen([sys.executable, "-m", "tests.fault_worker", job["child_job"]], start_new_session=True)
        write_record(workdir / f"{job['step']}.self.pid")
        time.sleep(600)
    if do in ("sleep", "stubborn"):  # stubborn: ignores SIGTERM, so only SIGKILL ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN if do == "stubborn" else signal.SIG_DFL)
        write_record(workdir / f"{job['step']}.self.pid")
        time.sleep(600)
    raise ValueError(f"unknown action {do}")


if __name__ == "__main__":
    worker_main(_run)
