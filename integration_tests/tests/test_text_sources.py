"""`--tokenizer`, `.jsonl` and HF datasets as `--data` (trainer/text_sources.py, data.load_tokens, validation):
documents in order each followed by EOS, the tokenizer's size against the model's, every bad record named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_ARGS, kjv_documents, without_preset_sizes, write_jsonl
from trainer.config import find_problems, parse_args
from trainer.data import ByteTokenizer, load_tokens
from trainer.text_sources import data_kind, load_tokenizer
from trainer.validation import BadInput, validate


def test_jsonl_with_an_hf_tokenizer_is_each_document_then_eos(text_corpus) -> None:
    tokenizer = load_tokenizer(text_corpus["tokenizer"])
    documents = kjv_documents(200)
    tokens = load_tokens(text_corpus["jsonl"], vocab_size=len(tokenizer), tokenizer=tokenizer)
    want: list[int] = []
    for document in documents:  # the reference: the tokenizer itself, one document at a time
        want += [*tokenizer.encode(document, add_special_tokens=False), tokenizer.eos_token_id]
    assert tokens.tolist() == want
    assert tokenizer.decode(tokens[:6]) == "Genesis [UNK] In the [UNK] God"  # a 400-word vocabulary


def test_jsonl_with_the_byte_tokenizer_and_another_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["first doc", "zweites Dokument ü"], field="body")
    tokens = load_tokens(path, vocab_size=256, data_field="body")
    assert ByteTokenizer().decode(tokens) == "first doc\nzweites Dokument ü\n"
    with pytest.raises(ValueError, match=r"line 1 has no string field 'text'.*line 2 has no string field 'text'"):
        load_tokens(path, vocab_size=256)


def test_bad_jsonl_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\nnot json\n\n[1, 2]\n{"text": 3}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON") as info:
        load_tokens(path, vocab_size=256)
    text = str(info.value)
    for expected in ("line 2 is not JSON", "line 4 has no string field 'text'", "line 5 has no string field"):
        assert expected in text, text
    assert str(path) in text


def test_txt_with_an_hf_tokenizer(tmp_path: Path, text_corpus) -> None:
    tokenizer = load_tokenizer(text_corpus["tokenizer"])
    path = tmp_path / "a.txt"
    path.write_text("And God said , Let there be light")
    tokens = load_tokens(path, vocab_size=len(tokenizer), tokenizer=tokenizer)
    assert tokens.tolist() == [*tokenizer.encode(path.read_text(), add_special_tokens=False), tokenizer.eos_token_id]


def test_data_kinds() -> None:
    assert data_kind("x/corpus.jsonl") == "jsonl"
    assert data_kind("roneneldan/TinyStories") == "dataset"  # a hub name: not a path here
    assert data_kind("/no/such/folder/data") == "missing"
    assert data_kind(Path(__file__).parent) == "dataset"  # a folder


def test_preset_takes_the_tokenizer_vocabulary_and_a_folder_model_must_cover_it(tmp_path: Path, text_corpus) -> None:
    out = tmp_path / "out"
    args = [*TINY_ARGS, "--model", "llama", "--tokenizer", str(text_corpus["tokenizer"]), "--out", str(out)]
    validated = validate(parse_args([*args, "--data", str(text_corpus["jsonl"])]), world_size=1)
    spec, model, corpus = validated.spec, validated.model, validated.corpus
    assert spec.vocab_size == 400
    assert model.get_input_embeddings().weight.shape[0] == 400
    assert int(corpus.train.max()) < 400
    assert corpus.val is None
    # An HF folder whose vocabulary is smaller than the tokenizer's: both numbers named.
    from trainer.models import build_model, preset_spec

    small = preset_spec("llama", hidden_size=32, num_layers=2, mtp_depths=0, tie_embeddings=False, vocab_size=300)
    small.save(build_model(small, seed=0), tmp_path / "small")
    with pytest.raises(BadInput, match="has 400 tokens but the model's vocabulary has 300 entries"):
        validate(parse_args([*without_preset_sizes(args), "--model-path", str(tmp_path / "small")]), world_size=1)


def test_tokenizer_and_field_options_that_cannot_apply_are_refused(tmp_path: Path) -> None:
    torch.save(torch.arange(100), tmp_path / "ids.pt")
    cfg = parse_args(
        ["--data", str(tmp_path / "ids.pt"), "--tokenizer", "tok", "--data-field", "body", "--data-split", "x"]
    )
    problems = find_problems(cfg, world_size=1)
    assert len(problems) == 3, problems
    assert "--tokenizer tok applies to text data" in problems[0]
    assert "--data-field body applies to .jsonl files and HF datasets only" in problems[1]
    assert "--data-split x applies to HF datasets only" in problems[2]
    with pytest.raises(BadInput, match=r"--tokenizer .*missing-tokenizer: cannot load an HF tokenizer there"):
        validate(
            parse_args([*TINY_ARGS, "--tokenizer", str(tmp_path / "missing-tokenizer"), "--out", str(tmp_path)]),
            world_size=1,
        )


def test_hf_dataset_folder_as_data(tmp_path: Path, text_corpus) -> None:
    datasets = pytest.importorskip(
        "datasets", reason="the `datasets` package is not installed (optional: pip install datasets)"
    )
    documents = kjv_documents(20)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"story": documents})}).save_to_disk(str(tmp_path / "ds"))
    tokens = load_tokens(tmp_path / "ds", vocab_size=256, data_field="story")
    assert ByteTokenizer().decode(tokens) == "".join(f"{d}\n" for d in documents)
    with pytest.raises(ValueError, match=r"no split 'validation' \(it has \['train'\]\)"):
        load_tokens(tmp_path / "ds", vocab_size=256, data_field="story", data_split="validation")
    with pytest.raises(ValueError, match=r"no column 'text' \(it has \['story'\]\)"):
        load_tokens(tmp_path / "ds", vocab_size=256)


def test_hf_dataset_without_the_datasets_package_says_how_to_install(tmp_path: Path, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError, as when not installed
    (tmp_path / "ds").mkdir()
    with pytest.raises(ValueError, match=r"need the `datasets` package, which is not installed: pip install datasets"):
        load_tokens(tmp_path / "ds", vocab_size=256)
