"""Worker lifetime and failure reports through the real launcher, with a model-free worker (tests/fault_worker.py).

Real processes, real signals, real torchrun: what is tested is that no worker outlives its task, that a
PID is never trusted without its start time, and that the reason a worker failed reaches the task.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import child_env
from finetune_flows.runtime import forkserver
from finetune_flows.errors import UserInputError, WorkerFailed, WorkerOOM
from finetune_flows.runtime.gpus import GpuInfo, GpuSelection
from finetune_flows.runtime.launcher import (
    COMPILE_CACHES, WorkerOutput, compile_caches, python_module, run_worker, torchrun_module, worker_env, write_job,
)
from finetune_flows.runtime.processes import (
    ProcessId, alive, ancestors, descendants, parent_of, read_record, remove_stale_records, start_time, tree,
    write_record,
)

ROOT = Path(__file__).resolve().parent.parent


def wait_for(path: Path, timeout: float = 120) -> ProcessId:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ident = read_record(path) if path.exists() else None
        if ident is not None:
            return ident
        time.sleep(0.05)
    raise TimeoutError(f"{path} never named a running process")


FORKED_WORKER_SETUP = "from finetune_flows.runtime import forkserver; forkserver.FORKABLE += ('tests.fault_worker',); "


@pytest.fixture(params=["fresh", "forked"])
def cpu_env(request, monkeypatch) -> dict[str, str]:
    """A CPU worker's GPU environment, with the worker started as a fresh process or forked from the fork server
    (finetune_flows/runtime/forkserver.py, which CPU workers of the pipeline's steps use): the launcher's guarantees
    hold for both."""
    if request.param == "forked":
        monkeypatch.setattr(forkserver, "FORKABLE", (*forkserver.FORKABLE, "tests.fault_worker"))
    else:
        monkeypatch.setenv(forkserver.SWITCH_ENV, "0")
    return {"CUDA_VISIBLE_DEVICES": ""}


def test_result_comes_back_and_no_records_are_left(tmp_path, cpu_env):
    job = write_job(tmp_path, "probe", do="result")
    assert run_worker("probe", python_module("tests.fault_worker", job), cpu_env, tmp_path) == {"ok": True,
                                                                                                "rank": None}
    assert not (tmp_path / "probe.pid").exists()


def test_a_worker_reads_nothing_from_the_terminal(tmp_path, cpu_env):
    """Workers get /dev/null as stdin, whatever the CLI's stdin is: nothing in a worker (transformers' "Do you wish
    to run the custom code? [y/N]") can wait on a person or read what was typed at the CLI."""
    read, write = os.pipe()
    saved = os.dup(0)
    os.dup2(read, 0)  # the orchestrator's stdin: a pipe, as a terminal would be, not /dev/null
    try:
        job = write_job(tmp_path, "probe", do="describe", keys=[])
        got = run_worker("probe", python_module("tests.fault_worker", job), cpu_env, tmp_path)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read, write):
            os.close(fd)
    assert got["stdin"] == "/dev/null"


