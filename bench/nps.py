"""End-to-end encoder throughput: fusedenc against PyTorch, same weights, same inputs, one process.

    python3 bench/nps.py                          # t82, bt4, bert-base on a GPU; tiny on CPU
    python3 bench/nps.py --preset t82 --batch-sizes 1,16,256 --impl torch,torch-compile,fusedenc-graph
    python3 bench/nps.py --compile-modes max-autotune-no-cudagraphs,reduce-overhead

Presets (bench/presets.py): t82, bt4 (Lc0-style post-LN with alpha = (2L)^-0.25,
64 tokens per position), bert-base (sequence 128 and 512; ``bert-base-s512``
for one), tiny and tiny-bert (CPU-sized).  Batch = positions or sequences per call.

Implementations (all built from one idiomatic PyTorch model's weights):

  unfused          the plain library path the fused GEMMs replace: three Q/K/V
                   GEMMs (torch.mm), each bias add and the activation as their own
                   kernels, alpha as its own multiply, residual add, F.layer_norm;
                   attention is F.scaled_dot_product_attention.
  torch            idiomatic PyTorch: one in_proj nn.Linear (bias in the GEMM),
                   F.scaled_dot_product_attention, torch.nn.functional activation,
                   nn.LayerNorm; the alpha multiply only when alpha != 1.
  torch-fastpath   nn.TransformerEncoder in eval mode, batch_first, under
                   inference_mode, where its fused fast path
                   (torch._transformer_encoder_layer_fwd) can serve the preset:
                   relu/gelu and alpha = 1 (bert-base).  For t82/bt4/tiny it
                   cannot; a stand-in with the same shapes, gelu and alpha = 1 is
                   timed ("torch-fastpath (gelu stand-in)"), excluded from the
                   check and from the ratios.  Whether the fast path really ran is
                   verified by counting calls of torch._transformer_encoder_layer_fwd.
  torch-compile    torch.compile(torch model), default mode, one static graph per
                   batch size (``--compile-dynamic`` for one dynamic graph);
                   ``--compile-modes`` adds torch-compile:<mode> rows.
  fusedenc         fusedenc.encoder.EncoderStack, eager.
  fusedenc-graph   EncoderStack.graph_runner (one CUDA graph per batch size).

Reference lines: ``gemm-floor``, the four GEMMs of every layer alone (each
layer's own weights, the faster of torch.mm and fusedenc.linear, i.e. the
vendor library) captured in one CUDA graph so small batches are not
launch-bound; ``roofline``, all matmul FLOPs (GEMMs and attention's two
batched matmuls) at the dense GEMM rate measured on this device in this run.

Correctness, before any timing: each implementation runs the check batch (the
smallest batch size >= 4 of the sweep) and its output is compared with an
fp32 reference of the same math (written out with matmul/softmax/layer_norm,
on the half-precision weights upcast; fp64 when the run is fp32):

    max|out - ref| <= slack * 2 * max|torch - ref| + atol

``torch`` is the idiomatic implementation in the run's dtype; slack defaults
to 1.5 (``--check-slack``) because rounding differences compound over 15
post-LN layers; atol is 1e-3 (fp16), 8e-3 (bf16), 1e-5 (fp32).  An
implementation that fails is reported loudly and not timed, and the exit
status is 1.

Timing: device events around each call (eager calls issued back to back, so
host launch cost shows where it limits), warm-up, median of >= 20 calls
(``--reps``), inputs rotated among several sets when one set fits in L2;
compile and CUDA-graph capture time is measured apart (first call / capture)
and reported in the JSON and the table.  Outputs: ``<out-dir>/nps_<tag>.json``
and ``.txt`` (the tables), rewritten after each preset so a cut-off run keeps
what finished, and ``.png`` (throughput vs batch size).  A step that makes no
progress for ``--step-timeout`` seconds (a hung kernel) ends the run with
status 3, naming the step.  On an H100 one preset takes about 1.5 minutes
(t82) to 3 (bert-base at 512 tokens), most of it torch.compile.

On CPU (no GPU): tiny preset, float32 (fp16 matmuls are slow on CPU),
torch-compile and fusedenc-graph skipped unless asked for with --impl.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import math
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script: import the sibling modules

import _timing as T  # noqa: E402
from presets import DTYPES, PRESETS, Run, select_runs, torch_activation  # noqa: E402

import fusedenc  # noqa: E402
from fusedenc.activations import apply_activation  # noqa: E402

IMPLS = ("unfused", "torch", "torch-fastpath", "torch-compile", "fusedenc", "fusedenc-graph")
GPU_ONLY_BY_DEFAULT = ("torch-compile", "fusedenc-graph")
DEFAULT_BATCHES = (1, 16, 64, 256, 1024)
ATOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}
SCHEMA = "fusedenc.bench.nps/1"


# ------------------------------------------------------------ the models ----


class TorchBlock(nn.Module):
    """Idiomatic PyTorch post-LN block: h = LN(x + alpha * attn(x)); out = LN(h + alpha * ffn(h))."""

    def __init__(self, d: int, heads: int, d_ff: int, activation: str, alpha: float, eps: float):
        super().__init__()
        self.heads, self.alpha = heads, alpha
        self.in_proj = nn.Linear(d, 3 * d)  # rows q, k, v: nn.MultiheadAttention's in_proj layout
        self.out_proj = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d, eps=eps)
        self.ffn1 = nn.Linear(d, d_ff)
        self.ffn2 = nn.Linear(d_ff, d)
        self.norm2 = nn.LayerNorm(d, eps=eps)
        self.act = torch_activation(activation)

    def _residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y if self.alpha == 1.0 else x + self.alpha * y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.in_proj(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        h = self.norm1(self._residual(x, self.out_proj(a)))
        return self.norm2(self._residual(h, self.ffn2(self.act(self.ffn1(h)))))


class TorchEncoder(nn.Module):
    def __init__(self, run: Run):
        super().__init__()
        p = run.preset
        self.blocks = nn.ModuleList(
            TorchBlock(p.d_model, p.heads, p.d_ff, p.activation, p.alpha, p.eps) for _ in range(p.layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


def build_torch_model(run: Run, device: torch.device, seed: int) -> TorchEncoder:
    """The idiomatic model, initialised on the CPU in fp32 from ``seed`` (same weights on any
    device), with non-trivial LayerNorm affines, then cast to the run's dtype."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TorchEncoder(run)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.copy_(1.0 + 0.1 * torch.randn_like(m.weight))
                    m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.to(device=device, dtype=run.dtype).eval().requires_grad_(False)


