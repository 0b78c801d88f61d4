"""One test per row of README.md's cache-key table: everything the row lists changes the step's key (as its task
module declares it, `CACHE_KEY` in tasks/<step>.py), everything it says is not in the key leaves it alone. Each test
also checks that the row names what it tests; the last ones that the declared key is the one the engine uses."""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

import finetune_flows.store.fingerprint as fingerprint
from finetune_flows.config.schema import (
    DataConfig, EvalConfig, ExportConfig, LoraConfig, QuantizationConfig, TrainConfig, load_config,
)
from finetune_flows.data.dataset import PreparedDataset
from finetune_flows.config.plan import Plan
from finetune_flows.models.sources import materialize_tokenizer
from finetune_flows.models.quantize import QuantizedModel
from finetune_flows.orchestration.steps import Step
from finetune_flows.runtime.gpus import GpuSelection
from finetune_flows.training.train import TRAIN_KEYS_NOT_IN_CACHE_KEY
from tasks import (
    evaluate_adapter, evaluate_checkpoint, merge_adapter, prepare_dataset, quantize_base_model, train_adapter,
)

# Each step's key as its task module declares it
data_key, quantize_key = prepare_dataset.CACHE_KEY, quantize_base_model.CACHE_KEY
train_key, eval_key, checkpoint_key = train_adapter.CACHE_KEY, evaluate_adapter.CACHE_KEY, evaluate_checkpoint.CACHE_KEY
merge_key = merge_adapter.CACHE_KEY

REPO = Path(__file__).resolve().parent.parent
PLAN = Plan(device="cpu", nproc=1, precision="fp32", compute_dtype="float32", train_attn="sdpa",
            eval_attn="sdpa")
KERNELS = "hardware.kernels={RMSNorm: 'kernels-community/liger_kernels:LigerRMSNorm'}"  # layers swapped at evaluation
NOT_IN_ANY = ["run.name=other", "run.output_dir=/elsewhere", "run.cache_dir=/another/cache", "hardware.gpus=cpu",
              "hardware.memory_budget_gib=24", "hardware.rdzv_timeout_seconds=30"]


def readme_row(step: str) -> str:
    text = (REPO / "README.md").read_text()
    (row,) = re.findall(rf"^\| {re.escape(step)} \|.*$", text, flags=re.M)
    for lib in fingerprint.STEP_LIBRARIES[step]:
        assert lib.split("-")[0] in row, f"the README row of {step} does not name {lib}"
    for module in fingerprint.STEP_CODE[step]:
        assert f"{module}.py" in row, f"the README row of {step} does not name finetune_flows/{module}.py"
    return row


def alternative(model: type[BaseModel], name: str, value: object) -> object:
    """Another valid value for a config field (so every field, including ones added later, gets tested)."""
    annotation = model.model_fields[name].annotation
    options = [a for arg in typing.get_args(annotation) for a in (typing.get_args(arg) or [arg])]
    literals = [o for o in (typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else
                            options) if isinstance(o, str) and o != value]
    if isinstance(value, bool):
        return not value
    if bool in options and value == "auto":  # bool | Literal["auto"]
        return True
    if int in options and value == "auto":  # int | Literal["auto"] | None
        return 64
    if literals and typing.get_origin(annotation) is typing.Literal:
        return literals[0]
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 if value else 0.5
    if value is None:
        return 64 if int in options else "some-value"
    if isinstance(value, str):
        return ["q_proj"] if name == "target_modules" else value + "x"
    raise AssertionError(f"no alternative value for {model.__name__}.{name}={value!r}: add one to this test")


EVAL_ATTENTION = frozenset({"attn_implementation"})  # in the evaluation keys as what it resolves to (the plan)


def section_overrides(section: str, model: type[BaseModel], cfg, skip: frozenset[str] = frozenset()) -> list[str]:
    current = getattr(cfg, section)
    return [f"{section}.{name}={alternative(model, name, getattr(current, name))}"
            for name in model.model_fields if name not in skip and not isinstance(getattr(current, name), BaseModel)]


