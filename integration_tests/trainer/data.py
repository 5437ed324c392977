"""Training data for the reference trainer: a byte-level tokenizer and a deterministic, resumable batch stream.

What it is for: turning a corpus (a UTF-8 text file, `.jsonl` records or an HF dataset, tokenized one byte = one
token or by `--tokenizer`; or a token file) into fixed-length training windows, the same on every rank, with a cursor
that a checkpoint stores so `--resume` continues exactly. `.jsonl` and HF datasets are read by text_sources.py.
What it must not do: download anything itself, or depend on the rank layout (every rank computes the same global
batch and takes its data-parallel slice).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "kjv_genesis_exodus.txt"


class ByteTokenizer:
    """One token per UTF-8 byte: vocab 256, nothing to download, round-trips any text exactly."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """`text` -> int64 token ids `[N]`."""
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        data = bytes(int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids))
        return data.decode("utf-8", errors="replace")


def load_tokens(
    path: str | Path | None,
    *,
    vocab_size: int,
    tokenizer: Any = None,
    data_field: str | None = None,
    data_split: str | None = None,
    label: str = "--data",
) -> torch.Tensor:
    """Load a corpus as int64 token ids `[N]`.

    Formats: `.txt` (UTF-8 text), `.jsonl` (one JSON record per line, text in `data_field`, default "text"), an HF
    dataset (a folder or a hub name; `data_field` column of `data_split`, default "train"; needs `datasets`), `.pt`
    (a 1-D integer tensor saved with `torch.save`), `.bin` (little-endian uint16 ids, the nanoGPT convention). None
    means the embedded text. Text is tokenized by `tokenizer` (an HF tokenizer; text_sources.encode_documents) or,
    when None, one token per UTF-8 byte; documents of `.jsonl` / datasets are each followed by the tokenizer's EOS
    token (a newline byte for the byte tokenizer). `label` names the option in messages (`--val-data`).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: unknown suffix, empty file, a `.txt` that is not UTF-8 (file and byte offset named), a `.pt`
            that cannot be read or holds no 1-D integer tensor, a bad `.jsonl` record or dataset, or ids outside
            `[0, vocab_size)`.
    """
    from trainer.text_sources import data_kind, encode_documents, read_documents

    kind = data_kind(path) if path is not None else "txt"
    path = Path(path) if path is not None else DEFAULT_TEXT
    missing = f"{label} {path}: no such file (give a .txt, .jsonl, .pt or .bin file, or an HF dataset)"
    if kind == "missing":
        raise FileNotFoundError(missing)
    if kind == "unknown":
        raise ValueError(
            f"{label} {path}: unknown format {path.suffix.lower()!r}; use .txt, .jsonl, .pt (int tensor), "
            ".bin (uint16) or an HF dataset folder"
        )
    if kind != "dataset" and not path.is_file():
        raise FileNotFoundError(missing)
    if kind in ("jsonl", "dataset"):
        documents = read_documents(
            path if kind == "jsonl" else str(path), data_field=data_field, data_split=data_split, label=label
        )
        if tokenizer is None:
            tokens = ByteTokenizer().encode("".join(f"{document}\n" for document in documents))
        else:
            tokens = encode_documents(documents, tokenizer)
    elif kind == "pt":
        tokens = _load_pt(path, label=label)
    else:
        raw = path.read_bytes()
        if not raw:
            raise ValueError(f"{label} {path}: the file is empty; give a corpus with at least --seq-len + 2 tokens")
        if kind == "txt":
            text = _utf8_text(path, raw, label=label)
            tokens = ByteTokenizer().encode(text) if tokenizer is None else encode_documents([text], tokenizer)
        else:
            if len(raw) % 2:
                raise ValueError(f"{label} {path}: a .bin file holds uint16 ids, but its size {len(raw)} is odd")
            tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint16).to(torch.int64)
    if tokens.numel() == 0:
        raise ValueError(f"{label} {path}: the corpus is empty")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{label} {path}: token ids span [{low}, {high}] but the model's vocabulary has {vocab_size} entries; "
            "re-tokenize the data or build the model with a larger vocab_size"
        )
    return tokens


def _utf8_text(path: Path, raw: bytes, *, label: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{label} {path} is not UTF-8 text: byte offset {exc.start} holds {raw[exc.start : exc.start + 1]!r} "
            f"({exc.reason}); convert the file to UTF-8, or give token ids as .pt or .bin"
        ) from None


def _load_pt(path: Path, *, label: str) -> torch.Tensor:
    """A 1-D integer tensor from a `torch.save` file (weights-only unpickling: no code runs)."""
    try:
        tokens = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling raises many types (UnpicklingError, RuntimeError, EOFError, ...)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(
            f"{label} {path}: cannot be read as a torch.save file ({type(exc).__name__}: {first_line}); save a 1-D "
            "integer tensor with torch.save(ids, path)"
        ) from None
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"{label} {path}: expected a 1-D integer tensor, got a {type(tokens).__name__}")
    if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(
            f"{label} {path}: expected a 1-D integer tensor of token ids, got a {tokens.dtype} tensor of shape "
            f"{tuple(tokens.shape)}"
        )
    return tokens.to(torch.int64)


@dataclass(frozen=True)
class Corpus:
    """The run's tokens: `train` int64 `[N]` (the training stream's only source) and `val` int64 `[M]`, the held-out
    tokens of `--val-fraction` / `--val-data` (None without validation)."""

    train: torch.Tensor
    val: torch.Tensor | None = None


@dataclass
class BatchStream:
    """Deterministic stream of `[global_batch, seq_len + 1]` windows over a token corpus.

    Window k starts at `(k * seq_len) % (N - seq_len - 1)`: consecutive, non-overlapping windows that wrap around
    the corpus. `position` counts the windows consumed so far; it is all the state a resume needs.
    """

    tokens: torch.Tensor
    seq_len: int
    global_batch: int
    position: int = 0

    def __post_init__(self) -> None:
        if self.tokens.numel() < self.seq_len + 2:
            raise ValueError(
                f"the corpus has {self.tokens.numel()} tokens, too few for --seq-len {self.seq_len}; "
                "use more data or a shorter sequence"
            )

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next global batch: `(input_ids, labels)`, both int64 `[global_batch, seq_len]`; labels are shifted."""
        span = self.tokens.numel() - self.seq_len - 1
        starts = [((self.position + i) * self.seq_len) % span for i in range(self.global_batch)]
        windows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])
        self.position += self.global_batch
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seq_len": self.seq_len, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["seq_len"], state["global_batch"]) != (self.seq_len, self.global_batch):
            raise ValueError(
                f"the checkpoint was written with seq_len={state['seq_len']}, global_batch={state['global_batch']}; "
                f"this run has seq_len={self.seq_len}, global_batch={self.global_batch}: resume with the same values"
            )
        self.position = int(state["position"])