def block_state_dicts(model: TorchEncoder) -> list[dict[str, torch.Tensor]]:
    """Each layer's weights under fusedenc.EncoderBlock's parameter names."""
    out = []
    for blk in model.blocks:
        out.append({
            "qkv_weight": blk.in_proj.weight, "qkv_bias": blk.in_proj.bias,
            "out_weight": blk.out_proj.weight, "out_bias": blk.out_proj.bias,
            "norm1_weight": blk.norm1.weight, "norm1_bias": blk.norm1.bias,
            "ffn1_weight": blk.ffn1.weight, "ffn1_bias": blk.ffn1.bias,
            "ffn2_weight": blk.ffn2.weight, "ffn2_bias": blk.ffn2.bias,
            "norm2_weight": blk.norm2.weight, "norm2_bias": blk.norm2.bias,
        })  # fmt: skip
    return out


@contextlib.contextmanager
def _full_precision_matmuls():
    """No TF32 (or other reduced precision) in the reference's fp32 matmuls."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old[0]
        torch.set_float32_matmul_precision(old[1])


def reference_forward(sds: list[dict[str, torch.Tensor]], x: torch.Tensor, run: Run, dtype: torch.dtype):
    """The block's math written out in ``dtype`` (fp32, or fp64 for fp32 runs): the check's oracle."""
    p = run.preset
    b, s, d = x.shape
    h_, dh = p.heads, run.head_dim
    x = x.to(dtype)
    with _full_precision_matmuls():
        for sd in sds:
            w = {k: v.to(dtype) for k, v in sd.items()}
            qkv = x @ w["qkv_weight"].t() + w["qkv_bias"]
            q, k, v = qkv.view(b, s, 3, h_, dh).permute(2, 0, 3, 1, 4)
            probs = torch.softmax((q @ k.transpose(-1, -2)) * dh**-0.5, dim=-1)
            a = (probs @ v).transpose(1, 2).reshape(b, s, d)
            y = a @ w["out_weight"].t() + w["out_bias"]
            h = F.layer_norm(x + p.alpha * y, (d,), w["norm1_weight"], w["norm1_bias"], p.eps)
            f = apply_activation(h @ w["ffn1_weight"].t() + w["ffn1_bias"], p.activation)
            g = f @ w["ffn2_weight"].t() + w["ffn2_bias"]
            x = F.layer_norm(h + p.alpha * g, (d,), w["norm2_weight"], w["norm2_bias"], p.eps)
    return x


# ------------------------------------------------------------ implementations ----


@dataclasses.dataclass
class Impl:
    name: str
    call: Callable[[torch.Tensor], torch.Tensor]
    checked: bool = True  # takes part in the correctness check and the ratios
    output_is_view: bool = False  # a later call overwrites the output (graphs): clone it to keep it
    setup_s: float = 0.0  # building, loading, capturing: outside the timed region
    notes: list[str] = dataclasses.field(default_factory=list)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    cleanup: Callable[[], None] = lambda: None


def make_unfused(model: TorchEncoder, run: Run) -> Impl:
    p = run.preset
    d, heads, dh, alpha, eps = p.d_model, p.heads, run.head_dim, p.alpha, p.eps
    act = torch_activation(p.activation)
    layers = []
    for sd in block_state_dicts(model):
        wq, wk, wv = (t.contiguous() for t in sd["qkv_weight"].split(d))
        bq, bk, bv = (t.contiguous() for t in sd["qkv_bias"].split(d))
        layers.append((wq, bq, wk, bk, wv, bv, sd["out_weight"], sd["out_bias"], sd["norm1_weight"],
                       sd["norm1_bias"], sd["ffn1_weight"], sd["ffn1_bias"], sd["ffn2_weight"], sd["ffn2_bias"],
                       sd["norm2_weight"], sd["norm2_bias"]))  # fmt: skip

    def gemm_then_bias(x2d, w, b):
        return torch.mm(x2d, w.t()).add_(b)  # the GEMM, then the bias as its own kernel

    def heads_view(t, b, s):
        return t.view(b, s, heads, dh).transpose(1, 2)

    def forward(x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        x2 = x.reshape(b * s, d)
        for wq, bq, wk, bk, wv, bv, wo, bo, n1w, n1b, w1, b1, w2, b2, n2w, n2b in layers:
            q = heads_view(gemm_then_bias(x2, wq, bq), b, s)
            k = heads_view(gemm_then_bias(x2, wk, bk), b, s)
            v = heads_view(gemm_then_bias(x2, wv, bv), b, s)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b * s, d)
            y = gemm_then_bias(a, wo, bo)
            if alpha != 1.0:
                y = y.mul_(alpha)  # the scalar multiply: its own kernel
            h = F.layer_norm(x2 + y, (d,), n1w, n1b, eps)  # residual add, then LayerNorm
            g = gemm_then_bias(act(gemm_then_bias(h, w1, b1)), w2, b2)  # activation: its own kernel
            if alpha != 1.0:
                g = g.mul_(alpha)
            x2 = F.layer_norm(h + g, (d,), n2w, n2b, eps)
        return x2.view(b, s, d)

    return Impl("unfused", forward)


def fastpath_serves(run: Run) -> tuple[bool, str]:
    """Whether nn.TransformerEncoderLayer can express the preset at all (then its fast path applies)."""
    p = run.preset
    why = []
    if p.activation not in ("relu", "gelu"):
        why.append(f"activation {p.activation} is not relu/gelu (a callable activation disables the fast path)")
    if p.alpha != 1.0:
        why.append(f"residual scale alpha = {p.alpha:.4g} is not expressible (the layer computes LN(x + sublayer(x)))")
    if p.heads % 2:
        why.append("odd head count disables the fast path")
    return (not why), "; ".join(why)


_FASTPATH_OP = "_transformer_encoder_layer_fwd"


@contextlib.contextmanager
def _count_fastpath_calls():
    """Count calls of torch._transformer_encoder_layer_fwd (what the fast path runs) while inside."""
    original = getattr(torch, _FASTPATH_OP)
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(torch, _FASTPATH_OP, counting)
    try:
        yield calls
    finally:
        setattr(torch, _FASTPATH_OP, original)


def make_fastpath(model: TorchEncoder, run: Run, device: torch.device, check_x: torch.Tensor) -> Impl:
    p = run.preset
    serves, why_not = fastpath_serves(run)
    activation = p.activation if serves else "gelu"
    layer = nn.TransformerEncoderLayer(
        p.d_model, p.heads, p.d_ff, dropout=0.0, activation=activation, layer_norm_eps=p.eps,
        batch_first=True, norm_first=False, device=device, dtype=run.dtype,
    )  # fmt: skip
    enc = nn.TransformerEncoder(layer, p.layers, enable_nested_tensor=False)
    with torch.no_grad():
        for mine, theirs in zip(model.blocks, enc.layers):
            theirs.self_attn.in_proj_weight.copy_(mine.in_proj.weight)
            theirs.self_attn.in_proj_bias.copy_(mine.in_proj.bias)
            theirs.self_attn.out_proj.weight.copy_(mine.out_proj.weight)
            theirs.self_attn.out_proj.bias.copy_(mine.out_proj.bias)
            for a, b in (("linear1", "ffn1"), ("linear2", "ffn2"), ("norm1", "norm1"), ("norm2", "norm2")):
                getattr(theirs, a).weight.copy_(getattr(mine, b).weight)
                getattr(theirs, a).bias.copy_(getattr(mine, b).bias)
    enc = enc.eval().requires_grad_(False)

    with _count_fastpath_calls() as calls:
        enc(check_x)
    on_fast_path = calls[0] == p.layers
    impl = Impl("torch-fastpath" if serves else "torch-fastpath (gelu stand-in)", enc, checked=serves)
    impl.info = {
        "serves_preset": serves,
        "why_not": why_not or None,
        "on_fast_path": on_fast_path,
        "fast_path_calls": f"{calls[0]}/{p.layers} layers ran torch.{_FASTPATH_OP}",
    }
    if serves:
        impl.notes.append(f"fast path verified: {impl.info['fast_path_calls']}" if on_fast_path else
                          f"NOT ON THE FAST PATH: only {impl.info['fast_path_calls']}")  # fmt: skip
    else:
        impl.notes.append(
            f"nn.TransformerEncoder cannot serve {run.name} ({why_not}); timed as a stand-in with the same "
            f"shapes, gelu and alpha = 1 (fast path {'verified' if on_fast_path else 'NOT taken'}: "
            f"{impl.info['fast_path_calls']}); not the same math, so excluded from the check and the ratios"
        )
    return impl


def _raise_recompile_limits(limit: int = 256) -> None:
    """Every (preset, batch size) is its own static graph; dynamo's default cap (8) would fall back to eager."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


