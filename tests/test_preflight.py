"""Bad input found before a Prefect server starts: one message, exit 2, no traceback, nothing left behind.

The CLI cases run the real `python flows/finetune.py` in a subprocess with a fresh PREFECT_HOME and no API URL, so
"no server was started" is visible as a home without a database.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import child_env, tiny_checkpoint
from finetune_flows.config.schema import load_config
from finetune_flows.errors import ConfigError, DataError, UserInputError
from finetune_flows.config.preflight import check_lora_targets, check_utf8, preflight

ROOT = Path(__file__).resolve().parent.parent


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env = child_env(env, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    return subprocess.run([sys.executable, "flows/finetune.py", "--set", "model.source=generated:tiny-llama",
                           "--set", f"run.output_dir={tmp_path / 'runs'}", "--set", f"run.cache_dir={tmp_path / 'c'}",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def assert_one_message_before_any_server(done: subprocess.CompletedProcess, tmp_path: Path, *needles: str) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr + done.stdout, done.stderr
    for needle in needles:
        assert needle in done.stderr, done.stderr
    assert not list(tmp_path.glob("prefect-home/*.db")), "a Prefect server was started for bad input"
    assert not list(tmp_path.glob("runs/*")), "a run directory was left behind"



def test_a_probe_directory_that_is_a_file_is_named_before_anything_runs(tmp_path, monkeypatch):
    from finetune_flows.runtime.environment import PROBE_DIR_ENV

    (tmp_path / "probes").write_text("not a directory")
    monkeypatch.setenv(PROBE_DIR_ENV, str(tmp_path / "probes"))
    with pytest.raises(UserInputError, match=f"{PROBE_DIR_ENV}={tmp_path / 'probes'}: {tmp_path / 'probes'} is a file"):
        preflight(load_config(None, ["model.source=generated:tiny-llama", f"run.cache_dir={tmp_path / 'c'}",
                                     f"run.output_dir={tmp_path / 'runs'}"]))

def cache_config(tmp_path: Path):
    return load_config(None, ["model.source=generated:tiny-llama", f"run.cache_dir={tmp_path / 'c'}",
                              f"run.output_dir={tmp_path / 'runs'}"])


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _file(path: Path) -> None:
    path.write_text("kept")


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "gone")


def _link_to_file(path: Path) -> None:
    (path.parent / "a-file").write_text("kept")
    path.symlink_to(path.parent / "a-file")


@pytest.mark.parametrize("name, plant, says", [
    ("adapters", _file, "is a file, so no directory can be created there"),
    (".locks", _file, "is a file, so no directory can be created there"),
    (".verified", _file, "is a file, so no directory can be created there"),
    ("datasets", _dangling, "is a link to {c}/gone, which does not exist"),
    ("quantized", _link_to_file, "is a link to {c}/a-file, which is a file, not a directory"),
])
def test_a_store_directory_that_cannot_be_one_is_named_before_anything_runs(tmp_path, name, plant, says):
    # before, the cache root alone was checked: the step writing there failed with a traceback (adapters: after
    # the base was quantized, and retried); these fail as root too
    cache = tmp_path / "c"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "kept").write_text("written before")
    plant(cache / name)
    before = listing(cache)
    with pytest.raises(UserInputError) as info:
        preflight(cache_config(tmp_path))
    assert str(info.value) == (f"run.cache_dir={cache}: {cache / name} {says.format(c=cache)}; fix that, or set "
                               "run.cache_dir (or FINETUNE_FLOWS_CACHE) to another directory")
    assert listing(cache) == before and (cache / "models" / "kept").read_text() == "written before"


def test_cli_refuses_a_cache_whose_adapters_directory_is_a_file(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "adapters").write_text("kept")
    done = cli(tmp_path)
    assert_one_message_before_any_server(done, tmp_path, f"{tmp_path / 'c' / 'adapters'} is a file")
    assert done.stderr.count("\n") == 1 and (tmp_path / "c" / "adapters").read_text() == "kept"
    assert listing(tmp_path / "c") == ["adapters"]


def test_the_cache_named_by_the_environment_is_named_so(tmp_path, monkeypatch):
    (tmp_path / "env-cache").mkdir()
    (tmp_path / "env-cache" / ".locks").write_text("kept")
    monkeypatch.setenv("FINETUNE_FLOWS_CACHE", str(tmp_path / "env-cache"))
    with pytest.raises(UserInputError, match=f"^FINETUNE_FLOWS_CACHE={tmp_path / 'env-cache'}: .*/.locks is a file.*"
                                             "set FINETUNE_FLOWS_CACHE to another directory$"):
        preflight(cache_config(tmp_path))


def test_store_directories_that_are_links_to_directories_pass(tmp_path):
    shared = tmp_path / "shared"
    for name in ("models", "adapters", ".locks"):
        (shared / name).mkdir(parents=True)
        (tmp_path / "c" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "c" / name).symlink_to(shared / name)
    preflight(cache_config(tmp_path))


def test_every_kind_of_store_entry_is_checked():
    from finetune_flows.config.preflight import STORE_DIRS

    sources = "\n".join(p.read_text() for p in (ROOT / "finetune_flows").rglob("*.py"))
    kinds = set(re.findall(r"\bEntry\([^,()]+,\s*\"([^\"]+)\"", sources))
    assert kinds and kinds <= set(STORE_DIRS), kinds - set(STORE_DIRS)
    assert {"models", "tokenizers"} <= set(STORE_DIRS)  # sources.py passes its kind as a variable


@pytest.fixture
def mounted(tmp_path):
    """Mount a tmpfs with the given options at a path under the cache (root only, as tests/test_faults.py's disk)."""
    mounts = []

    def mount(path: Path, options: str) -> Path:
        path.mkdir(parents=True)
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
                                               ).returncode != 0:
            pytest.skip("mounting a tmpfs needs root (CI runs as root)")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)])


