"""The terminal a person watches: one live progress line under a real pseudo-terminal, plain log lines without.

The child processes run the real ProgressReporter (and, in the slow tests, the real `python flows/finetune.py`)
with their stderr on a pty (`pty.openpty`) or on a pipe, and the tests read exactly what reached that terminal.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from conftest import child_env, tiny_overrides
from finetune_flows.reporting.progress import format_duration, progress_line

ROOT = Path(__file__).resolve().parent.parent
CLEAR = "\r\x1b[2K"
LIVE_LINE = re.compile(r"train +(\d+)/(\d+) \[[#.]+\] +\d+%")

FEED_EVENTS = r"""
import logging, sys
from finetune_flows.reporting.progress import ProgressReporter

handler = logging.StreamHandler(sys.stderr)  # like Prefect's console handler on the root logger
handler.setFormatter(logging.Formatter("%(levelname)s | %(message)s"))
logging.getLogger().addHandler(handler)
logging.getLogger().setLevel(logging.INFO)
with ProgressReporter(6) as progress:
    for step in range(1, 7):
        progress(dict(kind="train_step", step=step, max_steps=6, elapsed=2.0 * step, tokens_per_second=90.0))
        if step % 2 == 0:
            progress(dict(kind="train_log", step=step, max_steps=6, loss=2.0 / step, learning_rate=1e-3,
                          elapsed=2.0 * step, tokens_per_second=90.0))
        if step == 3:
            progress(dict(kind="checkpoint", step=3))
logging.getLogger("after").info("trained 6 steps")
"""


def run_in_terminal(argv: list[str], env: dict[str, str], timeout: float, columns: int = 160) -> tuple[int, str]:
    """Run argv with stdin/stdout/stderr on a fresh pseudo-terminal; return (exit code, what the terminal got)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        # Until the process exits, then what is still buffered: a helper it started (Prefect's temporary server)
        # may hold the terminal open after it exits, so end-of-file cannot be the signal.
        while True:
            exited = proc.poll() is not None
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"{argv} still running after {timeout} s:\n{b''.join(chunks).decode()[-3000:]}")
            if not select.select([master], [], [], 0.2)[0]:
                if exited:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: nothing holds the terminal any more
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def run_without_terminal(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    done = subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)
    return done.returncode, done.stdout.decode(errors="replace")


