"""The evaluation copy (finetune_flows/models/dequantize.py) holds exactly the weights the 4-bit model computes with,
and is a store entry: one writer, a manifest that marks it complete, never a torn copy loaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from eval_support import tiny_quantized, trained_once
from finetune_flows.models.dequantize import DequantizedCopy, dequantize_linear4bit, dequantized_copy
from finetune_flows.store.entries import MANIFEST, Entry


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def base(request, shared_cache):
    return tiny_quantized(shared_cache / "dequantize", request.param)


def _load(path, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, device_map={"": "cpu"}, dtype=getattr(torch, dtype)).eval()


def test_copy_equals_the_dequantized_4bit_weights_bit_for_bit(base, tmp_path):
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    import torch

    path = dequantized_copy(base, tmp_path)
    copy, four_bit = _load(path, base.compute_dtype), _load(base.path, base.compute_dtype)
    quantized = {n: m for n, m in four_bit.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(quantized) == 14
    copied = dict(copy.named_modules())
    for name, module in quantized.items():
        linear = copied[name]
        assert type(linear) is torch.nn.Linear and linear.weight.dtype == getattr(torch, base.compute_dtype)
        expected = F.dequantize_4bit(module.weight.data, module.weight.quant_state).to(linear.weight.dtype)
        assert torch.equal(linear.weight, expected), name
        assert torch.equal(linear.weight, dequantize_linear4bit(module)), name
    others = {n: p for n, p in four_bit.named_parameters() if not isinstance(p, bnb.nn.Params4bit)}
    copy_params = dict(copy.named_parameters())
    assert others and all(torch.equal(copy_params[n], p) for n, p in others.items())
    assert not hasattr(copy.config, "quantization_config")


def test_transformers_dequantize_gives_the_same_weights_here(base, tmp_path):
    """model.dequantize() casts from the dtype stored at quantization time; in this pipeline that is the compute
    dtype, so it must agree with the copy (if it ever does not, the copy is the one matching the 4-bit matmul)."""
    import torch

    copy = _load(dequantized_copy(base, tmp_path), base.compute_dtype)
    theirs = _load(base.path, base.compute_dtype).dequantize(dtype=getattr(torch, base.compute_dtype))
    ours = dict(copy.named_parameters())
    assert all(torch.equal(ours[n], p) for n, p in theirs.named_parameters())


def test_copy_computes_what_the_4bit_model_computes(base, tmp_path):
    import torch

    copy, four_bit = _load(dequantized_copy(base, tmp_path), base.compute_dtype), _load(base.path, base.compute_dtype)
    # In eval mode on a CPU with AVX512-BF16, bnb swaps in a fused kernel that rounds activations and scales to
    # bf16 whatever the compute dtype; in train mode (as during QLoRA training, and on GPUs) it multiplies by
    # the dequantized weight, which is what the copy holds. (The tiny model has no dropout.)
    four_bit.train()
    ids = torch.randint(3, 1000, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = copy(input_ids=ids).logits.float(), four_bit(input_ids=ids).logits.float()
    # Same weights; only the matmul kernels (and their summation order) differ.
    tol = 1e-4 if base.compute_dtype == "float32" else 5e-2
    assert torch.allclose(a, b, atol=tol, rtol=tol), (a - b).abs().max()


def test_copy_is_made_once_and_reused(base, tmp_path):
    first = dequantized_copy(base, tmp_path)
    made = (first / MANIFEST).stat().st_mtime_ns
    assert dequantized_copy(base, tmp_path) == first and (first / MANIFEST).stat().st_mtime_ns == made
    assert first.parent == tmp_path / "dequantized" and not [p for p in first.parent.iterdir() if p.name[0] == "."]
    # the key says what the copy was made from; the manifest too, and it lists every file the copy holds
    assert first.name.startswith(f"{base.fingerprint}-{base.compute_dtype}-cpu-")
    manifest = json.loads((first / MANIFEST).read_text())
    record = DequantizedCopy.model_validate(manifest["result"])
    assert (record.base_fingerprint, record.dtype, record.device, record.linear_layers) == (
        base.fingerprint, base.compute_dtype, "cpu", 14)
    assert set(manifest["files"]) == {str(p.relative_to(first)) for p in first.rglob("*") if p.name != MANIFEST}
    plain = base.model_copy(update={"load_in_4bit": False})
    assert dequantized_copy(plain, tmp_path) == base.path


# A writer of the copy in a process of its own; it prints "ready" just before asking for the copy. "slow": signals
# (`flag`) once it is making the copy, then waits for `flag`.go to go on; "die": signals once the weights are written
# (the tokenizer not yet) and hangs there, to be killed.
WRITER = r"""
import sys, time
from pathlib import Path
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer  # imported before "ready": the copy is asked for at once
from finetune_flows.models import dequantize
from finetune_flows.models.quantize import QuantizedModel