class Keys:
    """A step's key before and after one change to the config (everything else fixed)."""

    def __init__(self, compute, base: list[str]):
        self.compute, self.base = compute, base
        self.reference = compute(load_config(None, base))

    def changed_by(self, override: str) -> bool:
        return self.compute(load_config(None, [*self.base, override])) != self.reference

    def assert_in_key(self, overrides: list[str]) -> None:
        unchanged = [o for o in overrides if not self.changed_by(o)]
        assert not unchanged, f"these should change the key but do not: {unchanged}"

    def assert_not_in_key(self, overrides: list[str]) -> None:
        changed = [o for o in overrides if self.changed_by(o)]
        assert not changed, f"these should leave the key alone but change it: {changed}"

    def assert_library_and_code_in_key(self, monkeypatch, step: str, tmp_path: Path, cfg) -> None:
        real = fingerprint.installed_version
        for lib in fingerprint.STEP_LIBRARIES[step]:
            monkeypatch.setattr(fingerprint, "installed_version", lambda d, lib=lib: "0.0.1" if d == lib else real(d))
            assert self.compute(cfg) != self.reference, f"a {lib} upgrade must change the {step} key"
        monkeypatch.setattr(fingerprint, "installed_version", real)
        for module in fingerprint.STEP_CODE[step]:
            if not (REPO / "finetune_flows" / f"{module}.py").is_file():
                continue
            shutil.rmtree(tmp_path / "finetune_flows", ignore_errors=True)
            shutil.copytree(REPO / "finetune_flows", tmp_path / "finetune_flows")
            with open(tmp_path / "finetune_flows" / f"{module}.py", "a") as f:
                f.write("\n# a code change\n")
            monkeypatch.setattr(fingerprint, "_PROJECT", tmp_path / "finetune_flows")
            assert self.compute(cfg) != self.reference, \
                f"a change to finetune_flows/{module}.py must change the {step} key"
        monkeypatch.setattr(fingerprint, "_PROJECT", REPO / "finetune_flows")


@pytest.fixture(scope="module")
def tokenizer_dir(shared_cache):
    return materialize_tokenizer("generated:tiny-llama", shared_cache)


def dataset(fp: str = "d1") -> PreparedDataset:
    return PreparedDataset(path=Path("/d"), fingerprint=fp, format="chat", train_rows=1, eval_rows=1, train_tokens=1,
                           truncated=0, dropped=0)


def base_model(fp: str = "b1") -> QuantizedModel:
    return QuantizedModel(path=Path("/b"), fingerprint=fp, load_in_4bit=True, compute_dtype="float32",
                          memory_footprint_mb=1.0, linear4bit_layers=1, quantize_seconds=1.0)


def test_prepare_dataset_row(tmp_path, tokenizer_dir, monkeypatch):
    row = readme_row("prepare-dataset")
    for named in ("`data.source`", "`data.eval_source`", "`data.hub_revision`", "`data.*`", "tokenizer",
                  "`model.revision`", "transformers", "tokenizers", "datasets", "`finetune_flows/data/dataset.py`",
                  "`finetune_flows/data/rows.py`", "`finetune_flows/data/demo.py`", "`quantization.*`", "`lora.*`",
                  "`train.*`", "`eval.*`", "`run.*`"):
        assert named in row, named
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text('{"prompt": "a", "response": "b"}\n')
    held.write_text('{"prompt": "c", "response": "d"}\n')
    keys = Keys(lambda cfg: data_key(cfg, tokenizer_dir), [f"data.source={train}", f"data.eval_source={held}"])
    cfg = load_config(None, keys.base)
    keys.assert_in_key(section_overrides("data", DataConfig, cfg, skip=frozenset({"source", "eval_source"})))
    keys.assert_in_key([f"data.source={held}", "data.columns.prompt=question"])
    train.write_text('{"prompt": "a", "response": "B"}\n')  # the file's bytes, not its name
    assert data_key(cfg, tokenizer_dir) != keys.reference
    train.write_text('{"prompt": "a", "response": "b"}\n')
    held.write_text('{"prompt": "c", "response": "D"}\n')
    assert data_key(cfg, tokenizer_dir) != keys.reference
    held.write_text('{"prompt": "c", "response": "d"}\n')
    hub = Keys(lambda cfg: data_key(cfg, tokenizer_dir), ["data.source=hub:org/tickets", "data.hub_revision=a"])
    hub.assert_in_key(["data.hub_revision=b"])
    other_tokenizer = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, other_tokenizer)
    (other_tokenizer / "tokenizer_config.json").write_text((other_tokenizer / "tokenizer_config.json").read_text()
                                                           .replace("<|im_end|>", "<|endoftext|>", 1))
    assert data_key(cfg, other_tokenizer) != keys.reference  # another tokenizer (model or revision)
    keys.assert_not_in_key(["model.trust_remote_code=true", "quantization.quant_type=fp4", "lora.r=4",
                            "train.learning_rate=1e-3", "eval.max_samples=3", *NOT_IN_ANY])
    keys.assert_library_and_code_in_key(monkeypatch, "prepare-dataset", tmp_path, cfg)