def terminal_env(**extra: str) -> dict[str, str]:
    """A child's environment without our terminal size: the pty's own size is the one the child must read."""
    return child_env({k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, **extra)


def test_progress_line_reads_like_a_status_bar():
    line = progress_line(12, 40, 0.81234, 93.4, 125.0)
    assert line == "train 12/40 [######..............]  30%  loss 0.8123  93 tokens/s  ETA 2m05s"
    assert progress_line(1, 40, None, None, None).endswith("ETA --")
    assert [format_duration(s) for s in (7, 65, 3700)] == ["7s", "1m05s", "1h01m"]


def test_progress_line_is_redrawn_in_place_under_a_pty():
    rc, screen = run_in_terminal([sys.executable, "-c", FEED_EVENTS], terminal_env(), timeout=120)
    assert rc == 0, screen
    draws = [int(m.group(1)) for m in re.finditer(re.escape(CLEAR) + r"train +(\d+)/6", screen)]
    assert sorted(set(draws)) == list(range(1, 7)) and draws == sorted(draws), screen  # each step, in place
    after_checkpoint = screen.split("checkpoint saved at step 3", 1)[1]
    assert after_checkpoint.split(CLEAR)[1].startswith("train 3/6"), screen  # redrawn below the log line
    assert "ETA 8s" in screen and "loss 0.3333" in screen and "90 tokens/s" in screen
    assert "step 2/6 loss" not in screen  # the log line is drawn by the live line, not printed beside it
    assert "INFO | checkpoint saved at step 3" in screen
    final = screen.rsplit(CLEAR, 1)[1]  # the last state stays on screen as a line of its own
    assert final.startswith("train 6/6 [####################] 100%") and "\n" in final
    assert final.index("train 6/6") < final.index("INFO | trained 6 steps")


def test_plain_log_lines_without_a_terminal():
    rc, out = run_without_terminal([sys.executable, "-c", FEED_EVENTS], terminal_env(), timeout=120)
    assert rc == 0, out
    assert "\r" not in out and "\x1b" not in out and not LIVE_LINE.search(out)
    lines = [line for line in out.splitlines() if "step" in line]
    assert lines == ["INFO | step 2/6 loss 1.0000 lr 0.001 90.0 tokens/s", "INFO | checkpoint saved at step 3",
                     "INFO | step 4/6 loss 0.5000 lr 0.001 90.0 tokens/s",
                     "INFO | step 6/6 loss 0.3333 lr 0.001 90.0 tokens/s", "INFO | trained 6 steps"], out



def test_a_log_line_shows_the_learning_rate_in_three_digits_not_the_schedulers_float(caplog):
    from finetune_flows.reporting.progress import ProgressReporter

    with caplog.at_level(logging.INFO, logger="finetune_flows"), ProgressReporter(400) as progress:
        for step, lr in ((50, 0.0008863636363636364), (100, 0.0)):
            progress(dict(kind="train_log", step=step, max_steps=400, loss=6.226, learning_rate=lr, elapsed=5.0,
                          tokens_per_second=8967.6))
    assert [r.getMessage() for r in caplog.records] == ["step 50/400 loss 6.2260 lr 0.000886 8967.6 tokens/s",
                                                        "step 100/400 loss 6.2260 lr 0 8967.6 tokens/s"]


# ---------------------------------------------------------------- the real CLI


def cli(cache: Path, runs: Path, seed: int) -> list[str]:
    overrides = tiny_overrides(cache, runs, **{"train.seed": seed, "train.logging_steps": 2,
                                              "tracking.report_to": "none", "export.merge": False})
    return [sys.executable, "flows/finetune.py", *(a for o in overrides for a in ("--set", o))]


def cli_env(tmp_path: Path) -> dict[str, str]:
    """A plain CLI run: its own temporary Prefect server and result storage (not this test session's)."""
    env = terminal_env(PREFECT_HOME=str(tmp_path / "prefect-home"),
                       PREFECT_LOCAL_STORAGE_PATH=str(tmp_path / "prefect-storage"))
    env.pop("PREFECT_API_URL", None)
    return env


@pytest.mark.slow
def test_cli_run_on_a_terminal_shows_one_live_line_and_no_noise(shared_cache, tmp_path):
    env = cli_env(tmp_path)
    rc, screen = run_in_terminal(cli(shared_cache / "cli", tmp_path / "runs", seed=1), env, timeout=900)
    assert rc == 0, screen[-4000:]
    steps = [int(m.group(1)) for m in re.finditer(re.escape(CLEAR) + r"train +(\d+)/6", screen)]
    assert steps and steps[-1] == 6 and sorted(set(steps)) == list(range(1, 7)), screen[-4000:]
    assert "{'loss'" not in screen and "'train_runtime'" not in screen  # the Trainer's raw dicts are gone
    assert "step 2/6 loss" not in screen  # drawn by the live line, not printed a second time
    assert "concurrency limit" not in screen  # a temporary local server has no other runs to queue behind


@pytest.mark.slow
def test_cli_run_without_a_terminal_logs_each_logging_step_once(shared_cache, tmp_path):
    env = cli_env(tmp_path)
    rc, out = run_without_terminal(cli(shared_cache / "cli", tmp_path / "runs", seed=2), env, timeout=900)
    assert rc == 0, out[-4000:]
    assert "\r" not in out and not LIVE_LINE.search(out)
    assert [int(s) for s in re.findall(r"step (\d+)/6 loss", out)] == [1, 2, 4, 6], out[-4000:]
    assert "{'loss'" not in out and "concurrency limit" not in out
    # bitsandbytes' offline miss of its optional Hub CPU kernel (CPUs with AVX512-BF16) is not shown at all: a note
    # about it came only from the process that first imported bitsandbytes, so the output flipped with test order
    assert "gemm_4bit_forward" not in out and "pip install kernels" not in out
    assert "quantization-bitsandbytes" not in out and "Skipping publisher trust check" not in out


def test_bitsandbytes_optional_hub_kernel_miss_is_not_shown():
    import logging

    from finetune_flows.runtime.lifecycle import quiet_optional_hub_kernel_warning

    quiet_optional_hub_kernel_warning()
    ops, hub = logging.getLogger("bitsandbytes.backends.cpu.ops"), logging.getLogger("kernels.hf_hub")
    miss = ops.makeRecord(ops.name, logging.WARNING, "ops.py", 252, "Failed to load CPU gemm_4bit_forward from "
                          "kernels-community: %s. Please make sure you already `pip install kernels` and the "
                          "kernels >= 0.11.1", ("Kernel repository could not verify publisher trust status.",), None)
    trust = hub.makeRecord(hub.name, logging.WARNING, "hf_hub.py", 1, "Skipping publisher trust check for "
                           "kernels-community/quantization-bitsandbytes (offline)", (), None)
    assert not ops.filter(miss) and not hub.filter(trust)
    other = ops.makeRecord(ops.name, logging.WARNING, "ops.py", 1, "something else", (), None)
    assert ops.filter(other) and other.getMessage() == "something else"  # nothing else is touched


def test_a_missing_device_limit_is_said_once_at_info_level(prefect_server, caplog, monkeypatch):
    import logging

    import finetune_flows.orchestration.concurrency as concurrency

    monkeypatch.setattr(concurrency, "_REPORTED_MISSING", set())
    with caplog.at_level(logging.INFO, logger="finetune_flows"):
        for _ in range(3):  # quantize, train, evaluate: three device steps of one run
            with concurrency.device_slots([]):
                pass
    said = [r for r in caplog.records if "no concurrency limit named" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO], [r.getMessage() for r in said]


@pytest.mark.parametrize("packing", [True, False])
def test_every_step_is_timed_with_its_own_tokens_the_last_one_included(tmp_path, capsys, packing):
    """The DataLoader builds a batch ahead of training: counted when built, the first step got two batches' tokens
    and the last none ("0.0 tokens/s"). A real Trainer on the CPU, both collators, gradient accumulation 2."""
    import json

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from finetune_flows.runtime.lifecycle import EVENT_PREFIX
    from finetune_flows.data.packing import PackedCollator
    from finetune_flows.data.packing import PadCollator
    from finetune_flows.training.clock import StepClock, steady_state, steady_text
    from finetune_flows.training.worker import _callbacks
    from tests.test_packing import random_rows, tiny_qwen3

    steps, accumulation = 4, 2
    model = get_peft_model(tiny_qwen3(2).train(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           task_type="CAUSAL_LM"))
    if packing:
        batches = [random_rows([5 + i, 11, 7 + 2 * i], seed=i) for i in range(steps * accumulation)]
        data, collator, per_batch = batches, PackedCollator(0), [sum(len(r["input_ids"]) for r in b) for b in batches]
    else:
        data = random_rows([4 + 3 * i for i in range(2 * steps * accumulation)])
        collator = PadCollator(0)
        per_batch = [len(a["input_ids"]) + len(b["input_ids"]) for a, b in zip(data[::2], data[1::2])]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=1 if packing else 2,
                             gradient_accumulation_steps=accumulation, max_steps=steps, use_cpu=True, report_to=[],
                             save_strategy="no", logging_steps=1, disable_tqdm=True, remove_unused_columns=False,
                             train_sampling_strategy="sequential")
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    clock = StepClock(collator, model)
    trainer.add_callback(_callbacks(steps, collator, clock, tmp_path, time.perf_counter()))
    torch.manual_seed(0)
    trainer.train()
    per_step = [sum(per_batch[i * accumulation:(i + 1) * accumulation]) for i in range(steps)]
    assert [tokens for _, _, tokens, _ in clock.steps] == per_step
    assert collator.tokens == sum(per_batch)
    events = [json.loads(line[len(EVENT_PREFIX):]) for line in capsys.readouterr().out.splitlines()
              if line.startswith(EVENT_PREFIX)]
    logged = [e for e in events if e["kind"] == "train_log"]
    assert [e["step"] for e in logged] == list(range(1, steps + 1))
    assert all(e["tokens_per_second"] > 0 for e in logged)
    # four steps are too few for a steady-state figure: the summary line says why instead of "steady None"
    assert steady_text(steady_state(clock.steps, 1.0, 2)) == (
        "no steady-state figure: 2 step(s) after the 2-step warm-up (checkpoint and compiling steps left out), "
        "fewer than one 5-step window")


