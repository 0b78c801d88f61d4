"""Reading, validating, formatting and loss masking, with the generated tokenizer (ChatML) and a template-less one."""

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from finetune_flows.config.schema import load_config
from finetune_flows.data.dataset import IGNORE_INDEX, build_dataset, load_split, tokenize_example
from finetune_flows.data.rows import normalize, read_rows
from finetune_flows.errors import DataError
from finetune_flows.models.sources import materialize_tokenizer

ROWS = [{"prompt": f"Say {w}", "response": w.upper()} for w in ("red", "green", "blue", "cyan", "pink")] * 4


@pytest.fixture(scope="module")
def tokenizer_dir(shared_cache):
    return materialize_tokenizer("generated:tiny-llama", shared_cache)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def cfg_for(source, tmp_path, *extra):
    return load_config(None, [f"data.source={source}", f"run.cache_dir={tmp_path}/cache", *extra])


def trainable_text(tokenizer, enc):
    return tokenizer.decode([t for t, lab in zip(enc["input_ids"], enc["labels"]) if lab != IGNORE_INDEX])


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_each_file_type_reads_the_same_rows(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".csv":
        path.write_text("prompt,response\n" + "\n".join(f"{r['prompt']},{r['response']}" for r in ROWS) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    cfg = cfg_for(path, tmp_path)
    fmt, examples = normalize(read_rows(str(path), cfg.data), cfg.data, str(path))
    assert fmt == "instruction" and len(examples) == len(ROWS)
    assert examples[0] == [{"role": "user", "content": "Say red"}, {"role": "assistant", "content": "RED"}]


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": \n')
    with pytest.raises(DataError, match=r"bad.jsonl line 2: not valid JSON"):
        read_rows(str(path), cfg_for(path, tmp_path).data)


def test_a_json_error_reads_as_one_sentence(tmp_path):
    """Some decoder messages end with `at` already (`Invalid control character at`): never `at at column`."""
    path = tmp_path / "tab.jsonl"
    path.write_text('{"prompt": "a\tb", "response": "c"}\n')
    with pytest.raises(DataError) as info:
        read_rows(str(path), cfg_for(path, tmp_path).data)
    assert str(info.value).endswith("tab.jsonl line 1: not valid JSON (Invalid control character at column 14)")
    path = tmp_path / "open.json"
    path.write_text('[{"prompt": "a}]')
    with pytest.raises(DataError) as info:
        read_rows(str(path), cfg_for(path, tmp_path).data)
    assert str(info.value).endswith("open.json: not valid JSON (Unterminated string starting at line 1, column 13)")


def test_bad_rows_are_listed_with_their_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": ""}, {"prompt": 3, "response": "d"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = cfg_for(path, tmp_path)
    with pytest.raises(DataError) as info:
        normalize(read_rows(str(path), cfg.data), cfg.data, str(path))
    assert "2 malformed row(s)" in str(info.value)
    assert "line 2: `response` must be non-empty text" in str(info.value)
    assert "line 3: `prompt` must be non-empty text" in str(info.value)


def test_missing_column_names_what_was_found(tmp_path):
    path = tmp_path / "cols.csv"
    path.write_text("question,answer\nhi,there\n")
    cfg = cfg_for(path, tmp_path, "data.format=instruction")
    with pytest.raises(DataError, match=r"needs column\(s\) prompt, response, found: answer, question"):
        normalize(read_rows(str(path), cfg.data), cfg.data, str(path))
    mapped = cfg_for(path, tmp_path, "data.columns.prompt=question", "data.columns.response=answer")
    assert normalize(read_rows(str(path), mapped.data), mapped.data, str(path))[0] == "instruction"


def test_unknown_layout_and_empty_and_missing_files(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"foo": 1}\n')
    cfg = cfg_for(path, tmp_path)
    with pytest.raises(DataError, match="cannot tell the format from the columns"):
        normalize(read_rows(str(path), cfg.data), cfg.data, str(path))
    path.write_text("\n")
    with pytest.raises(DataError, match="the dataset is empty"):
        normalize(read_rows(str(path), cfg.data), cfg.data, str(path))
    with pytest.raises(DataError, match="data file not found"):
        read_rows(str(tmp_path / "missing.jsonl"), cfg.data)
    with pytest.raises(DataError, match=r"data file not found: data/missing.jsonl \(relative to the current "
                                        rf"directory, {re.escape(str(Path.cwd()))}\)"):
        read_rows("data/missing.jsonl", cfg.data)
    (tmp_path / "data.txt").write_text("hi")
    with pytest.raises(DataError, match="unsupported file type .txt"):
        read_rows(str(tmp_path / "data.txt"), cfg.data)


def test_csv_row_with_extra_fields(tmp_path):
    path = tmp_path / "extra.csv"
    path.write_text("prompt,response\na,b\nc,d,e\n")
    with pytest.raises(DataError, match="extra.csv line 3: more fields than the header"):
        read_rows(str(path), cfg_for(path, tmp_path).data)


def test_a_csv_record_is_named_by_every_line_it_spans(tmp_path):
    """A quoted field may hold line breaks: the record is named by all its lines."""
    path = tmp_path / "lines.csv"
    data = cfg_for(path, tmp_path).data
    path.write_text('prompt,response\n"two\nlines",b\nc,d\n')  # a quoted line break: one record, two lines
    assert [r["__row__"] for r in read_rows(str(path), data)] == ["lines 2-3", "line 4"]


@pytest.mark.parametrize("rows", ['a,b\n"say hi,there\nc,d\ne,f\n',  # open to the end of the file
                                  'a,b\n"say hi,there\nc,d\ne,He said "no" twice\ng,h\n'])  # closed further down
def test_a_stray_csv_quote_is_refused_not_folded_into_one_field(tmp_path, rows):
    """The lenient reader folds every row after a stray quote into one field (up to the file's end or the next
    quote), and a run trains on that: the record it starts is named instead."""
    path = tmp_path / "stray.csv"
    path.write_text("prompt,response\n" + rows)
    with pytest.raises(DataError, match=r"stray.csv: the record that starts on line 3 is not valid CSV \("):
        read_rows(str(path), cfg_for(path, tmp_path).data)


def test_csv_quoting_that_is_valid_reads_as_written(tmp_path):
    path = tmp_path / "quotes.csv"
    path.write_text('prompt,response\nq"x,a\n"say ""hi""",b\n"one,\r\ntwo",c\nq,"[1,2]"\nlong,' + "x" * 200_000 + "\n")
    rows = read_rows(str(path), cfg_for(path, tmp_path).data)
    assert [(r["prompt"], r["response"][:5]) for r in rows] == [
        ('q"x', "a"), ('say "hi"', "b"), ("one,\r\ntwo", "c"), ("q", "[1,2]"), ("long", "xxxxx")]
    assert len(rows[-1]["response"]) == 200_000  # no field size limit: data.max_length is the limit


def test_a_csv_column_named_twice_is_refused(tmp_path):
    path = tmp_path / "twice.csv"
    path.write_text("prompt,response,response\na,b,c\n")
    with pytest.raises(DataError, match="twice.csv line 1: column\\(s\\) 'response' appear more than once"):
        read_rows(str(path), cfg_for(path, tmp_path).data)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_lone_surrogate_is_named_by_row_and_key(tmp_path, suffix):
    """`"\\ud83d"` (an emoji cut in two) is valid JSON that no tokenizer takes; a whole pair reads as the emoji."""
    path = tmp_path / f"tweets{suffix}"
    good, bad = '{"prompt": "smile \\ud83d\\ude00", "response": "ok"}', '{"prompt": "cut \\ud83d", "response": "ok"}'
    path.write_text(f"{good}\n{bad}\n" if suffix == ".jsonl" else f"[{good}, {bad}]")
    where = "line 2" if suffix == ".jsonl" else "row 2"
    with pytest.raises(DataError, match=f"tweets{suffix} {where}: `prompt` holds a lone UTF-16 surrogate "
                                        r"\('\\ud83d' at character 5\)"):
        read_rows(str(path), cfg_for(path, tmp_path).data)
    path.write_text(f"{good}\n" if suffix == ".jsonl" else f"[{good}]")
    assert read_rows(str(path), cfg_for(path, tmp_path).data)[0]["prompt"] == "smile \U0001f600"


def test_an_empty_chat_turn_is_refused_like_an_empty_response(tmp_path):
    """An empty answer teaches the model to say nothing, and scores as a hit for `contains`."""
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": a}]} for a in ("hello", " ")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = cfg_for(path, tmp_path)
    with pytest.raises(DataError, match=r"1 malformed row\(s\): line 2: `messages`\[2\] \(assistant\) must be "
                                        "non-empty text \\(got ' '\\)"):
        normalize(read_rows(str(path), cfg.data), cfg.data, str(path))


def test_when_most_rows_are_malformed_the_detected_format_is_named(tmp_path):
    """The format is told from the first row's columns: a first row of another format blames every other row."""
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n" + "".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    cfg = cfg_for(path, tmp_path)
    with pytest.raises(DataError, match=r"4 malformed row\(s\) as text format \(detected from the columns of line 1; "
                                        r"set data.format\): line 2: `text` must be non-empty text"):
        normalize(read_rows(str(path), cfg.data), cfg.data, str(path))


def test_a_missing_data_file_names_its_key(tmp_path):
    cfg = cfg_for(tmp_path / "train.jsonl", tmp_path, f"data.eval_source={tmp_path / 'held.jsonl'}")
    with pytest.raises(DataError, match=f"data.eval_source={tmp_path / 'held.jsonl'}: data file not found"):
        read_rows(cfg.data.eval_source, cfg.data)
    with pytest.raises(DataError, match="data.source=.*: .* is not a file \\(a directory of files is not read"):
        read_rows(str(tmp_path), cfg.data)


def test_held_out_rows_the_length_cut_drops_are_not_generated_from(tmp_path, tokenizer_dir):
    """eval_prompts.jsonl holds the rows eval.parquet holds: a held-out row whose answer data.max_length cuts off
    entirely is neither in the eval loss nor generated from (its prompt can be far beyond the model's context)."""
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    held.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "Say teal", "response": "TEAL"},
                                                           {"prompt": "lorem ipsum " * 200, "response": "LONG"}]))
    cfg = cfg_for(train, tmp_path, f"data.eval_source={held}", "data.max_length=64")
    stats = build_dataset(cfg, tokenizer_dir, tmp_path / "out")
    assert (stats.eval_rows, stats.dropped) == (1, 1)
    prompts = [json.loads(line) for line in (tmp_path / "out" / "eval_prompts.jsonl").read_text().splitlines()]
    assert [p["reference"] for p in prompts] == ["TEAL"]