def test_a_store_directory_on_a_read_only_file_system_is_named(tmp_path, mounted):
    adapters = mounted(tmp_path / "c" / "adapters", "ro,size=64k")
    with pytest.raises(UserInputError, match=f"{adapters} is on a read-only file system; fix that"):
        preflight(cache_config(tmp_path))


def test_a_store_directory_on_a_full_file_system_is_named(tmp_path, mounted):
    adapters = mounted(tmp_path / "c" / "adapters", "size=64k")
    with pytest.raises(OSError, match="No space left"), open(adapters / "fill", "wb", buffering=0) as f:
        while True:  # fill it
            f.write(b"\0" * 4096)
    with pytest.raises(UserInputError, match=f"{adapters} is on a full file system"):
        preflight(cache_config(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory: nothing to refuse")
def test_a_read_only_store_directory_is_named(tmp_path):
    (tmp_path / "c" / "adapters").mkdir(parents=True)
    (tmp_path / "c" / "adapters").chmod(0o555)
    try:
        with pytest.raises(UserInputError, match=f"{tmp_path / 'c' / 'adapters'} is not writable"):
            preflight(cache_config(tmp_path))
    finally:
        (tmp_path / "c" / "adapters").chmod(0o755)


def test_cli_names_the_line_of_a_row_that_is_not_utf8(tmp_path):
    data = tmp_path / "tickets.jsonl"
    data.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n')
    done = cli(tmp_path, "--set", f"data.source={data}")
    assert_one_message_before_any_server(done, tmp_path, f"{data} line 2: not UTF-8 text (byte 0xe9 at column 16)")


SPLITS = {  # rows of the training file, of the held-out file (None: split off), overrides -> the message
    "too few rows": (["a"], None, [], "train.jsonl: 1 row(s) is too few to hold 1 out for evaluation and train on "
                     "the rest (data.eval_fraction=0.1)"),
    "a fraction that leaves no training row": (
        ["a", "b", "c", "d"], None, ["data.eval_fraction=0.9"],
        "train.jsonl: 4 row(s) is too few to hold 4 out for evaluation and train on the rest "
        "(data.eval_fraction=0.9)"),
    "no held-out row left": (["a", "b"], ["A", " b "], [], "eval.jsonl: every held-out example's prompt also appears "
                             "in training (exactly or after folding case and whitespace, data.held_out_fold_digits="
                             "false)"),
}


@pytest.mark.parametrize("case", SPLITS)
def test_cli_refuses_a_split_that_leaves_nothing_before_any_server(tmp_path, case):
    train, held, overrides, message = SPLITS[case]
    args = []
    for name, prompts in (("train", train), ("eval", held)):
        if prompts is not None:
            rows = "".join(f'{{"prompt": "{p}", "response": "r"}}\n' for p in prompts)
            (tmp_path / f"{name}.jsonl").write_text(rows)
            args += ["--set", f"data.{'source' if name == 'train' else 'eval_source'}={tmp_path / f'{name}.jsonl'}"]
    for override in overrides:
        args += ["--set", override]
    done = cli(tmp_path, *args)
    assert_one_message_before_any_server(done, tmp_path, message)
    assert done.stderr.count("\n") == 1, done.stderr


def test_cli_refuses_a_checkpoint_with_its_own_code_unless_trusted(tmp_path):
    """config.json's auto_map means loading runs the checkpoint's Python code: refused in one line naming the key,
    before anything loads (the weights here are not even a model)."""
    import json

    model = tmp_path / "custom"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "custom-llama", "auto_map": {
        "AutoConfig": "configuration_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.CustomModel"}}))
    (model / "model.safetensors").write_bytes(b"never read")
    done = cli(tmp_path, "--set", f"model.source={model}")
    assert_one_message_before_any_server(
        done, tmp_path, f"model.source={model}: config.json has an auto_map (AutoConfig, AutoModelForCausalLM), so "
        "loading it runs the checkpoint's own Python code; set model.trust_remote_code=true if you trust that code")
    assert done.stderr.count("\n") == 1, done.stderr
    # trusted, the same directory passes this check, and the next one finds what is wrong with it
    from finetune_flows.errors import ModelSourceError
    from finetune_flows.models.sources import check_model_source

    with pytest.raises(ModelSourceError, match="model.safetensors is not a readable safetensors file"):
        check_model_source(str(model), trust_remote_code=True)


