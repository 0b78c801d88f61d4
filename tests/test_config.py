import re
from pathlib import Path

import pytest
import yaml

from finetune_flows.config.schema import FinetuneConfig, config_reference, load_config
from finetune_flows.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_defaults_are_the_demo():
    cfg = load_config(None)
    assert cfg.model.source == "builtin:smollm2-135m-instruct"
    assert cfg.data.source == "builtin:ticket-triage"
    assert cfg.quantization.load_in_4bit and cfg.quantization.quant_type == "nf4"


def test_every_problem_is_reported_at_once(tmp_path):
    path = write(tmp_path, {
        "model": {"sorce": "x"},  # typo: unknown key
        "train": {"learning_rate": "fast", "max_steps": 10},  # wrong type
        "hardware": {"gpus": "two"},  # bad spec
        "lora": {"r": 0},  # out of range
        "bogus": {},  # unknown section
    })
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert str(path) in text
    for needle in ("model.sorce: unknown key", "train.learning_rate", "hardware.gpus", "lora.r", "bogus: unknown key"):
        assert needle in text
    assert len(info.value.problems) == 5


def test_a_key_that_takes_a_value_or_auto_gets_one_line_naming_both():
    """pydantic checks each member of a union on its own (`true`/`false` and `auto`): its errors become one line."""
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.gradient_checkpointing=sometimes", "train.loss_chunk_tokens=32",
                           "lora.target_modules=[q_proj, 5]", "train.learning_rate=fast"])
    assert sorted(info.value.problems) == sorted([
        "train.gradient_checkpointing: Input should be a valid boolean or 'auto' (got 'sometimes')",
        "train.loss_chunk_tokens: Input should be greater than or equal to 64 or 'auto' (got 32)",
        "train.learning_rate: Input should be a valid number, unable to parse string as a number (got 'fast')",
        "lora.target_modules: Input should be a valid string (item 1) or 'all-linear' (got ['q_proj', 5])",
    ])


def test_overrides_are_typed_and_nested(tmp_path):
    cfg = load_config(REPO / "configs/demo.yaml",
                      ["train.learning_rate=1e-4", "lora.target_modules=[q_proj, v_proj]", "train.max_steps=30",
                       "hardware.gpus=2,0", "data.max_samples=50"])
    assert cfg.train.learning_rate == pytest.approx(1e-4)
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.hardware.gpus == "2,0"
    assert cfg.data.max_samples == 50


def test_override_errors_name_the_key():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["train.learning_rate"])
    with pytest.raises(ConfigError, match="train.nope: unknown key"):
        load_config(None, ["train.nope=1"])
    for empty in ("=5", "train.=5", ".lr=1"):  # an empty key (or part of one) printed as "  - : unknown key"
        with pytest.raises(ConfigError, match=f"override `{re.escape(empty)}`: expected KEY=VALUE"):
            load_config(None, [empty])
    with pytest.raises(ConfigError, match=r"override `train.learning_rate=\[1`: the value is not valid YAML"):
        load_config(None, ["train.learning_rate=[1"])  # was a yaml ScannerError traceback
    with pytest.raises(ConfigError, match="run.name: String should have at most 100 characters"):
        load_config(None, ["run.name=" + "r" * 101])  # a path component too long for the file system, found late


def test_an_unknown_key_one_typo_from_a_key_of_its_section_gets_a_suggestion():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.max_stepz=3", "trian.seed=1", "lora.rr=4", "hardware.gpu=cpu"])
    text = str(info.value)
    for line in ("train.max_stepz: unknown key (did you mean train.max_steps?)", "trian: unknown key (did you mean "
                 "train?)", "hardware.gpu: unknown key (did you mean hardware.gpus?)", "lora.rr: unknown key\n"):
        assert line in text + "\n", text


def test_zero_steps_is_refused_not_read_as_a_whole_epoch():
    """The Trainer trains `epochs` when max_steps <= 0: a 0 would quietly run an epoch (the demo: minutes)."""
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.max_steps=0"])
    assert str(info.value).endswith("train.max_steps: 0 steps: a positive number of optimizer steps, or -1 to train "
                                    "for `train.epochs` (got 0)")
    assert load_config(None, ["train.max_steps=-1"]).train.max_steps == -1


def test_impossible_combinations():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.precision=fp16", "quantization.compute_dtype=bfloat16",
                           "train.optimizer=paged_adamw_8bit", "quantization.load_in_4bit=false"])
    assert len(info.value.problems) == 2
    assert "pick one dtype" in str(info.value) and "paged_adamw_8bit needs bitsandbytes" in str(info.value)


def test_cuda_graphs_with_a_setting_that_rules_them_out_is_refused():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.cuda_graphs=true", "train.packing=false", "train.compile=false"])
    assert ("train.cuda_graphs=true with train.packing=false and train.compile=false: CUDA graphs replay compiled "
            "layers of packed micro-batches of one shape") in str(info.value)
    assert load_config(None, ["train.cuda_graphs=true"]).train.cuda_graphs  # auto settings leave it to the planner
    # `auto` (the default) leaves them to the planner whatever the other settings
    assert load_config(None, ["train.packing=false", "train.compile=false"]).train.cuda_graphs == "auto"


