"""In-process checks of `trainer.validation.validate` and the loaders it asks (no process group): every problem a
run is refused for, in the user's terms. The multi-rank proof (exit code 2 on every rank, before any rendezvous) is
in test_bad_input.py, with a few launches that gather many of these problems each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from trainer.checkpoint import MANIFEST_FILE, STATE_FILE, _sha256, existing_checkpoints, verify_checkpoint
from trainer.config import find_problems, parse_args
from trainer.data import load_tokens
from trainer.models import build_model, preset_spec
from trainer.validation import BadInput, validate

TINY = ["--hidden-size", "32", "--layers", "2", "--seq-len", "16", "--global-batch", "4", "--steps", "1"]
FOLDER = ["--seq-len", "16", "--global-batch", "4", "--steps", "1"]  # a --model-path run: the folder sets the size


def _refusal(args: list[str], *, world_size: int = 1) -> str:
    with pytest.raises(BadInput) as info:
        validate(parse_args(args), world_size=world_size)
    return str(info.value)


def _saved_folder(name: str, folder: Path, *, layers: int = 2) -> Path:
    spec = preset_spec(name, hidden_size=32, num_layers=layers, mtp_depths=1, tie_embeddings=False, vocab_size=None)
    spec.save(build_model(spec, seed=0), folder)
    return folder


def _edit_tensors(folder: Path, *, drop: str, add: str) -> None:
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    del tensors[drop]
    tensors[add] = torch.zeros(3)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"Genesis\n\xff\xfe more", r"is not UTF-8 text: byte offset 8 holds b'\\xff'"),
        (b"", "the file is empty"),
    ],
    ids=["not-utf8", "empty"],
)
def test_text_data_problems_name_the_file_and_offset(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=expected) as info:
        load_tokens(path, vocab_size=256)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"not a torch file", r"cannot be read as a torch.save file \(UnpicklingError"),
        ({"ids": torch.arange(5)}, "expected a 1-D integer tensor, got a dict"),
        (torch.rand(10), r"got a torch.float32 tensor of shape \(10,\)"),
        (torch.zeros(2, 5, dtype=torch.int64), r"got a torch.int64 tensor of shape \(2, 5\)"),
        (torch.zeros(0, dtype=torch.int64), "the corpus is empty"),
    ],
    ids=["garbage", "dict", "float", "2d", "empty"],
)
def test_pt_data_problems_are_value_errors(tmp_path: Path, payload: object, expected: str) -> None:
    path = tmp_path / "ids.pt"
    if isinstance(payload, bytes):
        path.write_bytes(payload)
    else:
        torch.save(payload, path)
    with pytest.raises(ValueError, match=expected):
        load_tokens(path, vocab_size=256)


def test_empty_bin_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ids.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="the file is empty"):
        load_tokens(tmp_path / "ids.bin", vocab_size=256)


def test_numbers_that_are_not_finite_or_out_of_range_are_each_named() -> None:
    args = ["--lr", "nan", "--min-lr", "-1", "--weight-decay", "inf", "--timeout", "nan", "--threads", "-2"]
    cfg = parse_args([*args, "--adam-eps", "0", "--resume", "latest", "--overwrite"])
    problems = find_problems(cfg, world_size=1)
    text = "\n".join(problems)
    for expected in (
        "--lr nan: must be a finite number",
        "--weight-decay inf: must be a finite number",
        "--timeout nan: must be a finite number",
        "--threads -2: must be >= 0",
        "--overwrite with --resume latest",
    ):
        assert expected in text, f"{expected!r} not in\n{text}"
    # Issue 22: a non-finite value hides no other problem: --min-lr -1 and --adam-eps 0 are named next to the NaNs.
    assert "--lr nan, --min-lr -1.0, --warmup-steps 20: need lr > 0, 0 <= min-lr <= lr" in text, text
    assert "--grad-clip 1.0, --weight-decay inf, --adam-eps 0.0: need grad-clip >= 0" in text, text
    assert len(problems) == 7, problems
    negative = find_problems(parse_args(["--lr", "-0.1", "--timeout", "inf"]), world_size=1)
    assert any("need lr > 0" in p for p in negative), negative
    assert any("--timeout inf: must be a finite number" in p for p in negative), negative
    huge = find_problems(parse_args(["--timeout", "1e12"]), world_size=1)
    assert huge == ["--timeout 1000000000000.0: must be > 0 and at most 604800 seconds (a week)"]


def test_out_that_cannot_be_written_is_refused_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    message = _refusal(["--model", "llama", *TINY, "--out", str(blocker / "run")])
    assert f"--out {blocker / 'run'}: {blocker} is a file, so the folder cannot be created" in message
    message = _refusal(["--model", "llama", *TINY, "--out", str(blocker)])
    assert f"--out {blocker} is a file, not a folder" in message
    assert not (tmp_path / "a-file" / "run").exists()


def test_a_fresh_run_into_an_out_with_checkpoints_needs_resume_or_overwrite(tmp_path: Path) -> None:
    step = tmp_path / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000005.tmp").mkdir()  # an unfinished write is no checkpoint
    (tmp_path / "checkpoints" / "latest").write_text(step.name)
    assert existing_checkpoints(tmp_path) == ["step_00000004", "latest"]
    message = _refusal(["--model", "llama", *TINY, "--out", str(tmp_path)])
    assert f"--out {tmp_path} already holds checkpoints (step_00000004, latest)" in message
    assert "--resume latest, choose another --out, or pass --overwrite" in message
    validate(parse_args(["--model", "llama", *TINY, "--out", str(tmp_path), "--overwrite"]), world_size=1)
    assert step.is_dir(), "validation deletes nothing; the run does, after the process group exists"
    resumed = _refusal(["--model", "llama", *TINY, "--out", str(tmp_path), "--resume", "latest"])
    assert "already holds checkpoints" not in resumed  # resuming is what the checkpoints are for
    assert "has no manifest.json: it is incomplete" in resumed


@pytest.mark.parametrize(
    ("preset", "drop"),
    [("llama", "model.layers.1.post_attention_layernorm.weight"), ("nemotron", "backbone.layers.0.mixer.A_log")],
)
def test_model_path_missing_a_tensor_is_refused_in_the_files_names(tmp_path: Path, preset: str, drop: str) -> None:
    folder = _saved_folder(preset, tmp_path / "model")
    _edit_tensors(folder, drop=drop, add="model.extra_scale")
    message = _refusal([*FOLDER, "--model-path", str(folder), "--out", str(tmp_path / "out")])
    assert f"missing keys (1): ['{drop}']" in message, message
    assert "unexpected keys (1): ['model.extra_scale']" in message, message
    assert "_fp32_params" not in message


def test_model_path_with_tied_head_loads_without_lm_head_tensor(tmp_path: Path) -> None:
    """The allow-listed case: a tied head has no tensor of its own in the folder."""
    spec = preset_spec("llama", hidden_size=32, num_layers=2, mtp_depths=0, tie_embeddings=True, vocab_size=None)
    spec.save(build_model(spec, seed=0), tmp_path / "tied")
    (path,) = (tmp_path / "tied").glob("*.safetensors")
    assert "lm_head.weight" not in load_file(path)
    model = validate(
        parse_args([*FOLDER, "--model-path", str(tmp_path / "tied"), "--out", str(tmp_path)]), world_size=1
    ).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_pp_larger_than_the_layers_of_a_model_path_is_refused(tmp_path: Path) -> None:
    folder = _saved_folder("llama", tmp_path / "model", layers=2)
    message = _refusal(
        [*FOLDER, "--model-path", str(folder), "--pp", "4", "--out", str(tmp_path / "out")], world_size=4
    )
    assert "Number of stages (4) cannot exceed number of layers (2)" in message, message


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(folder)): _sha256(p) for p in files}
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": manifest}))


def test_manifest_covers_the_trainer_state_and_every_file(tmp_path: Path) -> None:
    folder = tmp_path / "step_00000002"
    (folder / "dcp").mkdir(parents=True)
    (folder / "dcp" / "0.distcp").write_bytes(b"weights")
    (folder / STATE_FILE).write_text(json.dumps({"step": 2, "losses": []}))
    _write_manifest(folder)
    assert verify_checkpoint(folder) == []
    (folder / STATE_FILE).write_text(json.dumps({"step": 1, "losses": []}))  # a tampered step counter
    (folder / "dcp" / "extra").write_bytes(b"?")
    assert verify_checkpoint(folder) == [
        f"checkpoint {folder}: {STATE_FILE} is corrupt (its sha256 differs from the manifest)",
        f"checkpoint {folder}: dcp/extra is not in the manifest (added after the checkpoint was written?)",
    ]


# ------------------------------------------------------------------------------------------------------------------
# Issue 22: non-finite weights in --model-path, preset sizes with --model-path, non-UTF-8 .jsonl, messages' labels
# ------------------------------------------------------------------------------------------------------------------


def test_model_path_with_a_nan_or_inf_tensor_is_refused_naming_tensor_and_file(tmp_path: Path) -> None:
    import torch.distributed as dist

    folder = _saved_folder("llama", tmp_path / "model")
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.mlp.down_proj.weight"][0, :3] = float("nan")
    tensors["model.norm.weight"][0] = float("inf")
    save_file(tensors, path, metadata={"format": "pt"})
    message = _refusal([*FOLDER, "--model-path", str(folder), "--out", str(tmp_path / "out")])
    assert (
        f"--model-path {folder}: tensor 'model.layers.1.mlp.down_proj.weight' in {path.name} holds 3 NaN value(s)"
        in message
    ), message
    assert f"tensor 'model.norm.weight' in {path.name} holds 1 infinite value(s) of 32" in message, message
    assert "refusing to start (2 problems)" in message, message
    assert not dist.is_initialized(), "refused before any process group"


def test_the_nan_check_of_a_model_path_is_split_over_the_ranks(tmp_path: Path, one_rank_group: None) -> None:
    """Issue 23: an N-rank job does not read every tensor on every rank to look for NaN / inf. Each of the N parts
    reads only its share (disjoint, together every tensor once, each about 1 / N of the bytes), and the lines of all
    parts are the one-process lines; validation at world size 2 leaves the check to the ranks, and the loop's
    `refuse_nonfinite_weights` refuses with every rank's lines (BadInput: exit code 2 on every rank)."""
    from trainer.guards import _value_check_share, model_path_nonfinite_problems
    from trainer.loop import refuse_nonfinite_weights

    folder = _saved_folder("llama", tmp_path / "model", layers=4)
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    bad = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.up_proj.weight", "model.norm.weight"]
    for key in bad:
        tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    whole = model_path_nonfinite_problems(folder)
    assert len(whole) == 3
    sizes = [(path.name, key, t.numel() * t.element_size()) for key, t in tensors.items()]
    shares = [_value_check_share(sizes, part=part, parts=2) for part in range(2)]
    assert not shares[0] & shares[1]
    assert shares[0] | shares[1] == {(path.name, key) for key in tensors}
    total = sum(size for _, _, size in sizes)
    biggest = max(size for _, _, size in sizes)
    for share in shares:  # greedy by bytes: each part within one tensor of half the checkpoint
        held = sum(size for file, key, size in sizes if (file, key) in share)
        assert abs(held - total / 2) <= biggest, (held, total)
    parts = [model_path_nonfinite_problems(folder, part=part, parts=2) for part in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(whole)
    assert all(parts), "these three tensors are not all in one share"

    args = [*FOLDER, "--model-path", str(folder), "--out", str(tmp_path / "out")]
    assert validate(parse_args([*args, "--dp", "2"]), world_size=2).plan.dp == 2, "N ranks: checked after the group"
    cfg = parse_args(args)
    with pytest.raises(BadInput) as info:  # on a one-rank group: its one part is the whole check
        refuse_nonfinite_weights(cfg)
    assert str(info.value).startswith("refusing to start (3 problems):"), info.value
    assert all(line in str(info.value) for line in whole), info.value


def test_a_model_path_with_only_bin_weights_is_refused_up_front_with_the_conversion(tmp_path: Path) -> None:
    """Issue 23: a folder of PyTorch `.bin` weights (no safetensors) is refused in one line that says so and how to
    convert it, next to the other problems, before any process group (not a loader's FileNotFoundError)."""
    import torch.distributed as dist

    folder = _saved_folder("llama", tmp_path / "model")
    (path,) = folder.glob("*.safetensors")
    torch.save(load_file(path), folder / "pytorch_model.bin")
    path.unlink()
    message = _refusal([*FOLDER, "--model-path", str(folder), "--lr", "nan", "--out", str(tmp_path / "out")])
    assert "refusing to start (2 problems)" in message, message
    assert (
        f"--model-path {folder} holds PyTorch .bin weights (pytorch_model.bin) and no safetensors (model.safetensors "
        "or model.safetensors.index.json): the trainer reads safetensors only, each rank just its own slices; convert "
        "it once, e.g. python -c"
    ) in message, message
    assert f"save_pretrained('{folder}-safetensors')" in message, message
    assert "--lr nan: must be a finite number" in message
    assert "cannot build the model" not in message
    assert not dist.is_initialized()
    (folder / "pytorch_model.bin").unlink()
    message = _refusal([*FOLDER, "--model-path", str(folder), "--out", str(tmp_path / "out")])
    assert f"--model-path {folder} holds no weights (no model.safetensors" in message, message


def test_preset_sizes_with_a_model_path_are_refused(tmp_path: Path) -> None:
    folder = _saved_folder("llama", tmp_path / "model")
    base = ["--seq-len", "16", "--global-batch", "4", "--steps", "1", "--model-path", str(folder)]
    (problem,) = find_problems(parse_args([*base, "--hidden-size", "32", "--layers", "2"]), world_size=1)
    assert problem == (
        "--hidden-size 32 and --layers 2 size the presets (--model), not a --model-path model, whose config.json "
        "sets its size: drop them"
    )
    assert find_problems(parse_args(base), world_size=1) == []
    cfg = parse_args(["--model", "llama"])
    assert (cfg.hidden_size, cfg.layers) == (None, None), "not given: the preset's defaults (64, 4) apply"
    model = validate(
        parse_args(["--model", "llama", "--seq-len", "16", "--steps", "1", "--out", str(tmp_path)]), world_size=1
    ).model
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 4)