def test_a_forked_worker_gets_what_a_fresh_one_gets_and_its_exit_status(tmp_path, monkeypatch, caplog):
    """Same environment (the step's, not the server's), working directory, arguments and a session of its own; one
    server serves jobs that differ only in variables read at run time, another environment gets its own; exit
    statuses come back as `subprocess` reports them."""
    monkeypatch.setattr(forkserver, "FORKABLE", (*forkserver.FORKABLE, "tests.fault_worker"))
    caplog.set_level(logging.INFO, logger="finetune_flows")
    keys = ["CUDA_VISIBLE_DEVICES", "FINETUNE_FLOWS_FAULTS", "FORK_TEST_VAR", "PYTHONPATH"]
    seen = {}
    for name, extra in [("a", {}), ("b", {"FINETUNE_FLOWS_FAULTS": "{}"}), ("c", {"FORK_TEST_VAR": "other"})]:
        monkeypatch.setenv("FORK_TEST_VAR", extra.get("FORK_TEST_VAR", "one"))
        if "FINETUNE_FLOWS_FAULTS" in extra:
            monkeypatch.setenv("FINETUNE_FLOWS_FAULTS", extra["FINETUNE_FLOWS_FAULTS"])
        job = write_job(tmp_path / name, "probe", do="describe", keys=keys)
        seen[name] = run_worker("probe", python_module("tests.fault_worker", job), {"CUDA_VISIBLE_DEVICES": ""},
                                tmp_path / name)
    monkeypatch.setenv(forkserver.SWITCH_ENV, "0")
    job = write_job(tmp_path / "fresh", "probe", do="describe", keys=keys)
    fresh = run_worker("probe", python_module("tests.fault_worker", job), {"CUDA_VISIBLE_DEVICES": ""},
                       tmp_path / "fresh")
    assert "forked from the fork server" in caplog.text
    for got in (*seen.values(), fresh):
        assert got["session"] == got["pid"] and got["cwd"] == os.getcwd()
        assert len(got["argv"]) == 2 and got["argv"][1].endswith("/probe.job.json")
        assert got["argv"][0].endswith("tests/fault_worker.py") and got["env"]["CUDA_VISIBLE_DEVICES"] == ""
        assert got["env"]["PYTHONPATH"] == fresh["env"]["PYTHONPATH"]
    assert [seen[n]["env"]["FORK_TEST_VAR"] for n in "abc"] == ["one", "one", "other"]
    assert seen["b"]["env"]["FINETUNE_FLOWS_FAULTS"] == "{}" and seen["a"]["env"]["FINETUNE_FLOWS_FAULTS"] is None
    assert seen["a"]["ppid"] == seen["b"]["ppid"] != seen["c"]["ppid"]  # a server per environment
    assert all(got["torch"] for got in seen.values()) and not fresh["torch"]  # imported once, in the server
    monkeypatch.delenv(forkserver.SWITCH_ENV)
    server = forkserver._servers[forkserver._key(worker_env({"CUDA_VISIBLE_DEVICES": ""}), os.getcwd())]
    for code in (0, 3):
        job = write_job(tmp_path / "exit", "probe", do="exit", code=code)
        proc = server.spawn("tests.fault_worker", [str(job)], worker_env({"CUDA_VISIBLE_DEVICES": ""}))
        assert proc.wait(timeout=60) == code and proc.poll() == code
    job = write_job(tmp_path / "exit", "probe", do="sleep")
    proc = server.spawn("tests.fault_worker", [str(job)], worker_env({"CUDA_VISIBLE_DEVICES": ""}))
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.3)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def gpu(index: int, name: str, capability: tuple[int, int]) -> GpuInfo:
    return GpuInfo(index=index, name=name, memory_total_mib=81920, memory_free_mib=81920, capability=capability)


def test_compile_caches_are_one_folder_per_gpu_model_in_the_projects_cache_and_a_set_variable_wins(tmp_path,
                                                                                                    monkeypatch):
    for var in COMPILE_CACHES:
        monkeypatch.delenv(var, raising=False)
    h200 = GpuSelection(ids=[0, 1], gpus=[gpu(0, "NVIDIA H200", (9, 0)), gpu(1, "NVIDIA H200", (9, 0))])
    assert compile_caches(tmp_path, h200) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile" / "NVIDIA-H200-sm90" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "compile" / "NVIDIA-H200-sm90" / "triton"),
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(tmp_path / "compile" / "NVIDIA-H200-sm90" / "flash-attn-cute")}
    mixed = GpuSelection(ids=[0, 1], gpus=[gpu(0, "NVIDIA L4", (8, 9)), gpu(1, "NVIDIA A100 80GB PCIe", (8, 0))])
    assert Path(compile_caches(tmp_path, mixed)["TRITON_CACHE_DIR"]).parent.name == \
        "NVIDIA-A100-80GB-PCIe-sm80-NVIDIA-L4-sm89"
    monkeypatch.setenv("TRITON_CACHE_DIR", "/fast/disk/triton")  # the user's own choice is left alone
    assert set(compile_caches(tmp_path, GpuSelection(ids=[], gpus=[]))) == {"TORCHINDUCTOR_CACHE_DIR",
                                                                            "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"}