def test_a_tokenizer_rebuilt_byte_for_byte_later_keeps_the_dataset_and_adapter_keys(tmp_path):
    """The key holds the tokenizer's files, not the store's manifest of them (which records when it was written)."""
    import time

    cfg = load_config(None)
    first = materialize_tokenizer("generated:tiny-llama", tmp_path)
    files = {p.name: p.read_bytes() for p in first.iterdir() if p.name != "manifest.json"}
    key = data_key(cfg, first)
    created = (first / "manifest.json").read_text()
    shutil.rmtree(first)
    time.sleep(1.1)  # the manifest's time has a resolution of one second
    again = materialize_tokenizer("generated:tiny-llama", tmp_path)
    assert again == first and (again / "manifest.json").read_text() != created
    assert {p.name: p.read_bytes() for p in again.iterdir() if p.name != "manifest.json"} == files
    assert data_key(cfg, again) == key  # so the dataset, and the adapter trained on it, stay cached


def test_quantize_base_model_row(tmp_path, monkeypatch):
    row = readme_row("quantize-base-model")
    for named in ("`model.source`", "`model.revision`", "`model.trust_remote_code`", "`quantization.*`",
                  "compute dtype", "device", "stored in", "`hardware.strategy`", "torch", "transformers",
                  "bitsandbytes", "accelerate",
                  "`finetune_flows/models/quantize.py`", "`finetune_flows/models/sources.py`", "`data.*`", "`lora.*`",
                  "`train.*`", "`eval.*`", "`run.*`"):
        assert named in row, named
    keys = Keys(lambda cfg: quantize_key(cfg, PLAN), [])
    cfg = load_config(None)
    keys.assert_in_key(section_overrides("quantization", QuantizationConfig, cfg))
    keys.assert_in_key(["model.source=generated:tiny-llama", "model.trust_remote_code=true"])
    hub = Keys(lambda cfg: quantize_key(cfg, PLAN), ["model.source=org/model", f"model.revision={'a' * 40}"])
    hub.assert_in_key([f"model.revision={'b' * 40}"])
    local = tmp_path / "ckpt"
    local.mkdir()
    (local / "config.json").write_text('{"model_type": "llama"}')
    (local / "model.safetensors").write_bytes(b"w1")
    before = quantize_key(load_config(None, [f"model.source={local}"]), PLAN)
    (local / "model.safetensors").write_bytes(b"w2")
    assert quantize_key(load_config(None, [f"model.source={local}"]), PLAN) != before
    for plan_change in ({"compute_dtype": "bfloat16"}, {"device": "cuda"}, {"strategy": "fsdp"}):
        assert quantize_key(cfg, PLAN.model_copy(update=plan_change)) != keys.reference, plan_change
    keys.assert_not_in_key(["data.seed=1", "data.source=/x.jsonl", "lora.r=4", "train.learning_rate=1e-3",
                            "eval.max_samples=3", *NOT_IN_ANY])
    keys.assert_library_and_code_in_key(monkeypatch, "quantize-base-model", tmp_path, cfg)