def test_a_jsonl_line_that_is_not_utf8_is_named_with_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "In the beginning"}\n{"text": "caf\xe9"}\n{"text": "ok"}\n')
    message = _refusal(["--model", "llama", *TINY, "--data", str(path), "--out", str(tmp_path / "out")])
    assert f"--data {path}: line 2 is not UTF-8 text (byte 13 of the line holds b'\\xe9')" in message, message


def test_the_pp_x_cp_refusal_names_the_model_path_it_was_given(tmp_path: Path) -> None:
    from trainer.config import cp_problems

    cfg = parse_args(["--model-path", str(tmp_path / "m"), "--pp", "2", "--cp", "2", "--seq-len", "16"])
    (problem,) = cp_problems(cfg, cp_layout="load_balanced", pad_multiple=2)
    assert f"and --model-path {tmp_path / 'm'} uses the load_balanced layout" in problem, problem
    assert "--model nemotron" not in problem


def _hf_folder(folder: Path, config: object) -> Path:
    import transformers

    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_a_pipeline_that_cannot_reproduce_the_forward_is_refused_before_the_process_group(tmp_path: Path) -> None:
    """Issue 22 item 5: Phi at --pp 2 (its final LayerNorm lies outside the generic stage forward) is refused by
    validation, naming the module, instead of by the stage split on every rank after init_process_group."""
    import transformers

    config = transformers.PhiConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    folder = _hf_folder(tmp_path / "phi", config)
    message = _refusal([*FOLDER, "--model-path", str(folder), "--pp", "2", "--out", str(tmp_path / "o")], world_size=2)
    assert "--pp 2: PhiForCausalLM: model.final_layernorm (LayerNorm) is part of the model's own forward" in message