def broken_checkpoint(model: Path, shared_cache: Path, fault: str) -> str:
    """A copy of the tiny generated checkpoint in `model`, broken as `fault` says; returns what the error names."""
    import shutil

    from finetune_flows.models.sources import materialize_model

    shutil.copytree(materialize_model("generated:tiny-llama", shared_cache), model)
    weights = model / "model.safetensors"
    if fault == "missing shard":  # an index as save_pretrained writes for a sharded model, one shard not copied
        weights.rename(model / "model-00001-of-00002.safetensors")
        (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors"}}))
        return ("model.safetensors.index.json names 1 of 2 weight file(s) that are not there: "
                "model-00002-of-00002.safetensors")
    if fault == "truncated weights":  # a copy that stopped half-way
        weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
        return "model.safetensors is not a readable safetensors file (Error while deserializing header"
    config = json.loads((model / "config.json").read_text())
    if fault == "config of another size":  # bitsandbytes packed these as they were: training failed on a matmul
        (model / "config.json").write_text(json.dumps(config | {"hidden_size": 128, "head_dim": 32}))
        return ("20 weight(s) do not have the shape its config.json gives, e.g. model.embed_tokens.weight is "
                "[1024, 64] in model.safetensors, [1024, 128] in the model; is config.json this checkpoint's?")
    config["model_type"] = "no-such-architecture"
    (model / "config.json").write_text(json.dumps(config))
    return ("transformers cannot build a causal language model from its config (ValueError: The checkpoint you are "
            "trying to load has model type `no-such-architecture`")


@pytest.mark.parametrize("fault", ["missing shard", "truncated weights", "unknown model_type",
                                   "config of another size"])
def test_a_broken_local_checkpoint_is_one_message_before_any_server(tmp_path, shared_cache, fault):
    """Each passed the checks before: a server started, the dataset step ran, and the quantize worker failed with
    transformers' traceback (15 to 22 of them in the log), or (another size) training failed twice on a matmul."""
    model = tmp_path / "model"
    needle = broken_checkpoint(model, shared_cache, fault)
    done = cli(tmp_path, "--set", f"model.source={model}")
    assert_one_message_before_any_server(done, tmp_path, f"model.source={model}: {needle}")


@pytest.mark.parametrize("fault", ["truncated weights", "config of another size"])
def test_a_broken_checkpoint_in_the_local_hub_cache_is_one_message_before_any_model_loads(tmp_path, shared_cache,
                                                                                           monkeypatch, fault):
    """A Hub id's snapshot in the local Hub cache had no shape check and (with the Hub reachable) no header check,
    where a local directory has both: it passed, and the quantize or train worker failed after a server started."""
    import huggingface_hub.constants

    import finetune_flows.config.preflight as checks
    from finetune_flows.errors import ModelSourceError
    from test_offline_hub import hub_cache_entry

    needle = broken_checkpoint(tmp_path / "model", shared_cache, fault)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(checks, "hub_reachable", lambda: True)  # a shard missing would be downloaded: no excuse
    snapshot = hub_cache_entry(tmp_path / "hub", "model", "org/tiny", tmp_path / "model")
    with pytest.raises(ModelSourceError) as refused:
        preflight(load_config(None, ["model.source=org/tiny", f"run.cache_dir={tmp_path / 'c'}",
                                     f"run.output_dir={tmp_path / 'runs'}"]))
    assert str(refused.value).startswith(f"model.source=org/tiny: {needle}"), refused.value
    assert str(refused.value).endswith(f" (in the local Hub cache, {snapshot})"), refused.value


# Tiny models of each kind, as transformers' own classes save them: (config class, model class, config keys)
SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
NOT_DECODERS = {
    "bert": ("BertConfig", "BertForMaskedLM", SMALL, "an encoder-only (masked language) model"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", SMALL, "an encoder-only (masked language) model"),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(vocab_size=256, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64), "an encoder-decoder model"),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=256, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16), "an encoder-decoder model"),
}


def save_tiny_model(path: Path, config_class: str, model_class: str, keys: dict) -> None:
    import transformers

    getattr(transformers, model_class)(getattr(transformers, config_class)(**keys)).save_pretrained(path)


@pytest.mark.parametrize("kind", sorted(NOT_DECODERS))
def test_a_model_that_is_no_decoder_only_causal_lm_is_one_message_before_any_model_loads(tmp_path, kind):
    """transformers maps BERT (and BART) to a causal-LM head class, so such a checkpoint passed every check, was
    quantized and failed in the training worker after a server had started; T5's message was a class repr."""
    from finetune_flows.config.preflight import check_lora_targets_of_source
    from finetune_flows.errors import ModelSourceError

    config_class, model_class, keys, kind_said = NOT_DECODERS[kind]
    save_tiny_model(tmp_path / kind, config_class, model_class, keys)
    with pytest.raises(ModelSourceError) as refused:
        check_lora_targets_of_source(load_config(None, [f"model.source={tmp_path / kind}"]))
    assert str(refused.value) == (
        f"model.source={tmp_path / kind}: model_type={kind} ({model_class}) is {kind_said}; fine-tuning here needs a "
        "decoder-only causal language model (Llama, Qwen, Mistral, Phi-3, Gemma, GPT-2 and the like)")


def test_a_bert_checkpoint_is_refused_by_the_cli_before_any_server(tmp_path):
    config_class, model_class, keys, _ = NOT_DECODERS["bert"]
    save_tiny_model(tmp_path / "bert", config_class, model_class, keys)
    done = cli(tmp_path, "--set", f"model.source={tmp_path / 'bert'}")
    assert_one_message_before_any_server(done, tmp_path, f"model.source={tmp_path / 'bert'}: model_type=bert "
                                         "(BertForMaskedLM) is an encoder-only (masked language) model")


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gpt2",
                                        "gpt_neox", "falcon"])
def test_decoder_only_models_pass_the_causal_lm_check(tmp_path, model_type):
    from transformers import AutoConfig

    from finetune_flows.config.preflight import check_lora_targets_of_source

    AutoConfig.for_model(model_type, **SMALL, pad_token_id=0).save_pretrained(tmp_path)
    # padded batches: GPT-2's attn_pdrop=0.1 is refused with packing (test_a_gpt2_checkpoint_is_one_message_...)
    check_lora_targets_of_source(load_config(None, [f"model.source={tmp_path}", "train.packing=false"]))


def test_a_gpt2_checkpoint_is_one_message_before_any_server(tmp_path, shared_cache):
    """A GPT-2 checkpoint (n_head, not num_attention_heads, in its config.json) passed the checks, then the flow
    failed with KeyError: 'num_attention_heads' after a server started; read through its config class, its
    attn_pdrop=0.1, which packed training cannot apply, is the one message (tests/test_model_families.py)."""
    model = tiny_checkpoint(tmp_path / "gpt2", shared_cache, "gpt2")
    done = cli(tmp_path, "--set", f"model.source={model}")
    assert_one_message_before_any_server(done, tmp_path, f"model.source={model}: its config sets attn_pdrop=0.1 "
                                         "(attention dropout), which packed training cannot apply; set "
                                         "train.packing=false")
    assert done.stderr.count("\n") == 1, done.stderr


