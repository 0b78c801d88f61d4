"""Processes by identity, not by number: a PID with its start time, the tree below a process, stopping it.

A PID alone can be reused by an unrelated process once ours has exited, so every PID this project writes down
carries its start time, and nothing is signalled unless both still match. psutil reads the process table; where a
process is missing (or /proc is), it reads as gone.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from finetune_flows.files import write_atomic


def start_time(pid: int) -> int | None:
    """Start time in clock ticks after boot (/proc/<pid>/stat field 22). Our own, not psutil's create_time(): that
    adds the boot time as the wall clock has it now, so a record read in another process could read as another
    process after a clock change (psutil keeps the tick count it compares itself private)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def parent_of(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def alive(pid: int) -> bool:
    """Running, and not a zombie (an exited process whose entry waits for its parent's wait())."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below pid, including those that started their own session (torchrun's ranks do)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def ancestors(pid: int) -> list[int]:
    """The parent of pid, its parent, and so on up to PID 1."""
    try:
        return [parent.pid for parent in psutil.Process(pid).parents()]
    except psutil.Error:
        return []


@dataclass(frozen=True)
class ProcessId:
    """A process as (pid, start time): still the same process only while both match."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        start = start_time(pid)
        return None if start is None else cls(pid, start)

    @classmethod
    def parse(cls, text: str) -> ProcessId | None:
        try:
            pid, start = text.split()
            return cls(int(pid), int(start))
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"{self.pid} {self.start}"

    def is_running(self) -> bool:
        return start_time(self.pid) == self.start and alive(self.pid)

    def signal(self, sig: int) -> bool:
        """Send sig if this is still the same process; False if it is gone (or another process has its PID)."""
        if not self.is_running():
            return False
        try:
            os.kill(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False


def write_record(path: Path, pid: int | None = None) -> None:
    """`<pid> <start time>` of this (or the given) process, written atomically."""
    ident = ProcessId.of(pid or os.getpid())
    write_atomic(path, f"{ident}\n")


def read_record(path: Path) -> ProcessId | None:
    """The process a record names, if it is still running; None for a stale or unreadable record."""
    try:
        ident = ProcessId.parse(path.read_text())
    except OSError:
        return None
    return ident if ident is not None and ident.is_running() else None


def remove_record_if_mine(path: Path) -> None:
    try:
        if ProcessId.parse(path.read_text()) == ProcessId.of(os.getpid()):
            path.unlink()
    except OSError:
        pass


def remove_stale_records(directory: Path, pattern: str = "*.pid") -> None:
    """Records whose process is gone (killed before it could remove its own) are deleted."""
    for path in directory.glob(pattern) if directory.is_dir() else []:
        if read_record(path) is None:
            path.unlink(missing_ok=True)


def describe(pid: int) -> str:
    """`pid (command line)`, shortened, for a log line about a process; the pid alone once it is gone."""
    try:
        command = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return str(pid)
    return f"{pid} ({command[:117] + '...' if len(command) > 120 else command})"


def tree(pid: int) -> list[ProcessId]:
    """pid and everything below it, each with its start time."""
    return [ident for p in (pid, *descendants(pid)) if (ident := ProcessId.of(p)) is not None]


def signal_tree(members: list[ProcessId], group: int | None, sig: int) -> None:
    """Signal a process group (the worker's session) and every member (ranks run in sessions of their own)."""
    if group is not None:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for ident in members:
        ident.signal(sig)


def wait_gone(members: list[ProcessId], timeout: float, poll: float = 0.1, while_waiting=None) -> bool:
    """Wait until no member runs; call while_waiting() between polls (e.g. to drain their output). Our own loop, not
    psutil.wait_procs: that reaps a member that is our child behind subprocess's back (its exit status lost) and has
    no hook between polls."""
    deadline = time.monotonic() + timeout
    while any(m.is_running() for m in members):
        if time.monotonic() >= deadline:
            return False
        if while_waiting is not None:
            while_waiting()
        time.sleep(poll)
    return True

