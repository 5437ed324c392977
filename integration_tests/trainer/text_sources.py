"""Text sources of the reference trainer: `.jsonl` records, HF datasets, and an HF tokenizer (`--tokenizer`).

What it is for: turning `--data` into a list of documents (`read_documents`: a `.jsonl` file's `--data-field`
values, an HF dataset's column: a folder saved with `save_to_disk`, a folder of data files, or a hub name, through
`datasets`), loading `--tokenizer` (transformers' `AutoTokenizer`, offline unless the folder is a hub id), and encoding
documents into one token stream (`encode_documents`: documents in order, each followed by the tokenizer's EOS token
when it has one, so a window that crosses a boundary sees where a document ended).
What it must not do: import `datasets` or `transformers` before they are needed (a run on plain text needs neither),
or decide batching (data.py's `BatchStream` does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.config import RunConfig

DEFAULT_FIELD = "text"
DEFAULT_SPLIT = "train"
TEXT_SUFFIXES = (".txt", ".jsonl")
TOKEN_SUFFIXES = (".pt", ".bin")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
INSTALL_DATASETS = "pip install datasets (or uv pip install datasets)"


def data_kind(source: str | Path) -> str:
    """What a `--data` / `--val-data` value is: "txt", "jsonl", "pt", "bin" (a file, by suffix), "dataset" (a folder,
    or a hub name such as `roneneldan/TinyStories` that is not a path here), or "missing" (a path that does not exist,
    to be reported by the loader)."""
    path = Path(source)
    suffix = path.suffix.lower()
    if path.is_dir():
        return "dataset"
    if suffix in TEXT_SUFFIXES + TOKEN_SUFFIXES:
        return suffix[1:]
    if path.exists():
        return "unknown"
    return "dataset" if _HUB_NAME.match(str(source)) else "missing"


def data_option_problems(cfg: RunConfig) -> list[str]:
    """`--tokenizer`, `--data-field` and `--data-split` must apply to the data they are given with."""
    from trainer.data import DEFAULT_TEXT

    problems = []
    sources = [s for s in (cfg.data if cfg.data is not None else str(DEFAULT_TEXT), cfg.val_data) if s is not None]
    kinds = {data_kind(s) for s in sources}
    if cfg.tokenizer is not None and kinds & {"pt", "bin"}:
        problems.append(
            f"--tokenizer {cfg.tokenizer} applies to text data (.txt, .jsonl, HF datasets), but {', '.join(sources)} "
            "holds token ids already; drop --tokenizer or give text"
        )
    if cfg.data_field is not None and not kinds & {"jsonl", "dataset"}:
        problems.append(f"--data-field {cfg.data_field} applies to .jsonl files and HF datasets only")
    if cfg.data_split is not None and "dataset" not in kinds:
        problems.append(f"--data-split {cfg.data_split} applies to HF datasets only")
    return problems


# ------------------------------------------------------------------------------------------------------------------
# Documents
# ------------------------------------------------------------------------------------------------------------------


def read_jsonl(path: Path, *, field: str, label: str = "--data") -> list[str]:
    """The `field` string of every record of a JSON-lines file (blank lines skipped).

    Raises:
        ValueError: a line that is not UTF-8 or not a JSON object, or a record without a string `field` (the file
            and up to five line numbers named).
    """
    documents, bad = [], []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named like any other bad line
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad.append(
                    f"line {number} is not UTF-8 text (byte {exc.start} of the line holds "
                    f"{raw[exc.start : exc.start + 1]!r})"
                )
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                bad.append(f"line {number} is not JSON ({exc.msg})")
                continue
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                bad.append(f"line {number} has no string field {field!r}")
                continue
            documents.append(value)
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(f"{label} {path}: {'; '.join(bad[:5])}{more} (choose the field with --data-field)")
    return documents


def read_dataset(source: str, *, field: str, split: str, label: str = "--data") -> list[str]:
    """The `field` column of an HF dataset: a folder written by `save_to_disk` (`load_from_disk`), a folder of data
    files or a hub name (`load_dataset`), taking `split` of a dataset dictionary.

    Raises:
        ValueError: `datasets` is missing, the dataset cannot be loaded, or has no such split or string column.
    """
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"HF datasets need the `datasets` package, which is not installed: {INSTALL_DATASETS}"
        ) from None
    path = Path(source)
    try:
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(source)
    except Exception as exc:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ConnectionError)
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{label} {source}: cannot load it as an HF dataset ({type(exc).__name__}: {first_line})"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"{label} {source}: no split {split!r} (it has {sorted(loaded)}); choose one with --data-split"
            )
        loaded = loaded[split]
    if field not in loaded.column_names:
        raise ValueError(
            f"{label} {source}: no column {field!r} (it has {loaded.column_names}); choose one with --data-field"
        )
    column = loaded[field]
    if not all(isinstance(value, str) for value in column):
        raise ValueError(f"{label} {source}: column {field!r} does not hold strings only")
    return list(column)


def read_documents(
    source: str | Path, *, data_field: str | None, data_split: str | None, label: str = "--data"
) -> list[str]:
    """The documents of a `.jsonl` file or an HF dataset (see `data_kind`); `label` names the option in messages."""
    field = data_field or DEFAULT_FIELD
    if data_kind(source) == "jsonl":
        return read_jsonl(Path(source), field=field, label=label)
    return read_dataset(str(source), field=field, split=data_split or DEFAULT_SPLIT, label=label)


# ------------------------------------------------------------------------------------------------------------------
# Tokenizers
# ------------------------------------------------------------------------------------------------------------------


def load_tokenizer(path: str | Path) -> Any:
    """An HF tokenizer (`AutoTokenizer.from_pretrained(path)`): a folder with tokenizer.json / tokenizer_config.json.

    Raises:
        ValueError: nothing loadable there (the loader's message included).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises OSError, ValueError, EnvironmentError, ... for a bad folder
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"--tokenizer {path}: cannot load an HF tokenizer there ({type(exc).__name__}: {first_line}); give a "
            "folder written by tokenizer.save_pretrained (tokenizer.json, tokenizer_config.json)"
        ) from None


def encode_documents(documents: Sequence[str], tokenizer: Any) -> torch.Tensor:
    """int64 token ids `[N]`: each document's tokens (no BOS or other added specials), then the EOS id if the
    tokenizer has one."""
    if not documents:
        return torch.zeros(0, dtype=torch.int64)
    encoded = tokenizer(list(documents), add_special_tokens=False, verbose=False)["input_ids"]
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for document in encoded:
        ids.extend(document)
        if eos is not None:
            ids.append(int(eos))
    return torch.tensor(ids, dtype=torch.int64)


__all__ = [
    "DEFAULT_FIELD",
    "DEFAULT_SPLIT",
    "data_kind",
    "data_option_problems",
    "encode_documents",
    "load_tokenizer",
    "read_dataset",
    "read_documents",
    "read_jsonl",
]