def test_loss_chunks_asked_for_without_liger_are_refused():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.loss_chunk_tokens=1024", "train.liger_kernel=false"])
    assert "train.loss_chunk_tokens with train.liger_kernel=false" in str(info.value)
    assert load_config(None, ["train.loss_chunk_tokens=1024"]).train.loss_chunk_tokens == 1024
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        load_config(None, ["train.loss_chunk_tokens=8"])
    # the default (`auto`, the planner's choice) and `null` (Liger's own chunks) go with Liger off as well
    assert load_config(None, ["train.liger_kernel=false"]).train.loss_chunk_tokens == "auto"
    assert load_config(None, ["train.loss_chunk_tokens=null", "train.liger_kernel=false"]).train.loss_chunk_tokens \
        is None
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        load_config(None, ["train.loss_chunk_tokens=automatic"])


def test_checkpoint_cadence_adapts_to_short_runs():
    # a run shorter than save_steps still checkpoints (at its last step): no error for `--set train.max_steps=5`
    assert load_config("configs/demo.yaml", ["train.max_steps=5"]).train.save_steps == 10


@pytest.mark.parametrize("spec", ["auto", "auto:2", "cpu", "none", "0", "2,0", "0, 1"])
def test_gpu_specs_accepted(spec):
    assert load_config(None, [f"hardware.gpus={spec}"]).hardware.gpus == spec.replace(" ", "")


@pytest.mark.parametrize("spec", ["auto:0", "gpu0", "1,1", "-1"])
def test_gpu_specs_refused(spec):
    with pytest.raises(ConfigError, match="hardware.gpus"):
        load_config(None, [f"hardware.gpus='{spec}'"])


def test_a_run_directory_given_as_the_config_is_named_a_directory(tmp_path):
    """`--config runs/<run>` said "config file not found: runs/<run>", of a directory that is there."""
    with pytest.raises(ConfigError, match=f"{tmp_path} is a directory, not a config file$"):
        load_config(tmp_path)
    (tmp_path / "config.resolved.yaml").write_text("{}")
    with pytest.raises(ConfigError, match=f"{tmp_path} is a directory, not a config file \\(the run's config is "
                                          f"{tmp_path / 'config.resolved.yaml'}\\)"):
        load_config(tmp_path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    bad.write_text("train:\n  learning_rate: 5e-3\nmodel:\n  source: generated:tiny-llama\ntrain:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"line 5, column 1: `train` is given twice \(first at line 1\)"):
        load_config(bad)  # PyYAML keeps the last: the first section's learning rate would be dropped unsaid


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates_and_says_how_to_run_it(path):
    cfg = load_config(path)
    assert isinstance(cfg, FinetuneConfig)
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert any("python flows/" in line for line in header), "each config's header shows the command that runs it"


def test_reference_documents_every_key():
    text = config_reference()
    for section, model in FinetuneConfig.model_fields.items():
        for key, field in model.annotation.model_fields.items():
            assert f"{section}.{key} = " in text or f"{section}.{key}." in text
            if not hasattr(field.annotation, "model_fields"):
                assert field.description, f"{section}.{key} has no description"


def test_help_config_into_a_closed_pipe_exits_quietly():
    """`--help-config | head -3`: the reader is gone before the output is written; no traceback, exit 0."""
    import subprocess
    import sys

    from conftest import child_env

    proc = subprocess.Popen([sys.executable, "flows/finetune.py", "--help-config"], cwd=REPO, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the child has even imported its modules: every write of it meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err


def test_docs_reference_matches_the_config_model():
    page = (REPO / "docs" / "config-reference.md").read_text()
    assert f"```text\n{config_reference()}\n```" in page, "regenerate docs/config-reference.md (--help-config)"


def test_training_retries_wait_the_first_delay_then_double_it():
    from flows.finetune import retrying_trainer

    trainer = retrying_trainer(load_config(None, ["train.retries=3", "train.retry_delay_seconds=10"]))
    assert (trainer.retries, trainer.retry_delay_seconds) == (3, [10, 20, 40])
    assert retrying_trainer(load_config(None, ["train.retries=0"])).retries == 0


def test_print_params_writes_the_run_parameter_that_deployment_run_takes(tmp_path):
    """`--print-params`: the config file plus `--set`s, validated, as `{"config": ...}` for `--params`; a bad key
    is one message and exit status 2, and nothing is started."""
    import json
    import subprocess
    import sys

    from conftest import child_env
    from finetune_flows.config.parameters import config_parameter

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "flows/finetune.py", "--config", "configs/nightly.yaml", *args],
                              cwd=REPO, env=child_env(PREFECT_HOME=str(tmp_path)), capture_output=True, text=True,
                              timeout=120)

    done = cli("--set", "train.learning_rate=5e-4", "--print-params")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"config": config_parameter(REPO / "configs/nightly.yaml",
                                                                  ["train.learning_rate=5e-4"])}
    assert json.loads(done.stdout)["config"]["data"]["source"] == "data/nightly-tickets.jsonl"
    bad = cli("--set", "train.learning_rat=5e-4", "--print-params")
    assert (bad.returncode, bad.stdout) == (2, "") and "train.learning_rat: unknown key" in bad.stderr, bad.stderr
    assert not list(tmp_path.iterdir()), "a Prefect server was started"