def test_attention_the_ring_cannot_honour_is_refused_before_the_process_group(tmp_path: Path) -> None:
    """Issue 22 item 5: an HF model with attention dropout at --cp 2 is refused by validation (am-context-parallel's
    `cp_attention_problems`), not by the CP context on every rank after init_process_group."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.1,
    )
    folder = _hf_folder(tmp_path / "llama", config)
    message = _refusal([*FOLDER, "--model-path", str(folder), "--cp", "2", "--out", str(tmp_path / "o")], world_size=2)
    assert "--cp 2: LlamaForCausalLM: attention dropout [0.1] is not supported by ring attention" in message


@pytest.mark.parametrize(
    ("preset", "tensor"),
    [("llama", "model.layers.0.mlp.up_proj.weight"), ("nemotron", "backbone.layers.0.mixer.out_proj.weight")],
)
def test_model_path_tensor_of_the_wrong_shape_is_named_with_both_shapes(
    tmp_path: Path, preset: str, tensor: str
) -> None:
    """Issue 22 item 8: not transformers' "look at the above report", but the tensor, the file's shape and the
    model's, in the one refusal."""
    folder = _saved_folder(preset, tmp_path / "model")
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    model_shape = list(tensors[tensor].shape)
    tensors[tensor] = torch.zeros(model_shape[0] + 4, *model_shape[1:])
    save_file(tensors, path, metadata={"format": "pt"})
    message = _refusal([*FOLDER, "--model-path", str(folder), "--out", str(tmp_path / "out")])
    assert "above report" not in message, message
    assert tensor in message, message
    wrong = (model_shape[0] + 4, *model_shape[1:])
    assert f"{tensor}: checkpoint {wrong} vs model {tuple(model_shape)}" in message, message