def test_train_adapter_row(tmp_path, monkeypatch):
    row = readme_row("train-adapter")
    for named in ("dataset", "4-bit base", "`lora.*`", "`train.*`", "`TRAIN_KEYS_NOT_IN_CACHE_KEY`", "ranks",
                  "device", "precision", "attention", "torch", "transformers", "peft", "bitsandbytes", "accelerate",
                  "`finetune_flows/training/train.py`", "`finetune_flows/training/worker.py`", "`eval.*`", "`run.*`",
                  "`hardware.launcher`", "`hardware.nodes`", "`hardware.gpus_per_node`", "`hardware.strategy`",
                  *(f"`train.{k}`" for k in TRAIN_KEYS_NOT_IN_CACHE_KEY)):
        assert named in row, named
    keys = Keys(lambda cfg: train_key(cfg, dataset(), base_model(), PLAN), [])
    cfg = load_config(None)
    keys.assert_in_key(section_overrides("lora", LoraConfig, cfg))
    keys.assert_in_key(section_overrides("train", TrainConfig, cfg, skip=TRAIN_KEYS_NOT_IN_CACHE_KEY | {"epochs"}))
    by_epochs = Keys(lambda cfg: train_key(cfg, dataset(), base_model(), PLAN), ["train.max_steps=-1"])
    by_epochs.assert_in_key(["train.epochs=0.5"])  # epochs count only there (a config refuses them beside max_steps)
    keys.assert_not_in_key([f"train.{k}={alternative(TrainConfig, k, getattr(cfg.train, k))}"
                            for k in sorted(TRAIN_KEYS_NOT_IN_CACHE_KEY)])
    assert train_key(cfg, dataset("d2"), base_model(), PLAN) != keys.reference
    assert train_key(cfg, dataset(), base_model("b2"), PLAN) != keys.reference
    for plan_change in ({"nproc": 2}, {"device": "cuda"}, {"precision": "bf16"}, {"train_attn": "eager"},
                        {"strategy": "fsdp"}):
        assert train_key(cfg, dataset(), base_model(), PLAN.model_copy(update=plan_change)) != keys.reference
    for launch in (["hardware.nodes=2", "hardware.rdzv_endpoint=node1:29400"], ["hardware.launcher=ray"]):
        assert train_key(load_config(None, launch), dataset(), base_model(), PLAN) != keys.reference, launch
    keys.assert_not_in_key(["eval.max_samples=3", "eval.metric=contains", *NOT_IN_ANY])
    keys.assert_library_and_code_in_key(monkeypatch, "train-adapter", tmp_path, cfg)


def test_evaluate_adapter_row(tmp_path, monkeypatch):
    row = readme_row("evaluate-adapter")
    for named in ("dataset", "4-bit base", "adapter's files", "`eval.*`", "attention", "device", "torch",
                  "transformers", "peft", "bitsandbytes", "accelerate", "`finetune_flows/evaluation/evaluate.py`",
                  "`finetune_flows/evaluation/worker.py`", "`finetune_flows/evaluation/metrics.py`", "`train.*`",
                  "`lora.*`", "`run.*`", "`hardware.kernels`"):
        assert named in row, named
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"a1")
    keys = Keys(lambda cfg: eval_key(cfg, dataset(), base_model(), adapter, PLAN), [])
    cfg = load_config(None)
    keys.assert_in_key(section_overrides("eval", EvalConfig, cfg, skip=EVAL_ATTENTION))
    assert eval_key(cfg, dataset("d2"), base_model(), adapter, PLAN) != keys.reference
    assert eval_key(cfg, dataset(), base_model("b2"), adapter, PLAN) != keys.reference
    (adapter / "adapter_model.safetensors").write_bytes(b"a2")
    assert eval_key(cfg, dataset(), base_model(), adapter, PLAN) != keys.reference
    (adapter / "adapter_model.safetensors").write_bytes(b"a1")
    for plan_change in ({"eval_attn": "eager"}, {"device": "cuda"}):
        assert eval_key(cfg, dataset(), base_model(), adapter, PLAN.model_copy(update=plan_change)) \
            != keys.reference
    keys.assert_in_key([KERNELS])
    # the attention setting counts as the backend it resolves to (the plan's eval_attn, above), not as written
    keys.assert_not_in_key(["train.learning_rate=1e-3", "lora.r=4", "eval.attn_implementation=sdpa", *NOT_IN_ANY])
    keys.assert_library_and_code_in_key(monkeypatch, "evaluate-adapter", tmp_path, cfg)