def test_torchs_own_default_in_the_environment_does_not_keep_the_compile_cache_out_of_the_project(tmp_path,
                                                                                                   monkeypatch):
    """Inductor writes its default folder into os.environ on first use, and importing a transformers model does
    that (its continuous-batching cache is wrapped in torch.compiler.disable): the bench's ours rows then compiled
    into /tmp, which a lent machine loses, instead of the store. Only a value the user chose wins."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    code = ("import os, transformers.generation.continuous_batching.cache; "
            "print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))")
    default = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert default != "None"  # torch set it, nobody asked
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default)
    cpu = GpuSelection(ids=[], gpus=[])
    assert compile_caches(tmp_path, cpu)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "cpu" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert "TORCHINDUCTOR_CACHE_DIR" not in compile_caches(tmp_path, cpu)


def test_training_workers_get_expandable_segments_unless_the_user_set_the_allocator(monkeypatch):
    """Packed micro-batches change shape every step; without expandable segments the 8B bench held 95 GiB reserved
    for 71 GiB allocated. The user's own PYTORCH_CUDA_ALLOC_CONF reaches the worker unchanged."""
    from finetune_flows.runtime.launcher import training_env
    from finetune_flows.training.ray_worker import forwarded_env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    h200 = GpuSelection(ids=[0], gpus=[gpu(0, "NVIDIA H200", (9, 0))])
    env = worker_env(training_env(h200.env))
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert forwarded_env(env)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # Ray's workers too
    assert "PYTORCH_CUDA_ALLOC_CONF" not in worker_env(h200.env)  # other workers (evaluation's CUDA graphs) as before
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert worker_env(training_env(h200.env))["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    cpu = GpuSelection(ids=[], gpus=[])  # the same environment as the other steps' workers: one fork server for all
    assert training_env(cpu.env) == cpu.env


def test_ray_training_workers_get_the_compile_caches_and_stable_hashes_the_training_step_sets(tmp_path, monkeypatch):
    """Ray's workers are started by the raylets, not by the training step's driver: what the step set for its worker
    reaches them through Ray's runtime environment, and nothing else of the host's environment does."""
    from finetune_flows.training.ray_worker import forwarded_env
    from finetune_flows.runtime.launcher import STABLE_HASHES

    for var in COMPILE_CACHES:
        monkeypatch.delenv(var, raising=False)
    h200 = GpuSelection(ids=[0], gpus=[gpu(0, "NVIDIA H200", (9, 0))])
    step = {**h200.env, **STABLE_HASHES, **compile_caches(tmp_path, h200)}
    driver = {**worker_env(step), "HOST_SECRET": "x"}  # the environment run_worker gives the driver
    ray_workers = forwarded_env(driver)
    assert "HOST_SECRET" not in ray_workers and "CUDA_VISIBLE_DEVICES" not in ray_workers  # Ray assigns each a GPU
    for var in (*COMPILE_CACHES, *STABLE_HASHES, "CUDA_DEVICE_ORDER", "PYTHONPATH",
                "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"):
        assert ray_workers[var] == driver[var], var
    assert ray_workers["TRITON_CACHE_DIR"] == str(tmp_path / "compile" / "NVIDIA-H200-sm90" / "triton")


def test_a_workers_compiled_kernels_land_in_the_projects_cache(tmp_path, monkeypatch):
    """A fresh container loses /tmp; the project's cache (a volume) keeps what torch.compile built."""
    for var in COMPILE_CACHES:
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / "cache"
    job = write_job(tmp_path, "train", do="compile")
    env = compile_caches(cache, GpuSelection(ids=[], gpus=[]))
    result = run_worker("train", python_module("tests.fault_worker", job), env, tmp_path)
    inductor = cache / "compile" / "cpu" / "inductor"
    assert result["value"][0] == pytest.approx(2 * 0.7310586 + 1) and result["inductor"] == str(inductor)
    assert any(p.is_file() for p in inductor.rglob("*"))


def test_user_error_raised_in_torchrun_ranks_reaches_the_task_as_one_message(tmp_path):
    """torchrun exits 1 whatever its ranks did: the reason comes from the ranks' failure reports."""
    job = write_job(tmp_path, "train", do="user_error")
    with pytest.raises(UserInputError) as info:
        run_worker("train", torchrun_module("tests.fault_worker", job, 2), {"CUDA_VISIBLE_DEVICES": ""}, tmp_path)
    assert str(info.value).startswith("rows.jsonl line 3: not valid JSON (rank ")
    assert "\n" not in str(info.value)
    assert not list((tmp_path / "ranks").glob("*.pid")), "a rank left its PID record behind"
    # torchrun kept its attempt folders beside the job (one per rank), not in a torchelastic_* folder of /tmp
    assert sorted(p.name for p in (tmp_path / "torchrun").glob("*/attempt_0/*")) == ["0", "1"]


def test_a_rank_killed_before_it_removed_its_pid_record_leaves_none_behind(tmp_path, cpu_env):
    """A rank that dies without unwinding (here os._exit; torchrun's SIGTERM to a rank still starting did it, seen
    in a fresh clone's suite) cannot remove its record: the launcher removes it once the worker is gone."""
    job = write_job(tmp_path, "train", do="exit", code=1)
    with pytest.raises(WorkerFailed):
        run_worker("train", python_module("tests.fault_worker", job), {**cpu_env, "RANK": "0"}, tmp_path)
    assert not list((tmp_path / "ranks").glob("*.pid")), "a dead rank's PID record was left behind"


def test_out_of_memory_is_reported_with_the_split_it_happened_at(tmp_path, cpu_env):
    job = write_job(tmp_path, "train", do="oom", micro_batch_split=4)
    with pytest.raises(WorkerOOM) as info:
        run_worker("train", python_module("tests.fault_worker", job), cpu_env, tmp_path)
    assert info.value.split == 4 and "out of host memory" in info.value.message
    assert json.loads((tmp_path / "train.oom.json").read_text())["split"] == 4


def test_a_plain_crash_stays_retryable(tmp_path, cpu_env):
    job = write_job(tmp_path, "evaluate", do="crash")
    with pytest.raises(WorkerFailed) as info:
        run_worker("evaluate", python_module("tests.fault_worker", job), cpu_env, tmp_path)
    assert type(info.value) is WorkerFailed and "RuntimeError: something broke" in info.value.tail


def run_interrupted(tmp_path, cpu_env, interrupt, stop_grace: float) -> None:
    """run_worker on a hanging worker whose child (in another session) ignores SIGTERM, while `interrupt(main)`, in
    a thread, signals the main thread (whose id it gets); the run must end in KeyboardInterrupt. Python leaves
    SIGINT ignored when it starts ignored (a suite started in the background by a shell without job control:
    `make test &` in a script), and then Ctrl-C never reaches run_worker; these tests need Python's default."""
    child_job = write_job(tmp_path, "child", do="stubborn")
    job = write_job(tmp_path, "evaluate", do="hang", child_job=str(child_job))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, args=(threading.main_thread().ident,), daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_worker("evaluate", python_module("tests.fault_worker", job), cpu_env, tmp_path, stop_grace=stop_grace)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_interrupted_wait_stops_the_whole_tree_sigkill_after_the_grace_period(tmp_path, caplog, cpu_env):
    """Ctrl-C in the orchestrator: SIGTERM to the worker and its child in another session; the child ignores it,
    so SIGKILL follows after the grace period, and run_worker returns only once both are gone."""
    seen: dict[str, ProcessId] = {}
    failed: list[Exception] = []

    def interrupt(main: int) -> None:  # interrupts even when a pid never shows: the test ends with that error
        try:
            seen["child"] = wait_for(tmp_path / "child.self.pid")
            seen["worker"] = wait_for(tmp_path / "evaluate.self.pid")
        except Exception as exc:
            failed.append(exc)
        signal.pthread_kill(main, signal.SIGINT)

    run_interrupted(tmp_path, cpu_env, interrupt, stop_grace=2)
    assert not failed, failed
    assert not seen["worker"].is_running() and not seen["child"].is_running()
    assert "did not stop within 2 s: SIGKILL to pids" in caplog.text
    assert not (tmp_path / "evaluate.pid").exists()


def test_a_second_ctrl_c_during_the_grace_period_kills_at_once_and_says_so(tmp_path, caplog, cpu_env):
    """The second Ctrl-C is the user's "now": SIGKILL at once. The log said "did not stop within 25 s" 0.05 s after
    the first signal; it now says what happened."""
    seen: dict[str, ProcessId] = {}

    def interrupt_twice(main: int) -> None:
        try:
            seen["child"] = wait_for(tmp_path / "child.self.pid")
        finally:
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(1)
            signal.pthread_kill(main, signal.SIGINT)

    started = time.monotonic()
    run_interrupted(tmp_path, cpu_env, interrupt_twice, stop_grace=60)
    assert time.monotonic() - started < 40 and not seen["child"].is_running()
    assert re.search(r"was stopped again [0-9.]+ s into its 60 s to stop \(a second Ctrl-C or signal\)", caplog.text)
    assert "did not stop within" not in caplog.text


def test_processes_a_finished_worker_left_behind_are_stopped_and_named(tmp_path, caplog, cpu_env):
    """After every compiled training row on the H200 the launcher had to stop a process the finished worker left,
    and logged "stopping the train worker (pids [960])": no word of what it was. It now says the worker exited and
    names what it left, by command line. A leftover that holds the worker's output pipe (this one does) no longer
    keeps the step waiting for as long as it runs."""
    caplog.set_level(logging.INFO)
    job = write_job(tmp_path, "train", do="leave")
    started = time.monotonic()
    assert run_worker("train", python_module("tests.fault_worker", job), cpu_env, tmp_path, stop_grace=5) == \
        {"ok": True}
    assert time.monotonic() - started < 60  # not until the leftover, holding the worker's output pipe, ends itself
    left = ProcessId.parse((tmp_path / "left.pid").read_text())  # read_record trusts only a running process
    assert left is not None and not left.is_running()
    assert (f"the train worker exited (code 0) leaving processes behind: {left.pid} (" in caplog.text
            and "import time; time.sleep(600)); SIGTERM now, SIGKILL after 5 s" in caplog.text)


def test_the_last_lines_of_a_stopped_worker_reach_its_log_though_the_reader_is_behind(tmp_path):
    """A stopped rank's "received SIGTERM: saving a checkpoint" was missing from train.log on a loaded host: the
    worker was gone, the non-blocking drain found nothing queued yet, and the log was closed while the reader
    thread still had the line to read. finish() handles the output up to its end, for at most its timeout."""
    def behind():
        time.sleep(0.5)
        yield "received SIGTERM: saving a checkpoint\n"

    output = WorkerOutput("train", tmp_path / "train.log", logging.getLogger("test"), None)
    output.start(behind())
    output.drain()  # all a stop did before
    output.finish(timeout=5)
    output.close()
    assert (tmp_path / "train.log").read_text() == "received SIGTERM: saving a checkpoint\n"

    def never_ends():  # a pipe some process outside the worker still holds
        time.sleep(60)
        yield ""

    held = WorkerOutput("train", tmp_path / "held.log", logging.getLogger("test"), None)
    held.start(never_ends())
    started = time.monotonic()
    held.finish(timeout=0.5)
    assert time.monotonic() - started < 5
    held.close()


@pytest.mark.parametrize("launch", ["fresh", "forked"])
def test_workers_die_with_an_orchestrator_killed_by_sigkill(tmp_path, launch):
    """No finally block runs after SIGKILL: the kernel's parent-death signal takes the worker down, and the
    worker's own child (its own session, like a torchrun rank) goes the same way. A forked worker's fork server
    gets the signal from the kernel and the worker gets it from the server's end."""
    child_job = write_job(tmp_path, "child", do="sleep")
    job = write_job(tmp_path, "evaluate", do="hang", child_job=str(child_job))
    script = ((FORKED_WORKER_SETUP if launch == "forked" else "")
              + "from pathlib import Path; from finetune_flows.runtime.launcher import python_module, run_worker; "
              f"run_worker('evaluate', python_module('tests.fault_worker', Path({str(job)!r})), "
              f"{{'CUDA_VISIBLE_DEVICES': ''}}, Path({str(tmp_path)!r}))")
    orchestrator = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT,
                                    env=child_env(**{forkserver.SWITCH_ENV: "1" if launch == "forked" else "0"}))
    try:
        worker = wait_for(tmp_path / "evaluate.self.pid")
        child = wait_for(tmp_path / "child.self.pid")
        above = ProcessId.of(parent_of(worker.pid))  # the orchestrator, or the fork server below it
        assert (above.pid == orchestrator.pid) == (launch == "fresh")
        orchestrator.kill()
        orchestrator.wait()
        deadline = time.monotonic() + 30
        while (worker.is_running() or child.is_running() or above.is_running()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not worker.is_running() and not child.is_running() and not above.is_running()
    finally:
        for path in ("evaluate.self.pid", "child.self.pid"):
            ident = read_record(tmp_path / path)
            if ident is not None:
                ident.signal(signal.SIGKILL)


def test_a_worker_whose_orchestrator_is_gone_exits_at_once(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = ProcessId.of(dead.pid)
    dead.wait()
    job = write_job(tmp_path, "probe", do="sleep")
    env = child_env(FINETUNE_FLOWS_LAUNCHER=str(ident or f"{dead.pid} 1"))
    done = subprocess.run([sys.executable, "-m", "tests.fault_worker", str(job)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "orchestrator that started this worker is gone" in done.stderr


def test_a_pid_record_is_trusted_only_while_its_process_runs(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    record = tmp_path / "rank-0.pid"
    write_record(record, proc.pid)
    assert read_record(record) == ProcessId.of(proc.pid)
    forged = tmp_path / "rank-1.pid"
    forged.write_text(f"{proc.pid} 1\n")  # same PID, another start time: a reused PID
    assert read_record(forged) is None and not ProcessId.parse(forged.read_text()).signal(signal.SIGKILL)
    assert proc.poll() is None, "a stale record signalled a live process"
    proc.kill()
    proc.wait()
    assert read_record(record) is None
    remove_stale_records(tmp_path)
    assert not list(tmp_path.glob("*.pid"))


def test_an_exited_process_awaiting_its_parents_wait_is_gone_and_the_tree_reaches_across_sessions():
    """A zombie has exited (psutil's is_running() still says True for one); a rank in a session of its own is
    still below the process that started it."""
    # The parent keeps its Popen: one it discarded would reap the child in Popen.__del__ (waitpid) if the child was
    # already dead then, as when the SIGKILL below lands while the parent is still inside Popen().
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            "start_new_session=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not descendants(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = descendants(parent.pid)
        assert parent.pid in ancestors(child) and os.getpid() in ancestors(child)
        assert [ident.pid for ident in tree(parent.pid)] == [parent.pid, child]
        assert alive(child)
        os.kill(child, signal.SIGKILL)
        while psutil.Process(child).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)  # the parent sleeps: no one reaps it
        assert psutil.Process(child).is_running() and not alive(child)
        assert not ProcessId(child, start_time(child)).is_running()
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_child_pythons_started_by_tests_keep_the_pythonpath_they_inherit(tmp_path):
    """A GPU image carries its wheels on PYTHONPATH (a sitecustomize there adds them): a test's CLI run that replaced
    PYTHONPATH with the checkout alone could not import its stack, and the GPU SIGTERM test waited 600 s for it."""
    extra = tmp_path / "site"
    extra.mkdir()
    (extra / "sitecustomize.py").write_text("import os\nos.environ['CARRIED_SITE'] = 'yes'\n")
    env = child_env(dict(os.environ, PYTHONPATH=str(extra)))
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(extra)]
    seen = subprocess.run([sys.executable, "-c", "import os, tasks; print(os.environ.get('CARRIED_SITE'))"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0 and seen.stdout.strip() == "yes", seen.stderr  # both the checkout and the carried site


def test_the_stop_vote_of_one_rank_makes_no_collective(tmp_path, monkeypatch):
    """Each training step asks every rank whether any was told to stop (a MAX all-reduce, whose .item() waits for
    the device on NCCL); one rank has nothing to agree on and answers without it. Two gloo ranks still vote."""
    import torch.distributed as dist

    from finetune_flows.runtime.lifecycle import _any_rank

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        def refused(*args, **kwargs):
            raise AssertionError("one rank made a collective")

        monkeypatch.setattr(dist, "all_reduce", refused)
        assert _any_rank(True) is True and _any_rank(False) is False
    finally:
        dist.destroy_process_group()
    script = ("import sys, torch.distributed as dist\n"
              "from finetune_flows.runtime.lifecycle import _any_rank\n"
              "rank = int(sys.argv[1])\n"
              f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'two'}', rank=rank, world_size=2)\n"
              "print(_any_rank(rank == 1))\n"
              "dist.destroy_process_group()\n")
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE, text=True,
                              env=child_env()) for r in (0, 1)]
    assert [p.communicate(timeout=120)[0].strip() for p in ranks] == ["True", "True"]


LOST_IN_A_FINALIZER = """
import os, signal, sys, time
from prefect.exceptions import TerminationSignal
from prefect.utilities.engine import capture_sigterm
from finetune_flows.cli import stop_on_signals
from finetune_flows.runtime.lifecycle import Stopped, raise_if_stopped, watch_stop_signals

class Transport:  # an object whose finalizer runs when the signal's handler does
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10**6):  # Prefect's handler raises in here, and the interpreter drops its exception
            pass

def wait():  # as the wait on a worker does
    for _ in range(100):
        raise_if_stopped()
        time.sleep(0.1)
    print("went on")

try:
    # the CLI (Prefect's SIGTERM handler over its own, as during a flow run), or a deployment run's process
    with (stop_on_signals() if sys.argv[1] == "cli" else watch_stop_signals()), capture_sigterm():
        Transport()
        print("the finalizer's exception was lost", flush=True)
        wait()
except Stopped as exc:
    print("stopped by", exc)
except TerminationSignal as exc:
    print("terminated by", signal.Signals(exc.signal).name)
"""


@pytest.mark.parametrize("process, outcome, code", [("cli", ["stopped by SIGTERM"], 0),
                                                    ("deployment", [], -signal.SIGTERM)])
def test_a_sigterm_whose_prefect_exception_was_lost_in_a_finalizer_still_stops_the_run(process, outcome, code):
    """During a flow run Prefect's SIGTERM handler raises TerminationSignal. Raised inside a finalizer, that exception
    is lost: a SIGTERM'd CLI run trained to the end and exited 0 (seen in the fault suite under load), and a
    deployment run's process went on. Every stop signal is recorded as it arrives, and the wait raises again what
    the handler raises, so the stop takes Prefect's own way: the CLI gets its Stopped back; a deployment run's
    process, with no cancellation intent from a runner here, is ended by the signal as Prefect ends it (with one,
    Prefect marks the run Cancelled instead)."""
    done = subprocess.run([sys.executable, "-c", LOST_IN_A_FINALIZER, process], capture_output=True, text=True,
                          timeout=120, env=child_env())
    assert "TerminationSignal" in done.stderr and "Exception ignored" in done.stderr, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["the finalizer's exception was lost", *outcome], (
        done.stdout + done.stderr[-2000:])
    assert done.returncode == code


def test_a_stop_whose_exception_was_lost_still_stops_the_worker_and_the_next_step(tmp_path, cpu_env, monkeypatch):
    """The CLI's signal handler raises Stopped in the main thread wherever it is. Landing in an object's finalizer
    (a garbage-collected asyncio transport: "Exception ignored in ... __del__"), that exception is lost and the run
    went on to the end, exit 0 after a Ctrl-C (seen once in CI). The handler also records the stop: the wait on a
    worker raises Stopped within a second and stops the worker, and no further step starts."""
    from finetune_flows.orchestration.caching import run_step
    from finetune_flows.runtime import lifecycle

    monkeypatch.setattr(lifecycle, "_stop_requested", None)
    job = write_job(tmp_path, "probe", do="sleep")

    def lost_exception() -> None:  # what is left of the handler's work once its exception is swallowed
        while not (tmp_path / "probe.self.pid").exists():
            time.sleep(0.1)
        lifecycle.request_stop(signal.SIGINT)

    threading.Thread(target=lost_exception, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(lifecycle.Stopped) as stopped:
        run_worker("probe", python_module("tests.fault_worker", job), cpu_env, tmp_path)
    assert stopped.value.signum == signal.SIGINT and time.monotonic() - started < 60
    worker = read_record(tmp_path / "probe.self.pid")
    assert worker is None or not worker.is_running(), "the worker outlived the stop"
    with pytest.raises(lifecycle.Stopped):
        run_step(lambda **kwargs: pytest.fail("a step started after the stop"))
