"""The data layer with the real character tokenizer: every file format, errors that point at
file/row/key, exact loss masks (decoded back to text), length accounting, collate shapes and
packing."""

import json
import logging
import re

import datasets
import pytest
import torch
from rl_rollout.testing import make_tokenizer

from rl_core.data import (
    DataConfig,
    DataError,
    KTODataset,
    MissingDataFile,
    PreferenceDataset,
    PromptDataset,
    Row,
    SFTDataset,
    load_rows,
    model_inputs,
    pack_collate,
    pack_greedy,
    pad_collate,
    preference_collate,
    sequence_sums,
)

EOS = "<|im_end|>"
ROWS = [{"input": f"q{i}", "output": f"a{i}"} for i in range(5)]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def masked_text(tok, ids, mask):
    return tok.decode(ids[mask.bool()].tolist())


def masked_runs(tok, ids, mask):
    """Decoded text of each contiguous run of mask == 1."""
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"input_template": "User: "}, r"must contain '\{\}'.*'User: '"),
        ({"input_template": "{q} {}"}, r"not a valid str.format pattern.*'\{\{'"),
        ({"input_template": "Q: {}", "apply_chat_template": True}, "drop --input_template or --apply_chat_template"),
        ({"max_len": 0}, r"max_len \(--max_len\) must be a positive number of tokens, got 0"),
        ({"max_samples": -1}, "max_samples.*got -1"),
        ({"max_eval_samples": 0}, r"max_eval_samples \(--max_eval_samples\) must be a positive row count.*got 0"),
        ({"eval_dataset": " "}, r"eval_dataset \(--eval_dataset\) must be a non-empty path or unset"),
        ({"input_key": ""}, r"input_key \(--input_key\) must be a column name"),
        ({"chosen_key": "x", "rejected_key": "x"}, "two different columns"),
        ({"apply_chat_template": "yes"}, "must be true or false, got 'yes'"),
    ],
)
def test_config_rejects_bad_values_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


# ---------------------------------------------------------------- loading


def test_jsonl_rows_keep_their_line_numbers(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    rows = load_rows(p)
    assert rows == ROWS[:2]
    assert all(isinstance(r, Row) for r in rows)
    assert [r.where for r in rows] == [f"{p} line 1", f"{p} line 3"]  # the blank line 2 is skipped


def test_json_list_and_split_object(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(ROWS))
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"train": ROWS[:2], "test": ROWS[2:]}))
    assert load_rows(a) == ROWS
    assert load_rows(b, split="test") == ROWS[2:]
    assert load_rows(b)[1].where == f"{b} row 2"
    with pytest.raises(DataError, match=r"without split 'validation' \(top-level keys: train, test\); set --split"):
        load_rows(b, split="validation")


def test_json_file_holding_json_lines_is_read(tmp_path):
    p = write_jsonl(tmp_path / "d.json", ROWS)
    assert load_rows(p) == ROWS


def test_parquet(tmp_path):
    p = tmp_path / "d.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(p))
    rows = load_rows(p)
    assert rows == ROWS
    assert rows[4].where == f"{p} row 5"


def test_saved_dataset_and_dataset_dict_folders(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:3]), "test": datasets.Dataset.from_list(ROWS[3:])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert load_rows(tmp_path / "ds") == ROWS
    assert load_rows(tmp_path / "dd", split="test") == ROWS[3:]
    with pytest.raises(DataError, match=r"no split 'dev' \(splits: train, test\)"):
        load_rows(tmp_path / "dd", split="dev")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not one written by save_to_disk"):
        load_rows(tmp_path / "plain")


def test_comma_separated_files_concatenate_and_max_samples_cuts(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    b = tmp_path / "b.json"
    b.write_text(json.dumps(ROWS[2:]))
    rows = load_rows(f"{a}, {b}")
    assert rows == ROWS
    assert rows[2].where == f"{b} row 1"
    assert load_rows(f"{a},{b}", max_samples=3) == ROWS[:3]
    assert load_rows(a, max_samples=1) == ROWS[:1]


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n" + '{"input": "x", "output": \n')
    with pytest.raises(DataError, match=rf"{p} line 3: invalid JSON \(Expecting value at column \d+\)"):
        load_rows(p)
    p.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=rf"{p} line 2: expected a JSON object.*got list"):
        load_rows(p)


