"""The seed API called exactly as NeMo AutoModel documents it (pre-refactor `cp_utils`, `thd_utils`,
`gemma4_moe/cp_batch`): positional order, defaults and the documented vectors. The single-process cases fake a C=2
mesh (no collective runs in those paths); the torch-style entry points (`am_context_parallel.upstream`) run on one
real 2-rank gloo group per module, checked against the same model on the unsharded sequence."""

from __future__ import annotations

import contextlib
import inspect
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _cp_dist import case_result, run_cases, run_group
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh

from am_context_parallel import (
    LoadBalancedLayout,
    all_reduce_cp_gradients,
    make_cp_batch_for_te,
    process_input_for_thd,
    split_batch_into_thd_chunks,
)
from am_context_parallel.upstream import (
    _ring_sdpa,
    attach_context_parallel_hooks,
    attach_cp_sdpa_hooks,
    create_context_parallel_ctx,
    get_train_context,
    make_contiguous_shard_cp_batch_and_ctx,
    make_cp_batch_and_ctx,
    unshard_context_parallel_tensor,
)
from am_testing import root_api_problems


def _fake_cp_mesh(size: int, rank: int) -> object:
    return types.SimpleNamespace(
        size=lambda *_: size, get_local_rank=lambda *_: rank, get_group=lambda *_: None, mesh_dim_names=("cp",)
    )


def _packed_batch() -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.arange(1, 13).view(2, 6),
        "labels": torch.arange(1, 13).view(2, 6),
        "position_ids": torch.arange(6).repeat(2, 1),
        "seq_lens": torch.tensor([[3, 2], [6, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, -1000]]),
    }


def test_make_cp_batch_and_ctx_positional_without_mesh():
    assert list(inspect.signature(make_cp_batch_and_ctx).parameters)[:8] == [
        "device_mesh",
        "batch",
        "loss_mask",
        "use_te",
        "padding_token_id",
        "num_chunks",
        "seq_lens_padding_value",
        "extra_seq_buffers",
    ]
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long)}
    ctx, out = make_cp_batch_and_ctx(None, batch, None, False, 0, 1, -1000, None)
    assert out is batch
    assert ctx is contextlib.nullcontext or isinstance(ctx(), contextlib.nullcontext)


def test_process_input_for_thd_reference_vector():
    out = process_input_for_thd(_packed_batch(), -1000, 0)
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 11]
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 6, 12]
    assert int(out["max_seqlen"]) == 6
    assert out["input_ids"].tolist() == list(range(1, 13))
    assert out["qkv_format"] == "thd"
    assert "seq_lens" not in out


def test_split_batch_into_thd_chunks_and_te_path_at_cp1():
    one = split_batch_into_thd_chunks(_packed_batch(), 1)
    assert one["cu_seqlens"].tolist() == [0, 3, 5, 11]
    two = split_batch_into_thd_chunks(_packed_batch(), 2, -1000, 0)
    assert two["input_ids"].shape == (2, 6)
    assert two["cu_seqlens"][1].tolist()[:2] == [0, 6]
    te = make_cp_batch_for_te(_fake_cp_mesh(1, 0), _packed_batch(), "thd", 0, 1, -1000)
    assert te["cu_seqlens"].tolist() == [0, 3, 5, 11]


def test_contiguous_shard_reference_vector():
    """S=3, C=2, rank 1 keeps [3, pad]; labels [3, -100]; packed ids [2, 0]; positions continue past the end."""
    batch = {
        "input_ids": torch.tensor([[1, 2, 3]]),
        "labels": torch.tensor([[1, 2, 3]]),
        "_packed_seq_ids": torch.tensor([[1, 1, 2]]),
    }
    _ctx, out = make_contiguous_shard_cp_batch_and_ctx(_fake_cp_mesh(2, 1), None, batch, padding_token_id=0)
    assert out["input_ids"].tolist() == [[3, 0]]
    assert out["labels"].tolist() == [[3, -100]]
    assert out["_packed_seq_ids"].tolist() == [[2, 0]]
    assert out["position_ids"].tolist() == [[2, 3]]


# --- torch-style entry points (upstream.py) -------------------------------------------------------------------

# fp32 ring vs local fp32 SDPA on the full sequence: only the order of the softmax sums differs.
FP32_ATOL = 1e-5
# Gradients of a sum-of-squares loss are O(100) here; relative to that, fp32 reordering stays ~1e-7.
GRAD_RTOL = 1e-5
_ORIGINAL_SDPA = F.scaled_dot_product_attention
B, S, H = 2, 8, 8


