"""Launch the reference trainer as real processes (torchrun, gloo) and share the runs between tests.

Every launch goes through am-testing (`run_process`, the harness of every multi-rank test in the repository) with a
deadline: a hung run is stopped whole and fails its test with an error naming the run.

Each launch costs ~10-30 s on 2 cores (process start, imports, process groups), so a run is started at most once
per pytest session: `runs.get(name)` launches the named configuration the first time and returns the cached
result afterwards (the single-process references are shared by every parity test that needs them).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from am_testing import DeadlineExceeded, run_process

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train.py"
sys.path.insert(0, str(ROOT))

# Tiny everywhere: hidden 32, 4 layers, 16 tokens, 4 sequences, 3 steps (4 microbatches of 1 for the pipelines).
TINY = ["--hidden-size", "32", "--layers", "4", "--seq-len", "16", "--global-batch", "4", "--steps", "3"]
# fp32 parity runs. Adam's epsilon is raised from 1e-8 to 1e-6 so that an fp32 rounding difference in a gradient
# element that is ~0 (|g| ~ eps) cannot turn into a whole learning-rate step of difference in that weight.
PARITY = [*TINY, "--dtype", "fp32", "--adam-eps", "1e-6", "--no-progress", "--timeout", "60"]
LAUNCH_TIMEOUT_S = 240
# The three am-moe balancing loss terms, large enough to move the router measurably in 3 steps.
GEMMA_AUX_TERMS = ["--moe-aux-loss-coeff", "0.01", "--moe-seq-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
# --tp's options: the stream between the TP regions on sequence shards, the loss over the head's vocabulary shards.
TP_EXTRAS = ["--sequence-parallel", "--loss-parallel"]
# In-process validate() calls: a tiny preset run.
TINY_ARGS = ["--hidden-size", "32", "--layers", "2", "--seq-len", "16", "--global-batch", "4", "--steps", "1"]


def without_preset_sizes(args: list[str]) -> list[str]:
    """`args` without `--hidden-size N` / `--layers N`, which size the presets and are refused with --model-path."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--hidden-size", "--layers"):
            skip = True
        else:
            kept.append(arg)
    return kept


@dataclass
class Run:
    """One finished launch: its command, exit code, output, wall time, and (on success) its summary."""

    args: list[str]
    nproc: int
    out: Path
    returncode: int
    output: str
    wall_s: float
    summary: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # how errors name the run (a RunCache configuration, or the out folder and arguments)

    def check(self) -> Run:
        assert self.returncode == 0, (
            f"trainer run {self.name!r} failed ({self.returncode}): {' '.join(self.args)}\n{self.output[-6000:]}"
        )
        return self

    def final_weights(self) -> dict[str, torch.Tensor]:
        """The HF-format export of the newest checkpoint (safetensors), name -> tensor."""
        from safetensors.torch import load_file

        root = self.out / "checkpoints"
        folder = root / (root / "latest").read_text().strip() / "model"
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(glob.glob(str(folder / "*.safetensors"))):
            weights.update(load_file(path))
        assert weights, f"no safetensors in {folder}"
        return weights


def launch(
    args: list[str],
    *,
    nproc: int,
    out: Path,
    env: dict[str, str] | None = None,
    timeout: float = LAUNCH_TIMEOUT_S,
    script: Path = TRAIN,
    name: str | None = None,
) -> Run:
    """Run train.py (or another entry `script` that calls `trainer.loop.main`) with `nproc` processes (torchrun for
    > 1, plain python for 1) and wait for it, at most `timeout` seconds.

    The launch goes through am-testing's `run_process`: a run still going at `timeout` is stopped with every process
    it started, and `am_testing.DeadlineExceeded` names it (`name`, default the `out` folder and the arguments) with
    each process's stack; a run that fails by itself returns its exit code and output for the test to judge.
    """
    full_args = [*args, "--out", str(out)]
    if nproc == 1:
        command = [sys.executable, str(script), *full_args]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(script), *full_args,
        ]  # fmt: skip
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    label = name or f"{out.name} ({nproc} process{'es' if nproc > 1 else ''}: {' '.join(args)})"
    done = run_process(command, name=label, deadline_s=timeout, env=environment, cwd=ROOT)
    run = Run(command, nproc, out, done.returncode, done.output, done.wall_s, name=label)
    summary = out / "summary.json"
    if done.returncode == 0 and summary.is_file():
        run.summary = json.loads(summary.read_text())
    return run