def test_missing_file_and_unknown_extension(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(MissingDataFile, match=f"{missing}.*does not exist"):
        load_rows(missing)
    assert issubclass(MissingDataFile, FileNotFoundError) and issubclass(MissingDataFile, ValueError)
    csv = tmp_path / "d.csv"
    csv.write_text("input,output\n")
    with pytest.raises(DataError, match=r"unknown extension '.csv'; valid: .jsonl, .json, .parquet, or a folder"):
        load_rows(csv)


# ---------------------------------------------------------------- errors on rows


def test_missing_key_names_file_row_key_present_keys_and_flag(tmp_path, tok):
    rows = ROWS[:2] + [{"input": "q", "answer": "a"}]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(
        DataError,
        match=rf"{p} line 3: missing key 'output' \(keys present: input, answer\); set --output_key",
    ):
        SFTDataset(load_rows(p), tok, DataConfig(output_key="output"))


def test_skip_bad_rows_counts_and_warns(tok, caplog):
    rows = ROWS[:3] + [{"input": "q"}, {"input": "q", "output": ["not", "text"]}, {"input": "q", "output": "  "}]
    cfg = DataConfig(output_key="output")
    with pytest.raises(DataError, match=r"rows\[3\] \(row 4\): 'output' \(--output_key\) must be a string"):
        SFTDataset(rows[:3] + rows[4:5], tok, cfg)
    with pytest.raises(DataError, match=r"rows\[3\] \(row 4\): 'output' \(--output_key\) is empty"):
        SFTDataset(rows[:3] + rows[5:], tok, cfg)
    with caplog.at_level(logging.INFO, logger="rl_core.data.datasets"):
        ds = SFTDataset(rows, tok, DataConfig(output_key="output", skip_bad_rows=True))
    r = ds.report
    assert (r.rows_in, r.rows_kept, r.bad_rows_skipped, r.truncated, r.dropped_too_long) == (6, 3, 3, 0, 0)
    assert len(ds) == 3
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 3 bad rows" in warnings[0] and "missing key 'output'" in warnings[0]
    assert r.summary() in [rec.getMessage() for rec in caplog.records if rec.levelno == logging.INFO]


def test_all_rows_bad_or_dropped_raises(tok):
    with pytest.raises(DataError, match="kept 0/2 rows.*no usable rows"):
        SFTDataset([{"input": "q"}, {"x": 1}], tok, DataConfig(output_key="output", skip_bad_rows=True))
    with pytest.raises(DataError, match="1 dropped as too long.*no usable rows"):
        PromptDataset([{"input": "a long prompt"}], tok, DataConfig(max_len=4))


# ---------------------------------------------------------------- SFT


def test_sft_plain_mask_is_exactly_response_plus_eos(tok):
    cfg = DataConfig(output_key="output", input_template="Q: {}\nA: ")
    it = SFTDataset([{"input": "2+2?", "output": "four"}], tok, cfg)[0]
    assert it["input_ids"].dtype == torch.long and it["input_ids"].shape == it["loss_mask"].shape
    assert tok.decode(it["input_ids"].tolist()) == "Q: 2+2?\nA: four" + EOS
    assert masked_text(tok, it["input_ids"], it["loss_mask"]) == "four" + EOS
    assert it["loss_mask"].tolist() == [0] * len("Q: 2+2?\nA: ") + [1] * (len("four") + 1)


def test_sft_eos_not_doubled_when_response_has_it(tok):
    it = SFTDataset([{"input": "q", "output": "yes" + EOS}], tok, DataConfig(output_key="output"))[0]
    assert tok.decode(it["input_ids"].tolist()) == "qyes" + EOS


def test_sft_chat_single_turn_renders_template_and_masks_reply(tok):
    cfg = DataConfig(output_key="output", apply_chat_template=True)
    it = SFTDataset([{"input": "hi", "output": "Hello there"}], tok, cfg)[0]
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"}], tokenize=False
    )
    assert tok.decode(it["input_ids"].tolist()) == expected
    assert masked_runs(tok, it["input_ids"], it["loss_mask"]) == ["Hello there" + EOS]
    assert it["loss_mask"][-1] == 0  # the template's trailing newline after eos is not a target


def test_sft_multi_turn_masks_only_assistant_turns(tok):
    messages = [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1!"},
        {"role": "user", "content": "U2"},
        {"role": "assistant", "content": "A2?"},
    ]
    it = SFTDataset([{"input": messages}], tok, DataConfig(apply_chat_template=True))[0]
    assert tok.decode(it["input_ids"].tolist()) == tok.apply_chat_template(messages, tokenize=False)
    assert masked_runs(tok, it["input_ids"], it["loss_mask"]) == ["A1!" + EOS, "A2?" + EOS]
    unmasked = tok.decode(it["input_ids"][it["loss_mask"] == 0].tolist())
    assert "SYS" in unmasked and "U1" in unmasked and "U2" in unmasked and "A1" not in unmasked


