"""`--config run.toml` (trainer/config_file.py): the file's values under the command line, every bad key named."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import EXAMPLE_CONFIG
from trainer.config import find_problems, parse_args


def test_file_values_become_options_and_the_command_line_wins(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text('model = "llama"\nglobal-batch = 16\nlr = 1\nprogress = false\nout = "somewhere"\nseq_len = 32\n')
    cfg = parse_args(["--config", str(run), "--seq-len", "64"])
    assert (cfg.model, cfg.global_batch, cfg.progress, cfg.out) == ("llama", 16, False, Path("somewhere"))
    assert cfg.lr == 1.0
    assert isinstance(cfg.lr, float)
    assert cfg.seq_len == 64, "the command line overrides the file"
    assert cfg.config == str(run)
    assert parse_args([]).model == "nemotron", "the file changed nothing outside its own parse"


def test_every_unknown_key_and_wrong_value_is_listed_at_once(tmp_path: Path, capsys) -> None:
    run = tmp_path / "bad.toml"
    run.write_text(
        'modle = "llama"\nbatch = 4\nsteps = "ten"\ndtype = "fp16"\nprogress = 1\noverwrite = "yes"\nlr = true\n'
    )
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", str(run)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for expected in (
        "6 problems",
        "unknown keys ['modle', 'batch']",
        "steps = 'ten': --steps takes an integer",
        "dtype = 'fp16': --dtype must be one of bf16, bf16-pure, fp32",
        "progress = 1: --no-progress is a switch; write progress = true or false",
        "overwrite = 'yes': --overwrite is a switch",
        "lr = true: --lr takes a value, not true/false",
    ):
        assert expected in err, f"{expected!r} not in\n{err}"


def test_unreadable_files_are_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "missing.toml")])
    assert "missing.toml: no such file" in capsys.readouterr().err
    (tmp_path / "broken.toml").write_text("model = \n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "broken.toml")])
    assert "cannot be read as TOML" in capsys.readouterr().err


def test_the_example_config_parses_to_a_valid_run() -> None:
    cfg = parse_args(["--config", str(EXAMPLE_CONFIG)])
    assert (cfg.optimizer, cfg.lr_schedule, cfg.val_every, cfg.activation_checkpointing) == ("sgd", "linear", 2, True)
    assert find_problems(cfg, world_size=1) == []