def make_compile(model: TorchEncoder, mode: str, dynamic: bool) -> Impl:
    import torch._dynamo

    _raise_recompile_limits()
    compiled = torch.compile(model, mode=None if mode == "default" else mode, dynamic=True if dynamic else False)
    # Modes that replay CUDA graphs (cudagraph trees) need each call marked as a new step,
    # and their outputs are overwritten by the next call.
    cudagraphs = mode in ("reduce-overhead", "max-autotune")

    def call(x):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(x)

    name = "torch-compile" if mode == "default" else f"torch-compile:{mode}"
    impl = Impl(name, call, output_is_view=cudagraphs, cleanup=torch._dynamo.reset)
    impl.notes.append(
        f"mode {mode}, {'one dynamic-shape graph' if dynamic else 'one static graph per batch size'}; "
        "compile time = first call at each batch size (outside the timed region)"
    )
    impl.info = {"mode": mode, "dynamic": dynamic}
    return impl


def _load_fusedenc_stack(model: TorchEncoder, run: Run, device: torch.device):
    from fusedenc.encoder import EncoderBlock, EncoderStack

    p = run.preset
    blocks = []
    for sd in block_state_dicts(model):
        blk = EncoderBlock(
            p.d_model, p.heads, p.d_ff, p.activation, norm_first=False, residual_alpha=p.alpha,
            layer_norm_eps=p.eps, dtype=run.dtype, device=device,
        )  # fmt: skip
        missing, unexpected = blk.load_state_dict(sd, strict=False)
        if unexpected:
            raise RuntimeError(f"EncoderBlock has no parameters named {unexpected}; has {sorted(blk.state_dict())}")
        if missing:
            raise RuntimeError(f"EncoderBlock parameters not loaded from the torch model: {missing}")
        blocks.append(blk)
    return EncoderStack(blocks).eval().requires_grad_(False)


