"""GPU smoke kit (issue 26): every BackendConfig value this CUDA machine supports, in both models, against torch.

On a machine without CUDA it prints ONE line saying so and exits 0. On one CUDA GPU it runs, for Nemotron-H and
Gemma 4 (bf16 parameters, AdamW), a few training steps per backend choice this machine can run
(`am_precision.backend_runtime_problems` decides; nothing is faked): attention sdpa / eager / flex / cudnn / te,
experts torch (per-expert loop) vs torch_mm (grouped GEMM), rms_norm torch, TE linears + norms, TE's fused RoPE
(rope_fusion: Gemma 4; Nemotron-H has no RoPE and refuses it) and TE FP8 autocast when Transformer Engine is
installed, plus TE's fused RoPE kernel against the torch rotation on the same angles (fp32 / bf16, shared and per-row
positions), and am-moe's grouped-GEMM backends alone (loop, grouped_mm, gmm, te, mxfp8 on Blackwell, auto with its
measured pick).
The library token dispatchers (deepep, uccl_ep, hybridep) and the library expert GEMMs behind them (experts te /
gmm, which `BackendConfig` pairs with a library dispatcher) run at ep 2 on two GPUs (two NCCL processes) against the
unsharded experts on the same tokens, when the library and two GPUs are there; otherwise each dispatcher is skipped
with one line naming what is missing.
Each run starts from the same weights and batch as the reference (`torch` / sdpa) run; its
first loss must equal the reference's within bf16 tolerance. It also initialises NCCL on one rank (one all-reduce).
Writes bench/results-gpu.json: per run step time (median), tokens/s, MFU against the GPU's dense bf16 peak (when
the GPU is a known one), peak memory, first loss and its difference from the reference, or the refusal reason.

Run: `uv run nox -s gpu`, or `python bench/gpu_smoke.py` in any environment with torch, transformers and the am-*
wheels (see the root README, "GPU smoke kit without internet").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results-gpu.json"
STEPS = 6  # the first warms up (compilation, cuBLAS / cuDNN plans); the median of the others is reported
BATCH, SEQ = 4, 1024
BF16_LOSS_TOL = 0.05  # first-step loss of two kernels of the same bf16 model: rounding order only

# Dense bf16 tensor-core peaks (FLOP/s) of known GPUs, from the vendors' data sheets (without sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12, "GB200": 2500e12, "L40S": 362e12}


def _peak_flops(name: str) -> float | None:
    for key, flops in PEAK_BF16.items():
        if key in name:
            return flops
    return None


def _nemotron(backend: Any) -> tuple[torch.nn.Module, int]:
    from transformers import NemotronHConfig

    from am_models_nemotron import NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=32000,
        hidden_size=1024,
        hybrid_override_pattern="M*EM-E*M",
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=2816,
        mamba_num_heads=32,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=4,
        chunk_size=128,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=512,
        moe_shared_expert_intermediate_size=1024,
        time_step_limit=(0.001, math.inf),
    )
    torch.manual_seed(0)
    return NemotronHForCausalLM(config, backend), config.vocab_size


def _gemma4(backend: Any) -> tuple[torch.nn.Module, int]:
    from transformers import Gemma4TextConfig

    from am_models_gemma4 import Gemma4ForCausalLM

    config = Gemma4TextConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        global_head_dim=256,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        sliding_window=512,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0,
        enable_moe_block=True,
        num_experts=16,
        top_k_experts=4,
        moe_intermediate_size=512,
    )
    torch.manual_seed(0)
    return Gemma4ForCausalLM(config, backend=backend), config.vocab_size


MODELS: dict[str, Callable[[Any], tuple[torch.nn.Module, int]]] = {"nemotron": _nemotron, "gemma4": _gemma4}


def _variants() -> dict[str, dict[str, Any]]:
    """Backend fields per run; "reference" is the plain torch backend the others are compared with."""
    runs: dict[str, dict[str, Any]] = {"reference": {}}
    for attn in ("eager", "flex", "cudnn", "te"):
        runs[f"attn={attn}"] = {"attn": attn}
    runs["experts=torch_mm"] = {"experts": "torch_mm"}
    runs["experts=torch_mm_mxfp8"] = {"experts": "torch_mm_mxfp8"}
    runs["rms_norm=torch"] = {"rms_norm": "torch"}
    runs["linear=te,rms_norm=te"] = {"linear": "te", "rms_norm": "te"}
    runs["rope_fusion"] = {"rope_fusion": True}  # Gemma 4: TE's fused RoPE; Nemotron-H (NoPE) refuses it
    runs["rope=quack"] = {"rope": "quack"}  # Gemma 4: QuACK's rotary kernel; Nemotron-H refuses it
    runs["te_fp8=current"] = {"linear": "te", "rms_norm": "te", "te_fp8": {"recipe": "current"}}
    return runs


def _backend(fields: dict[str, Any]) -> Any:
    from am_precision import BackendConfig

    base = {"attn": "sdpa", "linear": "torch", "rms_norm": "torch_fp32", "experts": "torch", "dispatcher": "torch"}
    return BackendConfig(**{**base, **fields})


def _train(model: torch.nn.Module, vocab: int, params_count: int, peak: float | None) -> dict[str, Any]:
    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=gen).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    step = statistics.median(times[1:])
    tokens = BATCH * SEQ
    flops = 6 * params_count * tokens  # forward + backward of the dense-equivalent parameters (MoE: an upper bound)
    return {
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "mfu": None if peak is None else flops / step / peak,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def _run_model(name: str, peak: float | None) -> dict[str, Any]:
    from am_precision import backend_runtime_problems

    out: dict[str, Any] = {}
    reference_loss = None
    # The first model trained in a process pays for CUDA context, cuBLAS / cuDNN handles and allocator growth in
    # more than its first step (on an H200 the first reference ran 2x slower than the same kernels right after it),
    # so one untimed reference run warms the process before any run is measured.
    model, vocab = MODELS[name](_backend({}))
    _train(model.to(device="cuda", dtype=torch.bfloat16).train(), vocab, 1, peak)
    del model
    torch.cuda.empty_cache()
    for run, fields in _variants().items():
        try:
            backend = _backend(fields)
        except ValueError as err:  # a combination BackendConfig itself refuses
            out[run] = {"refused": str(err)}
            continue
        missing = backend_runtime_problems(backend)
        if missing:
            out[run] = {"skipped": missing}
            print(f"gpu: {name} {run}: skipped: {'; '.join(missing)}", flush=True)
            continue
        try:
            model, vocab = MODELS[name](backend)
            model = model.to(device="cuda", dtype=torch.bfloat16)
            params_count = sum(p.numel() for p in model.parameters())
            result = _train(model.train(), vocab, params_count, peak)
        except ValueError as err:  # the model refuses the value (e.g. rope_fusion in NoPE Nemotron-H)
            out[run] = {"refused": str(err)}
            continue
        except (RuntimeError, NotImplementedError) as err:
            out[run] = {"failed": f"{type(err).__name__}: {err}"}
            continue
        finally:
            torch.cuda.empty_cache()
        if run == "reference":
            reference_loss = result["first_loss"]
        elif reference_loss is not None:
            result["first_loss_diff"] = abs(result["first_loss"] - reference_loss)
            result["matches_reference"] = result["first_loss_diff"] <= BF16_LOSS_TOL
        out[run] = result
        print(f"gpu: {name} {run}: {json.dumps(result)}", flush=True)
    return out


EXPERT_BACKENDS = ("loop", "grouped_mm", "gmm", "te", "mxfp8", "auto")  # am_moe.GroupedExperts(grouped_mm=...)
MXFP8_REL_TOL = 0.1  # two chained MXFP8 GEMMs against bf16 (relative Frobenius error; ~7% measured in emulation)


def _expert_backends() -> dict[str, Any]:
    """am-moe's grouped-GEMM backends on this GPU (bf16, 64 experts, top-8, 8192 tokens, H=I=1024, SwiGLU), forward +
    backward against the per-expert loop: max |diff| of the output and the input gradient, median time, or the
    refusal (a missing package or GPU is named); "mxfp8" (MXFP8 forward on Blackwell) is skipped with one line
    elsewhere and compared by relative error; "auto" reports what its measurement picked. The token-level
    dispatchers (deepep / uccl_ep / hybridep) need ep >= 2, i.e. two GPUs: `_library_dispatchers`."""
    from am_moe import GroupedExperts, mxfp8_problems

    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens, experts_n, top_k, hidden = 8192, 64, 8, 1024
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    weights, index = torch.rand(tokens, experts_n, generator=gen).softmax(-1).topk(top_k, -1)
    weights, index = weights.cuda(), index.cuda()
    out: dict[str, Any] = {}
    reference = None
    for backend in EXPERT_BACKENDS:
        if backend == "mxfp8":
            capability = torch.cuda.get_device_capability()
            missing = mxfp8_problems("cuda", capability, torch.bfloat16, (hidden, 2 * hidden))
            if missing:
                out[backend] = {"skipped": missing}
                print(f"gpu: am-moe experts grouped_mm=mxfp8: skipped: {'; '.join(missing)}", flush=True)
                continue
        torch.manual_seed(0)
        module = GroupedExperts(experts_n, hidden, hidden, gated=True, activation="silu", grouped_mm=backend)
        module.init_weights(std=0.02)
        module = module.to("cuda", torch.bfloat16)
        try:
            times = []
            for _ in range(4):
                inp = x.clone().requires_grad_()
                torch.cuda.synchronize()
                start = time.perf_counter()
                y = module(inp, index, weights)
                y.backward(torch.ones_like(y))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        except (ValueError, RuntimeError, ImportError) as err:
            out[backend] = {"refused_or_failed": f"{type(err).__name__}: {err}"}
            continue
        result: dict[str, Any] = {"fwd_bwd_s": statistics.median(times[1:])}
        choice = module.grouped_mm_choice
        result["choice"] = None if choice is None else {"backend": choice.backend, "reason": choice.reason}
        if reference is None:
            reference = (y.detach().float(), inp.grad.float())
        else:
            result["max_abs_diff_out"] = float((y.detach().float() - reference[0]).abs().max())
            result["max_abs_diff_x_grad"] = float((inp.grad.float() - reference[1]).abs().max())
            if backend == "mxfp8":
                rel = float((y.detach().float() - reference[0]).norm() / reference[0].norm())
                result["rel_diff_out"] = rel
                result["matches_reference"] = rel <= MXFP8_REL_TOL
        out[backend] = result
        print(f"gpu: am-moe experts grouped_mm={backend}: {json.dumps(result)}", flush=True)
    return out


LIBRARY_DISPATCHERS = ("deepep", "uccl_ep", "hybridep")  # BackendConfig.dispatcher values am-moe runs with a library
DISPATCH_EXPERTS = ("grouped_mm", "te", "gmm")  # expert GEMMs behind each dispatcher (te / gmm need a library one)
EP_TOKENS, EP_EXPERTS, EP_TOP_K, EP_HIDDEN = 4096, 16, 4, 1024  # per rank; SwiGLU experts, H = I


def _library_dispatchers() -> dict[str, Any]:
    """Each library dispatcher at ep 2 (two NCCL processes, one GPU each), with each expert GEMM of
    `DISPATCH_EXPERTS`, against the unsharded experts (torch._grouped_mm) on the same tokens; or one skip line per
    dispatcher naming what is missing (the package, CUDA, a second GPU: `am_moe.dispatcher_problems`)."""
    import tempfile

    import torch.multiprocessing as mp

    from am_moe import dispatcher_problems

    out: dict[str, Any] = {}
    runnable = []
    gpus = torch.cuda.device_count()
    for name in LIBRARY_DISPATCHERS:
        problems = dispatcher_problems(name, ep=2, device_type="cuda")
        if gpus < 2:
            problems.append(f"dispatcher={name!r} at ep 2 needs two CUDA GPUs; this machine has {gpus}")
        if problems:
            out[name] = {"skipped": problems}
            print(f"gpu: dispatcher {name}: skipped: {'; '.join(problems)}", flush=True)
        else:
            runnable.append(name)
    if not runnable:
        return out
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_ep2_worker, args=(port, runnable, folder), nprocs=2, join=True)
        for rank in range(2):
            for key, result in json.loads((Path(folder) / f"rank{rank}.json").read_text()).items():
                out.setdefault(key, {})[f"rank{rank}"] = result
                print(f"gpu: dispatcher {key} rank {rank}: {json.dumps(result)}", flush=True)
    return out


def _ep2_worker(rank: int, port: int, names: list[str], folder: str) -> None:
    """One of the two ep ranks: this rank's half of the tokens through experts sharded over ep 2 with each
    dispatcher, against the unsharded experts on the same rows (output and input gradient per token; the expert
    weight gradient of this rank's experts after summing the reference's over both ranks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from am_moe import GroupedExperts, apply_expert_parallel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("ep",))
    gen = torch.Generator(device="cpu").manual_seed(0)  # the same batch on both ranks; each takes its half
    x = torch.randn(2 * EP_TOKENS, EP_HIDDEN, generator=gen)
    weights, index = torch.rand(2 * EP_TOKENS, EP_EXPERTS, generator=gen).softmax(-1).topk(EP_TOP_K, -1)
    mine = slice(rank * EP_TOKENS, (rank + 1) * EP_TOKENS)
    x, weights, index = x[mine].to("cuda", torch.bfloat16), weights[mine].cuda(), index[mine].cuda()
    local = slice(rank * EP_EXPERTS // 2, (rank + 1) * EP_EXPERTS // 2)
    results: dict[str, Any] = {}

    def experts(grouped_mm: str) -> GroupedExperts:
        torch.manual_seed(0)
        module = GroupedExperts(EP_EXPERTS, EP_HIDDEN, EP_HIDDEN, gated=True, activation="silu", grouped_mm=grouped_mm)
        module.init_weights(std=0.02)
        return module.to("cuda", torch.bfloat16)

    reference = experts("grouped_mm")
    ref_in = x.clone().requires_grad_()
    ref_out = reference(ref_in, index, weights)
    ref_out.backward(torch.ones_like(ref_out))
    assert reference.down_proj.grad is not None
    assert ref_in.grad is not None
    ref_x_grad, ref_down = ref_in.grad.float(), reference.down_proj.grad.float()
    dist.all_reduce(ref_down)  # the experts' gradient over both ranks' tokens, as expert parallelism sums it
    for name in names:
        for grouped_mm in DISPATCH_EXPERTS:
            key = f"{name}/experts={grouped_mm}"
            try:
                module = experts(grouped_mm)
                apply_expert_parallel(module, mesh, dispatcher=name)
                times = []
                for _ in range(4):
                    inp = x.clone().requires_grad_()
                    module.zero_grad(set_to_none=True)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = module(inp, index, weights)
                    out.backward(torch.ones_like(out))
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
            except (ValueError, RuntimeError, ImportError) as err:
                results[key] = {"failed": f"{type(err).__name__}: {err}"}
                continue
            x_grad: Any = inp.grad
            down_grad: Any = module.down_proj.grad  # a DTensor: this rank's experts
            diffs = {
                "out": float((out.float() - ref_out.float()).abs().max() / ref_out.float().abs().max()),
                "x_grad": float((x_grad.float() - ref_x_grad).abs().max() / ref_x_grad.abs().max()),
                "down_grad": float(
                    (down_grad.to_local().float() - ref_down[local]).abs().max() / ref_down[local].abs().max()
                ),
            }
            results[key] = {
                "fwd_bwd_s": statistics.median(times[1:]),
                "max_rel_diff": diffs,
                "matches_reference": max(diffs.values()) <= BF16_LOSS_TOL,
            }
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _fused_rope_check() -> dict[str, Any]:
    """TE's fused RoPE (am_precision.fused_rope) against the torch rotation on the same angles, fp32 and bf16, with
    one angle table and with per-row positions (packed rows)."""
    from am_models_gemma4.attention import _rotary
    from am_precision import backend_runtime_problems, fused_rope

    missing = backend_runtime_problems(_backend({"rope_fusion": True}), fields=("rope_fusion",))
    if missing:
        return {"skipped": missing}
    out: dict[str, Any] = {}
    gen = torch.Generator(device="cpu").manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for rows in ("shared", "per_row"):
            positions = (
                torch.arange(256).expand(2, 256)
                if rows == "shared"
                else torch.stack([torch.arange(256), torch.arange(256) % 100])
            )
            freqs = positions[..., None].float() * inv_freq
            angles = torch.cat((freqs, freqs), dim=-1).cuda()
            x = torch.randn(2, 256, 8, 64, generator=gen).to(device="cuda", dtype=dtype)
            expected = _rotary(x, angles.cos().to(dtype), angles.sin().to(dtype))
            actual = fused_rope(x, angles)
            diff = float((actual.float() - expected.float()).abs().max())
            out[f"{dtype}/{rows}"] = {"max_abs_diff": diff, "matches_reference": diff <= tol * 4}
    return out


def _nccl_one_rank() -> dict[str, Any]:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return {"skipped": "this torch build has no NCCL"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        value = torch.ones(4, device="cuda")
        dist.all_reduce(value)
        torch.cuda.synchronize()
        ok = bool((value == 1).all())
    finally:
        dist.destroy_process_group()
    return {"ok": ok, "init_and_all_reduce_s": time.perf_counter() - start}


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu: skipped: no CUDA device here (torch.cuda.is_available() is False); nothing was run")
        return 0
    name = torch.cuda.get_device_name()
    peak = _peak_flops(name)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": name,
        "capability": list(torch.cuda.get_device_capability()),
        "peak_bf16_flops": peak,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "batch": BATCH,
        "seq": SEQ,
        "steps": STEPS,
        "nccl": _nccl_one_rank(),
        "am_moe_expert_backends": _expert_backends(),
        "library_dispatchers": _library_dispatchers(),
        "fused_rope": _fused_rope_check(),
    }
    for model_name in MODELS:
        with contextlib.suppress(KeyboardInterrupt):
            results[model_name] = _run_model(model_name, peak)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    mismatched = [
        f"{m}/{run}"
        for m in (*MODELS, "fused_rope")
        for run, r in results.get(m, {}).items()
        if isinstance(r, dict) and r.get("matches_reference") is False
    ]
    mismatched += [
        f"am_moe_expert_backends/{backend}"
        for backend, r in results["am_moe_expert_backends"].items()
        if r.get("matches_reference") is False
    ]
    mismatched += [
        f"library_dispatchers/{key}/{rank}"
        for key, ranks in results["library_dispatchers"].items()
        for rank, r in ranks.items()
        if isinstance(r, dict) and r.get("matches_reference") is False
    ]
    print(f"gpu: wrote {RESULTS}; runs that differ from the torch backend: {mismatched or 'none'}")
    return 1 if mismatched else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
