"""prepare-dataset's engine: the checked rows (finetune_flows/data/rows.py) tokenized, split and saved as a store entry.

Rows are instruction/response pairs, chat `messages`, or plain text. The tokenizer's chat template is applied where
it has one; prompt tokens get label -100 so only the answer is learned; BOS and EOS are added as the tokenizer
defines them, templated or not. Held-out rows whose prompt also appears in training (exactly, or after folding
case and whitespace, and digits where `data.held_out_fold_digits` says so) are removed, and the count is reported.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from finetune_flows.files import write_atomic
from finetune_flows.config.schema import DataConfig, FinetuneConfig
from finetune_flows.data.rows import normalize, read_rows, row_names
from finetune_flows.errors import DataError
from finetune_flows.store.fingerprint import combine, hash_bytes_of, hash_tree, step_versions
from finetune_flows.logs import run_logger
from finetune_flows.store.entries import MANIFEST, Entry, reuse_or_produce, step_state

IGNORE_INDEX = -100
FALLBACK_PROMPT = "### Instruction:\n{prompt}\n\n### Response:\n"


FEW_ROWS = 10  # fewer training rows than this: said, not refused (a smoke test may want exactly that)
PREFLIGHT_ROWS = 10_000  # rows of each source tokenized by the checks before a run (about 3 s on a CPU core)
OUTPUTS = ("train.parquet", "eval.parquet", "eval_prompts.jsonl", "stats.json")


class PreparedDataset(BaseModel):
    path: Path  # holds train.parquet, eval.parquet (input_ids, labels), eval_prompts.jsonl, stats.json
    fingerprint: str
    format: str
    train_rows: int
    eval_rows: int
    train_tokens: int
    truncated: int
    dropped: int
    eval_removed_exact: int = 0  # held-out rows dropped because training has the same prompt
    eval_removed_normalized: int = 0  # ... the same prompt once `folded` is folded
    folded: str = "case and whitespace"  # what the second count folded (fold_description)

    def removed_note(self) -> str:
        """How many held-out rows were removed, and why: for the log, the eval artifacts and the run summary."""
        return (f"{self.eval_removed_exact + self.eval_removed_normalized} held-out row(s) removed as copies of "
                f"training prompts ({self.eval_removed_exact} exact, {self.eval_removed_normalized} after folding "
                f"{self.folded})")


# ---------------------------------------------------------------- tokenizing


def bos_text(tokenizer) -> str:
    """The BOS token the tokenizer puts before a sequence by default, as text ('' if it adds none).

    Texts are tokenized with add_special_tokens=False (the chat template decides where special tokens go), so
    a tokenizer that expects a BOS gets it here, in every layout, unless the template already wrote it.
    """
    if not tokenizer.bos_token or tokenizer.bos_token_id is None:
        return ""
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return tokenizer.bos_token if ids and ids[0] == tokenizer.bos_token_id else ""


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    bos = bos_text(tokenizer)
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return text if text.startswith(bos) else bos + text
    # No template: a plain instruction layout, ending the answer with EOS.
    text = bos
    for m in messages:
        if m["role"] == "assistant":
            text += m["content"] + (tokenizer.eos_token or "")
        else:
            text += FALLBACK_PROMPT.format(prompt=m["content"]) if m["role"] == "user" else m["content"] + "\n\n"
    return text  # a user turn already ends with the response header, so no generation prompt is needed


def assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant answers (what the loss sees)."""
    full = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True) if i else bos_text(tokenizer)
        through = render(tokenizer, messages[: i + 1])
        if not full.startswith(through) or not through.startswith(before):
            raise DataError("the model's chat template renders this conversation's earlier turns differently once "
                            "later turns follow (it rewrites or drops them), so the answers' tokens cannot be told "
                            "from the prompt's; train on the conversations as whole texts (a `text` column, "
                            "data.format=text) or use a model whose template keeps earlier turns as they were")
        spans.append((len(before), len(through)))
    return full, spans