def test_cli_names_the_yaml_file_and_line(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("train:\n  max_steps: 5\n  learning_rate: [1e-4\n")
    done = cli(tmp_path, "--config", str(config))
    assert_one_message_before_any_server(done, tmp_path, f"{config}: 1 problem(s)", "not valid YAML at line 4")


def test_cli_refuses_an_output_path_that_is_a_file(tmp_path):
    (tmp_path / "runs").write_text("not a directory")
    done = cli(tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"run.output_dir={tmp_path / 'runs'}: {tmp_path / 'runs'} is a file" in done.stderr
    assert not list(tmp_path.glob("prefect-home/*.db"))


def test_cli_lists_machine_problems_together(tmp_path):
    done = cli(tmp_path, "--set", "hardware.gpus=3", "--set", "train.optimizer=adamw_turbo",
               "--set", "hardware.attn_implementation=flash_attention_2")
    assert_one_message_before_any_server(
        done, tmp_path, "config vs this machine: 3 problem(s)", "train.optimizer=adamw_turbo is not an optimizer",
        "hardware.gpus=3: no GPU with id 3", "flash_attention_2 needs the flash-attn package")


def test_the_evaluation_backend_is_checked_against_the_machine_by_its_own_key():
    from finetune_flows.config.schema import load_config
    from finetune_flows.config.preflight import machine_problems

    problems = machine_problems(load_config(None, ["hardware.gpus=cpu", "eval.attn_implementation=flash_attention_4"]))
    assert "eval.attn_implementation=flash_attention_4 needs a CUDA GPU, but this run uses the CPU " \
           "(hardware.gpus=cpu)" in problems


def test_flows_run_the_same_preflight(tmp_path):
    """A deployment run has no CLI: the flow's first step is the same check."""
    from flows.finetune import finetune

    with pytest.raises(ConfigError, match="train.optimizer=adamw_turbo"):
        finetune.fn(load_config(None, [f"run.output_dir={tmp_path / 'runs'}", "train.optimizer=adamw_turbo"]))
    assert not (tmp_path / "runs").exists()


def test_short_runs_and_retry_bounds():
    # demo.yaml saves every 10 steps
    cfg = preflight(load_config(ROOT / "configs/demo.yaml", ["train.max_steps=5", "hardware.gpus=cpu"]))
    assert cfg.train.max_steps == 5
    with pytest.raises(ConfigError, match="train.retries"):
        load_config(None, ["train.retries=51"])  # Prefect refuses more than 50 retry delays


def test_encoding_error_position(tmp_path):
    f = tmp_path / "rows.csv"
    f.write_bytes(b"prompt,response\nok,fine\nbad \xff row,x\n")
    with pytest.raises(DataError, match=r"rows.csv line 3: not UTF-8 text \(byte 0xff at column 5\)"):
        check_utf8(f)


def test_lora_targets_are_checked_against_the_models_module_names(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256).save_pretrained(tmp_path)
    check_lora_targets(tmp_path, ["q_proj", "v_proj", "mlp.down_proj"])
    check_lora_targets(tmp_path, "all-linear")
    with pytest.raises(UserInputError) as info:
        check_lora_targets(tmp_path, ["q_proj", "query_key_value"])
    assert "no module named query_key_value" in str(info.value)
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in str(info.value)


READS_PROBE = r"""
import json, os, runpy, sys
from collections import Counter

config, data, out = (os.path.abspath(p) for p in sys.argv[1:4])
opens = Counter()


def hook(event, args):
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.abspath(os.fsdecode(args[0]))
    if path not in (config, data):
        return
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    if path == config:
        opens["config"] += 1
    elif any(name == "read_rows" for _, name in frames):
        checks = any(f.endswith(os.path.join("config", "preflight.py")) for f, _ in frames)
        opens["data rows, checks" if checks else "data rows, dataset step"] += 1


sys.addaudithook(hook)
sys.argv = ["flows/finetune.py", "--config", config]
try:
    runpy.run_path("flows/finetune.py", run_name="__main__")
except SystemExit as exc:
    opens["exit"] = exc.code
with open(out, "w") as f:
    json.dump(opens, f)
"""


@pytest.mark.slow
def test_a_local_run_parses_its_config_once_and_checks_each_data_row_once(tmp_path):
    """`python flows/finetune.py --config X.yaml`, counted by an audit hook on every file the process opens: the
    config file is read once (the CLI builds the typed config and passes it to the flow, which does not parse it
    again, nor to name the run), and the checks before the run read the data rows once (the flow does not repeat
    the CLI's preflight); the dataset step reads them once more, to tokenize."""
    from finetune_flows.data.demo import ticket_triage

    data = tmp_path / "tickets.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ticket_triage(120, seed=3)))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"source": "generated:tiny-llama"},
        "data": {"source": str(data), "format": "instruction", "max_length": 128},
        "train": {"max_steps": 2, "save_steps": 2, "per_device_batch_size": 4, "retry_delay_seconds": 0},
        "eval": {"max_samples": 4, "max_new_tokens": 4, "batch_size": 4},
        "hardware": {"gpus": "cpu"}, "export": {"merge": False},
        "run": {"name": "reads", "output_dir": str(tmp_path / "runs"), "cache_dir": str(tmp_path / "cache")}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env = child_env(env, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    counts = tmp_path / "counts.json"
    done = subprocess.run([sys.executable, "-c", READS_PROBE, str(config), str(data), str(counts)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert counts.is_file(), done.stderr[-3000:]
    assert json.loads(counts.read_text()) == {"config": 1, "data rows, checks": 1, "data rows, dataset step": 1,
                                              "exit": 0}, done.stderr[-3000:]


def test_cli_refuses_lora_targets_the_model_lacks_and_float16_on_the_cpu_before_any_server(tmp_path):
    """Both were found only inside the flow: the targets in the training step, after the base was quantized (the
    model loaded), and float16 in the environment step, each after a Prefect server had started."""
    done = cli(tmp_path, "--set", "lora.target_modules=[q_proj,foo_proj]")
    assert_one_message_before_any_server(done, tmp_path, "lora.target_modules: the model has no module named foo_proj",
                                         "its linear layers are down_proj, gate_proj, k_proj")
    done = cli(tmp_path, "--set", "train.precision=fp16", "--set", "eval.dtype=float16")
    assert_one_message_before_any_server(done, tmp_path, "config vs this machine: 2 problem(s)",
                                         "train.precision=fp16 needs a GPU", "eval.dtype=float16 needs a GPU")


def test_a_sources_config_is_read_without_weights_or_a_download(tmp_path):
    from finetune_flows.models.sources import model_config

    assert model_config("generated:qwen3-0.6b").num_hidden_layers == 28
    assert model_config("nobody-here/no-such-model") is None  # not in the local Hub cache: the training step checks
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256).save_pretrained(tmp_path)
    assert model_config(str(tmp_path)).num_hidden_layers == 3


def test_a_hub_model_or_dataset_that_cannot_be_had_offline_is_one_message_before_any_server(tmp_path):
    """Found inside the flow before, after a server had started, and printed three times; a relative path that
    does not exist read as a Hub id without saying the directory is missing."""
    done = cli(tmp_path, "--set", "model.source=checkpoints/mymodel", "--set", "data.source=hub:org/tickets")
    assert_one_message_before_any_server(
        done, tmp_path, "config vs this machine: 2 problem(s)",
        f"model.source=checkpoints/mymodel: no local directory {ROOT / 'checkpoints/mymodel'}, and as a Hub id "
        "checkpoints/mymodel@main is not in the local Hub cache", "data.source=hub:org/tickets: org/tickets@main is "
        "not in the local Hub cache", "HF_HUB_OFFLINE is set")


def test_a_hub_reference_the_local_cache_holds_needs_no_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from finetune_flows.config.preflight import hub_problems
    from finetune_flows.config.schema import load_config

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file

    repo = tmp_path / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    for commit in ("a" * 40, "b" * 40):  # each snapshot with its weights (one without them is refused offline)
        (repo / "snapshots" / commit).mkdir(parents=True)
        save_file({"w": torch.zeros(1)}, repo / "snapshots" / commit / "model.safetensors")
    assert hub_problems(load_config(None, ["model.source=org/model"])) == []
    assert hub_problems(load_config(None, ["model.source=org/model", f"model.revision={'b' * 40}"])) == []
    [problem] = hub_problems(load_config(None, ["model.source=org/model", "model.revision=v2"]))
    assert "org/model@v2 is not in the local Hub cache" in problem


@pytest.mark.parametrize("flow", ["evaluate", "export"])
def test_an_adapter_for_another_model_is_one_message_before_any_server(tmp_path, flow):
    """An adapter trained on tiny-llama, with a config naming the Qwen3-0.6B shape: refused from the adapter's
    weight shapes against the model's layers (built on the meta device), not after quantizing the model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune_flows.models.sources import _materialize_generated

    base, adapter = tmp_path / "tiny", tmp_path / "adapter"
    base.mkdir()
    _materialize_generated("tiny-llama", base)
    model = AutoModelForCausalLM.from_pretrained(base)
    get_peft_model(model, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(adapter)
    AutoTokenizer.from_pretrained(base).save_pretrained(adapter)  # an adapter directory as a run saves it
    config = tmp_path / "other.yaml"
    config.write_text(yaml.safe_dump({"model": {"source": "generated:qwen3-0.6b"},
                                      "run": {"output_dir": str(tmp_path / "runs"), "cache_dir": str(tmp_path / "c")}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env = child_env(env, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    done = subprocess.run([sys.executable, f"flows/{flow}.py", "--adapter", str(adapter), "--config", str(config)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert_one_message_before_any_server(
        done, tmp_path, f"the adapter {adapter} does not fit model.source=generated:qwen3-0.6b:",
        "down_proj.lora_A.weight: 128 inputs, the model's layer has 3072", "was it trained on another model?")
    made = {p.name for p in (tmp_path / "c").iterdir() if not p.name.startswith(".")}
    assert made <= {"tokenizers"}, made  # the checks' tokenizer only: no model made, nothing quantized


def test_a_merged_checkpoint_for_another_model_is_one_message_before_any_server(tmp_path):
    """`evaluate.py --merged` with a config for another model: the merged checkpoint was scored beside the wrong
    base, then the adapter its card names failed to load in the worker (a traceback, exit 1, after quantizing);
    with no adapter named, the table's `base` row was the other model's, exit 0."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune_flows.models.sources import _materialize_generated

    merged, adapter, other = tmp_path / "run" / "merged", tmp_path / "run" / "adapter", tmp_path / "other"
    merged.mkdir(parents=True)
    _materialize_generated("tiny-llama", merged)  # a plain checkpoint with its tokenizer, as a merge leaves it
    get_peft_model(AutoModelForCausalLM.from_pretrained(merged), LoraConfig(r=4, target_modules="all-linear")) \
        .save_pretrained(adapter)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    tokenizer.save_pretrained(adapter)  # an adapter directory as a run saves it
    (merged / "README.md").write_text(f"---\nfinetune_flows:\n  adapter: {json.dumps(str(adapter))}\n---\n")
    shape = json.loads((merged / "config.json").read_text())
    LlamaForCausalLM(LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=96, intermediate_size=192,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)) \
        .save_pretrained(other)  # another model, its layers wider
    tokenizer.save_pretrained(other)
    config = tmp_path / "other.yaml"
    config.write_text(yaml.safe_dump({"model": {"source": str(other)}, "data": {"builtin_examples": 120},
                                      "run": {"output_dir": str(tmp_path / "runs"), "cache_dir": str(tmp_path / "c")}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env = child_env(env, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    def evaluate() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "flows/evaluate.py", "--merged", str(merged), "--config", str(config)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    assert_one_message_before_any_server(
        evaluate(), tmp_path, f"the adapter {adapter} (which {merged / 'README.md'} names as the adapter the "
        f"checkpoint was merged from) does not fit model.source={other}:", "was it trained on another model?")
    (merged / "README.md").unlink()  # no adapter to check: it scored the merged checkpoint beside the other model
    assert_one_message_before_any_server(
        evaluate(), tmp_path, f"the merged checkpoint {merged} is not made from model.source={other}: hidden_size 64 "
        "(the model's: 96), intermediate_size 128 (the model's: 192); was it made from another model?")


def test_an_adapter_checked_against_its_own_model_passes(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune_flows.config.preflight import check_adapter_fits
    from finetune_flows.models.sources import _materialize_generated

    base, adapter = tmp_path / "tiny", tmp_path / "adapter"
    base.mkdir()
    _materialize_generated("tiny-llama", base)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules="all-linear")) \
        .save_pretrained(adapter)
    check_adapter_fits(adapter, load_config(None, ["model.source=generated:tiny-llama"]))
    check_adapter_fits(adapter, load_config(None, [f"model.source={base}"]))


TEMPLATES = {  # a chat template -> what the checks say about the rows it is given
    "refuses a system turn": (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "line 1: the model's chat template refuses this row (TemplateError: System role not supported)"),
    "rewrites earlier turns": (  # as Qwen3's drops earlier answers' reasoning: the answers cannot be masked
        "{% for m in messages %}{% if m.role == 'assistant' and loop.last %}{{ '<|im_start|>assistant\\n<think>\\n\\n"
        "</think>\\n\\n' + m.content + '<|im_end|>\\n' }}{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
        "'<|im_end|>\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{% endif %}",
        "line 1: the model's chat template renders this conversation's earlier turns differently once later turns "
        "follow"),
}


@pytest.mark.parametrize("case", TEMPLATES)
def test_a_chat_template_that_cannot_take_the_rows_is_named_by_row_before_any_server(tmp_path, shared_cache, case):
    """Both were found by the dataset step, after a server had started: a traceback, a retry, exit 1."""
    import shutil

    from finetune_flows.models.sources import materialize_model

    template, message = TEMPLATES[case]
    model = tmp_path / "model"
    shutil.copytree(materialize_model("generated:tiny-llama", shared_cache), model)
    (model / "chat_template.jinja").write_text(template)
    data = tmp_path / "chat.jsonl"
    def turns(i):
        return [{"role": "system", "content": "Be brief."}] * (i % 2) + [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": f"2+{i}?"}, {"role": "assistant", "content": str(2 + i)}]

    data.write_text("".join(json.dumps({"messages": turns(i)}) + "\n" for i in range(1, 21)))
    done = cli(tmp_path, "--set", f"data.source={data}", "--set", f"model.source={model}")
    assert_one_message_before_any_server(done, tmp_path, f"{data} {message}")


def test_data_none_of_whose_rows_fit_max_length_is_said_before_any_server(tmp_path):
    """The held-out split (or the training one) keeping no row within data.max_length was found by the dataset
    step, after a server had started; the split is the run's own (data.seed), so the checks name the same split."""
    rows = [{"prompt": f"Question {i}?", "response": str(i)} for i in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    long = [{"prompt": f"long {i} " + "lorem ipsum dolor sit amet " * 40, "response": str(i)} for i in range(3)]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in long))
    done = cli(tmp_path, "--set", f"data.source={tmp_path / 'train.jsonl'}", "--set", "data.max_length=64",
               "--set", f"data.eval_source={tmp_path / 'held.jsonl'}")
    assert_one_message_before_any_server(done, tmp_path, f"{tmp_path / 'held.jsonl'}: no evaluation example fits in "
                                         "data.max_length=64; raise data.max_length or shorten the prompts")


def test_evaluate_and_export_runs_ignore_the_trainings_tracking_settings(tmp_path):
    """They log to no tracker: an adapter trained with an MLflow server that is down now was refused by their checks."""
    from deploy_support import free_port
    from finetune_flows.config.preflight import without_tracking

    cfg = load_config(None, ["model.source=generated:tiny-llama", f"run.cache_dir={tmp_path / 'c'}",
                             f"run.output_dir={tmp_path / 'runs'}",
                             f"tracking.mlflow_uri=http://127.0.0.1:{free_port()}"])
    with pytest.raises(UserInputError, match="no MLflow server answers there"):
        preflight(cfg)
    assert preflight(without_tracking(cfg)).tracking.mlflow_uri is None


def test_a_ray_head_nothing_answers_at_is_said_before_anything_loads(monkeypatch):
    """ray.init retried such an address for good, after the dataset and the 4-bit base were made."""
    from deploy_support import free_port
    from finetune_flows.errors import EnvironmentMismatch
    from finetune_flows.runtime.ray_cluster import cluster_fits, ray_problems

    pytest.importorskip("ray")
    port = free_port()
    cfg = load_config(None, ["hardware.launcher=ray", f"hardware.ray_address=127.0.0.1:{port}"])
    (problem,) = ray_problems(cfg)
    assert problem.startswith(f"hardware.ray_address=127.0.0.1:{port}: no Ray head answers at 127.0.0.1:{port} (")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # `auto`: the cluster this host joined, as Ray finds it
    (problem,) = ray_problems(load_config(None, ["hardware.launcher=ray"]))
    assert re.match(rf"hardware.ray_address=auto: no Ray head answers at [\d.]+:{port} \(", problem), problem
    assert ray_problems(load_config(None, [])) == []  # torchrun: no Ray
    with pytest.raises(EnvironmentMismatch, match=r"= 4 training workers, one GPU each, but the Ray cluster at "
                                                  r"head:6379 has 2 GPU\(s\) in all"):
        cluster_fits(4, {"CPU": 64.0, "GPU": 2.0}, True, "head:6379")
    cluster_fits(2, {"CPU": 2.0}, False, "head:6379")


def test_a_ray_head_that_wants_a_token_this_host_does_not_send_is_named_so():
    """A head started with token authentication answers the cluster-id question with UNAUTHENTICATED: the message
    says so and what to set, not that nothing there is a Ray head. A gRPC server speaking the GCS service stands in
    for that head (starting a token-mode cluster needs the token on the host, which the test would then hold)."""
    from concurrent import futures

    grpc = pytest.importorskip("grpc")
    pytest.importorskip("ray")
    from ray.core.generated import gcs_service_pb2_grpc

    from finetune_flows.runtime.ray_cluster import ray_problems

    class TokenHead(gcs_service_pb2_grpc.NodeInfoGcsServiceServicer):
        def GetClusterId(self, request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing authentication token")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    gcs_service_pb2_grpc.add_NodeInfoGcsServiceServicer_to_server(TokenHead(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        cfg = load_config(None, ["hardware.launcher=ray", f"hardware.ray_address=127.0.0.1:{port}"])
        (problem,) = ray_problems(cfg)
    finally:
        server.stop(None)
    assert problem.startswith(f"hardware.ray_address=127.0.0.1:{port}: the Ray head at 127.0.0.1:{port} refuses this "
                              "host's credentials (missing authentication token)"), problem
    assert "RAY_AUTH_MODE=token" in problem


def test_a_port_that_accepts_connections_but_is_no_ray_head_is_said_before_anything_loads():
    """A TCP connection was the whole check: the dashboard's HTTP port (or the client port without `ray://`) passed,
    and ray.init failed (twice, with the retry) after the dataset and the 4-bit base were made."""
    import http.server
    import threading

    from finetune_flows.runtime.ray_cluster import ray_problems

    pytest.importorskip("ray")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        for address, what in ((f"127.0.0.1:{port}", "a Ray head's GCS port"),
                              (f"ray://127.0.0.1:{port}", "a Ray Client server")):
            cfg = load_config(None, ["hardware.launcher=ray", f"hardware.ray_address={address}"])
            (problem,) = ray_problems(cfg)
            assert problem.startswith(f"hardware.ray_address={address}: something accepts connections at "
                                      f"127.0.0.1:{port}, but it is not {what}"), problem
    finally:
        server.shutdown()
        server.server_close()
    (problem,) = ray_problems(load_config(None, ["hardware.launcher=ray", "hardware.ray_address=headnode"]))
    assert problem.startswith("hardware.ray_address=headnode: not an address Ray connects to: name the head as "
                              "host:port"), problem


@pytest.mark.parametrize("flow, args, said", [
    ("finetune", ["--config", "configs/demo.yaml", "--config", "configs/nightly.yaml"],
     "--config given more than once"),
    ("export", ["--adapter", "a", "--config", "x.yaml", "--adapter", "b"], "--adapter given more than once"),
    ("evaluate", ["--adapter", "a", "--adapter", "b"], "--adapter given more than once"),
    ("evaluate", ["--merged", "a", "--adapter", "b"], "--adapter given after --merged (the same option)"),
    ("evaluate", ["--adapter", "a", "--merged", "b"], "--merged given after --adapter (the same option)")])
def test_a_second_config_or_adapter_is_refused_not_silently_used(flow, args, said, capsys):
    """`--config a.yaml --config b.yaml` ran b alone, without a word: there is one run per command. `--adapter a
    --merged b` said "--merged given more than once", given once: the two names are one option."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"flows.{flow}").main(args)
    assert exit_.value.code == 2
    dest = "config" if flow == "finetune" else "adapter"
    assert f"{said}: one run per command (run it once per {dest})" in capsys.readouterr().err


def test_a_local_model_whose_tokenizer_cannot_load_is_one_message_before_any_server(tmp_path, shared_cache):
    import shutil

    from finetune_flows.models.sources import materialize_model

    model = tmp_path / "model"
    shutil.copytree(materialize_model("generated:tiny-llama", shared_cache), model)
    (model / "tokenizer.json").write_text('{"truncated": ')
    done = cli(tmp_path, "--set", f"model.source={model}")
    assert_one_message_before_any_server(done, tmp_path, f"model.source={model}: its tokenizer cannot be loaded "
                                         "(JSONDecodeError: ")


def bare_gguf(path: Path, architecture: str) -> Path:
    """A GGUF of the given architecture with one small tensor and no tokenizer (enough for its header)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_gguf_header_reader_agrees_with_the_gguf_package_in_milliseconds(tmp_path):
    """gguf.GGUFReader maps every tensor (about 2 s for the built-in model): too slow for every run's checks."""
    import time

    import gguf

    from conftest import tiny_gguf
    from finetune_flows.models.gguf_header import GGML_BLOCKS, read_gguf_header
    from finetune_flows.models.sources import _builtin_gguf

    assert {k: v for k, v in gguf.GGML_QUANT_SIZES.items() if k in GGML_BLOCKS} == GGML_BLOCKS
    path = tiny_gguf(tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(path))
    header = read_gguf_header(path)
    assert header.architecture == "llama" and header.size == path.stat().st_size
    assert header.needed_bytes == max(t.data_offset + t.n_bytes for t in reader.tensors)
    builtin = _builtin_gguf("smollm2-135m-instruct")[0]
    started = time.perf_counter()
    header = read_gguf_header(builtin)
    assert time.perf_counter() - started < 0.5  # about 20 ms
    assert header.architecture == "llama" and header.needed_bytes == header.size == builtin.stat().st_size


@pytest.mark.parametrize("fault, said", [
    ("data", "the file is truncated: its GGUF header declares 20096 bytes of header and tensor data, the file has "
             "19096"),
    ("header", "the file is truncated or corrupt: it ends inside its header (the file has 200 bytes)"),
    ("bert", "the file is a GGUF of architecture bert, which transformers "),
    ("t5", "the file is a GGUF of architecture t5, an encoder-decoder model; fine-tuning here needs a decoder-only"),
    ("t5encoder", "the file is a GGUF of architecture t5encoder, an encoder-only model; fine-tuning here needs"),
])
def test_a_gguf_that_transformers_cannot_fine_tune_is_one_message_before_any_run(tmp_path, fault, said):
    """A truncated GGUF was "its tokenizer cannot be loaded (ValueError: ...)", BERT's "architecture bert is not
    supported yet", T5's a TypeError; with the data on the Hub the tokenizer is not loaded before the run, so a
    worker met them. The header says it in one line, whatever the data."""
    from conftest import tiny_gguf
    from finetune_flows.errors import ModelSourceError

    path = tmp_path / "model.gguf"
    if fault in ("data", "header"):
        data = tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
        assert len(data) == 20096
        path.write_bytes(data[:200] if fault == "header" else data[:-1000])
    else:
        bare_gguf(path, fault)
    with pytest.raises(ModelSourceError) as refused:
        preflight(load_config(None, [f"model.source={path}", "data.source=hub:org/tickets",
                                     f"run.cache_dir={tmp_path / 'c'}", f"run.output_dir={tmp_path / 'runs'}"]))
    assert str(refused.value).startswith(f"model.source={path}: {said}"), refused.value
    assert "\n" not in str(refused.value)
    if fault == "bert":
        assert "cannot load from GGUF; it loads " in str(refused.value) and "llama" in str(refused.value)


def test_a_micro_batch_smaller_than_the_longest_row_is_said_before_any_server(tmp_path):
    """train.micro_batch_tokens below the longest training row was refused by the training plan only, after the base
    had been quantized, with advice (checkpointing, more memory) that does not help."""
    rows = [{"prompt": f"Question {i}? " + "more words " * (i % 5), "response": str(i)} for i in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = cli(tmp_path, "--set", f"data.source={tmp_path / 'train.jsonl'}", "--set", "train.micro_batch_tokens=16")
    assert_one_message_before_any_server(done, tmp_path, "train.micro_batch_tokens=16 is less than the longest "
                                         "training row (")
    assert re.search(r"row \((\d+) tokens, data.max_length=256\): a packed micro-batch holds whole rows; set at "
                     r"least \1, or lower data.max_length", done.stderr), done.stderr
    longest = int(re.search(r"row \((\d+) tokens", done.stderr).group(1))
    preflight(load_config(None, ["model.source=generated:tiny-llama", f"run.cache_dir={tmp_path / 'c'}",
                                 f"run.output_dir={tmp_path / 'runs'}", f"data.source={tmp_path / 'train.jsonl'}",
                                 "data.max_length=256", f"train.micro_batch_tokens={longest}"]))  # the longest: fits


ENGINE_ON_BAD_PARAMETERS = """
import importlib, io, logging, sys
# as `python -m prefect.engine` does: the flow's module is imported, then the run's parameters are validated, and a
# failure is logged through the flow run's logger before the flow's body (and anything it sets up) runs
stream = io.StringIO()
for module, name, params in [
    ("flows.finetune", "finetune", {"config": {"train": {"learning_rate": "fast"}}}),
    ("flows.evaluate", "evaluate", {"adapter": 5}),
    ("flows.export", "export", {"adapter": "a", "config": {"lora": {"rank": 8}}}),
]:
    try:
        flow = getattr(importlib.import_module(module), name)
        logger = logging.getLogger("prefect.flow_runs")
        logger.handlers, logger.propagate = [logging.StreamHandler(stream)], False  # not Prefect's: no run here
        flow.validate_parameters(params)
    except Exception:
        logging.getLogger("prefect.flow_runs").error("Engine execution exited with unexpected exception", exc_info=True)
sys.stdout.write(stream.getvalue())
"""


def test_a_run_whose_parameters_fail_validation_logs_the_keys_without_a_traceback():
    """A run created with `enforce_parameter_schema: false` is validated in the flow process, before the flow's body
    runs: its log names the bad keys (Prefect's ParameterTypeError), without the engine's stack as well."""
    done = subprocess.run([sys.executable, "-c", ENGINE_ON_BAD_PARAMETERS], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for needle in ("config.train.learning_rate: Input should be a valid number",
                   "adapter: Input should be a valid string", "config.lora.rank: Extra inputs are not permitted"):
        assert needle in done.stdout, done.stdout[-3000:]
    assert "Traceback" not in done.stdout, done.stdout[-3000:]
