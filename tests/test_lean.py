"""The Trainer without its per-micro-batch walks over the model (finetune_flows/training/lean.py): the same training
and the same logged figures, with the walks made once."""

import torch

from finetune_flows.data.packing import PackedCollator, PackedDataset, build_schedule
from finetune_flows.training.lean import lean_trainer, train_mode_once
from tests.test_packing import random_rows, tiny_qwen3


def lora_model():
    """LoRA over a base in eval mode, as from_pretrained leaves it, whose attention dropout acts only in training
    mode: a Trainer that never set the base's modules training would train differently."""
    from peft import LoraConfig, get_peft_model

    base = tiny_qwen3()
    base.config.attention_dropout = 0.2
    for layer in base.model.layers:
        layer.self_attn.attention_dropout = 0.2
    torch.manual_seed(0)
    return get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))


def run(tmp_path, name: str, lean: bool) -> tuple[object, dict, list]:
    """Three optimizer steps of two packed micro-batches each through a real Trainer on the CPU; the model's
    parameter counts and mode walks are recorded as they happen."""
    from transformers import Trainer, TrainingArguments

    model = lora_model()
    walks = {"num_parameters": 0, "train": 0}
    count_params, set_mode = model.num_parameters, type(model).train

    def num_parameters(*args, **kwargs):
        walks["num_parameters"] += 1
        return count_params(*args, **kwargs)

    def walk(mode=True):
        walks["train"] += 1
        return set_mode(model, mode)

    model.num_parameters, model.train = num_parameters, walk
    if lean:
        train_mode_once(model)
    rows = random_rows([40, 25, 60, 33, 18, 50, 29, 44, 37, 21, 55, 30], prompt=0)
    schedule = build_schedule([len(r["input_ids"]) for r in rows], 100, 2, 1, 0, 3)
    args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=1,
                             gradient_accumulation_steps=schedule.accumulation, max_steps=schedule.steps,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, remove_unused_columns=False, train_sampling_strategy="sequential")
    trainer_class = lean_trainer(Trainer) if lean else Trainer
    trainer = trainer_class(model=model, args=args, train_dataset=PackedDataset(rows, schedule),
                            data_collator=PackedCollator(0))
    walks["num_parameters"] = walks["train"] = 0  # what the Trainer's set-up did is not per micro-batch
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer.state, walks, losses


def test_the_lean_trainer_trains_alike_and_walks_the_model_once(tmp_path):
    plain, plain_walks, plain_losses = run(tmp_path, "plain", lean=False)
    lean, lean_walks, lean_losses = run(tmp_path, "lean", lean=True)
    assert lean.global_step == plain.global_step == 3
    assert lean.total_flos == plain.total_flos > 0  # the logged FLOPs do not change
    assert lean_losses == plain_losses
    assert plain_walks["num_parameters"] >= 6 and plain_walks["train"] >= 6  # one of each per micro-batch
    assert lean_walks == {"num_parameters": 1, "train": 1}  # for the first micro-batch only


def test_the_mode_walk_still_runs_after_any_change_of_mode():
    model = lora_model()
    train_mode_once(model)
    assert model.training and not model.get_base_model().training  # as a fresh PEFT model is
    model.train()
    assert all(module.training for module in model.modules())
    model.eval()
    assert not any(module.training for module in model.modules())
    assert model.train() is model
    assert all(module.training for module in model.modules())
    model.train(False)
    assert not any(module.training for module in model.modules())
    model.train(True)
    assert all(module.training for module in model.modules())
