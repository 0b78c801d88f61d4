"""CPU workers forked from a process that has imported torch, transformers and peft once.

On a CPU a small step's worker spends far longer importing its libraries (torch, transformers, peft, the Trainer)
than working. So the CPU workers of the steps in FORKABLE (CUDA_VISIBLE_DEVICES="") are not fresh interpreters: a
fork server, started by the launcher on first use, imports the libraries once and forks each worker. What the
launcher relies on holds for a forked worker as for a started one (runtime/launcher.py):
- it runs in a session of its own, with the step's environment, working directory and arguments, as
  `python -m <module> <job>` would (`ps` shows the server's command line; `top` and `ps -o comm` the module's
  name, e.g. `train_worker`; the launcher's log line names its pid); its stdout and stderr are the pipe the
  launcher reads, and what importing the libraries printed in the server (warnings, bitsandbytes' note) comes
  first, as it would have in a fresh process;
- it gets SIGTERM when the server dies, and the server gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG at both
  levels; the server is started from a thread of its own, as the signal follows the thread that started a child),
  so no worker outlives its launcher; the launcher ends its servers when it exits;
- the launcher learns its exit status from the server (minus the signal number for a signal, as `subprocess` has it).
GPU workers are always fresh processes: CUDA cannot be initialised again in a forked child, and on a GPU the import
is small beside the work. A server serves only jobs whose environment and working directory equal those it started
with, except the variables in PER_JOB (read when used, not when imported); any other gets a server of its own.
FINETUNE_FLOWS_FORK_SERVER=0 turns forking off (every worker a fresh process).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from finetune_flows.runtime.lifecycle import (
    exit_now, preexec_die_with, quiet_optional_hub_kernel_warning, set_parent_death_signal,
)
from finetune_flows.runtime.processes import alive

SWITCH_ENV = "FINETUNE_FLOWS_FORK_SERVER"
FORKABLE = ("finetune_flows.training.worker", "finetune_flows.evaluation.worker", "finetune_flows.models.quantize",
            "finetune_flows.export.merge")
PRELOAD = ("torch", "transformers", "peft", "bitsandbytes", "accelerate")
# Read by the worker when it runs, never when a library is imported: a job may differ from its server in these.
PER_JOB = frozenset({
    "FINETUNE_FLOWS_LAUNCHER", "FINETUNE_FLOWS_STOP_GRACE", "FINETUNE_FLOWS_FAULTS",  # runtime/lifecycle.py
    "FINETUNE_FLOWS_DEVICE_LOCKS",
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",  # the rank
    "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",  # launcher.COMPILE_CACHES
    "PYTEST_CURRENT_TEST",  # pytest's, new for every test: keyed on it, a test suite started a server per test
})
MESSAGE_BYTES = 1 << 20
READY_TIMEOUT = 600.0  # importing on a loaded small host can take a minute


def wanted(module: str, env: dict[str, str]) -> bool:
    return module in FORKABLE and env.get("CUDA_VISIBLE_DEVICES") == "" and os.environ.get(SWITCH_ENV, "1") != "0"


# ------------------------------------------------------------------ the launcher's side


class ForkedWorker:
    """A forked worker, with the part of `subprocess.Popen` the launcher uses: pid, stdout, poll(), wait()."""

    def __init__(self, server: ForkServer, pid: int, stdout, args: list[str]):
        self.server, self.pid, self.stdout, self.args = server, pid, stdout, args

    @property
    def returncode(self) -> int | None:
        return self.server.exit_status(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        rc = self.server.wait_exit(self.pid, timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return rc


class ForkServer:
    """One server process: started with an environment and working directory, forks workers for jobs with the same."""

    def __init__(self, env: dict[str, str], cwd: str, start: Callable[[Callable[[], Any]], Any]):
        self.env, self.cwd = env, cwd
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._preface = tempfile.TemporaryFile()  # what importing printed; the server hands it to every worker
        self.proc: subprocess.Popen = start(lambda: subprocess.Popen(
            [sys.executable, "-m", "finetune_flows.runtime.forkserver", str(theirs.fileno())], env=env, cwd=cwd,
            stdin=subprocess.DEVNULL, stdout=self._preface, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),),
            start_new_session=True, preexec_fn=preexec_die_with(os.getpid())))
        theirs.close()
        self._lock = threading.Condition()
        self._ids = itertools.count()
        self._started: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> exit status
        self._live: set[int] = set()
        self._closed = False
        ready = self._receive(READY_TIMEOUT)
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"the fork server did not start: {ready.get('error') or ready}")
        self._reader = threading.Thread(target=self._read, name="fork-server-reader", daemon=True)
        self._reader.start()

    def _receive(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self._sock], [], [], timeout)
        data = self._sock.recv(MESSAGE_BYTES) if ready else b""
        return json.loads(data) if data else {"error": "no answer" if not ready else "it exited"}

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MESSAGE_BYTES)
            except OSError:
                data = b""
            with self._lock:
                if not data:
                    self._closed = True
                    self._lock.notify_all()
                    return
                message = json.loads(data)
                if "exit" in message:
                    self._exits[message["exit"]] = message["rc"]
                    self._live.discard(message["exit"])
                else:
                    self._started[message["req"]] = message["pid"]
                self._lock.notify_all()

    def usable(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def busy(self) -> bool:
        with self._lock:
            return bool(self._live)

    def spawn(self, module: str, args: list[str], env: dict[str, str]) -> ForkedWorker:
        """Fork a worker running `python -m module *args` with `env`; returns once it exists."""
        read_end, write_end = os.pipe()
        try:
            with self._lock:
                req = next(self._ids)
                message = {"req": req, "module": module, "args": args, "env": env, "cwd": self.cwd}
                socket.send_fds(self._sock, [json.dumps(message).encode()], [write_end])
                if not self._lock.wait_for(lambda: req in self._started or self._closed, timeout=60):
                    raise RuntimeError("the fork server did not fork the worker within 60 s")
                if req not in self._started:
                    raise RuntimeError("the fork server exited")
                pid = self._started.pop(req)
                self._live.add(pid)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        stdout = os.fdopen(read_end, "r", encoding="utf-8", errors="replace")
        return ForkedWorker(self, pid, stdout, [sys.executable, "-m", module, *args])

    def exit_status(self, pid: int) -> int | None:
        with self._lock:
            return self._status(pid)

    def _status(self, pid: int) -> int | None:
        if pid in self._exits:
            return self._exits[pid]
        if self._closed:  # the server is gone: its workers got SIGTERM from the kernel; no one reports their status
            if not alive(pid):
                return -signal.SIGTERM
        return None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while (rc := self._status(pid)) is None:
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if left <= 0:
                    return None
                self._lock.wait(timeout=left)  # woken by the reader; the 0.5 s bound notices a server gone quietly
            return rc

    def close(self) -> None:
        """End the server (its idle state; a worker still running gets SIGTERM from the kernel)."""
        try:
            self._sock.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._preface.close()


class _Starter:
    """A thread of its own that starts the servers: PR_SET_PDEATHSIG fires when the *thread* that started a child
    ends, and the task threads that ask for a worker come and go; this one lives as long as the process."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="fork-server-starter", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done.put((fn(), None))
            except BaseException as exc:  # handed to the caller
                done.put((None, exc))

    def __call__(self, fn: Callable[[], Any]) -> Any:
        done: queue.Queue = queue.Queue()
        self._jobs.put((fn, done))
        result, exc = done.get()
        if exc is not None:
            raise exc
        return result