RANK_TRAINER = """
import gc, json, sys
import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback

from finetune_flows.config.plan import Plan
from finetune_flows.config.schema import load_config
from finetune_flows.training.distributed import single_rank_defaults
from finetune_flows.training.planner import TrainingPlan
from finetune_flows.data.packing import PadCollator
from finetune_flows.training.worker import train_with_frozen_heap, training_arguments
from tests.test_packing import random_rows, tiny_qwen3

single_rank_defaults()  # a rank of one, as the worker runs without torchrun
cfg = load_config(None, ["train.logging_steps=100", "train.save_steps=100", "tracking.report_to=[]"])
plan = Plan(device="cpu", nproc=1, precision="fp32", compute_dtype="float32", train_attn="sdpa", eval_attn="sdpa")
tplan = TrainingPlan(packing=False, micro_batch_tokens=0, micro_batch_rows=2, gradient_accumulation_steps=2,
                     gradient_checkpointing=False, tokens_per_step=40.0, predicted_peak_gib=0.0, budget_gib=None,
                     reasons=[])
args = training_arguments(cfg, plan, tplan, __import__("pathlib").Path(sys.argv[1]),
                          dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3),
                          on_gpu=False, use_liger=False)
model = get_peft_model(tiny_qwen3(2).train(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                       task_type="CAUSAL_LM"))
truths, frozen = [], []
plain = torch.Tensor.__bool__

def counted(self):  # a tensor's truth tested in the Trainer's own code
    if sys._getframe(1).f_code.co_filename.endswith("transformers/trainer.py"):
        truths.append(sys._getframe(1).f_code.co_name)
    return plain(self)

class Frozen(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        frozen.append(gc.get_freeze_count())

trainer = Trainer(model=model, args=args, train_dataset=random_rows([6, 9, 4, 11, 7, 5] * 2),
                  data_collator=PadCollator(0), callbacks=[Frozen()])
torch.Tensor.__bool__ = counted
train_with_frozen_heap(trainer, None)
torch.Tensor.__bool__ = plain
print(json.dumps({"steps": trainer.state.global_step, "truths": truths, "frozen": frozen,
                  "after": gc.get_freeze_count()}))
"""