def test_sft_multi_turn_needs_messages(tok):
    with pytest.raises(DataError, match="must be a chat message list for multi-turn SFT.*set --output_key"):
        SFTDataset([{"input": "plain"}], tok, DataConfig(apply_chat_template=True))
    with pytest.raises(ValueError, match="needs --output_key"):
        SFTDataset([{"input": "plain"}], tok, DataConfig())
    with pytest.raises(DataError, match="holds chat messages, so set --apply_chat_template"):
        SFTDataset([{"input": [{"role": "user", "content": "x"}], "output": "y"}], tok, DataConfig(output_key="output"))


def test_sft_truncation_and_drop_counts(tok):
    rows = [
        {"input": "ab", "output": "cd"},  # 2 + 2 + eos = 5 tokens: fits
        {"input": "abc", "output": "defghij"},  # 11 tokens: cut to 6
        {"input": "abcdefgh", "output": "x"},  # the prompt alone fills max_len: dropped
    ]
    ds = SFTDataset(rows, tok, DataConfig(output_key="output", max_len=6))
    r = ds.report
    assert (r.rows_in, r.rows_kept, r.truncated, r.dropped_too_long, r.bad_rows_skipped) == (3, 2, 1, 1, 0)
    assert tok.decode(ds[0]["input_ids"].tolist()) == "abcd" + EOS
    assert tok.decode(ds[1]["input_ids"].tolist()) == "abcdef"
    assert ds[1]["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1]
    assert r.summary() == (
        "SFTDataset: kept 2/3 rows (max_len 6); 1 truncated, 1 dropped as too long, 0 bad rows skipped"
    )


# ---------------------------------------------------------------- prompts


def test_prompt_dataset_chat_template_label_and_too_long_drop(tok):
    rows = [{"q": "What is 2+2?", "ans": "4"}, {"q": "x" * 100, "ans": "5"}, {"q": "Hi", "ans": 7}]
    cfg = DataConfig(input_key="q", label_key="ans", apply_chat_template=True, max_len=40)
    ds = PromptDataset(rows, tok, cfg)
    assert ds.report.dropped_too_long == 1 and ds.report.rows_kept == 2 and ds.report.truncated == 0
    first = ds[0]
    assert first["prompt"] == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(first["prompt_ids"]) == first["prompt"]
    assert isinstance(first["prompt_ids"], list) and len(first["prompt_ids"]) == len("user\n") + len("What is 2+2?") + len("\n") + len("assistant\n") + 3  # 3 specials
    assert [it["label"] for it in ds] == ["4", 7]


def test_prompt_dataset_template_and_missing_label(tok):
    ds = PromptDataset([{"input": "2+2"}], tok, DataConfig(input_template="Q: {} A:"))
    assert ds[0] == {"prompt": "Q: 2+2 A:", "prompt_ids": tok("Q: 2+2 A:")["input_ids"], "label": None,
                     # the row as written, prompt before the template: what an --agent_cmd program reads
                     "row": {"input": "2+2", "prompt": "2+2", "label": None}}
    with pytest.raises(DataError, match=r"row 1\): missing key 'answer' \(keys present: input\); set --label_key"):
        PromptDataset([{"input": "2+2"}], tok, DataConfig(label_key="answer"))


def test_chat_template_required_on_tokenizer():
    bare = make_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="tokenizer has no chat_template"):
        PromptDataset([{"input": "x"}], bare, DataConfig(apply_chat_template=True))


# ---------------------------------------------------------------- preference and KTO


