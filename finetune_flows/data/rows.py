"""Reading a data source into rows (JSONL, JSON, CSV, Parquet, a built-in task or a Hub dataset) and checking them:
every row normalized to chat messages or plain text, errors naming the file, the row and the column."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from finetune_flows.config.schema import DataConfig
from finetune_flows.data.demo import BUILTIN_DATASETS
from finetune_flows.errors import DataError

ROLES = {"system", "user", "assistant"}
MAX_ROW_ERRORS = 5


# ---------------------------------------------------------------- reading


def read_rows(source: str, cfg: DataConfig) -> list[dict[str, Any]]:
    """Rows as dicts, with errors naming the file and row (and the key, where the file is not there)."""
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name not in BUILTIN_DATASETS:
            raise DataError(f"data.source={source}: unknown built-in dataset; known: {sorted(BUILTIN_DATASETS)}")
        return BUILTIN_DATASETS[name](cfg.builtin_examples, seed=cfg.seed)
    if source.startswith("hub:"):
        import datasets

        try:
            return list(datasets.load_dataset(source[4:], split=cfg.hub_split, revision=cfg.hub_revision))
        except Exception as exc:
            raise DataError(f"data.source={source}: could not load from the Hub: {exc}") from None
    path = Path(source).expanduser()
    key = "data.eval_source" if source == cfg.eval_source and source != cfg.source else "data.source"
    if not path.exists():
        relative = "" if path.is_absolute() else f" (relative to the current directory, {Path.cwd()})"
        raise DataError(f"{key}={source}: data file not found: {path}{relative}")
    if not path.is_file():
        raise DataError(f"{key}={source}: {path} is not a file (a directory of files is not read: name one "
                        ".jsonl, .json, .csv or .parquet file)")
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


def json_problem(exc: json.JSONDecodeError) -> str:
    """The decoder's message followed by `at `: some messages already end with it (`Invalid control character at`)."""
    return exc.msg.removesuffix(" at") + " at "


# The readers take "utf-8-sig": a UTF-8 file may start with a byte-order mark (Excel and Notepad write one), which is
# not part of the first key or column name.


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {lineno}: not valid JSON ({json_problem(exc)}column {exc.colno})") \
                    from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
            if "\\u" in line:  # only an escape can make a lone surrogate
                check_surrogates(row, f"{path} line {lineno}")
            row["__row__"] = f"line {lineno}"
            rows.append(row)
    return rows


def check_surrogates(value: Any, where: str, key: str = "") -> None:
    """Text holding half of a UTF-16 surrogate pair (`"\\ud83d"`: an emoji cut in two) is valid JSON but no
    tokenizer takes it; name the row and key instead of failing in the tokenizer."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise DataError(f"{where}: `{key}` holds a lone UTF-16 surrogate ({value[exc.start]!r} at character "
                            f"{exc.start + 1}), half of a character; repair or drop the row") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_surrogates(v, where, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_surrogates(v, where, f"{key}[{i}]")


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({json_problem(exc)}line {exc.lineno}, column {exc.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of objects (or {{\"data\": [...]}})")
    for i, row in enumerate(data, 1):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {i}: expected an object, got {type(row).__name__}")
        check_surrogates(row, f"{path} row {i}")
        row["__row__"] = f"row {i}"
    return data


def _read_csv(path: Path) -> list[dict[str, Any]]:
    # strict: a quote left open to the end of the file, or closed with text after it, is an error (the lenient
    # reader silently swallows the rows after it into one field); no field size limit (data.max_length is the limit)
    csv.field_size_limit(sys.maxsize)
    rows = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f, strict=True)
        end = 1  # the header's line
        try:
            names = reader.fieldnames or []
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise DataError(f"{path} line 1: column(s) {', '.join(map(repr, twice))} appear more than once in "
                                "the header")
            for row in reader:
                # a record may span lines (a quoted field with line breaks, or a stray quote that swallowed rows):
                # name all of them, not only the line it ends on
                start, end = end + 1, reader.line_num
                where = f"line {end}" if start == end else f"lines {start}-{end}"
                if None in row:
                    raise DataError(f"{path} {where}: more fields than the header has columns")
                row["__row__"] = where
                rows.append(row)
        except csv.Error as exc:  # the reader's line count stops at the last good record: name where this began
            raise DataError(f"{path}: the record that starts on line {end + 1} is not valid CSV ({exc}); a quote (\") "
                            "that opens a field must close right before a comma or the line's end, and a quote inside "
                            "a quoted field is written twice (\"\")") from None
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
            if value is None:
                why = "null, or in a CSV file a row with fewer fields than the header" if key in row else \
                    "no such field in the row"
                raise ValueError(f"`{key}` is missing ({why})")
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
        if m["role"] != "system" and not m["content"].strip():  # an empty answer teaches nothing and scores as a hit
            raise ValueError(f"`{c.messages}`[{i}] ({m['role']}) must be non-empty text (got {m['content']!r})")
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
        guessed = cfg.format == "auto" and len(errors) * 2 > len(rows)  # most rows bad: perhaps the guess was wrong
        detected = "" if not guessed else \
            f" as {fmt} format (detected from the columns of {rows[0].get('__row__', 'row 1')}; set data.format)"
        raise DataError(f"{where}: {len(errors)} malformed row(s){detected}: {shown}{more}")
    return fmt, out


def row_names(rows: list[dict[str, Any]]) -> list[str]:
    """Where each row is in its file ("line 7", "lines 7-9", "row 3"), in the order `normalize` returns them."""
    return [row.get("__row__", f"row {i}") for i, row in enumerate(rows, 1)]