def test_help_config_and_print_params_together_are_refused(capsys):
    """`--help-config --print-params` printed the reference alone, exit 0: the parameters asked for never came."""
    from flows.finetune import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help-config", "--print-params"])
    assert exit_.value.code == 2
    assert "argument --print-params: not allowed with argument --help-config" in capsys.readouterr().err


def test_the_default_config_is_found_when_the_flow_runs_from_another_directory(tmp_path):
    """`python /path/to/flows/finetune.py` from elsewhere said "config file not found: configs/demo.yaml"."""
    import json
    import subprocess
    import sys

    from conftest import child_env
    from finetune_flows.config.parameters import config_parameter

    done = subprocess.run([sys.executable, str(REPO / "flows/finetune.py"), "--print-params"], cwd=tmp_path,
                          env=child_env(PREFECT_HOME=str(tmp_path / "home")), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"config": config_parameter(REPO / "configs/demo.yaml", [])}


def test_an_empty_lora_target_list_is_refused_before_any_model_loads():
    # before: accepted, then PEFT's NoMatchingPeftModuleError inside the training worker, retried as a crash
    with pytest.raises(ConfigError) as info:
        load_config(None, ["lora.target_modules=[]"])
    assert info.value.problems == ["lora.target_modules: an empty list adapts no module: name the modules (e.g. "
                                   "[q_proj, v_proj]) or use all-linear (got [])"]


@pytest.mark.parametrize("overrides, problem", [
    (["train.epochs=3"], "train.epochs=3 with train.max_steps=100: epochs count only with train.max_steps=-1; set "
     "that to train for the epochs, or drop train.epochs"),
    (["train.packing=false", "train.micro_batch_tokens=2048"], "train.micro_batch_tokens with train.packing=false: "
     "padded batches hold train.per_device_batch_size rows; drop one of the two"),
    (["train.lr_scheduler=constant", "train.warmup_steps=50"], "train.warmup_steps=50 with train.lr_scheduler="
     "constant, which has no warm-up: use constant_with_warmup, or drop train.warmup_steps"),
])
def test_a_training_setting_that_would_be_ignored_is_refused(overrides, problem):
    # before: accepted, and the run trained 100 steps / padded batches of 8 rows as if the key were not there
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.problems == [problem]


def test_epochs_with_max_steps_minus_one_and_default_epochs_with_steps_are_accepted():
    assert load_config(None, ["train.max_steps=-1", "train.epochs=3"]).train.epochs == 3
    assert load_config(None, ["train.max_steps=20", "train.epochs=1"]).train.max_steps == 20


def test_constant_without_warm_up_is_accepted_and_the_run_length_reads_in_steps_or_epochs():
    assert load_config(None, ["train.lr_scheduler=constant", "train.warmup_steps=0"]).train.warmup_steps == 0
    assert load_config(None, ["train.lr_scheduler=constant"]).train.lr_scheduler == "constant"  # the default warm-up
    assert load_config(None, []).train.length == "100 steps"
    assert load_config(None, ["train.max_steps=-1", "train.epochs=2.5"]).train.length == "2.5 epoch(s)"  # not -1 steps


def test_the_run_directory_records_the_cache_the_run_used(tmp_path, monkeypatch):
    """With FINETUNE_FLOWS_CACHE set, config.resolved.yaml said `run.cache_dir: <the config's>`, a cache the run never
    touched: a run reproduced from the file without the variable rebuilt every step in another cache."""
    from finetune_flows.store.runs import create_run_dir

    monkeypatch.setenv("FINETUNE_FLOWS_CACHE", str(tmp_path / "used"))
    cfg = load_config(None, [f"run.cache_dir={tmp_path / 'set'}", f"run.output_dir={tmp_path / 'runs'}"])
    recorded_file = create_run_dir(cfg) / "config.resolved.yaml"
    assert yaml.safe_load(recorded_file.read_text())["run"]["cache_dir"] == str(tmp_path / "used")
    monkeypatch.delenv("FINETUNE_FLOWS_CACHE")
    reproduced = load_config(recorded_file)  # re-run from the file: the same cache, and otherwise the same config
    assert reproduced.cache_root == tmp_path / "used" and reproduced.model_copy(
        update={"run": cfg.run}).fingerprint() == cfg.fingerprint()
    # without the variable (or where it names the configured cache) the setting is kept as written
    default = load_config(None, [f"run.output_dir={tmp_path / 'runs'}"])
    assert yaml.safe_load((create_run_dir(default) / "config.resolved.yaml").read_text())["run"]["cache_dir"] == \
        "~/.cache/finetune-flows"
    monkeypatch.setenv("FINETUNE_FLOWS_CACHE", str(tmp_path / "set"))
    assert cfg.as_recorded() is cfg