def test_evaluate_checkpoint_row(tmp_path, monkeypatch):
    row = readme_row("evaluate-checkpoint")
    for named in ("dataset", "4-bit base", "checkpoint's files", "model card", "`eval.*`", "attention", "device",
                  "`finetune_flows/evaluation/evaluate.py`", "`finetune_flows/evaluation/worker.py`", "`train.*`",
                  "`export.*`", "`run.*`", "`hardware.kernels`"):
        assert named in row, named
    merged = tmp_path / "merged"
    merged.mkdir()
    for name, content in (("model.safetensors", "w1"), ("config.json", "{}"), ("README.md", "card 1")):
        (merged / name).write_text(content)
    keys = Keys(lambda cfg: checkpoint_key(cfg, dataset(), base_model(), merged, PLAN), [])
    cfg = load_config(None)
    keys.assert_in_key([*section_overrides("eval", EvalConfig, cfg, skip=EVAL_ATTENTION), KERNELS])
    assert checkpoint_key(cfg, dataset("d2"), base_model(), merged, PLAN) != keys.reference
    assert checkpoint_key(cfg, dataset(), base_model("b2"), merged, PLAN) != keys.reference
    elsewhere = tmp_path / "cache" / "merged" / "abc"  # another copy, another card: the same checkpoint
    shutil.copytree(merged, elsewhere)
    (elsewhere / "README.md").write_text("card 2")
    assert checkpoint_key(cfg, dataset(), base_model(), elsewhere, PLAN) == keys.reference
    (elsewhere / "model.safetensors").write_text("w2")
    assert checkpoint_key(cfg, dataset(), base_model(), elsewhere, PLAN) != keys.reference
    keys.assert_not_in_key(["train.learning_rate=1e-3", "lora.r=4", "export.dtype=float32",
                            "eval.attn_implementation=sdpa", *NOT_IN_ANY])
    keys.assert_library_and_code_in_key(monkeypatch, "evaluate-checkpoint", tmp_path, cfg)


