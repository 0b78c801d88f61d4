"""Step 3: read, validate, format and tokenize the data; split it; save it to disk.

Rows may be instruction/response pairs, chat `messages`, or plain text. The tokenizer's chat template is
applied where it has one; prompt tokens get label -100 so only the answer is learned. The result is cached on a
fingerprint of the data content, the tokenizer files and the data settings.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

from prefect import task
from pydantic import BaseModel

from tasks.config import DataConfig, FinetuneConfig
from tasks.demo_data import BUILTIN_DATASETS
from tasks.errors import DataError, retry_unless_user_error
from tasks.fingerprint import code_version, combine, hash_bytes_of, hash_tree
from tasks.runs import atomic_dir

IGNORE_INDEX = -100
ROLES = {"system", "user", "assistant"}
FALLBACK_PROMPT = "### Instruction:\n{prompt}\n\n### Response:\n"
MAX_ROW_ERRORS = 5


class PreparedDataset(BaseModel):
    path: Path  # holds train.parquet, eval.parquet (input_ids, labels), eval_prompts.jsonl, stats.json, DONE
    fingerprint: str
    format: str
    train_rows: int
    eval_rows: int
    train_tokens: int
    truncated: int
    dropped: int

    def is_complete(self) -> bool:
        return (self.path / "DONE").is_file()


# ---------------------------------------------------------------- reading


def read_rows(source: str, cfg: DataConfig) -> list[dict[str, Any]]:
    """Rows as dicts, with errors naming the file and row."""
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name not in BUILTIN_DATASETS:
            raise DataError(f"data.source={source}: unknown built-in dataset; known: {sorted(BUILTIN_DATASETS)}")
        return BUILTIN_DATASETS[name](cfg.builtin_examples, seed=cfg.seed)
    if source.startswith("hub:"):
        import datasets

        try:
            return list(datasets.load_dataset(source[4:], split=cfg.hub_split))
        except Exception as exc:
            raise DataError(f"data.source={source}: could not load from the Hub: {exc}") from None
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    if not path.is_file():
        raise DataError(f"data source {path} is not a file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            return _read_jsonl(path)
        if suffix == ".json":
            return _read_json(path)
        if suffix == ".csv":
            return _read_csv(path)
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc})") from None
    except DataError:
        raise
    except Exception as exc:  # e.g. a corrupt parquet file
        raise DataError(f"{path}: cannot be parsed as {suffix[1:]} ({exc})") from None
    raise DataError(f"{path}: unsupported file type {suffix or '(none)'}; use .jsonl, .json, .csv or .parquet")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
            row["__row__"] = f"line {lineno}"
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of objects (or {{\"data\": [...]}})")
    for i, row in enumerate(data, 1):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {i}: expected an object, got {type(row).__name__}")
        row["__row__"] = f"row {i}"
    return data


def _read_csv(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            where = f"line {reader.line_num}"
            if None in row:
                raise DataError(f"{path} {where}: more fields than the header has columns")
            row["__row__"] = where
            rows.append(row)
    return rows


# ---------------------------------------------------------------- validating


def detect_format(rows: list[dict[str, Any]], cfg: DataConfig, where: str) -> str:
    if cfg.format != "auto":
        return cfg.format
    keys = set(rows[0])
    c = cfg.columns
    if c.messages in keys:
        return "chat"
    if c.prompt in keys and c.response in keys:
        return "instruction"
    if c.text in keys:
        return "text"
    found = ", ".join(sorted(k for k in keys if k != "__row__"))
    raise DataError(
        f"{where}: cannot tell the format from the columns ({found}); expected `{c.messages}` (chat), "
        f"`{c.prompt}` + `{c.response}` (instruction) or `{c.text}` (text). Set data.format and data.columns."
    )


def to_messages(row: dict[str, Any], fmt: str, cfg: DataConfig) -> list[dict[str, str]] | str:
    """Normalize one row to chat messages (or plain text); raise ValueError describing what is wrong."""
    c = cfg.columns
    if fmt == "text":
        text = row.get(c.text)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"`{c.text}` must be non-empty text")
        return text
    if fmt == "instruction":
        msgs = []
        if c.system and c.system in row:
            system = row.get(c.system)
            if system is not None and not isinstance(system, str):
                raise ValueError(f"`{c.system}` must be text")
            if system:
                msgs.append({"role": "system", "content": system})
        for key, role in ((c.prompt, "user"), (c.response, "assistant")):
            value = row.get(key)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"`{key}` must be non-empty text (got {value!r})")
            msgs.append({"role": role, "content": value})
        return msgs
    messages = row.get(c.messages)
    if isinstance(messages, str):  # CSV cells hold JSON text
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            raise ValueError(f"`{c.messages}` is text that is not a JSON list") from None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"`{c.messages}` must be a non-empty list of {{role, content}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"`{c.messages}`[{i}] must be {{role: system|user|assistant, content: text}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"`{c.messages}` has no assistant message to learn from")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def normalize(rows: list[dict[str, Any]], cfg: DataConfig, where: str) -> tuple[str, list]:
    """Check every row; one DataError lists the first few bad rows, the column names, and the fix."""
    if not rows:
        raise DataError(f"{where}: the dataset is empty (no rows)")
    fmt = detect_format(rows, cfg, where)
    required = {"chat": [cfg.columns.messages], "instruction": [cfg.columns.prompt, cfg.columns.response],
                "text": [cfg.columns.text]}[fmt]
    missing = [k for k in required if k not in rows[0]]
    if missing:
        found = ", ".join(sorted(k for k in rows[0] if k != "__row__"))
        raise DataError(f"{where}: {fmt} format needs column(s) {', '.join(missing)}, found: {found}. "
                        f"Map yours with data.columns.*")
    out, errors = [], []
    for i, row in enumerate(rows, 1):
        try:
            out.append(to_messages(row, fmt, cfg))
        except ValueError as exc:
            errors.append(f"{row.get('__row__', f'row {i}')}: {exc}")
    if errors:
        shown = "; ".join(errors[:MAX_ROW_ERRORS])
        more = f" (and {len(errors) - MAX_ROW_ERRORS} more)" if len(errors) > MAX_ROW_ERRORS else ""
        raise DataError(f"{where}: {len(errors)} malformed row(s): {shown}{more}")
    return fmt, out


# ---------------------------------------------------------------- tokenizing


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    # No template: a plain instruction layout, ending the answer with EOS.
    text = ""
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
        before = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = render(tokenizer, messages[: i + 1])
        if not full.startswith(through) or not through.startswith(before):
            raise DataError("the tokenizer's chat template does not render conversations prefix-consistently, so "
                            "prompt tokens cannot be masked; use data.format=text or another template")
        spans.append((len(before), len(through)))
    return full, spans


def tokenize_example(tokenizer, example: list[dict[str, str]] | str, max_length: int) -> tuple[dict, bool]:
    """input_ids and labels (prompt positions = -100), truncated to max_length. Returns (encoded, truncated)."""
    if isinstance(example, str):
        text = example + (tokenizer.eos_token or "")
        spans = [(0, len(text))]
    else:
        text, spans = assistant_spans(tokenizer, example)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, labels = enc["input_ids"], []
    for tok_id, (start, end) in zip(ids, enc["offset_mapping"]):
        inside = any(s <= start < e for s, e in spans) or (end > start and any(s < end <= e for s, e in spans))
        labels.append(tok_id if inside else IGNORE_INDEX)
    truncated = len(ids) > max_length
    return {"input_ids": ids[:max_length], "labels": labels[:max_length]}, truncated


def prompt_and_reference(tokenizer, example: list[dict[str, str]] | str) -> dict[str, str] | None:
    """For generation metrics: everything up to the last answer, and that answer."""
    if isinstance(example, str):
        return None
    last = max(i for i, m in enumerate(example) if m["role"] == "assistant")
    return {"prompt": render(tokenizer, example[:last], add_generation_prompt=True),
            "reference": example[last]["content"]}


# ---------------------------------------------------------------- the step


def data_fingerprint(cfg: FinetuneConfig, tokenizer_dir: Path) -> str:
    d = cfg.data
    content = []
    for source in filter(None, (d.source, d.eval_source)):
        p = Path(source).expanduser()
        content.append(hash_bytes_of([p]) if p.is_file() else source)
    return combine(content, hash_tree(tokenizer_dir, (".json", ".jinja", ".model", ".txt")),
                   d.model_dump(mode="json"), code_version("dataset", "demo_data"))


def build_dataset(cfg: FinetuneConfig, tokenizer_dir: Path, out: Path) -> PreparedDataset:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    d = cfg.data
    fmt, examples = normalize(read_rows(d.source, d), d, d.source)
    rng = random.Random(d.seed)
    rng.shuffle(examples)
    if d.max_samples:
        examples = examples[: d.max_samples]
    if d.eval_source:
        eval_fmt, eval_examples = normalize(read_rows(d.eval_source, d), d, d.eval_source)
        if eval_fmt != fmt:
            raise DataError(f"{d.eval_source} is {eval_fmt} format but {d.source} is {fmt}")
        train_examples = examples
    else:
        n_eval = max(1, round(len(examples) * d.eval_fraction))
        if len(examples) - n_eval < 1:
            raise DataError(f"{d.source}: {len(examples)} row(s) is too few to hold {n_eval} out for evaluation")
        train_examples, eval_examples = examples[n_eval:], examples[:n_eval]

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    stats = {"truncated": 0, "dropped": 0, "train_tokens": 0}

    def encode(batch: list) -> dict[str, list]:
        cols: dict[str, list] = {"input_ids": [], "labels": []}
        for ex in batch:
            enc, truncated = tokenize_example(tokenizer, ex, d.max_length)
            stats["truncated"] += truncated
            if all(label == IGNORE_INDEX for label in enc["labels"]):
                stats["dropped"] += 1  # the answer was cut off entirely: nothing to learn
                continue
            cols["input_ids"].append(enc["input_ids"])
            cols["labels"].append(enc["labels"])
        return cols

    train = encode(train_examples)
    stats["train_tokens"] = sum(map(len, train["input_ids"]))
    evaluation = encode(eval_examples)
    if not train["input_ids"]:
        raise DataError(f"{d.source}: no training example keeps any answer tokens within data.max_length="
                        f"{d.max_length}")
    if not evaluation["input_ids"]:
        raise DataError(f"{d.eval_source or d.source}: no evaluation example fits in data.max_length={d.max_length}")
    fingerprint = data_fingerprint(cfg, tokenizer_dir)
    with atomic_dir(out) as tmp:
        pq.write_table(pa.table(train), tmp / "train.parquet")
        pq.write_table(pa.table(evaluation), tmp / "eval.parquet")
        with open(tmp / "eval_prompts.jsonl", "w") as f:
            for ex in eval_examples:
                pr = prompt_and_reference(tokenizer, ex)
                if pr:
                    f.write(json.dumps(pr) + "\n")
        result = PreparedDataset(path=out, fingerprint=fingerprint, format=fmt,
                                 train_rows=len(train["input_ids"]), eval_rows=len(evaluation["input_ids"]),
                                 train_tokens=stats["train_tokens"], truncated=stats["truncated"],
                                 dropped=stats["dropped"])
        (tmp / "stats.json").write_text(result.model_dump_json(indent=2))
        (tmp / "DONE").touch()
    return result


def _dataset_key(context, parameters) -> str:
    return "dataset-" + data_fingerprint(parameters["cfg"], parameters["tokenizer_dir"])


@task(name="prepare-dataset", cache_key_fn=_dataset_key, persist_result=True, retries=1, retry_delay_seconds=5,
      retry_condition_fn=retry_unless_user_error, task_run_name="prepare-dataset[{cfg.data.source}]", tags=["data"])
def prepare_dataset(cfg: FinetuneConfig, tokenizer_dir: Path) -> PreparedDataset:
    from tasks.launcher import run_logger

    out = cfg.cache_root / "datasets" / data_fingerprint(cfg, tokenizer_dir)
    if (out / "DONE").is_file():
        return PreparedDataset.model_validate_json((out / "stats.json").read_text())
    result = build_dataset(cfg, tokenizer_dir, out)
    run_logger().info("dataset: %s format, %d train / %d eval rows, %d train tokens, %d truncated, %d dropped -> %s",
                      result.format, result.train_rows, result.eval_rows, result.train_tokens, result.truncated,
                      result.dropped, out)
    return result



def load_split(path: Path, split: str) -> list[dict[str, list[int]]]:
    """A tokenized split as rows of {input_ids, labels}: what the Trainer and the evaluator read."""
    import pyarrow.parquet as pq

    return pq.read_table(path / f"{split}.parquet").to_pylist()
