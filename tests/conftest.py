"""Test session set-up: offline Hub, Prefect state in a temp dir, one Prefect test server for the session."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="finetune-flows-tests-"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect-home")
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(_SESSION_TMP / "prefect-storage")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"
# A shared cache for the generated tiny model and tokenizer, so tests build them once. Under pytest-xdist
# (`make test`) the controller sets it before it starts the workers, so they share one cache (each its own Prefect
# home); the store's per-entry locks make concurrent use safe, as for concurrent runs.
os.environ.setdefault("FINETUNE_FLOWS_TEST_CACHE", str(_SESSION_TMP / "cache"))
# The machine probe (a child importing torch and bitsandbytes, ~8 s of CPU) once per session, not once per test cache:
# every CLI, deployment and in-process run of the session reads it from this store (environment.probe_dir).
os.environ.setdefault("FINETUNE_FLOWS_PROBE_DIR", os.environ["FINETUNE_FLOWS_TEST_CACHE"])

REPO = Path(__file__).resolve().parent.parent


def child_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a child Python started by a test: ours (or `base`), this checkout first on PYTHONPATH and
    whatever was there kept (a GPU image carries its wheels in a directory on PYTHONPATH), the Hub offline."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


# `make test` spreads whole files over pytest-xdist workers (--dist loadfile) in collection order; with
# --no-loadscope-reorder xdist keeps that order instead of sorting files by their number of tests, which sent the
# few-test, minutes-long integration files last, so one worker ran them alone at the end. These files start first,
# longest first (seconds on one worker in a fresh-clone `make test`, as the "slowest files" summary below prints
# them); the others follow in their usual order and fill the workers in at the end.
LONGEST_FIRST = [
    "test_scale_ray.py", "test_scale_out.py", "test_faults_signals.py", "test_preflight.py", "test_deployments.py",
    "test_faults_stack.py", "test_faults_cli.py", "test_compiling.py", "test_pipeline.py",
    "test_policy_deployments.py", "test_faults_store.py", "test_lifecycle.py", "test_float8.py", "test_faults.py",
    "test_bench_train.py", "test_bench_eval.py", "test_progress.py", "test_tether.py", "test_plots_ui.py",
    "test_honest_numbers.py", "test_plan_flow.py",
]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The session's temporary directory (Prefect home, the shared cache: ~50 MB) goes with the session; under
    pytest-xdist each worker removes its own and the controller, last, the one holding the shared cache.
    FINETUNE_FLOWS_KEEP_TEST_TMP=1 keeps it to look into."""
    if not os.environ.get("FINETUNE_FLOWS_KEEP_TEST_TMP"):
        shutil.rmtree(_SESSION_TMP, ignore_errors=True)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


def pytest_terminal_summary(terminalreporter):
    """Seconds per test file (setup + call + teardown, one worker's time): what LONGEST_FIRST is ordered by."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(getattr(report, "duration", None), float) and getattr(report, "nodeid", ""):
                name = report.nodeid.split("::")[0]
                per_file[name] = per_file.get(name, 0.0) + report.duration
    if len(per_file) > 1:
        slowest = sorted(per_file.items(), key=lambda kv: -kv[1])[:15]
        terminalreporter.write_sep("=", "slowest files (seconds on one worker)")
        for name, seconds in slowest:
            terminalreporter.write_line(f"{seconds:8.1f}s  {name}")


CUSTOM_CODE = {
    "configuration_custom.py": "from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n"
                               "    model_type = 'custom-llama'\n",
    "modeling_custom.py": "from transformers import LlamaForCausalLM\n\nfrom .configuration_custom import CustomConfig"
                          "\n\n\nclass CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n",
    "tokenization_custom.py": "from transformers import PreTrainedTokenizerFast\n\n\n"
                              "class CustomTokenizerFast(PreTrainedTokenizerFast):\n    pass\n",
}


def custom_code_checkpoint(out: Path) -> Path:
    """A tiny checkpoint whose config and tokenizer name their own Python code (auto_map), as a model with custom
    modeling code on the Hub does: transformers loads it only with trust_remote_code=True and otherwise asks."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune_flows.models.sources import build_generated_tokenizer

    build_generated_tokenizer(out)
    LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(out)
    for name, code in CUSTOM_CODE.items():
        (out / name).write_text(code)
    for name, update in (("config.json", {"model_type": "custom-llama", "auto_map": {
                             "AutoConfig": "configuration_custom.CustomConfig",
                             "AutoModelForCausalLM": "modeling_custom.CustomModel"}}),
                         ("tokenizer_config.json", {"tokenizer_class": "CustomTokenizerFast", "auto_map": {
                             "AutoTokenizer": [None, "tokenization_custom.CustomTokenizerFast"]}})):
        (out / name).write_text(json.dumps({**json.loads((out / name).read_text()), **update}))
    return out