def tokenize_example(tokenizer, example: list[dict[str, str]] | str, max_length: int) -> tuple[dict, bool]:
    """input_ids and labels (prompt positions = -100), truncated to max_length. Returns (encoded, truncated)."""
    if isinstance(example, str):
        bos = bos_text(tokenizer)
        text = bos + example + (tokenizer.eos_token or "")
        spans = [(len(bos), len(text))]
    else:
        text, spans = assistant_spans(tokenizer, example)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, labels = enc["input_ids"], []
    for tok_id, (start, end) in zip(ids, enc["offset_mapping"]):
        inside = any(s <= start < e for s, e in spans) or (end > start and any(s < end <= e for s, e in spans))
        labels.append(tok_id if inside else IGNORE_INDEX)
    truncated = len(ids) > max_length
    return {"input_ids": ids[:max_length], "labels": labels[:max_length]}, truncated


def encode_row(tokenizer, example: list[dict[str, str]] | str, max_length: int, where: str) -> tuple[dict, bool]:
    """`tokenize_example`, with a failure named by its row (`where`: the file and line) as a DataError: a chat
    template that refuses the row (`raise_exception`), one that cannot be masked."""
    try:
        return tokenize_example(tokenizer, example, max_length)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None
    except Exception as exc:  # the template's own error: a role it does not take, turns that do not alternate
        raise DataError(f"{where}: the model's chat template refuses this row ({type(exc).__name__}: {exc})") \
            from None


def check_rows_tokenize(tokenizer, examples: list, names: list[str], source: str, d: DataConfig,
                        limit: int = PREFLIGHT_ROWS) -> dict[int, int] | None:
    """The checks before a run: the first `limit` rows of a source tokenize, each failure named by its row. Returns
    the ids (`id()`) of the rows that keep answer tokens within data.max_length, each with its tokens as trained
    (truncated to data.max_length), where that was every row (None where the source has more), for
    `check_split_fits`."""
    fits = {}
    for example, name in zip(examples[:limit], names[:limit]):
        enc, _ = encode_row(tokenizer, example, d.max_length, f"{source} {name}")
        if any(label != IGNORE_INDEX for label in enc["labels"]):
            fits[id(example)] = len(enc["input_ids"])
    return fits if len(examples) <= limit else None


def check_split_fits(d: DataConfig, train: list, evaluation: list, fits: Collection[int]) -> None:
    """Both splits keep at least one row within data.max_length (`fits`: the ids of the rows that do)."""
    if not any(id(ex) in fits for ex in train):
        raise DataError(f"{d.source}: no training example keeps any answer tokens within data.max_length="
                        f"{d.max_length}; raise data.max_length or shorten the prompts")
    if not any(id(ex) in fits for ex in evaluation):
        raise DataError(f"{d.eval_source or d.source}: no evaluation example fits in data.max_length={d.max_length}; "
                        "raise data.max_length or shorten the prompts")


def prompt_and_reference(tokenizer, example: list[dict[str, str]] | str) -> dict[str, str] | None:
    """For generation metrics: everything up to the last answer, and that answer."""
    if isinstance(example, str):
        return None
    last = max(i for i, m in enumerate(example) if m["role"] == "assistant")
    return {"prompt": render(tokenizer, example[:last], add_generation_prompt=True),
            "reference": example[last]["content"]}


# ---------------------------------------------------------------- held out means held out


def prompt_text(example: list[dict[str, str]] | str) -> str:
    """What the model is asked: every turn before the last answer (a text example is all prompt)."""
    if isinstance(example, str):
        return example
    last = max(i for i, m in enumerate(example) if m["role"] == "assistant")
    return "\n".join(f"{m['role']}: {m['content']}" for m in example[:last])


def fold(text: str, digits: bool = False) -> str:
    """Case and whitespace folded (`Order 12  late` is `order 12 late`); with `digits`, runs of digits too (then
    `order 9 late` is the same prompt)."""
    text = text.casefold()
    return re.sub(r"\s+", " ", re.sub(r"\d+", "0", text) if digits else text).strip()