def test_merge_adapter_key_holds_every_export_setting_but_whether_the_fine_tune_flow_merges(tmp_path):
    """export.merge was in the key: flows/export.py on a run trained with export.merge=false merged the same
    checkpoint again under another key than the fine-tune flow's own merge, and the other way round."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"a1")
    keys = Keys(lambda cfg: merge_key(cfg, dataset(), base_model(), adapter, PLAN), [])
    keys.assert_in_key(section_overrides("export", ExportConfig, load_config(None), skip=frozenset({"merge"})))
    keys.assert_not_in_key(["export.merge=false", "train.learning_rate=1e-3", "eval.max_samples=3", *NOT_IN_ANY])
    assert merge_key(load_config(None), dataset("d2"), base_model(), adapter, PLAN) != keys.reference


TASK_MODULES = sorted(p.stem for p in (REPO / "tasks").glob("*.py") if p.stem != "__init__")


def test_every_task_module_states_its_cache_key_and_every_step_with_a_store_entry_has_one():
    declared = {}
    for name in TASK_MODULES:
        module = importlib.import_module(f"tasks.{name}")
        steps = [v for v in vars(module).values() if isinstance(v, Step) and v.__module__ == module.__name__]
        assert len(steps) == 1, f"tasks/{name}.py declares {len(steps)} steps"
        assert hasattr(module, "CACHE_KEY"), f"tasks/{name}.py states no CACHE_KEY (None: the step writes no entry)"
        key = module.CACHE_KEY
        assert steps[0].cache_key is key, f"tasks/{name}.py: @step(cache_key=CACHE_KEY) and CACHE_KEY go together"
        if key is not None:
            declared[steps[0].options["name"]] = key
    assert set(declared) == set(fingerprint.STEP_CODE) == set(fingerprint.STEP_LIBRARIES)


class EntryBuilt(Exception):
    pass


@pytest.mark.parametrize("name", ["prepare_dataset", "quantize_base_model", "train_adapter", "evaluate_adapter",
                                  "evaluate_checkpoint", "merge_adapter"])
def test_the_engine_names_the_store_entry_by_the_declared_key(name, tmp_path, tokenizer_dir, monkeypatch):
    """The task's call into the engine builds its store entry under CACHE_KEY(task's arguments) (the run stops
    there: what it would then compute is not what this checks)."""
    module = importlib.import_module(f"tasks.{name}")
    engine = sys.modules[module.CACHE_KEY.key.__module__]
    built = []

    def recording_entry(cache_root, kind, key):
        built.append((kind, key))
        raise EntryBuilt

    monkeypatch.setattr(engine, "Entry", recording_entry)
    data_file = tmp_path / "train.jsonl"
    data_file.write_text('{"prompt": "a", "response": "b"}\n')
    files = tmp_path / "files"
    files.mkdir()
    (files / "model.safetensors").write_bytes(b"w")
    cfg = load_config(None, [f"run.cache_dir={tmp_path / 'cache'}", f"data.source={data_file}"])
    gpus = GpuSelection(ids=[], gpus=[])
    data, base = dataset(), base_model()
    call, key_args = {  # the task's arguments, and those of the key it declares
        "prepare_dataset": ((cfg, tokenizer_dir), (cfg, tokenizer_dir)),
        "quantize_base_model": ((cfg, PLAN, gpus, tmp_path), (cfg, PLAN)),
        "train_adapter": ((cfg, data, base, PLAN, gpus, tmp_path), (cfg, data, base, PLAN)),
        "evaluate_adapter": ((cfg, data, base, files, PLAN, gpus), (cfg, data, base, files, PLAN)),
        "evaluate_checkpoint": ((cfg, data, base, files, PLAN, gpus), (cfg, data, base, files, PLAN)),
        "merge_adapter": ((cfg, data, base, files, PLAN, gpus), (cfg, data, base, files, PLAN)),
    }[name]
    with pytest.raises(EntryBuilt):
        getattr(module, name).fn(*call)
    assert built == [(module.CACHE_KEY.kind, module.CACHE_KEY(*key_args))]


def imported_engine_modules(entries: tuple[str, ...]) -> set[str]:
    """The engine modules (`training/worker`) that `entries` import, directly or through each other."""
    package = REPO / "finetune_flows"
    seen, todo = set(), list(entries)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for node in ast.walk(ast.parse((package / f"{module}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune_flows"):
                where = node.module.removeprefix("finetune_flows").strip(".").replace(".", "/")
                for alias in node.names:  # `from finetune_flows.training import sharding` names a module
                    name = f"{where}/{alias.name}".strip("/")
                    todo.append(name if (package / f"{name}.py").is_file() else where)
    return {module for module in seen if (package / f"{module}.py").is_file()}


@pytest.mark.parametrize("step", sorted(fingerprint.STEP_CODE))
def test_every_module_a_step_runs_is_in_its_key_or_declared_outside_it(step):
    """A module that starts to shape a step's output (the training worker's Trainer, the evaluation's layer kernels)
    changes that step's key: every engine module the step's code imports is in STEP_CODE, or declared as plumbing or
    as reaching the key through an input's fingerprint."""
    imported = imported_engine_modules(fingerprint.STEP_ENTRIES[step])
    assert set(fingerprint.STEP_ENTRIES[step]) <= set(fingerprint.STEP_CODE[step])
    unkeyed = imported - set(fingerprint.STEP_CODE[step]) - fingerprint.PLUMBING_CODE \
        - fingerprint.CODE_KEYED_BY_INPUTS[step]
    assert not unkeyed, f"{step} runs code that is not in its cache key: {sorted(unkeyed)}"
    assert "training/lean" in imported_engine_modules(fingerprint.STEP_ENTRIES["train-adapter"])  # the walk works
