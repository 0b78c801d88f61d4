"""The `static` generation engine: prompts sorted by length into a few large left-padded batches, a static KV cache
per batch, the prompts read in chunks, and on CUDA the decode steps replayed from one captured CUDA graph (the
engines and why: finetune_flows/evaluation/generation.py). The answers' loss can be read from the same cache."""

from __future__ import annotations

import time

from finetune_flows.data.dataset import IGNORE_INDEX
from finetune_flows.evaluation.generation import EngineUnavailable, Generation, sync_device, until_stop

PREFILL_TOKENS = {False: 8192, True: 65536}  # prompt tokens per prefill chunk (CPU, CUDA)
ANSWER_LOGITS_BYTES = 2**30  # fp32 logits of the scored answers held at once


def length_sorted_batches(lengths: list[int], extra: int, batch_tokens: int, max_rows: int = 4096) -> list[list[int]]:
    """Prompt indices, longest first, cut into batches whose padded size rows * (longest + extra) fits
    `batch_tokens` (a batch holds at least one prompt)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < max_rows and \
                (len(batches[-1]) + 1) * (lengths[batches[-1][0]] + extra) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def plain_cache(model) -> bool:
    """Whether every layer's static cache holds the whole sequence (no sliding-window or chunked layers): only then
    are the prompts prefilled in chunks and their answers scored from the cache (`answers` of `generate_static`)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    return all(type(layer) is StaticLayer for layer in StaticCache(config=model.config, max_cache_len=1).layers)


CPU_GQA_ATTENTION = "finetune_flows_sdpa_gqa"