def fold_description(digits: bool) -> str:
    return "case, digits and whitespace" if digits else "case and whitespace"


def held_out(train: list, evaluation: list, digits: bool = False) -> tuple[list, int, int]:
    """Eval examples whose prompt is not in training; (kept, removed exactly, removed after folding)."""
    exact = {prompt_text(ex) for ex in train}
    folded = {fold(p, digits) for p in exact}
    kept, removed_exact, removed_folded = [], 0, 0
    for ex in evaluation:
        p = prompt_text(ex)
        if p in exact:
            removed_exact += 1
        elif fold(p, digits) in folded:
            removed_folded += 1
        else:
            kept.append(ex)
    return kept, removed_exact, removed_folded


# ---------------------------------------------------------------- the step


def split(d: DataConfig, examples: list, eval_examples: list | None) -> tuple[list, list, int, int]:
    """(train, held out, removed exactly, removed after folding): the rows shuffled with data.seed and capped at
    data.max_samples, eval_fraction split off (or the eval_source rows taken), copies of training prompts removed.
    The checks before the run call it too, so a split that leaves nothing stops the run before a server starts."""
    examples = list(examples)
    random.Random(d.seed).shuffle(examples)
    if d.max_samples:
        examples = examples[: d.max_samples]
    if eval_examples is None:
        n_eval = max(1, round(len(examples) * d.eval_fraction))
        if len(examples) - n_eval < 1:
            capped = f", data.max_samples={d.max_samples}" if d.max_samples else ""
            raise DataError(f"{d.source}: {len(examples)} row(s) is too few to hold {n_eval} out for evaluation "
                            f"and train on the rest (data.eval_fraction={d.eval_fraction}{capped}); add rows, lower "
                            "data.eval_fraction or set data.eval_source")
        train_examples, eval_examples = examples[n_eval:], examples[:n_eval]
    else:
        train_examples = examples
    kept, removed_exact, removed_folded = held_out(train_examples, eval_examples, d.held_out_fold_digits)
    if not kept:
        fix = ("hold out rows whose prompts differ from the training ones" if d.eval_source
               else "use a separate data.eval_source")
        raise DataError(f"{d.eval_source or d.source}: every held-out example's prompt also appears in training "
                        f"(exactly or after folding {fold_description(d.held_out_fold_digits)}, "
                        f"data.held_out_fold_digits={str(d.held_out_fold_digits).lower()}): nothing is left to "
                        f"evaluate honestly; {fix}")
    return train_examples, kept, removed_exact, removed_folded


def data_key_parts(cfg: FinetuneConfig, tokenizer_dir: Path) -> dict[str, Any]:
    """Everything the prepared dataset depends on (the README's cache-key table lists the same)."""
    d = cfg.data
    content = []
    for source in filter(None, (d.source, d.eval_source)):
        p = Path(source).expanduser()
        if p.is_file():
            content.append(hash_bytes_of([p]))
        else:  # builtin: the generator's code is in the key; hub: the pinned revision
            content.append(f"{source}@{d.hub_revision}" if source.startswith("hub:") else source)
    # the tokenizer's files, not the store's manifest of them (it holds the time the entry was written)
    tokenizer = hash_tree(tokenizer_dir, (".json", ".jinja", ".model", ".txt"), exclude=(MANIFEST,))
    return {"data": content, "tokenizer": tokenizer,
            "settings": d.model_dump(mode="json"), **step_versions("prepare-dataset")}


def data_fingerprint(cfg: FinetuneConfig, tokenizer_dir: Path) -> str:
    return combine(data_key_parts(cfg, tokenizer_dir))