def tiny_checkpoint(out: Path, shared_cache: Path, family: str, **config) -> Path:
    """A tiny random GPT-2 or GPT-NeoX checkpoint (transformers' own classes) with generated:tiny-llama's tokenizer."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    from finetune_flows.models.sources import materialize_model

    tokenizer = AutoTokenizer.from_pretrained(materialize_model("generated:tiny-llama", shared_cache))
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **ids, **config))
    else:
        model = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, max_position_embeddings=512, **ids, **config))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_gguf(path: Path, add_bos: bool | None = True, add_eos: bool | None = None) -> Path:
    """A tiny llama GGUF (random weights, a sentencepiece-style vocabulary of letters) written with the `gguf`
    package, with `tokenizer.ggml.add_bos_token` / `add_eos_token` set as given (None: left out)."""
    import gguf
    import numpy as np

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<unk>", "<s>", "</s>", "\u2581", *letters, *("\u2581" + letter for letter in letters)]
    vocab, width, ffn = len(tokens), 16, 32
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(width)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(width // 2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(vocab)])
    writer.add_token_types([2, 3, 3] + [1] * (vocab - 3))  # unknown, control (BOS, EOS), normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, width), "output_norm.weight": (width,), "output.weight": (vocab, width),
              "blk.0.attn_norm.weight": (width,), "blk.0.ffn_norm.weight": (width,),
              **{f"blk.0.attn_{n}.weight": (width, width) for n in ("q", "k", "v", "output")},
              "blk.0.ffn_gate.weight": (ffn, width), "blk.0.ffn_up.weight": (ffn, width),
              "blk.0.ffn_down.weight": (width, ffn)}
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_benchmark(name: str):
    """benchmarks/<name>.py (a script, not a package module) loaded as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def prefect_server():
    """One real (temporary, SQLite) Prefect server for every test that runs flows."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def shared_cache() -> Path:
    return Path(os.environ["FINETUNE_FLOWS_TEST_CACHE"])


@pytest.fixture(scope="session")
def gpu_cache(shared_cache) -> Path:
    """One cache for every GPU-tier test, so the 4-bit base, its dequantized copy and the machine's probes are
    made once per tier, not once per test (quantizing the 0.6B shape takes ~55 s on an H200). FINETUNE_FLOWS_GPU_CACHE
    moves it: gpu_proof.py points it at its flow runs' cache, so a tier split over several device calls, and the
    flow runs after it, share what the first part made."""
    return Path(os.environ.get("FINETUNE_FLOWS_GPU_CACHE") or shared_cache / "gpu")


def tiny_overrides(cache: Path, runs: Path, **extra: object) -> list[str]:
    """A tiny generated model on the built-in task: the whole pipeline in seconds on a CPU."""
    base = {
        "model.source": "generated:tiny-llama",
        "data.builtin_examples": 120,
        "data.max_length": 128,
        "train.max_steps": 6,
        "train.save_steps": 3,
        "train.logging_steps": 1,
        "train.per_device_batch_size": 4,
        "train.learning_rate": 1e-3,
        "train.retry_delay_seconds": 0,
        "eval.max_samples": 8,
        "eval.max_new_tokens": 6,
        "eval.batch_size": 8,
        "export.merge": False,  # the merge step is tested where a test asks for it (export.merge=True)
        "run.name": "tiny",
        "run.cache_dir": str(cache),
        "run.output_dir": str(runs),
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def tiny_config(cache: Path, runs: Path, **extra: object):
    """`tiny_overrides` as the typed config the flow takes."""
    from finetune_flows.config.schema import load_config

    return load_config(None, tiny_overrides(cache, runs, **extra))


def kill_rank_after_checkpoint(adapters: Path, rank: int, checkpoint_glob: str, timeout: float = 300):
    """In a thread: SIGKILL training rank `rank` (its pid file `adapters/*/ranks/rank-N.pid`) as soon as its output
    directory holds a file matching `checkpoint_glob`, as the OOM killer or a preemption would. Returns the thread
    and a dict that gets the killed pid."""
    from finetune_flows.runtime.processes import read_record

    killed: dict[str, int] = {}

    def killer() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not killed:
            for pid_file in adapters.glob(f"*/ranks/rank-{rank}.pid") if adapters.exists() else []:
                proc = read_record(pid_file)  # None for a stale record: never signal a reused PID
                if proc and list(pid_file.parent.parent.glob(checkpoint_glob)) and proc.signal(signal.SIGKILL):
                    killed["pid"] = proc.pid
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    return thread, killed


@pytest.fixture(scope="module")
def two_rank_reference(prefect_server, shared_cache, tmp_path_factory):
    """2-rank torchrun (gloo) on one host: the curve the scaled-out launches must reproduce (tests/test_scale_*.py;
    the second module to ask is served from the shared cache)."""
    from flows.finetune import finetune

    result = finetune(tiny_config(shared_cache / "scale", tmp_path_factory.mktemp("runs"),
                                  **{"hardware.cpu_processes": 2}))
    assert result.train.world_size == 2
    return result