@pytest.fixture(scope="module")
def rank_training(tmp_path_factory):
    """The rank body's Trainer set-up (training_arguments, train_with_frozen_heap) on a tiny model in a CPU process
    of its own: 3 steps of 2 micro-batches."""
    import json

    out = tmp_path_factory.mktemp("rank")
    proc = subprocess.run([sys.executable, "-c", RANK_TRAINER, str(out)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_ranks_training_loop_reads_no_tensor_on_the_host_per_micro_batch(rank_training):
    """On a GPU, a tensor read on the host in a Python `if` waits for the device: the Trainer's NaN filter did so
    after every micro-batch's backward pass (isnan and isinf of the loss). The rank body's arguments leave it off, so
    the Trainer's loop tests no tensor's truth at all (its logging steps read the loss with .item(), none here)."""
    assert rank_training["steps"] == 3 and rank_training["truths"] == []


def test_the_rank_trains_with_the_heap_frozen_and_thaws_it_after(rank_training):
    assert len(rank_training["frozen"]) == 3 and all(n > 0 for n in rank_training["frozen"])
    assert rank_training["after"] == 0

def test_the_steady_state_leaves_out_the_warm_up_it_is_given_or_a_tenth_of_the_steps():
    from finetune_flows.training.clock import steady_state

    steps = [(i, 2.0 if i == 3 else 1.0, 100, False) for i in range(1, 21)]  # step 3 slow, 100 tokens each
    assert steady_state(steps, 1.0)["min"] == round(500 / 6, 1)  # 20 steps: 2 left out, step 3 in a window
    assert steady_state(steps, 1.0, 4) == {"tokens_per_second": 100.0, "min": 100.0, "max": 100.0, "windows": 3,
                                           "steps": 16}


class Device:
    """A GPU's timeline for StepClock's events (CUDA events cannot exist on this host): work the host has handed it
    and work it has run, both moved forward by the test."""

    def __init__(self):
        self.queued = 0.0  # seconds of work handed to the device so far
        self.done = 0.0  # seconds of it the device has run
        self.waits = 0  # times the host waited for it

    def events(self):
        device = self

        class Event:  # torch.cuda.Event's surface that the clock uses, recorded where the queued work ends
            def __init__(self):
                self.at = device.queued

            def query(self):
                return self.at <= device.done

            def synchronize(self):
                if self.at > device.done:
                    device.waits += 1
                    device.done = self.at

            def elapsed_time(self, end):
                return (end.at - self.at) * 1000.0

        return Event


class Model:  # the tally counts a batch's tokens when the model runs it
    def register_forward_pre_hook(self, hook):
        self.run = lambda: hook(self, ())


def test_on_a_gpu_the_step_clock_reads_the_devices_timeline_without_making_the_host_wait():
    """StepClock with device events: each step boundary is an event the device reaches after the step's work; a
    step's time is the device's time between two boundaries, read once the device has passed the second (the host
    never waits at a step end), and settle() waits for the rest. A save or compilation marked after a step lands in
    the next one."""
    from finetune_flows.data.packing import TokenTally
    from finetune_flows.training.clock import StepClock

    device, tally, model = Device(), TokenTally(), Model()
    clock = StepClock(tally, model, device.events())
    clock.start()
    for step, (seconds, tokens) in enumerate([(0.5, 100), (0.25, 80), (0.125, 60), (0.5, 40)], start=1):
        tally.built(tokens)
        model.run()
        device.queued += seconds
        clock.step_end(step)
        if step == 2:
            clock.exclude()  # e.g. a checkpoint saved after step 2: its time falls in step 3
        device.done = max(0.0, device.queued - 0.3)  # the host runs ahead of the device
    assert device.waits == 0
    ran = [(1, 0.5, 100, False), (2, 0.25, 80, False), (3, 0.125, 60, True)]
    assert clock.steps == ran  # step 4 ends at 1.375 s of the device's work; it has run 1.075
    assert clock.settle() == [*ran, (4, 0.5, 40, False)]
    assert device.waits == 1  # once, for the last step


def test_progress_before_the_device_has_run_a_step_has_no_rate_and_leaves_the_eta_to_the_reporter(capsys, tmp_path):
    """The rank's progress events, while the device has not yet finished any step: no tokens/s and no ETA (the
    reporter estimates one from the elapsed time), not an ETA of 0 s; then both, once a step has been timed."""
    from types import SimpleNamespace

    from finetune_flows.data.packing import TokenTally
    from finetune_flows.runtime.lifecycle import EVENT_PREFIX
    from finetune_flows.training.clock import StepClock
    from finetune_flows.training.worker import _callbacks

    device, tally, model = Device(), TokenTally(), Model()
    clock = StepClock(tally, model, device.events())
    events = _callbacks(4, tally, clock, tmp_path, time.perf_counter())
    args, control = SimpleNamespace(logging_steps=5, world_size=1), None
    state = SimpleNamespace(global_step=0, max_steps=4, is_world_process_zero=True)
    events.on_train_begin(args, state, control)
    for step in (1, 2):
        tally.built(100)
        model.run()
        device.queued += 0.5
        state.global_step = step
        events.on_step_end(args, state, control)
        device.done = device.queued  # the device finishes step 1 only after its progress event
    printed = [json.loads(line[len(EVENT_PREFIX):]) for line in capsys.readouterr().out.splitlines()
               if line.startswith(EVENT_PREFIX)]
    first, second = [e for e in printed if e["kind"] == "train_step"]
    assert first["tokens_per_second"] is None and first["eta_seconds"] is None
    assert second["tokens_per_second"] == 200.0 and second["eta_seconds"] == 1.0  # 2 steps left x 0.5 s


def test_a_gpu_ranks_dataloader_copies_batches_without_waiting_for_the_device(tmp_path, monkeypatch):
    """training_arguments for a GPU rank asks accelerate's prepared dataloader for non-blocking copies (from the
    Trainer's pinned batches) instead of copies that wait for the device's queue to drain; a CPU rank's are as
    before. The arguments are captured, not built: a GPU rank's process group needs NCCL, not in this CPU build."""
    import transformers

    from finetune_flows.config.plan import Plan
    from finetune_flows.config.schema import load_config
    from finetune_flows.training.planner import TrainingPlan
    from finetune_flows.training.worker import training_arguments

    captured = []
    monkeypatch.setattr(transformers, "TrainingArguments", lambda **kwargs: captured.append(kwargs))
    cfg = load_config(None, [])
    plan = Plan(device="cuda", nproc=1, precision="bf16", compute_dtype="bfloat16", train_attn="sdpa",
                eval_attn="sdpa")
    tplan = TrainingPlan(packing=True, micro_batch_tokens=1024, micro_batch_rows=0, gradient_accumulation_steps=1,
                         gradient_checkpointing=False, tokens_per_step=1024.0, predicted_peak_gib=1.0, budget_gib=2.0,
                         reasons=[])
    for on_gpu in (True, False):
        training_arguments(cfg, plan, tplan, tmp_path, dict(max_steps=1), on_gpu=on_gpu, use_liger=False)
    gpu, cpu = captured
    assert gpu["accelerator_config"] == {"non_blocking": True} and gpu.get("dataloader_pin_memory", True)
    assert cpu["accelerator_config"] == {"non_blocking": False}


KILL_WINDOW = """
import json, sys
from pathlib import Path
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback

from finetune_flows.config.plan import Plan
from finetune_flows.config.schema import load_config
from finetune_flows.data.packing import PadCollator
from finetune_flows.training.checkpoints import checkpoint_is_complete
from finetune_flows.training.clock import StepClock
from finetune_flows.training.distributed import single_rank_defaults
from finetune_flows.training.planner import TrainingPlan
from finetune_flows.training.worker import _callbacks, training_arguments
from tests.test_packing import random_rows, tiny_qwen3

single_rank_defaults()
cfg = load_config(None, ["train.save_steps=1", "train.save_total_limit=1", "tracking.report_to=[]"])
plan = Plan(device="cpu", nproc=1, precision="fp32", compute_dtype="float32", train_attn="sdpa", eval_attn="sdpa")
tplan = TrainingPlan(packing=False, micro_batch_tokens=0, micro_batch_rows=2, gradient_accumulation_steps=1,
                     gradient_checkpointing=False, tokens_per_step=20.0, predicted_peak_gib=0.0, budget_gib=None,
                     reasons=[])
out = Path(sys.argv[1])
args = training_arguments(cfg, plan, tplan, out, dict(per_device_train_batch_size=2, gradient_accumulation_steps=1,
                          max_steps=3), on_gpu=False, use_liger=False)
model = get_peft_model(tiny_qwen3(2).train(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                       task_type="CAUSAL_LM"))
complete = []

class KilledHere(TrainerCallback):
    # runs before the worker's callback: what a kill between the Trainer's save and its on_save would leave
    def on_save(self, args, state, control, **kwargs):
        complete.append(sorted(p.name for p in (out / "checkpoints").glob("checkpoint-*") if checkpoint_is_complete(p)))

collator = PadCollator(0)
trainer = Trainer(model=model, args=args, train_dataset=random_rows([6, 9, 4, 11, 7, 5]), data_collator=collator,
                  callbacks=[KilledHere()])
trainer.add_callback(_callbacks(3, collator, StepClock(collator, model, None), out, 0.0, cfg.train.save_total_limit))
trainer.train()
print(json.dumps({"complete": complete, "left": sorted(p.name for p in (out / "checkpoints").iterdir())}))
"""


def test_one_kept_checkpoint_is_removed_only_once_the_next_is_complete(tmp_path):
    """train.save_total_limit=1: the Trainer removed the old checkpoint before the worker wrote the new one's manifest,
    so a kill in between left no complete checkpoint and the rerun trained from step 0. The worker now rotates them
    after the manifest: at every save, one complete checkpoint is on disk."""
    import json

    proc = subprocess.run([sys.executable, "-c", KILL_WINDOW, str(tmp_path)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["complete"] == [[], ["checkpoint-1"], ["checkpoint-2"]], seen
    assert seen["left"] == ["checkpoint-3"], seen