def build_dataset(cfg: FinetuneConfig, tokenizer_dir: Path, out: Path) -> PreparedDataset:
    """Read, split, deduplicate and tokenize into `out` (an entry directory the caller holds the lock of)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    d = cfg.data
    rows = read_rows(d.source, d)
    fmt, examples = normalize(rows, d, d.source)
    where = {id(ex): f"{d.source} {name}" for ex, name in zip(examples, row_names(rows))}  # for errors only
    eval_examples = None
    if d.eval_source:
        rows = read_rows(d.eval_source, d)
        eval_fmt, eval_examples = normalize(rows, d, d.eval_source)
        if eval_fmt != fmt:
            raise DataError(f"{d.eval_source} is {eval_fmt} format but {d.source} is {fmt}")
        where |= {id(ex): f"{d.eval_source} {name}" for ex, name in zip(eval_examples, row_names(rows))}
    train_examples, eval_examples, removed_exact, removed_folded = split(d, examples, eval_examples)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=cfg.model.trust_remote_code)
    stats = {"truncated": 0, "dropped": 0, "train_tokens": 0}

    def encode(batch: list) -> tuple[dict[str, list], list]:
        cols: dict[str, list] = {"input_ids": [], "labels": []}
        kept = []
        for ex in batch:
            enc, truncated = encode_row(tokenizer, ex, d.max_length, where.get(id(ex), d.source))
            stats["truncated"] += truncated
            if all(label == IGNORE_INDEX for label in enc["labels"]):
                stats["dropped"] += 1  # the answer was cut off entirely: nothing to learn
                continue
            cols["input_ids"].append(enc["input_ids"])
            cols["labels"].append(enc["labels"])
            kept.append(ex)
        return cols, kept

    train, train_kept = encode(train_examples)
    stats["train_tokens"] = sum(map(len, train["input_ids"]))
    evaluation, eval_examples = encode(eval_examples)  # prompts are generated from the rows that fit only
    check_split_fits(d, train_kept, eval_examples, {id(ex) for ex in train_kept + eval_examples})
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(train), out / "train.parquet")
    pq.write_table(pa.table(evaluation), out / "eval.parquet")
    with open(out / "eval_prompts.jsonl", "w") as f:
        for ex in eval_examples:
            pr = prompt_and_reference(tokenizer, ex)
            if pr:
                f.write(json.dumps(pr) + "\n")
    result = PreparedDataset(path=out, fingerprint=data_fingerprint(cfg, tokenizer_dir), format=fmt,
                             train_rows=len(train["input_ids"]), eval_rows=len(evaluation["input_ids"]),
                             train_tokens=stats["train_tokens"], truncated=stats["truncated"],
                             dropped=stats["dropped"], eval_removed_exact=removed_exact,
                             eval_removed_normalized=removed_folded,
                             folded=fold_description(d.held_out_fold_digits))
    write_atomic(out / "stats.json", result.model_dump_json(indent=2))
    return result


def prepare_dataset(cfg: FinetuneConfig, tokenizer_dir: Path):
    """Reuse the verified dataset entry, or build it under the entry's lock."""
    entry = Entry(cfg.cache_root, "datasets", data_fingerprint(cfg, tokenizer_dir))
    result, reused = reuse_or_produce(entry, PreparedDataset, lambda: build_dataset(cfg, tokenizer_dir, entry.path),
                                      OUTPUTS)
    run_logger().info("dataset: %s format, %d train / %d eval rows (%s), %d train tokens, %d truncated, "
                      "%d dropped -> %s", result.format, result.train_rows, result.eval_rows, result.removed_note(),
                      result.train_tokens, result.truncated, result.dropped, result.path)
    if result.train_rows < FEW_ROWS:
        run_logger().warning("only %d training rows (and %d held out): an adapter fit to so few learns them by heart "
                             "and its evaluation says little; fine for a smoke test", result.train_rows,
                             result.eval_rows)
    return step_state(result, reused, entry)


def load_split(path: Path, split: str) -> list[dict[str, list[int]]]:
    """A tokenized split as rows of {input_ids, labels}: what the Trainer and the evaluator read."""
    import pyarrow.parquet as pq

    return pq.read_table(path / f"{split}.parquet").to_pylist()
