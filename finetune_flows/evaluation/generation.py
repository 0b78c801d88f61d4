"""Greedy generation for evaluation, by one of three engines (`eval.engine`):

- `generate`: the reference. `model.generate()` over padded batches of `eval.batch_size` prompts in input order,
  on the 4-bit model: the baseline to compare against, and for what the others cannot do.
- `static`: all prompts sorted by length and cut into a few large left-padded batches (`eval.batch_tokens`
  tokens each, so little padding), a static KV cache per batch, the prompt read in one forward pass, and on CUDA
  every decode step after the first replayed from one captured CUDA graph. A decode step of a small model is
  hundreds of kernel launches and little arithmetic, so replaying it as one graph over hundreds of sequences is
  what makes generation fast. Flash kernels unpad with host-side sizes and cannot be captured: with a flash
  backend the prompt is read by it and the one-token decode steps run graphed on sdpa.
- `continuous`: transformers' continuous batching (`generate_batch`: paged KV cache sized here, requests joining
  and leaving the running batch). It is built for flash attention (varlen kernels, paged decode, CUDA graphs);
  with sdpa/eager its attention mask spans the whole running batch, so its cost grows with the batch squared.
- `auto`: `static`, the fastest in `make bench-eval`, which compares the engines on a machine. It lives in
  static_engine.py; the others here.

`static` and `continuous` run on the evaluation copy of the base (models/dequantize.py) with the LoRA adapter
unmerged, so base and base + adapter are one model with the adapter switched off and on. Every engine stops at
the model's EOS/stop tokens and the chat template's end of turn, and returns, per prompt, the generated token ids
up to (not including) the first stop token; a prompt the engine failed on is reported, never silently dropped.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from finetune_flows.errors import UserInputError

ENGINES = ("auto", "static", "continuous", "generate")
CONTINUOUS_ATTENTION = ("sdpa", "eager", "paged|eager")  # plus every flash-attention flavour
NON_FLASH_BATCH_TOKENS, NON_FLASH_REQUESTS = 4096, 64  # continuous batching without flash attention


class EngineUnavailable(UserInputError):
    """The configured engine cannot run with this machine, model placement or attention backend."""


@dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per prompt, in prompt order, without the stop token
    seconds: float  # wall time of the whole generation, device work finished
    first_result_seconds: float  # until the first prompt's answer was complete
    failures: list[str] = field(default_factory=list)  # "prompt 17: <error>" for each prompt that failed
    details: dict = field(default_factory=dict)  # engine settings actually used (batches, graphs, KV pool)


def continuous_supports(attn: str) -> bool:
    return attn in CONTINUOUS_ATTENTION or "flash" in attn


def choose_engine(requested: str, attn: str, devices: int = 1) -> str:
    """The engine to run, or EngineUnavailable naming why the requested one cannot run here."""
    if requested not in ENGINES:
        raise EngineUnavailable(f"eval.engine={requested}: unknown engine; use one of {', '.join(ENGINES)}")
    if requested == "continuous":
        if not continuous_supports(attn):
            raise EngineUnavailable(f"eval.engine=continuous cannot use attention backend {attn}: continuous "
                                    "batching supports sdpa, eager and flash attention; use eval.engine=static")
        if devices > 1:
            raise EngineUnavailable(f"eval.engine=continuous runs on one device, but this model is spread over "
                                    f"{devices} GPUs; use eval.engine=static (or auto)")
    return "static" if requested == "auto" else requested


def turn_end_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant answer (`<|im_end|>`, `<|eot_id|>`),
    or None. Training ends every answer with it (data/dataset.py), and it need not be EOS: a Qwen2.5 base model's
    EOS is `<|endoftext|>` while its template ends turns with `<|im_end|>`."""
    if not getattr(tokenizer, "chat_template", None):
        return None  # the plain layout ends answers with EOS
    marker = "FINETUNE-FLOWS-ANSWER"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant",
                                              "content": marker}], tokenize=False)
    except Exception:  # a template that needs other turns: EOS and the generation config's stops only
        return None
    if marker not in text:
        return None
    ids = tokenizer(text[text.rindex(marker) + len(marker):].lstrip(), add_special_tokens=False)["input_ids"]
    added = getattr(tokenizer, "added_tokens_decoder", {})  # special added tokens (all_special_ids misses some)
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
    return ids[0] if ids and ids[0] in special else None