def _sdpa_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
              **kwargs):
    """sdpa that lets the kernel share each key/value head among its query heads. transformers' sdpa copies the
    KV heads out (`repeat_kv`) whenever there is a mask, for the sake of CUDA kernels; on the CPU that copy of
    the whole cache at every decode step costs as much as the attention itself."""
    import torch

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = query.shape[2] > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                                 else getattr(module, "is_causal", True))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling, is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register_attention(name: str, function) -> None:
    """Make `name` an attention implementation transformers can switch to, with sdpa's mask format."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


GROUPED_DECODE = "finetune_flows_grouped_decode"
GROUPED_MAX_QUERY = 16  # query positions per row up to which the grouped path is used (decode steps)


def _grouped_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs):
    """Attention of a few query positions (a decode step) over the whole KV cache, each key/value head shared by
    its query heads without copying it. transformers' sdpa copies every KV head out to its query heads
    (`repeat_kv`) whenever there is a mask, and a static cache always has one: at every decode step that writes
    and reads back a copy of the whole cache, several times the bytes the attention itself needs. Here the query
    heads of one KV head are folded into the query-length axis, so two plain batched matmuls read each cached key
    and value once. Softmax in fp32. Prefills (longer queries), soft-capping and position biases go to sdpa."""
    import torch

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, lq, dim = query.shape
    kv_heads = key.shape[1]
    if lq > GROUPED_MAX_QUERY or attention_mask is None or kwargs.get("softcap") is not None or \
            kwargs.get("position_bias") is not None or heads % kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    group, length = heads // kv_heads, key.shape[2]
    scale = scaling if scaling is not None else dim ** -0.5
    # query head h belongs to KV head h // group (repeat_kv's order): fold the group into the query axis
    scores = torch.matmul(query.reshape(b, kv_heads, group * lq, dim), key.transpose(-1, -2))
    scores = scores.view(b, kv_heads, group, lq, length).float() * scale
    mask = attention_mask[:, :, None, :, :length]  # (b or 1, 1, 1, lq, length)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(b, kv_heads, group * lq, length)
    out = torch.matmul(probs, value).view(b, heads, lq, dim)
    return out.transpose(1, 2).contiguous(), None


def last_position(tokens):
    """`logits_to_keep` for the last position. An int slices the hidden states into a non-contiguous view, which
    the CPU's bf16 matmul turns into a batched matmul over a copy of the (vocabulary-sized) lm_head weight per row;
    an index tensor gathers a contiguous row instead."""
    import torch

    return 1 if tokens.shape[1] == 1 else torch.tensor([tokens.shape[1] - 1], device=tokens.device)


class _DecodeGraph:
    """One decode step (input token -> next greedy token) captured as a CUDA graph and replayed.

    The static cache advances its own device-side length on every call, so a replay needs no host values: the
    new tokens and positions are copied into the captured input buffers, the graph is replayed, and the next
    tokens are read from its output buffer."""

    def __init__(self, step, tokens, positions, mask):
        import torch

        self.tokens, self.positions, self.mask = tokens.clone(), positions.clone(), mask
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = step(self.tokens, self.positions, self.mask)

    def __call__(self, tokens, positions):
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.out


def _static_batch(model, rows: list[list[int]], answers: list | None, max_new_tokens: int, stops: list[int],
                  pad_id: int, cuda_graphs: bool, decode_attn: str, prefill_tokens: int,
                  notes: list[str], phases: dict) -> tuple[list[list[int]], float, int]:
    """Greedy tokens for one left-padded batch, and the summed cross-entropy (and its token count) of the answers
    given for its rows (see `generate_static`). Adds the batch's prefill and decode seconds (device synchronised)
    and decode steps to `phases`."""
    import torch
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    device = model.device
    width = max(map(len, rows))
    n = len(rows)
    teacher = max((len(a[0]) - 1 for a in answers or [] if a), default=0)  # answer tokens fed back as inputs
    extra = max(max_new_tokens, teacher)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width + extra), dtype=torch.long)
    for r, row in enumerate(rows):  # left padding: every prompt ends at column width - 1
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):width] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    stop = torch.tensor(stops, device=device)
    cache = StaticCache(config=model.config, max_cache_len=width + extra)
    plain = all(type(layer) is StaticLayer for layer in cache.layers)

    def logits_at(tokens, pos, attn_mask, past=cache, keep=None):
        return model(input_ids=tokens, position_ids=pos, attention_mask=attn_mask, past_key_values=past,
                     use_cache=True, logits_to_keep=last_position(tokens) if keep is None else keep).logits

    def step(tokens, pos, attn_mask):
        return logits_at(tokens, pos, attn_mask)[:, -1].argmax(-1)

    prefill_attn = model.config._attn_implementation
    loss, count = 0.0, 0
    started = time.perf_counter()
    with torch.no_grad():
        if plain:
            last = _prefill_in_chunks(logits_at, cache, ids, positions, mask[:, :width],
                                      max(1, prefill_tokens // width))
        else:  # sliding-window layers and the like: prefill straight into the static cache
            last = logits_at(ids, positions, mask[:, :width + extra])[:, -1]
        token = last.argmax(-1)
        if answers and plain:
            loss, count = _answer_loss(logits_at, cache, last, answers, width, positions, mask, pad_id)
        del last
        sync_device(device)
        decoding = time.perf_counter()
        if decode_attn != prefill_attn:
            model.set_attn_implementation(decode_attn)
        try:
            out, steps = _decode(step, cache, token, positions[:, -1:] + 1, mask, width, max_new_tokens, stop,
                                 cuda_graphs, notes)
        finally:
            if decode_attn != prefill_attn:
                model.set_attn_implementation(prefill_attn)
        tokens = out.tolist()
    ended = time.perf_counter()
    phases["prefill_seconds"] += decoding - started
    phases["decode_seconds"] += ended - decoding
    phases["decode_steps"] += steps
    return tokens, loss, count


def _answer_loss(logits_at, cache, last, answers: list, width: int, positions, mask, pad_id: int) -> tuple[float, int]:
    """Cross-entropy of each row's given answer after its prompt, read from the prompt's cached keys and values
    instead of a second pass over the prompt: the prefill's last logits predict the answer's first token, and a
    forward pass over the answer (teacher forcing) the rest, a few rows at a time on a copy-on-write view of the
    cache (the static cache itself stays as the prompt left it)."""
    import torch
    from transformers import DynamicCache

    n, device = last.shape[0], last.device
    teacher = max((len(a[0]) - 1 for a in answers if a), default=0)
    first = torch.full((n,), IGNORE_INDEX, dtype=torch.long)
    inputs = torch.full((n, max(teacher, 1)), pad_id, dtype=torch.long)
    targets = torch.full((n, max(teacher, 1)), IGNORE_INDEX, dtype=torch.long)
    fed = torch.zeros((n, max(teacher, 1)), dtype=torch.long)  # which answer columns hold a real token
    for r, answer in enumerate(answers):
        if answer:
            tokens, labels = answer
            first[r] = labels[0]
            inputs[r, :len(tokens) - 1] = torch.tensor(tokens[:-1], dtype=torch.long)
            targets[r, :len(tokens) - 1] = torch.tensor(labels[1:], dtype=torch.long)
            fed[r, :len(tokens) - 1] = 1
    ce = torch.nn.functional.cross_entropy
    first = first.to(device)
    loss = float(ce(last.float(), first, ignore_index=IGNORE_INDEX, reduction="sum"))
    count = int((first != IGNORE_INDEX).sum())
    if teacher == 0:
        return loss, count
    inputs, targets, fed = inputs.to(device), targets.to(device), fed.to(device)
    pos = positions[:, -1:] + 1 + torch.arange(teacher, device=device)
    rows_per_chunk = max(1, ANSWER_LOGITS_BYTES // (teacher * last.shape[-1] * 4))
    for rows in torch.split(torch.arange(n, device=device), rows_per_chunk):
        view = DynamicCache(config=None)  # starts as views of the prompt's keys; the answer's are appended
        for i, layer in enumerate(cache.layers):
            view.update(layer.keys[rows, :, :width], layer.values[rows, :, :width], i)
        logits = logits_at(inputs[rows], pos[rows], torch.cat([mask[rows, :width], fed[rows]], 1), view, keep=0)
        loss += float(ce(logits.float().reshape(-1, logits.shape[-1]), targets[rows].reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="sum"))
    return loss, count + int((targets != IGNORE_INDEX).sum())


def _prefill_in_chunks(logits_at, cache, ids, positions, mask, rows_per_chunk: int):
    """Read the prompts a few rows at a time, each chunk attending to its own prompts only, and copy their keys
    and values into the static cache: the attention does not span the cache's empty decode columns, and on a CPU
    a chunk's activations stay in the processor caches (big batches pay off in decoding, not here). Each chunk is
    read at its own width: the prompts are left-padded to the batch's longest, so a chunk of shorter ones starts at
    the first column any of them uses, and the padding columns before it stay zero in the cache (masked out). Rows
    come longest first (`length_sorted_batches`), so a big batch prefills about its real tokens, not rows x its
    longest prompt. Returns the logits of every row's last position."""
    import torch
    from transformers import DynamicCache

    last = []
    for start in range(0, ids.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        used = mask[rows].bool().any(0)
        begin = int(used.nonzero()[0, 0]) if bool(used.any()) else 0
        chunk_cache = DynamicCache(config=None)
        last.append(logits_at(ids[rows, begin:], positions[rows, begin:], mask[rows, begin:], chunk_cache)[:, -1])
        for static_layer, layer in zip(cache.layers, chunk_cache.layers):
            if not static_layer.is_initialized:  # allocate for the whole batch, shaped like the chunk's keys
                static_layer.lazy_initialization(
                    layer.keys.new_empty((ids.shape[0], layer.keys.shape[1], 1, layer.keys.shape[-1])),
                    layer.values.new_empty((ids.shape[0], layer.values.shape[1], 1, layer.values.shape[-1])))
            static_layer.keys[rows, :, begin:ids.shape[1]] = layer.keys
            static_layer.values[rows, :, begin:ids.shape[1]] = layer.values
    for static_layer in cache.layers:
        static_layer.cumulative_length.fill_(ids.shape[1])
    return torch.cat(last)


def _decode(step, cache, token, pos, mask, width: int, max_new_tokens: int, stop, cuda_graphs: bool,
            notes: list[str]):
    """The greedy steps after the prefill's token, as a (rows x max_new_tokens) tensor padded with a stop token,
    and the number of decode steps run.

    On CUDA the second step is captured as a graph and the rest are replays. Without graphs, rows that reached a
    stop token leave the batch (and the KV cache), so a batch costs what its unfinished rows need."""
    import torch

    out = torch.full((token.shape[0], max_new_tokens), int(stop[0]), dtype=torch.long, device=token.device)
    out[:, 0] = token
    active = torch.arange(token.shape[0], device=token.device)
    done, graph, steps = torch.isin(token, stop), None, 0
    for t in range(1, max_new_tokens):
        if bool(done.all()):
            break
        steps += 1
        if graph is None and not cuda_graphs and bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            cache.reorder_cache(keep)
            token, pos, mask, active, done = token[keep], pos[keep], mask[keep], active[keep], done[keep]
        mask[:, width + t - 1] = 1  # the token fed now is the one generated last
        if graph is not None:
            token = graph(token[:, None], pos).clone()  # the graph's output buffer is reused
        elif cuda_graphs and t + 1 < max_new_tokens:
            side = torch.cuda.Stream(token.device)  # warm up off the capture stream, as CUDA graphs require
            side.wait_stream(torch.cuda.current_stream(token.device))
            with torch.cuda.stream(side):
                token = step(token[:, None], pos, mask)
            torch.cuda.current_stream(token.device).wait_stream(side)
            try:
                graph = _DecodeGraph(step, token[:, None], pos + 1, mask)
            except Exception as exc:  # something in the step cannot be captured: stay eager, say so
                cuda_graphs = False
                notes.append(f"CUDA graph capture failed, decoding eagerly: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200]}")
        else:
            token = step(token[:, None], pos, mask)
        out[active, t] = token
        pos = pos + 1
        done |= torch.isin(token, stop)
    return out, steps


def generate_static(model, prompt_ids: list[list[int]], max_new_tokens: int, stops: list[int], pad_id: int,
                    batch_tokens: int, cuda_graphs: bool | None = None,
                    answers: list[tuple[list[int], list[int]] | None] | None = None,
                    grouped_decode: bool | None = None) -> Generation:
    """Greedy answers of every prompt by length-sorted static batches (see the module doc).

    `answers` may give, per prompt, a reference continuation (token ids and their labels, -100 where not
    scored): its cross-entropy is then computed from the prompt's cached keys and values (`details["loss"]` =
    [summed loss, scored tokens]), so an evaluation's loss pass need not read those prompts again.
    `grouped_decode` runs the decode steps on `_grouped_attention` (each KV head read once, not copied out to its
    query heads; default on CUDA, where it makes the decode steps faster (`make bench-eval`), and not on the CPU, where
    `_sdpa_gqa` already shares the heads); `details` gives the prefill and decode seconds and the decode steps."""
    import torch

    device = model.device
    if cuda_graphs and device.type != "cuda":
        raise EngineUnavailable("CUDA graphs need a CUDA device; this model is on " + str(device))
    if answers and any(answers) and not plain_cache(model):  # their loss would be silently left out
        raise ValueError("answers are scored from the prompt cache only where plain_cache(model) holds")
    configured_attn = prefill_attn = model.config._attn_implementation
    if device.type == "cpu" and prefill_attn == "sdpa":
        _register_attention(CPU_GQA_ATTENTION, _sdpa_gqa)
        prefill_attn = CPU_GQA_ATTENTION
        model.set_attn_implementation(prefill_attn)
    # Flash kernels unpad a padded batch using host-side sizes, which a CUDA graph cannot capture: with them the
    # prompt is read by the flash kernel and the decode steps (one token per row) run graphed on sdpa.
    cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
    decode_attn = "sdpa" if cuda_graphs and prefill_attn not in ("sdpa", "eager") else prefill_attn
    if device.type == "cuda" if grouped_decode is None else grouped_decode:
        _register_attention(GROUPED_DECODE, _grouped_attention)
        decode_attn = GROUPED_DECODE
    prefill_tokens = min(batch_tokens, PREFILL_TOKENS[device.type == "cuda"])
    batches = length_sorted_batches([len(p) for p in prompt_ids], max_new_tokens, batch_tokens)
    stop_set = set(stops)
    outputs: list[list[int] | None] = [None] * len(prompt_ids)
    failures: list[str] = []
    notes: list[str] = []
    phases = {"prefill_seconds": 0.0, "decode_seconds": 0.0, "decode_steps": 0}
    loss, count = 0.0, 0
    first = None
    started = time.perf_counter()
    pending = list(batches)
    try:
        while pending:
            batch = pending.pop(0)
            try:
                rows, batch_loss, batch_count = _static_batch(
                    model, [prompt_ids[i] for i in batch], [answers[i] for i in batch] if answers else None,
                    max_new_tokens, stops, pad_id, cuda_graphs, decode_attn, prefill_tokens, notes, phases)
            except torch.OutOfMemoryError as exc:  # halve the batch; one prompt that does not fit fails visibly
                torch.cuda.empty_cache() if device.type == "cuda" else None
                if len(batch) > 1:
                    pending[:0] = [batch[: len(batch) // 2], batch[len(batch) // 2:]]
                else:
                    failures.append(f"prompt {batch[0]}: out of memory ({str(exc)[:160]})")
                continue
            for i, row in zip(batch, rows):
                outputs[i] = until_stop(row, stop_set)
            loss, count = loss + batch_loss, count + batch_count
            first = first or time.perf_counter() - started
    finally:
        if prefill_attn != configured_attn:
            model.set_attn_implementation(configured_attn)
    sync_device(device)
    return Generation([o if o is not None else [] for o in outputs], time.perf_counter() - started, first or 0.0,
                      failures, details={"batches": len(batches), "batch_tokens": batch_tokens,
                                         "cuda_graphs": cuda_graphs, "prefill_attention": prefill_attn,
                                         "decode_attention": decode_attn, "notes": sorted(set(notes)),
                                         "loss": [loss, count],
                                         **{k: round(v, 3) for k, v in phases.items()}})