class _Attn(nn.Module):
    """Calls F.scaled_dot_product_attention itself (looked up at call time), with the mask it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        q, k, v = (t.view(x.shape[0], x.shape[1], 2, H // 2).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=is_causal)
        return out.transpose(1, 2).reshape(x.shape)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attn()
        self.mlp = nn.Linear(H, H)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        attn_kwargs = {"is_causal": True} if mask is None else {"attention_mask": mask}
        for layer in self.layers:
            x = x + layer.self_attn(x, **attn_kwargs)
            x = x + layer.mlp(x)
        return x


def _inputs() -> tuple[_Model, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return _Model(), torch.randn(B, S, H), torch.randint(0, 50, (B, S))


def _case_buffers_sharded_in_place_and_sdpa_is_the_ring(mesh: object, rank: int) -> dict[str, object]:
    model, x, labels = _inputs()
    with torch.no_grad():
        expected = model(x)
    full_x, full_labels = x.clone(), labels.clone()
    keep = LoadBalancedLayout(cp_size=2, cp_rank=rank).local_indices(S)
    cp_ctx = create_context_parallel_ctx(mesh, [x, labels], [1, 1], {labels}, "alltoall")
    with get_train_context(False, False, cp_ctx)(), torch.no_grad():
        sharded_x_ok = torch.equal(x, full_x[:, keep])
        local = model(x)
        not_rebound = F.scaled_dot_product_attention is _ORIGINAL_SDPA  # a torch function mode routes it
    full = unshard_context_parallel_tensor(mesh, local, seq_dim=1)
    return {
        "sharded_x_ok": sharded_x_ok,
        "not_rebound": not_rebound,
        "restored_sdpa": F.scaled_dot_product_attention is _ORIGINAL_SDPA,
        "max_err": (full - expected).abs().max().item(),
        "x_restored": torch.equal(x, full_x),
        "labels_left_sharded": torch.equal(labels, full_labels[:, keep]),
    }


def _case_hooks_route_sdpa_under_make_cp_batch(mesh: object, rank: int) -> dict[str, object]:
    del rank
    model, x, labels = _inputs()
    causal_4d = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S)
    expected = model(x, causal_4d)
    expected.pow(2).sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    model.layers[1].self_attn = checkpoint_wrapper(model.layers[1].self_attn)  # hooks must reach the inner module
    handles = attach_context_parallel_hooks(model) + attach_cp_sdpa_hooks(model, mesh["cp"])
    batch = {"inputs_embeds": x.clone().requires_grad_(True), "labels": labels}
    ctx, batch = make_cp_batch_and_ctx(mesh, batch)
    with ctx():
        local_mask = torch.ones(B, 1, S // 2, S // 2, dtype=torch.bool)  # a local mask: the hook must drop it
        local = model(batch["inputs_embeds"], local_mask)
        local.pow(2).sum().backward()
    all_reduce_cp_gradients(model, group=mesh["cp"].get_group())
    full = unshard_context_parallel_tensor(mesh["cp"], local.detach(), seq_dim=1)
    for handle in handles:
        handle.remove()
    return {
        "hooks": len(handles),
        "max_err": (full - expected.detach()).abs().max().item(),
        "grad_rel_err": max(
            ((p.grad - g).abs().max() / g.abs().max()).item()
            for p, g in zip(model.parameters(), expected_grads, strict=True)
        ),
        "restored_sdpa": F.scaled_dot_product_attention is _ORIGINAL_SDPA,
    }


def _worker(rank: int, world_size: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    return run_cases(
        {
            "buffers": lambda: _case_buffers_sharded_in_place_and_sdpa_is_the_ring(mesh["cp"], rank),
            "hooks": lambda: _case_hooks_route_sdpa_under_make_cp_batch(mesh, rank),
            "barrier": lambda: dist.barrier(),
        }
    )


@pytest.fixture(scope="module")
def group_results() -> list[dict[str, object]]:
    return run_group(2, _worker)


@pytest.mark.parametrize("rank", [0, 1])
def test_create_context_parallel_ctx_shards_buffers_and_routes_sdpa(group_results, rank):
    """Inside the context the buffers hold this rank's head-tail chunks and SDPA is exact attention over the group;
    on exit the buffers not in `cp_no_restore_buffers` are full again and SDPA is the local kernel."""
    out = case_result(group_results, "buffers", rank)
    assert out["sharded_x_ok"]
    assert out["not_rebound"]  # nothing global is patched; max_err below shows the ring ran
    assert out["restored_sdpa"]
    assert out["max_err"] < FP32_ATOL
    assert out["x_restored"]
    assert out["labels_left_sharded"]


@pytest.mark.parametrize("rank", [0, 1])
def test_attach_hooks_make_a_custom_sdpa_model_exact_under_cp(group_results, rank):
    """`attach_context_parallel_hooks` + `attach_cp_sdpa_hooks` (one layer behind activation checkpointing): the
    model's own SDPA calls become the ring; output and summed gradients equal the unsharded run's."""
    out = case_result(group_results, "hooks", rank)
    assert out["hooks"] == 2 + 4  # one mask hook and one pre/post pair per self_attn
    assert out["max_err"] < FP32_ATOL
    assert out["grad_rel_err"] < GRAD_RTOL
    assert out["restored_sdpa"]


def test_attach_context_parallel_hooks_strips_the_mask_on_self_attn_only():
    seen: dict[str, dict[str, object]] = {}

    class Recorder(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
            seen[self.name] = kwargs
            return x

    model = nn.Module()
    model.self_attn = Recorder("attn")
    model.cross = Recorder("cross")
    handles = attach_context_parallel_hooks(model)
    assert len(handles) == 1
    mask = torch.ones(1, 1, 2, 2)
    model.self_attn(torch.ones(1), attention_mask=mask)
    assert seen["attn"] == {"attention_mask": None, "is_causal": True}
    model.self_attn(torch.ones(1), position_ids=3)
    assert seen["attn"] == {"position_ids": 3}  # no mask keyword: untouched
    model.cross(torch.ones(1), attention_mask=mask)
    assert seen["cross"]["attention_mask"] is mask


def test_get_train_context_stacks_what_it_is_asked_for():
    entered: list[str] = []

    @contextlib.contextmanager
    def cp_context():
        entered.append("cp")
        yield

    with get_train_context(False, True, cp_context())():
        assert torch._dynamo.compiled_autograd.compiled_autograd_enabled
    assert not torch._dynamo.compiled_autograd.compiled_autograd_enabled
    assert entered == ["cp"]
    with get_train_context(False, False, cp_context)():  # a factory (as make_cp_batch_and_ctx returns) is called
        pass
    assert entered == ["cp", "cp"]
    with get_train_context(False, False)():
        assert not torch._dynamo.compiled_autograd.compiled_autograd_enabled


def test_create_context_parallel_ctx_lists_every_problem():
    mesh = _fake_cp_mesh(2, 0)
    x, y = torch.zeros(1, 6), torch.zeros(1, 8)
    with pytest.raises(ValueError, match="create_context_parallel_ctx") as err:
        create_context_parallel_ctx(mesh, [x, y], [1, 1], [torch.zeros(1)], cp_rotate_method="allgather")
    message = str(err.value)
    for phrase in ("'allgather'", "different sequence lengths [6, 8]", "divisible by 2C = 4", "not among cp_buffers"):
        assert phrase in message
    single = _fake_cp_mesh(1, 0)
    with create_context_parallel_ctx(single, [x], [1], set()):
        assert x.shape == (1, 6)  # C = 1: nothing sharded
    assert unshard_context_parallel_tensor(single, x, seq_dim=1) is x
    assert attach_cp_sdpa_hooks(_Model(), single) == []


def test_ring_sdpa_refuses_to_run_outside_a_cp_context():
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="outside a CP context"):
        _ring_sdpa(q, q, q, is_causal=True)


def test_the_root_has_one_name_per_thing_and_upstream_is_a_layer() -> None:
    """Issue 21: the root exports the core (and the seed names that ARE the core) without `_private` names; every
    other upstream spelling lives in `am_context_parallel.upstream` only; importing the core never imports it."""
    import subprocess
    import sys

    import am_context_parallel
    from am_context_parallel import upstream

    assert root_api_problems(am_context_parallel) == []
    assert sorted(set(upstream.__all__) & set(am_context_parallel.__all__)) == ["make_cp_batch_and_ctx"]
    assert upstream.make_cp_batch_and_ctx is not am_context_parallel.make_cp_batch_and_ctx  # the model-less wrapper
    core_modules = (
        "batch context coverage hf kernels layouts mesh model_protocol ring ring_setup ring_stats thd training"
    )
    code = (
        "import sys, importlib\n"
        f"for name in {core_modules.split()!r}:\n"
        "    importlib.import_module('am_context_parallel.' + name)\n"
        "assert 'am_context_parallel.upstream' not in sys.modules, 'the core imported upstream'\n"
        "assert 'transformers' not in sys.modules, 'the core imported transformers'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)  # a fresh interpreter: imports only