base, cache, mode, flag = QuantizedModel.model_validate_json(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
if mode == "slow":
    real = dequantize.dequantize_model
    def slow(model, **kw):
        flag.touch()
        go = flag.with_name(flag.name + ".go")
        while not go.exists():
            time.sleep(0.1)
        return real(model, **kw)
    dequantize.dequantize_model = slow
elif mode == "die":
    real_save = transformers.PreTrainedModel.save_pretrained
    def save_then_hang(self, *args, **kw):
        real_save(self, *args, **kw)
        flag.touch()
        time.sleep(600)
    transformers.PreTrainedModel.save_pretrained = save_then_hang
print("ready", flush=True)
print("copy:", dequantize.dequantized_copy(base, cache), flush=True)
"""


def _writer(base, cache, mode: str, flag) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-c", WRITER, base.model_dump_json(), str(cache), mode, str(flag)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(flag, proc) -> None:
    deadline = time.monotonic() + 180
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the writer never got there"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fp32_base(shared_cache):
    return tiny_quantized(shared_cache / "dequantize", "float32")


def test_two_concurrent_writers_make_one_copy_and_no_torn_files(fp32_base, tmp_path):
    """Two evaluations needing the same copy at once (real processes): the second waits for the first's lock, then
    reuses what it made; one dequantization, one entry, every file in its manifest, nothing half-written beside it."""
    first = _writer(fp32_base, tmp_path, "slow", tmp_path / "holding")
    second = None
    try:
        _wait_for(tmp_path / "holding", first)  # the first is making the copy, and waits
        second = _writer(fp32_base, tmp_path, "plain", tmp_path / "unused")
        assert second.stdout.readline() == "ready\n"
        time.sleep(2)  # the second asks for the copy while the first is still making it
        (tmp_path / "holding.go").touch()
        out_second, _ = second.communicate(timeout=300)
        out_first, _ = first.communicate(timeout=300)
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
    assert (first.returncode, second.returncode) == (0, 0), out_first[-2000:] + out_second[-2000:]
    made = [line for line in (out_first + out_second).splitlines() if line.startswith("dequantized 14 Linear4bit")]
    assert len(made) == 1 and made[0] in out_first  # the second made nothing
    paths = {line for line in (out_first + out_second).splitlines() if line.startswith("copy: ")}
    (path,) = [line[len("copy: "):] for line in paths]
    (entry_dir,) = (tmp_path / "dequantized").iterdir()
    assert str(entry_dir) == path
    entry = Entry(tmp_path, "dequantized", entry_dir.name)
    assert entry.problem() is None
    files = json.loads(entry.manifest_path.read_text())["files"]
    assert set(files) == {str(p.relative_to(entry_dir)) for p in entry_dir.rglob("*") if p.name != MANIFEST}
    assert "model.safetensors" in files and "tokenizer_config.json" in files


def test_a_copy_whose_writer_was_killed_or_whose_files_were_damaged_is_made_again(fp32_base, tmp_path, capfd):
    writer = _writer(fp32_base, tmp_path, "die", tmp_path / "saved")
    try:
        _wait_for(tmp_path / "saved", writer)  # the weights are on disk, the tokenizer and manifest are not
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.communicate(timeout=60)
    (entry_dir,) = (tmp_path / "dequantized").iterdir()
    assert (entry_dir / "model.safetensors").is_file() and not (entry_dir / MANIFEST).exists()
    capfd.readouterr()

    assert dequantized_copy(fp32_base, tmp_path) == entry_dir  # not reused: made again, under the lock
    assert "dequantized 14 Linear4bit layers" in capfd.readouterr().out
    entry = Entry(tmp_path, "dequantized", entry_dir.name)
    assert entry.problem() is None and (entry_dir / "tokenizer_config.json").is_file()

    with open(entry_dir / "model.safetensors", "r+b") as f:  # a complete copy damaged later: not trusted either
        f.truncate(1000)
    assert dequantized_copy(fp32_base, tmp_path) == entry_dir
    assert "dequantized 14 Linear4bit layers" in capfd.readouterr().out and entry.problem() is None


def test_training_on_the_dequantized_base_computes_the_qlora_loss_and_gradients(shared_cache):
    """train.dequantize_base: the rank holds the NF4 weights dequantized; the LoRA adapter it trains sees the same
    loss and gradients as on the 4-bit model (fp32 here; only the matmul kernels differ)."""
    import torch

    base = tiny_quantized(shared_cache / "dequantize", "float32")
    plain, loss, grads = trained_once(base, dequantize_base=True)
    four_bit, loss4, grads4 = trained_once(base, dequantize_base=False)
    assert not any(type(m).__name__ == "Linear4bit" for m in plain.modules())
    assert any(type(m).__name__ == "Linear4bit" for m in four_bit.modules())
    assert grads.keys() == grads4.keys() and len(grads) == 28  # A and B of 14 projections
    assert abs(loss - loss4) < 1e-5, (loss, loss4)
    for name, g in grads.items():
        assert torch.allclose(g, grads4[name], atol=1e-5, rtol=1e-4), name


def test_dequantizing_in_place_frees_the_4bit_layers_before_it_returns(base):
    """The replaced Linear4bit layers are in reference cycles: left to Python's cyclic collector, their 4-bit weights
    stayed allocated through the training steps (3.3 GiB on the Qwen3-8B shape, measured on an H200)."""
    import weakref

    import bitsandbytes as bnb

    from finetune_flows.models.dequantize import dequantize_model

    model = _load(base.path, "float32")
    layers = [weakref.ref(m) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    weights = [weakref.ref(m.weight) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and dequantize_model(model) == len(layers)
    assert not [r for r in layers + weights if r() is not None]


def test_a_trusted_custom_code_checkpoint_gets_its_evaluation_copy_without_a_question(tmp_path, capfd):
    """model.trust_remote_code reaches every load of the copy (the tokenizer's too): transformers neither asks "Do
    you wish to run the custom code? [y/N]" nor refuses."""
    from conftest import custom_code_checkpoint
    from finetune_flows.export.merge import _parameter_count
    from finetune_flows.models.quantize import QuantizedModel

    checkpoint = custom_code_checkpoint(tmp_path / "custom")
    base = QuantizedModel(path=checkpoint, fingerprint="custom", load_in_4bit=True, compute_dtype="float32",
                          memory_footprint_mb=0.0, linear4bit_layers=0, quantize_seconds=0.0)
    copy = dequantized_copy(base, tmp_path / "cache", "cpu", trust_remote_code=True)
    assert (copy / MANIFEST).is_file() and (copy / "tokenizer_config.json").is_file()
    assert _parameter_count(checkpoint, trust_remote_code=True) > 0  # the merge step's size check
    out = capfd.readouterr()
    assert "Do you wish to run the custom code" not in out.out + out.err


def test_a_checkpoint_that_lacks_weights_its_config_needs_is_refused_by_the_quantize_worker(shared_cache, tmp_path):
    """tie_word_embeddings turned off in a checkpoint saved tied: there is no lm_head.weight, and transformers
    started it at random with a table in the log only, so the run trained and exported on a random output layer."""
    import shutil

    from conftest import tiny_config
    from finetune_flows.errors import UserInputError
    from finetune_flows.models.sources import materialize_model
    from finetune_flows.runtime.launcher import python_module, run_worker, write_job

    model = tmp_path / "model"
    shutil.copytree(materialize_model("generated:tiny-llama", shared_cache), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    cfg = tiny_config(shared_cache, tmp_path / "runs", **{"model.source": str(model)})
    job = write_job(tmp_path / "work", "quantize", config=cfg.model_dump(mode="json"), out=str(tmp_path / "out"),
                    compute_dtype="float32", fingerprint="f", quant_storage="uint8")
    with pytest.raises(UserInputError, match=f"model.source={model}: the checkpoint lacks 1 weight"
                                             r"\(s\) its config.json's model has, e.g. lm_head.weight;"):
        run_worker("quantize", python_module("finetune_flows.models.quantize", job), {}, job.parent)
    assert not (tmp_path / "out" / "quantization.json").exists()
