"""Diagnostic (run from an uncommitted copy in the call; here with its import path adjusted): what stays allocated on the GPU after dequantize_model (4-bit base from the bench's cache)."""
import gc
import json
import sys
from pathlib import Path

import torch
import bitsandbytes as bnb
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tasks.dequantize import dequantize_model  # noqa: E402

G = 2**30
for cfgp in sorted(Path(sys.argv[1]).glob("**/quantized/*/config.json")):
    path = cfgp.parent
    hidden = json.loads(cfgp.read_text())["hidden_size"]
    torch.cuda.empty_cache()
    a0 = torch.cuda.memory_allocated()
    model = AutoModelForCausalLM.from_pretrained(path, device_map={"": 0}, dtype=torch.bfloat16, attn_implementation="sdpa")
    a1 = torch.cuda.memory_allocated()
    four = [(m.weight.data.untyped_storage().data_ptr(), m.weight.data.untyped_storage().nbytes())
            for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    n = dequantize_model(model)
    gc.collect()
    a2 = torch.cuda.memory_allocated()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    alive, alive_bytes, big = 0, 0, {}
    starts = {s for s, _ in four}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                s = o.untyped_storage()
                if s.data_ptr() in starts:
                    alive += 1; alive_bytes += s.nbytes()
                key = (str(o.dtype), type(o).__name__)
                big[key] = big.get(key, 0) + o.numel() * o.element_size()
        except Exception:
            pass
    print(f"hidden {hidden}: loaded 4-bit {(a1 - a0) / G:.3f} GiB ({len(four)} Linear4bit, {sum(b for _, b in four) / G:.3f} GiB "
          f"of 4-bit storage); after dequantize of {n} + gc {(a2 - a0) / G:.3f} GiB allocated; parameters {params / G:.3f} GiB; "
          f"4-bit storages still alive {alive} ({alive_bytes / G:.3f} GiB); live CUDA tensors by dtype: "
          + ", ".join(f"{k}: {v / G:.3f}" for k, v in sorted(big.items(), key=lambda x: -x[1])[:6]), flush=True)
    del model
    gc.collect()