class RunCache:
    """Named launches, each run at most once per session."""

    CONFIGS: ClassVar[dict[str, tuple[int, list[str]]]] = {
        "nemotron": (1, ["--model", "nemotron", *PARITY]),
        "nemotron-pp2-1f1b": (2, ["--model", "nemotron", "--pp", "2", "--schedule", "1F1B", *PARITY]),
        "nemotron-pp2-interleaved": (
            2,
            ["--model", "nemotron", "--pp", "2", "--schedule", "Interleaved1F1B", "--stages-per-rank", "2", *PARITY],
        ),
        # its HF export in files of at most 16 KB (test_hf_export.py: the writers' budget)
        "nemotron-pp2-dp2": (4, ["--model", "nemotron", "--pp", "2", "--dp", "2", "--hf-shard-size", "16KB", *PARITY]),
        "gemma4-moe": (1, ["--model", "gemma4-moe", *PARITY]),
        "gemma4-moe-cp2-dp2": (4, ["--model", "gemma4-moe", "--cp", "2", "--dp", "2", *PARITY]),
        "gemma4-moe-pp2": (2, ["--model", "gemma4-moe", "--pp", "2", *PARITY]),
        "llama-tied": (1, ["--model", "llama", "--tie-embeddings", *PARITY]),
        "llama-tied-pp2": (2, ["--model", "llama", "--tie-embeddings", "--pp", "2", *PARITY]),
        "gemma4": (1, ["--model", "gemma4", *PARITY]),
        "nemotron-cp2": (2, ["--model", "nemotron", "--cp", "2", *PARITY]),
        "nemotron-pp2-cp2": (4, ["--model", "nemotron", "--pp", "2", "--cp", "2", *PARITY]),
        "gemma4-pp2-cp2": (4, ["--model", "gemma4", "--pp", "2", "--cp", "2", *PARITY]),
        # expert parallelism, carved out of dp x cp: (expert_dp, ep) = (1, 2), (1, 2) per stage, and (2, 2)
        "gemma4-moe-dp2-ep2": (2, ["--model", "gemma4-moe", "--dp", "2", "--ep", "2", *PARITY]),
        "nemotron-pp2-dp2-ep2": (4, ["--model", "nemotron", "--pp", "2", "--dp", "2", "--ep", "2", *PARITY]),
        "nemotron-dp2-ep2-cp2": (4, ["--model", "nemotron", "--dp", "2", "--ep", "2", "--cp", "2", *PARITY]),
        # tensor parallelism (tp innermost): pp x dp x cp x tp processes, ep still carved out of dp x cp
        "llama-tied-tp2": (2, ["--model", "llama", "--tie-embeddings", "--tp", "2", *PARITY]),
        "nemotron-tp2": (2, ["--model", "nemotron", "--tp", "2", *PARITY]),
        "gemma4-tp2-dp2": (4, ["--model", "gemma4", "--tp", "2", "--dp", "2", *PARITY]),
        "nemotron-pp2-tp2": (4, ["--model", "nemotron", "--pp", "2", "--tp", "2", *PARITY]),
        "gemma4-moe-dp2-tp2-ep2": (4, ["--model", "gemma4-moe", "--dp", "2", "--tp", "2", "--ep", "2", *PARITY]),
        # sequence parallelism + the vocabulary-parallel loss (test_tensor_parallel.py), with dp (Nemotron: MoE, MTP,
        # activation checkpointing) and cp (Gemma 4 MoE: ring attention over head-sharded q/k/v; tied head);
        # an HF plan (Mixtral, with its router loss) in test_router_aux.py
        "nemotron-dp2-tp2-sp-lp-ac": (
            4,
            ["--model", "nemotron", "--dp", "2", "--tp", "2", *TP_EXTRAS, "--activation-checkpointing", *PARITY],
        ),
        "gemma4-moe-cp2-tp2-sp-lp": (4, ["--model", "gemma4-moe", "--cp", "2", "--tp", "2", *TP_EXTRAS, *PARITY]),
        # load balancing (issue 25): Nemotron-H runs its recipe by default (bias update 1e-3, sequence aux 1e-4);
        # Gemma 4's recipe is all off, so its parity turns the three loss terms on by flag
        "nemotron-dp2-ep2": (2, ["--model", "nemotron", "--dp", "2", "--ep", "2", *PARITY]),
        "gemma4-moe-aux": (1, ["--model", "gemma4-moe", *PARITY, *GEMMA_AUX_TERMS]),
        "gemma4-moe-aux-dp2-ep2": (2, ["--model", "gemma4-moe", "--dp", "2", "--ep", "2", *PARITY, *GEMMA_AUX_TERMS]),
        # activation checkpointing under expert parallelism: each layer's recompute re-issues the all-to-all, and the
        # expert load / bias-update counts / aux-loss sums skip the recomputed forward (balancing on in both)
        "nemotron-dp2-ep2-ac": (
            2,
            ["--model", "nemotron", "--dp", "2", "--ep", "2", "--activation-checkpointing", *PARITY],
        ),
        "gemma4-moe-aux-dp2-ep2-ac": (
            2,
            [
                "--model",
                "gemma4-moe",
                "--dp",
                "2",
                "--ep",
                "2",
                "--activation-checkpointing",
                *PARITY,
                *GEMMA_AUX_TERMS,
            ],
        ),
        # BackendConfig.enable_fsdp_optimizations (issue 26): the model's FSDP hooks, equal to "nemotron-dp2-ep2"
        "nemotron-dp2-ep2-fsdp-opt": (
            2,
            ["--model", "nemotron", "--dp", "2", "--ep", "2", "--fsdp-optimizations", *PARITY],
        ),
    }

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[str, Run] = {}
        self.late: dict[str, DeadlineExceeded] = {}  # a hung configuration fails every test that needs it, once

    def get(self, name: str) -> Run:
        if name in self.late:
            raise self.late[name]
        if name not in self.runs:
            nproc, args = self.CONFIGS[name]
            try:
                self.runs[name] = launch(args, nproc=nproc, out=self.root / name, name=name)
            except DeadlineExceeded as late:
                self.late[name] = late
                raise
        return self.runs[name]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("runs"))


