"""Hub kernels from local directories (finetune_flows/models/kernels.py): a small universal (pure PyTorch) kernel repo
is built here, mapped onto a model's RMSNorm layers, and must replace them without changing the outputs; a kernel that
cannot load is a warning naming it, and the stock layer stays."""

from __future__ import annotations

import json
import logging

import pytest

from finetune_flows.models.kernels import apply_kernels, check_kernels, local_kernel_repo

KERNEL = '''
import torch
from torch import nn

calls = 0


class RMSNorm(nn.Module):
    """Same arithmetic as transformers' LlamaRMSNorm; counts its calls so a test can see it ran."""

    def forward(self, hidden_states):
        global calls
        calls += 1
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)
'''


def kernel_repo(root, name, layers_source):
    """A local kernel repository in the layout the `kernels` package loads: build/<variant>/<package>."""
    variant = root / name / "build" / "torch-universal"
    package = variant / name.replace("-", "_")
    package.mkdir(parents=True)
    (variant / "metadata.json").write_text(json.dumps({
        "name": name, "id": f"_{name.replace('-', '_')}_test", "version": 1, "license": "Apache-2.0",
        "python-depends": [], "backend": {"type": "cpu"}}))
    (package / "__init__.py").write_text("from . import layers\n")
    (package / "layers.py").write_text(layers_source)
    return root / name


@pytest.fixture
def tiny_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def logits(model):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.arange(3, 40).reshape(1, -1)).logits


def test_a_local_kernel_replaces_the_layer_and_keeps_the_outputs(tiny_model, tmp_path):
    import sys

    repo = kernel_repo(tmp_path, "rmsnorm-local", KERNEL)
    before = logits(tiny_model)
    result = apply_kernels(tiny_model, {"RMSNorm": f"{repo}:RMSNorm"})
    assert result == {"kernelized": {"RMSNorm": 5}, "failed": {}}  # 2 layers x 2 norms + the final norm
    kernel_module = sys.modules["_rmsnorm_local_test.layers"]
    calls = kernel_module.calls
    after = logits(tiny_model)
    assert kernel_module.calls == calls + 5  # the kernel, not the stock layer, ran
    import torch

    assert torch.equal(before, after)


def test_a_hub_id_resolves_from_local_kernels_offline(tiny_model, tmp_path, monkeypatch):
    repo = kernel_repo(tmp_path, "rmsnorm-hub", KERNEL)
    monkeypatch.setenv("LOCAL_KERNELS", f"acme/other=/nowhere:acme/rmsnorm={repo}")
    assert local_kernel_repo("acme/rmsnorm") == repo
    assert check_kernels({"RMSNorm": "acme/rmsnorm:RMSNorm"}) == {"RMSNorm": "loads (acme/rmsnorm:RMSNorm)"}
    assert apply_kernels(tiny_model, {"RMSNorm": "acme/rmsnorm:RMSNorm"})["kernelized"] == {"RMSNorm": 5}


def test_a_kernel_that_fails_to_load_is_a_warning_and_the_stock_layer_stays(tiny_model, tmp_path, caplog):
    import torch

    broken = kernel_repo(tmp_path, "rmsnorm-broken", "raise ImportError('built for another torch')\n")
    before = logits(tiny_model)
    with caplog.at_level(logging.WARNING, logger="finetune_flows"):
        result = apply_kernels(tiny_model, {"RMSNorm": f"{broken}:RMSNorm", "SiLU": "acme/not-here:Silu"})
    assert result["kernelized"] == {}
    assert "built for another torch" in result["failed"]["RMSNorm"]
    assert "acme/not-here" in result["failed"]["SiLU"]
    assert "kernel for RMSNorm not used, the stock layer stays" in caplog.text and "rmsnorm-broken" in caplog.text
    assert torch.equal(before, logits(tiny_model))
    assert check_kernels({"RMSNorm": f"{broken}:RMSNorm"})["RMSNorm"].startswith("cannot load, stock layer kept")