def test_preference_items_masks_and_margin(tok):
    rows = [{"p": "Q1", "c": "good", "r": "bad", "m": 2}, {"p": "Q2", "c": "yes!", "r": "no", "m": 0.5}]
    cfg = DataConfig(prompt_key="p", chosen_key="c", rejected_key="r", margin_key="m", apply_chat_template=True)
    ds = PreferenceDataset(rows, tok, cfg)
    it = ds[0]
    assert masked_runs(tok, it["chosen_ids"], it["chosen_mask"]) == ["good" + EOS]
    assert masked_runs(tok, it["rejected_ids"], it["rejected_mask"]) == ["bad" + EOS]
    prompt = "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(it["chosen_ids"].tolist()).startswith(prompt + "good")
    assert [x["margin"] for x in ds] == [2.0, 0.5]

    batch = preference_collate(list(ds), pad_id=tok.pad_token_id)
    lens = [len(x["chosen_ids"]) for x in ds] + [len(x["rejected_ids"]) for x in ds]
    assert batch["input_ids"].shape == (4, max(lens))
    assert batch["attention_mask"].sum(1).tolist() == lens
    assert masked_text(tok, batch["input_ids"][1], batch["loss_mask"][1]) == "yes!" + EOS  # chosen rows first
    assert masked_text(tok, batch["input_ids"][3], batch["loss_mask"][3]) == "no" + EOS
    assert batch["margin"].dtype == torch.float32 and batch["margin"].tolist() == [2.0, 0.5]
    with pytest.raises(DataError, match=r"'m' \(--margin_key\) must be a number, got 'big'"):
        PreferenceDataset([{**rows[0], "m": "big"}], tok, cfg)


def test_preference_full_conversations_without_prompt_key(tok):
    def conv(reply):
        return [{"role": "user", "content": "Q"}, {"role": "assistant", "content": reply}]

    ds = PreferenceDataset([{"chosen": conv("A+"), "rejected": conv("C-")}], tok, DataConfig(apply_chat_template=True))
    it = ds[0]
    assert masked_runs(tok, it["chosen_ids"], it["chosen_mask"]) == ["A+" + EOS]
    assert masked_runs(tok, it["rejected_ids"], it["rejected_mask"]) == ["C-" + EOS]
    assert it["margin"] == 0.0
    with pytest.raises(DataError, match="plain string but there is no prompt; set --prompt_key"):
        PreferenceDataset([{"chosen": "A", "rejected": "B"}], tok, DataConfig(apply_chat_template=True))


def test_kto_items_flags_and_collate(tok):
    rows = [
        {"input": "q1", "output": "good", "label": True},
        {"input": "q2", "output": "meh", "label": 0},
        {"input": "q3", "output": "x", "label": "yes"},
        {"input": "q4", "output": "y", "label": 2},
    ]
    cfg = DataConfig(output_key="output", skip_bad_rows=True)
    ds = KTODataset(rows, tok, cfg)
    assert ds.report.bad_rows_skipped == 2 and [it["desirable"] for it in ds] == [True, False]
    assert masked_text(tok, ds[1]["input_ids"], ds[1]["loss_mask"]) == "meh" + EOS
    with pytest.raises(DataError, match=r"row 3\): 'label' \(--desirable_key\) must be true/false or 0/1, got 'yes'"):
        KTODataset(rows, tok, DataConfig(output_key="output"))

    batch = pad_collate(list(ds), pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, 7) and batch["desirable"].dtype == torch.bool
    assert batch["desirable"].tolist() == [True, False]
    assert batch["input_ids"][1, -1] == tok.pad_token_id and batch["attention_mask"][1].tolist() == [1] * 6 + [0]
    assert batch["loss_mask"][1, -1] == 0


def test_pad_collate_sft_right_pads(tok):
    ds = SFTDataset([{"input": "a", "output": "bcdef"}, {"input": "a", "output": "b"}], tok, DataConfig(output_key="output"))
    batch = pad_collate(list(ds), pad_id=tok.pad_token_id)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert batch["input_ids"].shape == (2, 7)
    assert batch["input_ids"][1].tolist() == ds[1]["input_ids"].tolist() + [tok.pad_token_id] * 4
    assert batch["loss_mask"][1].tolist() == [0, 1, 1, 0, 0, 0, 0]


# ---------------------------------------------------------------- packing