def stop_token_ids(model, tokenizer) -> list[int]:
    """The model's EOS/stop tokens (its generation config may list several), the tokenizer's EOS and the chat
    template's end of turn (`turn_end_id`)."""
    found = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = list(found) if isinstance(found, (list, tuple)) else [found]
    ids += [tokenizer.eos_token_id, turn_end_id(tokenizer)]
    return sorted({int(i) for i in ids if i is not None})


def until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    """The tokens before the first stop token."""
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i]
    return tokens


def sync_device(device) -> None:
    """Wait for the device's queued work, so a wall time includes it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- generate: the reference


def generate_reference(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int,
                       **generate_kwargs) -> Generation:
    """The reference: `model.generate()` on padded batches of `batch_size` prompts, in input order; `generate_kwargs`
    go to every generate() call (e.g. transformers' static cache) and into the details."""
    import torch

    device = model.device
    stops = set(stop_token_ids(model, tokenizer))
    tokenizer.padding_side = "left"  # generation continues from the right edge
    outputs: list[list[int]] = []
    first = None
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=sorted(stops), **generate_kwargs)
        outputs += [until_stop(row, stops) for row in out[:, batch["input_ids"].shape[1]:].tolist()]
        first = first or time.perf_counter() - started
    sync_device(device)
    return Generation(outputs, time.perf_counter() - started, first or 0.0,
                      details={"batch_size": batch_size, **generate_kwargs})


# ---------------------------------------------------------------- continuous: transformers' continuous batching


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    from finetune_flows.models.shapes import config_shape

    shape = config_shape(config)
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * dtype_bytes


def generate_continuous(model, prompt_ids: list[list[int]], max_new_tokens: int, stops: list[int], pad_id: int,
                        batch_tokens: int, memory_bytes: int, cuda_graphs: bool | None = None,
                        page_size: int = 256) -> Generation:
    """Greedy answers by `generate_batch`, with the paged KV pool sized for every prompt at once (capped by
    `memory_bytes`) and each result's `error` checked."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    device = model.device
    if "flash" not in model.config._attn_implementation:
        # sdpa/eager see the running batch as one sequence under a (queries x cached tokens) mask, so the cost of
        # a step grows with the square of the batch: keep it modest.
        batch_tokens, max_requests = min(batch_tokens, NON_FLASH_BATCH_TOKENS), NON_FLASH_REQUESTS
    else:
        max_requests = batch_tokens
    pages = sum(math.ceil((len(p) + max_new_tokens) / page_size) for p in prompt_ids)
    per_page = kv_bytes_per_token(model.config, torch.finfo(model.dtype).bits // 8) * page_size
    num_blocks = max(4, min(pages + 2, memory_bytes // per_page))
    cb = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks, max_batch_tokens=batch_tokens,
        max_requests_per_batch=min(len(prompt_ids), max_requests), use_cuda_graph=cuda_graphs,
        auto_switch_to_flash=False,  # never reach for a Hub kernel behind our back (offline hosts)
        allow_block_sharing=False,  # prompts share a system prompt, but prefix reuse changes nothing greedy
    )
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stops,
                              pad_token_id=pad_id)
    started = time.perf_counter()
    with torch.no_grad():
        results = model.generate_batch(prompt_ids, generation_config=config, continuous_batching_config=cb)
    sync_device(device)
    seconds = time.perf_counter() - started
    ordered = list(results.values())
    outputs, failures, finished = [], [], []
    stop_set = set(stops)
    for i in range(len(prompt_ids)):
        result = results.get(f"req_{i}")
        if result is None or result.error is not None:
            failures.append(f"prompt {i}: " + (result.error if result is not None else "no result returned"))
            outputs.append([])
            continue
        outputs.append(until_stop(list(result.generated_tokens), stop_set))
        finished.append(result.lifespan[1])
    if len(ordered) != len(prompt_ids) and not failures:
        failures.append(f"{len(prompt_ids)} prompts but {len(ordered)} results")
    first = (min(finished) - started) if finished else seconds
    return Generation(outputs, seconds, max(first, 0.0), failures,
                      details={"num_blocks": num_blocks, "page_size": page_size, "batch_tokens": batch_tokens,
                               "max_requests": max_requests, "cuda_graphs": cuda_graphs})