def test_instruction_masks_the_prompt(tokenizer):
    enc, truncated = tokenize_example(tokenizer, [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Say red"},
                                                  {"role": "assistant", "content": "RED"}], 512)
    assert not truncated
    assert trainable_text(tokenizer, enc) == "RED<|im_end|>\n"
    assert tokenizer.decode(enc["input_ids"]).startswith("<|im_start|>system\nBe brief.")


def test_multi_turn_chat_learns_every_assistant_turn_only(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"}, {"role": "assistant", "content": "goodbye"}]
    enc, _ = tokenize_example(tokenizer, messages, 512)
    assert trainable_text(tokenizer, enc) == "hello<|im_end|>\ngoodbye<|im_end|>\n"


def test_text_format_trains_on_everything(tokenizer):
    enc, _ = tokenize_example(tokenizer, "plain text here", 512)
    assert all(label != IGNORE_INDEX for label in enc["labels"])
    assert tokenizer.decode(enc["input_ids"]) == "plain text here" + tokenizer.eos_token


def test_without_chat_template_a_plain_layout_is_used(tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = None
    enc, _ = tokenize_example(tok, [{"role": "user", "content": "Say red"}, {"role": "assistant", "content": "RED"}],
                              512)
    assert tok.decode(enc["input_ids"]).startswith("### Instruction:\nSay red\n\n### Response:\n")
    assert trainable_text(tok, enc) == "RED" + tok.eos_token


def test_truncation(tokenizer):
    enc, truncated = tokenize_example(tokenizer, [{"role": "user", "content": "word " * 200},
                                                  {"role": "assistant", "content": "answer"}], 32)
    assert truncated and len(enc["input_ids"]) == 32
    assert all(label == IGNORE_INDEX for label in enc["labels"])  # the answer fell off: build_dataset drops it


def test_build_dataset_splits_and_saves(tmp_path, tokenizer_dir):
    path = tmp_path / "chat.jsonl"
    words = [a + b for a in ("red", "blue", "green", "gold", "grey") for b in ("cat", "dog", "owl", "fox", "elk",
                                                                           "bee", "ant", "cow")]
    rows = [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": f"a{i}"}]}
            for i, w in enumerate(words)]  # 40 distinct prompts: none is held out as a copy of a training one
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = cfg_for(path, tmp_path, "data.eval_fraction=0.25")
    out = tmp_path / "prepared"
    result = build_dataset(cfg, tokenizer_dir, out)
    assert (result.format, result.train_rows, result.eval_rows) == ("chat", 30, 10)
    assert len(load_split(out, "train")) == 30 and result.eval_removed_exact == result.eval_removed_normalized == 0
    prompts = [json.loads(line) for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 10 and prompts[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert prompts[0]["reference"].startswith("a")


def test_a_handful_of_rows_trains_with_a_warning(tmp_path, tokenizer_dir, caplog):
    from finetune_flows.data.dataset import prepare_dataset

    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {w}", "response": w}) + "\n" for w in ("red", "blue", "gold")))
    result = prepare_dataset(cfg_for(path, tmp_path), tokenizer_dir)
    assert (result.train_rows, result.eval_rows) == (2, 1)
    assert "only 2 training rows (and 1 held out)" in caplog.text


def test_builtin_demo_task_is_deterministic():
    from finetune_flows.data.demo import ticket_triage

    assert ticket_triage(50, seed=1) == ticket_triage(50, seed=1)
    answers = {ex["response"] for ex in ticket_triage(400, seed=1)}
    assert len(answers) == 12  # 4 teams x 3 priorities


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_column_and_a_missing_field_says_so(tmp_path):
    """Excel and Notepad save UTF-8 with a byte-order mark: it was read as part of the first column's name (CSV:
    "cannot tell the format from the columns (response, \\ufeffprompt)") or refused (JSONL)."""
    bom = "\ufeff".encode()
    rows = {"rows.csv": b"prompt,response\nhello,there\nsay,hi\n",
            "rows.jsonl": b'{"prompt": "hello", "response": "there"}\n{"prompt": "say", "response": "hi"}\n',
            "rows.json": b'[{"prompt": "hello", "response": "there"}]'}
    for name, body in rows.items():
        path = tmp_path / name
        path.write_bytes(bom + body)
        cfg = cfg_for(path, tmp_path)
        fmt, examples = normalize(read_rows(str(path), cfg.data), cfg.data, str(path))
        assert fmt == "instruction" and examples[0][0]["content"] == "hello", name
    path = tmp_path / "short.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"response": "d"}\n{"prompt": null, "response": "e"}\n')
    cfg = cfg_for(path, tmp_path)
    with pytest.raises(DataError) as info:
        normalize(read_rows(str(path), cfg.data), cfg.data, str(path))
    assert "line 2: `prompt` is missing (no such field in the row)" in str(info.value)
    assert "line 3: `prompt` is missing (null, or in a CSV file a row with fewer fields than the header)" in str(info.value)