def test_pack_collate_restarts_positions_and_masks_boundaries(tok):
    ds = SFTDataset(
        [{"input": "ab", "output": "c"}, {"input": "d", "output": "efg"}, {"input": "", "output": "hi"}],
        tok,
        DataConfig(output_key="output"),
    )
    packed = pack_collate(list(ds))
    lens = [len(it["input_ids"]) for it in ds]
    assert packed["seq_lens"] == lens == [4, 5, 3]
    assert packed["input_ids"].shape == packed["position_ids"].shape == packed["loss_mask"].shape == (1, 12)
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]
    assert packed["input_ids"][0].tolist() == torch.cat([it["input_ids"] for it in ds]).tolist()
    # the empty-prompt row's first token ('h') has no predecessor in its own sequence: never a target
    assert packed["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1]


def test_packed_preference_batch_keeps_the_pair_order_and_sums_per_sequence(tok):
    rows = [{"p": "Q1", "c": "good", "r": "bad"}, {"p": "Q2", "c": "yes, a longer one!", "r": "no"}]
    ds = PreferenceDataset(rows, tok, DataConfig(prompt_key="p", chosen_key="c", rejected_key="r"))
    padded = preference_collate(list(ds), pad_id=tok.pad_token_id)
    packed = preference_collate(list(ds), pad_id=tok.pad_token_id, packing=True)
    seqs = [it["chosen_ids"] for it in ds] + [it["rejected_ids"] for it in ds]  # chosen first, as padded
    assert packed["seq_lens"] == [len(s) for s in seqs] and "attention_mask" not in packed
    assert packed["input_ids"][0].tolist() == torch.cat(seqs).tolist()
    assert packed["margin"].tolist() == padded["margin"].tolist() == [0.0, 0.0]
    assert set(model_inputs(packed)) == {"input_ids", "position_ids"}
    assert set(model_inputs(padded)) == {"input_ids", "attention_mask"}
    # a per-token value summed under the loss mask: the same per sequence from either layout
    x_pad = torch.arange(padded["input_ids"].numel(), dtype=torch.float32).reshape(padded["input_ids"].shape)
    x_pack = torch.cat([x_pad[r, :n] for r, n in enumerate(packed["seq_lens"])])[None].requires_grad_()
    want = (x_pad * padded["loss_mask"]).sum(1)
    got = sequence_sums(x_pack, packed)
    assert got.dtype == torch.float64 and got.tolist() == want.tolist() == sequence_sums(x_pad, padded).tolist()
    got.sum().backward()  # differentiable: the gradient is the loss mask
    assert x_pack.grad.tolist() == packed["loss_mask"].float().tolist()


def test_pack_greedy_first_fit_decreasing():
    lengths = [5, 3, 8, 2, 4, 6]
    bins = pack_greedy(lengths, max_tokens=10)
    # decreasing: 8 -> A; 6 -> B; 5 -> C; 4 -> B (10); 3 -> C (8); 2 -> A (10)
    assert bins == [[2, 3], [4, 5], [0, 1]]
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    g = torch.Generator().manual_seed(0)
    many = torch.randint(1, 50, (200,), generator=g).tolist()
    bins = pack_greedy(many, max_tokens=64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert max(sum(many[i] for i in b) for b in bins) <= 64
    assert len(bins) <= -(-sum(many) // 64) * 1.25  # FFD is near the lower bound on random sizes
    with pytest.raises(ValueError, match="item 1 has 11 tokens, more than max_tokens=10"):
        pack_greedy([3, 11], max_tokens=10)


def test_bytes_that_are_not_utf8_are_named_by_file_line_and_offset_and_skip_bad_rows_skips_them(tmp_path, caplog):
    """issue 40 finding 5: non-UTF-8 bytes were `UnicodeDecodeError ... position 3972` with no file or line, also
    under --skip_bad_rows, which did not skip an invalid JSON line either."""
    from rl_core.data.blending import training_rows

    p = tmp_path / "mixed.jsonl"
    good = json.dumps({"prompt": "a"}).encode() + b"\n"
    p.write_bytes(good + b'{"prompt": "caf\xe9"}\n' + good + b'{"prompt": \n' + good)
    with pytest.raises(DataError, match=rf"{p} line 2: byte {len(good) + 15:,} of the file \(b'\\xe9'\) is not "
                                        r"UTF-8 \(invalid continuation byte\); re-encode the file as UTF-8"):
        load_rows(p)
    with caplog.at_level("WARNING", logger="rl_core.data.loading"):
        rows = load_rows(p, skip_bad=True)
    assert [r.number for r in rows] == [1, 3, 5]  # each kept row still knows its line
    assert re.search(rf"mixed.jsonl: skipped 2 bad lines \(skip_bad_rows\); first: line 2: byte {len(good) + 15:,} "
                     r"is not UTF-8; line 4: invalid JSON \(Expecting value", caplog.text), caplog.text
    assert len(training_rows(DataConfig(dataset=str(p), skip_bad_rows=True), seed=1)) == 3  # the CLI's path
    with pytest.raises(DataError, match=r"line 2: byte"):
        training_rows(DataConfig(dataset=str(p)), seed=1)
    whole = tmp_path / "array.json"
    whole.write_bytes(b'[{"prompt": "a"},\n {"prompt": "caf\xe9"}]')
    with pytest.raises(DataError, match=rf"{whole} line 2: byte 34 of the file .* is not UTF-8"):
        load_rows(whole, skip_bad=True)  # inside one JSON document there is no line to skip