def _attention_choice(run: Run, batch: int, device: torch.device) -> Optional[str]:
    """Which fusedenc attention backend serves this shape (views of a packed QKV buffer, no bias)."""
    from fusedenc.attention import explain

    p = run.preset
    qkv = torch.empty(batch, run.seq_len, 3, p.heads, run.head_dim, device=device, dtype=run.dtype)
    q, k, v = qkv.unbind(2)
    try:
        return explain(q, k, v).backend
    except Exception as exc:  # noqa: BLE001 - informational only
        return f"? ({exc})"


def make_fusedenc(model: TorchEncoder, run: Run, device: torch.device, batches: list[int]) -> Impl:
    stack = _load_fusedenc_stack(model, run, device)
    impl = Impl("fusedenc", stack)
    impl.info = {"attention_backend": {b: _attention_choice(run, b, device) for b in (min(batches), max(batches))}}
    impl.notes.append(
        "attention backend " + ", ".join(f"batch {b}: {n}" for b, n in impl.info["attention_backend"].items())
    )
    return impl


def make_fusedenc_graph(model: TorchEncoder, run: Run, device: torch.device, batches: list[int]) -> Impl:
    stack = _load_fusedenc_stack(model, run, device)
    runner = stack.graph_runner(run.seq_len, batch_sizes=tuple(sorted(set(batches))))
    capture_s = runner.capture_all()
    impl = Impl("fusedenc-graph", runner, output_is_view=True)
    impl.info = {"capture_s": capture_s, "buckets": sorted(set(batches))}
    impl.notes.append(f"captured {len(set(batches))} batch-size graphs in {capture_s:.2f} s (outside the timed region)")
    return impl


# ------------------------------------------------------------ reference lines ----


def gemm_floor(model: TorchEncoder, run: Run, batch: int, device: torch.device, reps: int) -> dict[str, Any]:
    """The four GEMMs of every layer alone, each with that layer's weights, in one CUDA graph.

    Timed through torch.mm (cuBLAS) and, with a native core, fusedenc.linear
    (the BLASLt call fusedenc makes); the floor is the faster.
    """
    p = run.preset
    t = run.tokens(batch)
    dt = run.dtype
    g = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(t, p.d_model, device=device, dtype=dt, generator=g)
    f_in = torch.randn(t, p.d_ff, device=device, dtype=dt, generator=g)
    outs = {n: torch.empty(t, n, device=device, dtype=dt) for n in {3 * p.d_model, p.d_model, p.d_ff}}
    sds = block_state_dicts(model)
    plan = []  # (input, weight, output) for each GEMM of each layer
    for sd in sds:
        plan += [(x, sd["qkv_weight"], outs[3 * p.d_model]), (x, sd["out_weight"], outs[p.d_model]),
                 (x, sd["ffn1_weight"], outs[p.d_ff]), (f_in, sd["ffn2_weight"], outs[p.d_model])]  # fmt: skip

    variants = {"torch.mm": lambda: [torch.mm(a, w.t(), out=o) for a, w, o in plan]}
    if device.type == "cuda" and fusedenc.backend().name != "reference":
        variants["fusedenc.linear"] = lambda: [fusedenc.linear(a, w, out=o) for a, w, o in plan]
    result: dict[str, Any] = {"variants_ms": {}}
    for name, fn in variants.items():
        if device.type == "cuda":
            graph = T.capture_graph(fn, device)
            timing = T.time_calls(lambda _: graph.replay(), [None], reps=reps, device=device)
            del graph
        else:
            timing = T.time_calls(lambda _: fn(), [None], reps=reps, device=device)
        result["variants_ms"][name] = timing.ms
    best = min(result["variants_ms"], key=result["variants_ms"].get)
    result.update(ms=result["variants_ms"][best], via=best, method="graph" if device.type == "cuda" else "wall")
    return result


# ------------------------------------------------------------ checking ----


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = (out.to(ref.dtype) - ref).abs().max().item()
    return math.inf if math.isnan(err) else err