_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()
_starter: _Starter | None = None
_owner = os.getpid()  # a process forked from a launcher must not talk to its parent's servers
IDLE_SERVERS = 2  # at most this many idle servers are kept (each holds ~1 GB of imported libraries)


def _key(env: dict[str, str], cwd: str) -> tuple:
    return cwd, tuple(sorted((k, v) for k, v in env.items() if k not in PER_JOB))


def spawn(module: str, args: list[str], env: dict[str, str], cwd: str) -> ForkedWorker:
    """A worker forked from the server for this environment (started first if there is none)."""
    global _starter, _owner
    key = _key(env, cwd)
    with _servers_lock:
        if _owner != os.getpid():
            _servers.clear()
            _starter, _owner = None, os.getpid()
        server = _servers.get(key)
        if server is None or not server.usable():
            if _starter is None:
                _starter = _Starter()
                atexit.register(close_all)
            idle = [k for k, s in _servers.items() if k != key and not s.busy()]
            for k in idle[: max(0, len(idle) - IDLE_SERVERS + 1)]:
                _servers.pop(k).close()
            server = _servers[key] = ForkServer({k: v for k, v in env.items() if k not in PER_JOB}, cwd, _starter)
    return server.spawn(module, args, env)


def close_all() -> None:
    with _servers_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()


# ------------------------------------------------------------------ the server


def _serve(sock: socket.socket) -> None:
    set_parent_death_signal()  # armed by preexec too; kept for a server started by hand
    quiet_optional_hub_kernel_warning()
    try:
        import importlib

        for name in PRELOAD:
            importlib.import_module(name)
        from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments  # noqa: F401
    except BaseException as exc:
        sock.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        raise
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    preface = Path("/proc/self/fd/1").read_bytes()  # our stdout is the launcher's temporary file
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    sock.send(json.dumps({"ready": True, "pid": os.getpid()}).encode())
    me = os.getpid()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.1)
        if readable:
            data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 1)
            if not data:  # the launcher closed its end or exited
                os._exit(0)
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                _run_worker(request, fds[0], sock, preface, me)
            os.close(fds[0])
            sock.send(json.dumps({"req": request["req"], "pid": pid}).encode())
        while True:  # report every worker that has exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exit": pid, "rc": os.waitstatus_to_exitcode(status)}).encode())


def _name_process(name: str) -> None:
    """The name `top` and `ps -o comm` show (a forked worker's command line stays the server's)."""
    import ctypes

    PR_SET_NAME = 15
    ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _run_worker(request: dict[str, Any], out: int, sock: socket.socket, preface: bytes, server: int) -> None:
    """In the forked child: become `python -m module args` in a session of its own; never returns."""
    import runpy
    import traceback

    code = 1
    try:
        os.setsid()
        preexec_die_with(server)()  # as for a Popen child: SIGTERM when the server dies, gone now if it already has
        sock.close()
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.write(1, preface)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [request["module"], *request["args"]]
        _name_process(request["module"].rsplit(".", 1)[-1])
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        exit_now(code)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