# ------------------------------------------------------------------------------------------------------------------
# Text data and a tokenizer built offline (the training-feature tests)
# ------------------------------------------------------------------------------------------------------------------

KJV = ROOT / "data" / "kjv_genesis_exodus.txt"
EXAMPLE_CONFIG = ROOT / "configs" / "example.toml"


def kjv_documents(count: int) -> list[str]:
    """The first `count` paragraphs (blank-line separated chunks of lines) of the embedded text, as documents."""
    lines = [line for line in KJV.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [" ".join(lines[i : i + 3]) for i in range(0, 3 * count, 3)]


def write_jsonl(path: Path, documents: list[str], *, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: doc, "id": i}) + "\n" for i, doc in enumerate(documents)))
    return path


def make_tokenizer(folder: Path, documents: list[str], *, vocab_size: int = 400) -> Path:
    """A word-level HF tokenizer trained on `documents` (no network), saved with `save_pretrained`: vocabulary
    `vocab_size` including [UNK], [PAD], [EOS]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator(
        documents, trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "[PAD]", "[EOS]"])
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`jsonl`: 200 documents of the embedded text; `tokenizer`: a word-level tokenizer folder trained on them."""
    root = tmp_path_factory.mktemp("text")
    documents = kjv_documents(200)
    return {
        "jsonl": write_jsonl(root / "kjv.jsonl", documents),
        "tokenizer": make_tokenizer(root / "tokenizer", documents),
    }


@pytest.fixture
def one_rank_group(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real one-rank gloo process group (file rendezvous in `tmp_path`) for in-process checks of collective code
    (checkpoint writes, evaluation); destroyed afterwards, so later tests see no process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