def check_impl(impl: Impl, x: torch.Tensor, ref: torch.Tensor, base: float, atol: float, slack: float) -> dict:
    out = impl.call(x)
    if impl.output_is_view:
        out = out.clone()
    if tuple(out.shape) != tuple(ref.shape):
        return {"passed": False, "reason": f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"}
    err = max_abs_err(out, ref)
    bound = slack * 2 * base + atol
    result = {"max_abs_err": err, "bound": bound, "finite": bool(torch.isfinite(out).all())}
    result["passed"] = bool(result["finite"] and err <= bound)
    if not impl.checked:
        result["passed"] = None  # a stand-in computes other math: reported, not judged
    return result


# ------------------------------------------------------------ one run ----


def _inputs(run: Run, batch: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    set_bytes = run.tokens(batch) * run.preset.d_model * torch.empty((), dtype=run.dtype).element_size()
    n = T.rotation_sets(set_bytes, device)
    g = torch.Generator(device=device).manual_seed(seed + batch)
    shape = (batch, run.seq_len, run.preset.d_model)
    return [torch.randn(shape, device=device, dtype=run.dtype, generator=g) for _ in range(n)]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _builders(args, run: Run, device: torch.device, batches: list[int], check_x: torch.Tensor):
    """name -> function building that implementation, in the order they run."""
    out: dict[str, Callable[[TorchEncoder], Impl]] = {}
    for name in args.impls:
        if name == "unfused":
            out[name] = lambda m: make_unfused(m, run)
        elif name == "torch":
            out[name] = lambda m: Impl("torch", m)
        elif name == "torch-fastpath":
            out[name] = lambda m: make_fastpath(m, run, device, check_x)
        elif name == "torch-compile":
            for mode in ["default"] + args.compile_modes:
                key = "torch-compile" if mode == "default" else f"torch-compile:{mode}"
                out[key] = lambda m, mode=mode: make_compile(m, mode, args.compile_dynamic)
        elif name == "fusedenc":
            out[name] = lambda m: make_fusedenc(m, run, device, batches)
        elif name == "fusedenc-graph":
            out[name] = lambda m: make_fusedenc_graph(m, run, device, batches)
    return out


def run_preset(run: Run, args, device: torch.device, ceilings: dict, progress: T.Progress) -> dict[str, Any]:
    batches = args.batch_sizes
    check_batch = min([b for b in batches if b >= 4] or [max(batches)])
    ref_dtype = torch.float64 if run.dtype == torch.float32 else torch.float32
    atol = ATOL[run.dtype]
    rec: dict[str, Any] = {
        "name": run.name, "config": run.config(), "describe": run.describe(), "batch_sizes": batches,
        "flops_per_batch_element": run.flops(1), "gemm_flops_per_batch_element": run.gemm_flops(1),
        "impls": {}, "skipped": {}, "errors": [], "reference_lines": {},
    }  # fmt: skip
    model = build_torch_model(run, device, args.seed)
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    check_x = torch.randn(check_batch, run.seq_len, run.preset.d_model, device=device, dtype=run.dtype, generator=g)

    progress.step(f"{run.name}: reference output")
    ref = reference_forward(block_state_dicts(model), check_x, run, ref_dtype)
    base = max_abs_err(model(check_x), ref)
    rec["check"] = {
        "batch": check_batch, "reference_dtype": str(ref_dtype).replace("torch.", ""),
        "torch_same_dtype_err": base, "atol": atol, "slack": args.check_slack,
        "rule": "max|out - ref| <= slack * 2 * max|torch - ref| + atol",
    }  # fmt: skip

    for name, reason in args.skipped.items():
        rec["skipped"][name] = reason
    for name, build in _builders(args, run, device, batches, check_x).items():
        progress.step(f"{run.name}: {name}: build + check")
        entry: dict[str, Any] = {"points": {}}
        try:
            t0 = time.perf_counter()
            impl = build(model)
            T.sync(device)
            entry["setup_s"] = time.perf_counter() - t0
            entry["label"], entry["checked"], entry["notes"], entry["info"] = impl.name, impl.checked, impl.notes, impl.info
            t0 = time.perf_counter()
            entry["check"] = check_impl(impl, check_x, ref, base, atol, args.check_slack)
            T.sync(device)
            entry["check"]["first_call_s"] = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - one broken implementation must not stop the others
            rec["errors"].append(f"{name}: build/check failed: {type(exc).__name__}: {exc}")
            entry["error"] = traceback.format_exc(limit=6)
            rec["impls"][name] = entry
            progress.write(f"!! {run.name}: {name} failed to build or run: {type(exc).__name__}: {exc}")
            for _ in batches:
                progress.step(f"{run.name}: {name}: skipped")
            _free(device)
            continue
        rec["impls"][name] = entry
        if entry["check"]["passed"] is False:
            c = entry["check"]
            progress.write(
                f"!! CHECK FAILED {run.name}: {name}: {c.get('reason') or ''}max|out-ref| = "
                f"{c.get('max_abs_err', math.nan):.3g} > bound {c.get('bound', math.nan):.3g} "
                f"(finite: {c.get('finite')}); NOT TIMED"
            )
            for _ in batches:
                progress.step(f"{run.name}: {name}: not timed")
        else:
            for b in batches:
                progress.step(f"{run.name}: {name}: batch {b}")
                pt = entry["points"][str(b)] = _time_point(impl, run, b, device, args)
                if "error" in pt:
                    rec["errors"].append(f"{name} batch {b}: {pt['error']}")
                elif b == check_batch:  # the check made the first call at this shape (compiled it)
                    pt["first_call_s"] += entry["check"]["first_call_s"]
        impl.cleanup()
        del impl
        _free(device)

    for b in batches:
        progress.step(f"{run.name}: GEMM floor, batch {b}")
        try:
            floor = gemm_floor(model, run, b, device, args.reps)
        except Exception as exc:  # noqa: BLE001
            floor = {"error": f"{type(exc).__name__}: {exc}"}
            rec["errors"].append(f"gemm-floor batch {b}: {floor['error']}")
        roof_ms = run.flops(b) / (ceilings["gemm"]["tflops"] * 1e12) * 1e3
        rec["reference_lines"][str(b)] = {"gemm_floor": floor, "roofline_ms": roof_ms}
        _free(device)
    _derive(rec, run)
    del model
    _free(device)
    return rec


def _time_point(impl: Impl, run: Run, batch: int, device: torch.device, args) -> dict[str, Any]:
    try:
        xs = _inputs(run, batch, device, args.seed)
        t0 = time.perf_counter()
        impl.call(xs[0])  # first call at this shape: compiles, autotunes, plans (not timed)
        T.sync(device)
        first_s = time.perf_counter() - t0
        timing = T.time_calls(impl.call, xs, reps=args.reps, warmup=args.warmup, device=device)
        return {"first_call_s": first_s, **timing.summary()}
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of memory"}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        xs = None
        _free(device)


def _derive(rec: dict[str, Any], run: Run) -> None:
    """Rates, ratios to torch and torch-compile, and % of the GEMM floor, per point."""
    for b in rec["batch_sizes"]:
        key = str(b)
        lines = rec["reference_lines"][key]
        floor_ms = lines["gemm_floor"].get("ms")
        lines["gemm_floor_per_s"] = b / (floor_ms * 1e-3) if floor_ms else None
        lines["roofline_per_s"] = b / (lines["roofline_ms"] * 1e-3)

        def ms_of(name):
            pt = rec["impls"].get(name, {}).get("points", {}).get(key, {})
            return pt.get("ms")

        torch_ms, compile_ms = ms_of("torch"), ms_of("torch-compile")
        for name, entry in rec["impls"].items():
            pt = entry.get("points", {}).get(key)
            if not pt or "ms" not in pt:
                continue
            pt["per_s"] = b / (pt["ms"] * 1e-3)
            comparable = entry.get("checked", True)
            pt["x_torch"] = torch_ms / pt["ms"] if (torch_ms and comparable) else None
            pt["x_compile"] = compile_ms / pt["ms"] if (compile_ms and comparable) else None
            pt["pct_gemm_floor"] = 100.0 * floor_ms / pt["ms"] if floor_ms else None


# ------------------------------------------------------------ report ----


def _fmt_rate(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v / 1e3:,.1f}k" if v >= 1e4 else f"{v:,.1f}"


def _fmt(v: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def report_lines(rec: dict[str, Any], run: Run) -> list[str]:
    unit = run.rate_unit
    out = [f"== {rec['describe']}"]
    c = rec["check"]
    out.append(
        f"   check at batch {c['batch']} against a {c['reference_dtype']} reference: {c['rule']} "
        f"(torch error {c['torch_same_dtype_err']:.3g}, slack {c['slack']}, atol {c['atol']:g})"
    )
    for name, e in rec["impls"].items():
        label = e.get("label", name)
        if "error" in e:
            out.append(f"   {label:42s} ERROR: {e['error'].strip().splitlines()[-1]}")
            continue
        ch = e["check"]
        verdict = {True: "ok", False: "FAILED: NOT TIMED", None: "not judged (stand-in)"}[ch["passed"]]
        err = f"err {ch['max_abs_err']:.3g} <= {ch['bound']:.3g}" if "max_abs_err" in ch else ch.get("reason", "")
        if ch["passed"] is None and "max_abs_err" in ch:
            err = f"err {ch['max_abs_err']:.3g} (other math)"
        out.append(f"   {label:42s} {err:32s} {verdict}; setup {e['setup_s']:.2f} s")
        for note in e.get("notes", []):
            out.append(f"   {'':42s} {note}")
    for name, why in rec["skipped"].items():
        out.append(f"   {name:42s} skipped: {why}")

    header = f"   {'batch':>5}  {'implementation':42s} {unit:>10} {'ms/batch':>10} {'x torch':>8} {'x compile':>9} " \
             f"{'% floor':>8}  {'first call':>10}"  # fmt: skip
    out += ["", header, "   " + "-" * (len(header) - 3)]
    for b in rec["batch_sizes"]:
        key = str(b)
        for name, e in rec["impls"].items():
            pt = e.get("points", {}).get(key)
            if pt is None:
                continue
            label = e.get("label", name)
            if "error" in pt:
                out.append(f"   {b:>5}  {label:42s} ERROR: {pt['error']}")
                continue
            out.append(
                f"   {b:>5}  {label:42s} {_fmt_rate(pt['per_s']):>10} {pt['ms']:>10.3f} "
                f"{_fmt(pt['x_torch'], '.2f', 'x'):>8} {_fmt(pt['x_compile'], '.2f', 'x'):>9} "
                f"{_fmt(pt['pct_gemm_floor'], '.0f', '%'):>8}  {pt['first_call_s']:>9.2f}s"
            )
        lines = rec["reference_lines"][key]
        fl = lines["gemm_floor"]
        if "ms" in fl:
            out.append(f"   {b:>5}  {'gemm-floor (' + fl['via'] + ', ' + fl['method'] + ')':42s} "
                       f"{_fmt_rate(lines['gemm_floor_per_s']):>10} {fl['ms']:>10.3f}")  # fmt: skip
        out.append(f"   {b:>5}  {'roofline (all matmul FLOPs)':42s} "
                   f"{_fmt_rate(lines['roofline_per_s']):>10} {lines['roofline_ms']:>10.3f}")  # fmt: skip
        out.append("")

    # Compact matrix: rate by implementation and batch size.
    names = [n for n, e in rec["impls"].items() if e.get("points")]
    if names:
        out.append(f"   {unit} by batch size")
        out.append(f"   {'':42s} " + " ".join(f"{b:>10}" for b in rec["batch_sizes"]))
        rows = [(rec["impls"][n].get("label", n), [rec["impls"][n]["points"].get(str(b), {}).get("per_s")
                 for b in rec["batch_sizes"]]) for n in names]  # fmt: skip
        rows.append(("gemm-floor", [rec["reference_lines"][str(b)]["gemm_floor_per_s"] for b in rec["batch_sizes"]]))
        rows.append(("roofline", [rec["reference_lines"][str(b)]["roofline_per_s"] for b in rec["batch_sizes"]]))
        for label, vals in rows:
            out.append(f"   {label:42s} " + " ".join(f"{_fmt_rate(v):>10}" for v in vals))
    out.append("   x torch / x compile: speed relative to torch / torch-compile at that batch size (stand-ins "
               "excluded); % floor: GEMM-floor time / this time; first call: compile, autotune and planning, untimed")  # fmt: skip
    return out


def plot(records: list[dict[str, Any]], runs: list[Run], path: str, env: dict[str, Any]) -> Optional[str]:
    """Throughput vs batch size, one panel per run; returns why not, if it could not plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    n = len(records)
    cols = min(2, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax, rec, run in zip(axes.flat, records, runs):
        bs = rec["batch_sizes"]
        for name, e in rec["impls"].items():
            pts = [(b, e.get("points", {}).get(str(b), {}).get("per_s")) for b in bs]
            pts = [(b, v) for b, v in pts if v]
            if pts:
                style = "--" if not e.get("checked", True) else "-"
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=e.get("label", name))
        floor = [(b, rec["reference_lines"][str(b)]["gemm_floor_per_s"]) for b in bs]
        floor = [(b, v) for b, v in floor if v]
        if floor:
            ax.plot(*zip(*floor), ":", color="black", label="GEMM floor")
        roof = [(b, rec["reference_lines"][str(b)]["roofline_per_s"]) for b in bs]
        ax.plot(*zip(*roof), ":", color="gray", label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel(f"batch ({run.preset.unit} per call)")
        ax.set_ylabel(run.rate_unit)
        ax.set_title(f"{run.name} ({str(run.dtype).replace('torch.', '')})", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(f"fusedenc nps benchmark: {env.get('device_name')}, torch {env.get('torch')}, {env.get('blaslt')}",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ------------------------------------------------------------ command line ----


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in T.comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench/nps.py", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    T.add_preset_arg(ap, PRESETS)
    ap.add_argument("--batch-sizes", type=_ints, default=list(DEFAULT_BATCHES),
                    help="positions or sequences per call (default 1,16,64,256,1024)")  # fmt: skip
    ap.add_argument("--impl", action="append", default=None,
                    help=f"repeatable or comma list of {', '.join(IMPLS)} (default: all; on CPU without "
                         f"{' and '.join(GPU_ONLY_BY_DEFAULT)})")  # fmt: skip
    ap.add_argument("--compile-modes", type=T.comma_list, default=[],
                    help="extra torch.compile modes to time besides default, e.g. "
                         "max-autotune-no-cudagraphs,reduce-overhead")  # fmt: skip
    ap.add_argument("--compile-dynamic", action="store_true",
                    help="one dynamic-shape torch.compile graph for all batch sizes (default: static per size)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (after the first call)")
    ap.add_argument("--check-slack", type=float, default=1.5, help="slack factor of the correctness rule (1.5)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    T.add_common_args(ap, DTYPES, "timed calls per point")
    args = ap.parse_args(argv)
    T.check_common_args(ap, args)
    if args.check_slack < 1.0:
        ap.error("--check-slack must be >= 1")
    impls = [i for item in (args.impl or []) for i in T.comma_list(item)]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"unknown --impl {', '.join(bad)}; choose from {', '.join(IMPLS)}")
    args.impl = impls
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device, args.reps = T.start(args.device, args.reps)
    on_gpu = device.type == "cuda"
    notes: list[str] = []

    try:
        runs = select_runs(args.preset, args.dtype, on_gpu)
    except ValueError as exc:
        print(f"bench/nps.py: {exc}", file=sys.stderr)
        return 2
    if not on_gpu and not args.dtype:
        notes.append("no GPU: running on CPU in float32 (fp16 matmuls are slow on CPU; --dtype overrides)")

    args.skipped = {}
    wanted = args.impl or [i for i in IMPLS if on_gpu or i not in GPU_ONLY_BY_DEFAULT]
    if not on_gpu and not args.impl:
        args.skipped["torch-compile"] = "not run on CPU by default (name it in --impl to run it)"
    if not on_gpu and ("fusedenc-graph" in wanted or not args.impl):
        wanted = [i for i in wanted if i != "fusedenc-graph"]
        args.skipped["fusedenc-graph"] = "needs a GPU (CUDA graphs)"
    if any(i.startswith("fusedenc") for i in wanted):
        try:
            importlib.import_module("fusedenc.encoder")  # (an import statement here would make fusedenc local)
        except ImportError as exc:
            for i in [i for i in wanted if i.startswith("fusedenc")]:
                wanted.remove(i)
                args.skipped[i] = f"fusedenc.encoder is not importable ({exc})"
    args.impls = wanted

    backend = fusedenc.backend()
    if on_gpu and backend.name == "reference":
        notes.append(f"WARNING: fusedenc has no active native core ({backend}); fusedenc rows time its PyTorch "
                     "reference, not the fused kernels")  # fmt: skip

    env = T.environment(device)
    base_path = T.result_base_path(args, runs, env, "nps")

    n_impl_rows = len(wanted) + (len(args.compile_modes) if "torch-compile" in wanted else 0)
    total = 1 + len(runs) * (1 + n_impl_rows * (1 + len(args.batch_sizes)) + len(args.batch_sizes))
    progress = T.Progress(total, "nps", enabled=not args.no_progress, step_timeout=args.step_timeout)
    records: list[dict[str, Any]] = []
    with torch.inference_mode():
        progress.step("ceilings: GEMM rate")
        ceilings = {"gemm": T.gemm_rate(device, runs[0].dtype)}
        head = [
            f"fusedenc nps benchmark on {env['device_name']} (driver {env.get('driver')}), torch {env['torch']}, "
            f"CUDA {env['cuda']}, HIP {env['hip']}, cuDNN {env['cudnn']}, {env['blaslt'] or 'no BLASLt'}; "
            f"fusedenc backend: {env['fusedenc_backend']}",
            f"GEMM rate (roofline ceiling): {ceilings['gemm']['tflops']:.4g} TFLOP/s "
            f"({ceilings['gemm']['dtype']}, {ceilings['gemm']['how']}, m,n,k={ceilings['gemm']['shape_mnk']}); "
            f"timing: median of {args.reps} calls after {args.warmup}+1 warm-up calls, "
            + ("device events" if on_gpu else "wall clock (CPU)"),
        ] + notes
        progress.write("\n".join(head))
        for run in runs:
            records.append(run_preset(run, args, device, ceilings, progress))
            # Each run's table as soon as it is done, and the files so far: a long run
            # that is cut off still leaves its finished presets behind.
            progress.write("\n" + "\n".join(report_lines(records[-1], run)))
            failures, errors = _write_outputs(base_path, head, records, runs, ceilings, env, notes, args, argv)
    progress.close()

    if failures:
        print("\nCHECK FAILURES (not timed): " + "; ".join(failures))
    if errors:
        print("\nERRORS:\n" + "\n".join(f"  {e}" for e in errors))
    written = [base_path + ".json", base_path + ".txt"]
    if not args.no_plot:
        why = plot(records, runs, base_path + ".png", env)
        if why:
            print(f"no plot: {why}")
        else:
            written.append(base_path + ".png")
    print("wrote " + ", ".join(written))
    return 1 if (failures or errors) else 0


def _write_outputs(base_path, head, records, runs, ceilings, env, notes, args, argv) -> tuple[list[str], list[str]]:
    """The JSON and the text tables of the runs finished so far; returns (check failures, errors)."""
    on_gpu = env["device"].startswith("cuda")
    lines = head[:]
    for rec, run in zip(records, runs):
        lines += [""] + report_lines(rec, run)
    failures = [f"{r['name']}: {n}" for r in records for n, e in r["impls"].items()
                if e.get("check", {}).get("passed") is False]  # fmt: skip
    errors = [f"{r['name']}: {e}" for r in records for e in r["errors"]]
    if failures:
        lines += ["", "CHECK FAILURES (not timed): " + "; ".join(failures)]
    if errors:
        lines += ["", "ERRORS:"] + [f"  {e}" for e in errors]
    result = {
        "schema": SCHEMA,
        "command": ["bench/nps.py"] + (argv if argv is not None else sys.argv[1:]),
        "complete": len(records) == len(runs),
        "env": env,
        "ceilings": ceilings,
        "methodology": {
            "timing": "device events per call, back to back" if on_gpu else "perf_counter per call (CPU)",
            "reps": args.reps, "warmup": args.warmup, "statistic": "median",
            "input_rotation": "inputs rotate among enough sets to span 4x L2 (at most 16 sets)",
            "gemm_floor": "4 GEMMs x layers with each layer's weights, one CUDA graph, faster of torch.mm "
                          "and fusedenc.linear",
            "roofline": "all matmul FLOPs (GEMMs + attention QK^T and PV) at the measured GEMM rate",
            "compile_dynamic": args.compile_dynamic,
            "check": f"max|out - ref| <= {args.check_slack} * 2 * max|torch - ref| + atol, before timing",
        },  # fmt: skip
        "notes": notes,
        "check_passed": not failures,
        "errors": errors,
        "runs": records,
    }
    T.write_json(base_path + ".json", result)
    with open(base_path + ".txt", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return failures, errors


if __name__ == "__main__":
    sys.exit(main())
