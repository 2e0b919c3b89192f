"""RLDataset on verl-layout parquet, left-padded collation, the resumable sampler, and the data prep CLIs."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data import prep_gsm8k, prep_synthetic
from hybridflow.data.rl_dataset import RLDataset, collate
from hybridflow.data.sampler import ResumableSampler
from hybridflow.data.synthetic import make_reverse_rows, write_parquet
from hybridflow.models.tiny import build_tokenizer
from hybridflow.rewards import synthetic as reverse_reward

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K = [
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
     "How many clips did Natalia sell altogether in April and May?",
     "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72"),
    ("Weng earns $12 an hour. How much did she earn for 50 minutes?",
     "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nShe earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"),
    ("A shop sold 1,200 pens. How many pens?", "It sold 1,200 pens.\n#### 1,200"),
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def write_verl_gsm8k(path, examples=GSM8K, split="train"):
    """The parquet verl's examples/data_preprocess/gsm8k.py writes (datasets.Dataset.to_parquet): same columns,
    nested types and huggingface schema metadata."""
    rows = [{
        "data_source": "openai/gsm8k",
        "prompt": [{"content": q + " " + INSTRUCTION, "role": "user"}],
        "ability": "math",
        "reward_model": {"ground_truth": a.split("#### ")[1].replace(",", ""), "style": "rule"},
        "extra_info": {"answer": a, "index": i, "question": q, "split": split},
    } for i, (q, a) in enumerate(examples)]
    schema = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()),
                                  ("split", pa.string())])),
    ], metadata={b"huggingface": json.dumps({"info": {"features": {}}}).encode()})
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return rows


def char_ids(tok, text):
    """Independent reference: our tokenizer is one id per character."""
    return tok.convert_tokens_to_ids(list(text))


def test_verl_gsm8k_parquet_loads_as_is(tmp_path, tok, caplog):
    path = tmp_path / "train.parquet"
    rows = write_verl_gsm8k(path)
    lengths = [len(r["prompt"][0]["content"]) + 4 for r in rows]  # + bos, <|user|>, eos, <|assistant|>
    limit = sorted(lengths)[1]  # keeps the two shortest prompts, drops the longest
    ds = RLDataset([str(path)], tok, max_prompt_length=limit)
    assert ds.num_filtered == 1 and ds.num_total == 3 and len(ds) == 2
    assert "filtered 1 of 3 prompts longer than max_prompt_length" in caplog.text
    kept = [i for i, n in enumerate(lengths) if n <= limit]
    for item, i in zip(ds, kept):
        content = rows[i]["prompt"][0]["content"]
        expected = [tok.bos_token_id, tok.convert_tokens_to_ids("<|user|>"), *char_ids(tok, content),
                    tok.eos_token_id, tok.convert_tokens_to_ids("<|assistant|>")]
        assert item["input_ids"] == expected
        assert item["data_source"] == "openai/gsm8k"
        assert item["ground_truth"] == rows[i]["reward_model"]["ground_truth"]
        assert item["extra_info"]["answer"] == rows[i]["extra_info"]["answer"]
        assert item["raw_prompt"] == [{"content": content, "role": "user"}]
        assert item["ability"] == "math" and item["index"] == i
    assert {item["ground_truth"] for item in ds} == {"10", "1200"}

    # not filtered: kept, and cut by data.truncation (its default, error, refuses: see the truncation tests)
    unfiltered = RLDataset([str(path)], tok, max_prompt_length=limit, filter_overlong_prompts=False, truncation="right")
    assert len(unfiltered) == 3 and unfiltered.num_filtered == 0 and unfiltered.num_truncated == 1


def test_index_runs_across_files_and_plain_prompts(tmp_path, tok):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_verl_gsm8k(a, GSM8K[:1])
    write_parquet(make_reverse_rows(2, seed=0), b)
    ds = RLDataset([str(a), str(b)], tok, max_prompt_length=400)
    assert [item["index"] for item in ds] == [0, 1, 2]
    assert [item["data_source"] for item in ds] == ["openai/gsm8k", "hybridflow/reverse", "hybridflow/reverse"]

    plain = RLDataset([str(b)], tok, max_prompt_length=400, apply_chat_template=False)
    assert plain[0]["input_ids"] == char_ids(tok, plain[0]["raw_prompt"][0]["content"])


def test_bad_files_name_file_and_column(tmp_path, tok):
    path = tmp_path / "no_source.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "reward_model": {"ground_truth": "1"}}]), path)
    with pytest.raises(KeyError, match=r"no_source.parquet' has no column 'data_source'"):
        RLDataset([str(path)], tok)
    path = tmp_path / "no_truth.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "data_source": "x", "reward_model": {"style": "rule"}}]),
                   path)
    with pytest.raises(KeyError, match=r"'reward_model' of data file .*no_truth.parquet' has no field 'ground_truth'"):
        RLDataset([str(path)], tok)
    with pytest.raises(KeyError, match="has no column 'question'"):
        RLDataset([str(path)], tok, prompt_key="question")
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        RLDataset([str(tmp_path / "missing.parquet")], tok)
    write_parquet(make_reverse_rows(2, seed=0), tmp_path / "r.parquet")
    with pytest.raises(ValueError, match="all 2 are longer than max_prompt_length=3"):
        RLDataset([str(tmp_path / "r.parquet")], tok, max_prompt_length=3)


def test_collate_left_pads():
    rows = [
        {"input_ids": [5, 6, 7], "data_source": "s", "ground_truth": "a", "extra_info": {"k": 1},
         "raw_prompt": [{"role": "user", "content": "x"}], "index": 4},
        {"input_ids": [8, 9, 10, 11, 12], "data_source": "t", "ground_truth": "b", "extra_info": {},
         "raw_prompt": [{"role": "user", "content": "y"}], "index": 9},
    ]
    tensors, non_tensors = collate(rows, pad_id=0, max_prompt_length=6)
    assert torch.equal(tensors["input_ids"], torch.tensor([[0, 0, 0, 5, 6, 7], [0, 8, 9, 10, 11, 12]]))
    assert torch.equal(tensors["attention_mask"], torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]]))
    assert torch.equal(tensors["position_ids"], torch.tensor([[0, 0, 0, 0, 1, 2], [0, 0, 1, 2, 3, 4]]))
    assert all(t.dtype == torch.long for t in tensors.values())
    assert set(non_tensors) == {"data_source", "ground_truth", "extra_info", "raw_prompt", "index"}
    for v in non_tensors.values():
        assert v.dtype == object and v.shape == (2,)
    assert non_tensors["raw_prompt"][1] == [{"role": "user", "content": "y"}]
    assert list(non_tensors["index"]) == [4, 9]
    with pytest.raises(ValueError, match=r"max_prompt_length=4 \(index, length\): \[\(9, 5\)\]"):
        collate(rows, pad_id=0, max_prompt_length=4)


def test_sampler_resume_is_bit_exact():
    def run(steps, interrupt_at=None):
        sampler = ResumableSampler(dataset_len=10, batch_size=3, seed=7)
        out = []
        for step in range(steps):
            if step == interrupt_at:
                state = json.loads(json.dumps(sampler.state_dict()))  # as it would be saved
                sampler = ResumableSampler(dataset_len=10, batch_size=3, seed=7)
                sampler.load_state_dict(state)
            out.append(sampler.next_batch())
        return out

    full = run(10)  # 3 batches per epoch (drop_last), so this crosses three epoch boundaries
    for cut in (1, 3, 4, 8):
        assert run(10, interrupt_at=cut) == full
    epochs = [sorted(sum(full[e * 3:(e + 1) * 3], [])) for e in range(3)]
    assert all(len(set(e)) == 9 and set(e) <= set(range(10)) for e in epochs)  # no repeats within an epoch
    assert full[:3] != full[3:6]  # a fresh order each epoch


def test_sampler_epochs_and_iteration():
    sampler = ResumableSampler(dataset_len=7, batch_size=3, seed=0, shuffle=False, drop_last=False)
    assert len(sampler) == 3
    assert list(sampler) == [[0, 1, 2], [3, 4, 5], [6]]
    assert sampler.epoch == 0
    assert list(sampler) == [[0, 1, 2], [3, 4, 5], [6]] and sampler.epoch == 1
    shuffled = ResumableSampler(dataset_len=7, batch_size=3, seed=0)
    first = next(iter(shuffled))
    rest = list(shuffled)  # iteration continues where the epoch stands
    assert len(rest) == 1 and len(set(first + rest[0])) == 6
    with pytest.raises(ValueError, match="seed=1 but this sampler has 0"):
        shuffled.load_state_dict({**shuffled.state_dict(), "seed": 1})
    with pytest.raises(ValueError, match="cannot fill one batch of 8"):
        ResumableSampler(dataset_len=7, batch_size=8, seed=0)


def test_reverse_rows_and_prep(tmp_path, tok):
    rows = make_reverse_rows(50, seed=3, min_len=3, max_len=5)
    texts = [r["extra_info"]["text"] for r in rows]
    assert len(set(texts)) == 50 and all(3 <= len(t) <= 5 for t in texts)
    for row in rows:
        text = row["extra_info"]["text"]
        assert row["prompt"] == [{"role": "user", "content": "reverse: " + text}]
        assert row["reward_model"]["ground_truth"] == "".join(reversed(text))
        truth = row["reward_model"]["ground_truth"]
        assert reverse_reward.compute_score(text[::-1] + "\n", truth) == 1.0
        assert reverse_reward.compute_score(text, truth) < 1.0 or text == truth  # palindromes aside
    assert make_reverse_rows(50, seed=3) == rows
    with pytest.raises(ValueError, match="allow only 8"):
        make_reverse_rows(9, seed=0, min_len=3, max_len=3, alphabet="ab")

    train, test = prep_synthetic.prepare(tmp_path, train_size=200, test_size=20, seed=0)
    train_ds, test_ds = RLDataset([str(train)], tok), RLDataset([str(test)], tok)
    assert len(train_ds) == 200 and len(test_ds) == 20
    train_texts = {item["extra_info"]["text"] for item in train_ds}
    assert not train_texts & {item["extra_info"]["text"] for item in test_ds}


def test_prep_gsm8k_matches_verl_layout(tmp_path, tok):
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K))
    out = tmp_path / "ours.parquet"
    prep_gsm8k.main(["--input", str(src), "--split", "train", "--out", str(out)])
    verl = tmp_path / "verl.parquet"
    write_verl_gsm8k(verl)
    ours, theirs = RLDataset([str(out)], tok, max_prompt_length=400), RLDataset([str(verl)], tok, max_prompt_length=400)
    assert [x["input_ids"] for x in ours] == [x["input_ids"] for x in theirs]
    assert [x["ground_truth"] for x in ours] == ["72", "10", "1200"]
    assert [x["extra_info"] for x in ours] == [x["extra_info"] for x in theirs]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl row 0: answer has no '#### <number>' line"):
        prep_gsm8k.main(["--input", str(bad), "--out", str(tmp_path / "x.parquet")])


def test_collate_from_dataset_round_trip(tmp_path, tok):
    write_parquet(make_reverse_rows(4, seed=1), tmp_path / "r.parquet")
    ds = RLDataset([str(tmp_path / "r.parquet")], tok, max_prompt_length=20)
    tensors, non_tensors = collate([ds[i] for i in range(4)], tok.pad_token_id, 20)
    for i in range(4):
        ids = tensors["input_ids"][i][tensors["attention_mask"][i].bool()].tolist()
        assert ids == ds[i]["input_ids"]
        assert tok.decode(ids) == tok.apply_chat_template(ds[i]["raw_prompt"], add_generation_prompt=True,
                                                          tokenize=False)
    np.testing.assert_array_equal(non_tensors["ground_truth"], [ds[i]["ground_truth"] for i in range(4)])


# ---------------------------------------------------------------- data.truncation (verl's over-long prompt modes)

def _gsm8k_expected_ids(tok, row):
    """Independent reference: chat template = bos, <|user|>, one id per character, eos, <|assistant|>."""
    return [tok.bos_token_id, tok.convert_tokens_to_ids("<|user|>"), *char_ids(tok, row["prompt"][0]["content"]),
            tok.eos_token_id, tok.convert_tokens_to_ids("<|assistant|>")]


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes_cut_overlong_prompts_like_verl(tmp_path, tok, caplog, mode):
    path = tmp_path / "train.parquet"
    rows = write_verl_gsm8k(path)
    full = [_gsm8k_expected_ids(tok, r) for r in rows]
    limit = 41  # odd, below every prompt's length: middle keeps 20 + 21
    assert all(len(ids) > limit for ids in full)
    ds = RLDataset([str(path)], tok, max_prompt_length=limit, filter_overlong_prompts=False, truncation=mode)
    assert len(ds) == 3 and ds.num_filtered == 0 and ds.num_truncated == 3
    assert f"truncated 3 of 3 prompts to max_prompt_length=41 tokens (data.truncation={mode}" in caplog.text
    for item, ids in zip(ds, full):
        want = {"left": ids[-41:], "right": ids[:41], "middle": ids[:20] + ids[-21:]}[mode]
        assert item["input_ids"] == want and len(want) == 41
    if mode == "left":  # the generation prompt survives: the model still answers as the assistant
        assert all(item["input_ids"][-1] == tok.convert_tokens_to_ids("<|assistant|>") for item in ds)
    tensors, _ = collate([ds[0], ds[1]], tok.pad_token_id, limit)
    assert tensors["attention_mask"].sum().item() == 82


def test_filtering_comes_before_truncation_and_short_prompts_are_untouched(tmp_path, tok):
    path = tmp_path / "train.parquet"
    rows = write_verl_gsm8k(path)
    lengths = [len(_gsm8k_expected_ids(tok, r)) for r in rows]
    limit = sorted(lengths)[1]
    # filter on: the over-long prompt is dropped, so truncation='error' never fires (verl's order)
    ds = RLDataset([str(path)], tok, max_prompt_length=limit, filter_overlong_prompts=True, truncation="error")
    assert len(ds) == 2 and ds.num_truncated == 0
    ds = RLDataset([str(path)], tok, max_prompt_length=limit, filter_overlong_prompts=False, truncation="right")
    assert ds.num_truncated == 1
    for item, row, n in zip(ds, rows, lengths):
        want = _gsm8k_expected_ids(tok, row)
        assert item["input_ids"] == (want if n <= limit else want[:limit])


@pytest.mark.bad_input
def test_truncation_error_names_file_row_and_the_way_out(tmp_path, tok):
    path = tmp_path / "train.parquet"
    rows = write_verl_gsm8k(path)
    longest = max(range(len(rows)), key=lambda i: len(rows[i]["prompt"][0]["content"]))
    n = len(_gsm8k_expected_ids(tok, rows[longest]))
    with pytest.raises(ValueError, match=rf"data file '.*train.parquet' row {longest}: prompt has {n} tokens > "
                                         rf"data.max_prompt_length={n - 1} and data.truncation='error'; set "
                                         r"data.filter_overlong_prompts=true .* or data.truncation=left\|right"):
        RLDataset([str(path)], tok, max_prompt_length=n - 1, filter_overlong_prompts=False)  # error is the default
    with pytest.raises(ValueError, match=r"data.truncation='both'; choose one of error, left, right, middle"):
        RLDataset([str(path)], tok, truncation="both")
