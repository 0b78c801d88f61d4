"""`python -m finetune_flows.runtime.tether --parent PID -- COMMAND...`: run COMMAND for as long as PID lives.

`make server`, `make worker` and `make run` start the Prefect server, worker and run through this. make ends its
recipe's process on SIGTERM, and a terminal's Ctrl-C reaches the whole process group, but when make itself is
SIGKILLed (a supervisor's escalation, the OOM killer) nothing told its child: the server or worker ran on, orphaned,
the worker still taking runs. Here:
- this process gets SIGTERM when PID dies, by any signal (PR_SET_PDEATHSIG), and leaves at once if PID is already
  gone;
- the first SIGTERM is passed on to COMMAND once (make also sends its own before it dies: a second one would make
  Prefect's server and worker kill their children at once, not stop them); a SIGINT is not passed on, as the
  terminal has already delivered it to COMMAND;
- whatever stops it, COMMAND and every process below it that is still there STOP_GRACE_SECONDS later is SIGKILLed;
- COMMAND gets SIGTERM if this process is SIGKILLed (PR_SET_PDEATHSIG again);
- the exit status is COMMAND's (128 + the signal that ended it).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading

from finetune_flows.runtime.lifecycle import preexec_die_with, set_parent_death_signal
from finetune_flows.runtime.processes import ProcessId, tree, wait_gone

STOP_GRACE_SECONDS = 30.0  # Prefect's server stops in a few seconds; a stuck one is killed after this (--grace)


def run_tethered(parent: int, command: list[str], grace: float = STOP_GRACE_SECONDS) -> int:
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # died before the death signal was armed: no signal would ever come
        print(f"tether: process {parent} that started `{command[0]}` is gone: not starting it", file=sys.stderr)
        return 1
    stopping = threading.Event()
    started: list[subprocess.Popen] = []
    members: list[ProcessId] = []  # COMMAND's tree when the stop began: what must be gone `grace` seconds later

    def kill_members() -> None:
        for ident in members:
            ident.signal(signal.SIGKILL)

    def on_signal(signum: int, _frame) -> None:
        if stopping.is_set():
            return
        stopping.set()
        if started:
            members.extend(tree(started[0].pid))
            if signum == signal.SIGTERM:
                started[0].send_signal(signal.SIGTERM)
        timer = threading.Timer(grace, kill_members)
        timer.daemon = True
        timer.start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    child = subprocess.Popen(command, preexec_fn=preexec_die_with(os.getpid()))
    started.append(child)
    if stopping.is_set() and not members:  # stopped before COMMAND existed
        members.extend(tree(child.pid))
        child.send_signal(signal.SIGTERM)
    code = child.wait()
    if stopping.is_set() and not wait_gone(members, grace):  # what COMMAND left behind (a server's uvicorn)
        kill_members()
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune_flows.runtime.tether", description=__doc__.split("\n")[0])
    parser.add_argument("--parent", type=int, required=True, help="the PID whose death ends COMMAND (make: $$PPID)")
    parser.add_argument("--grace", type=float, default=STOP_GRACE_SECONDS,
                        help="seconds COMMAND's processes get to stop before SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND after --")
    return run_tethered(args.parent, command, args.grace)


if __name__ == "__main__":
    sys.exit(main())
