"""The implementations bench/nps.py compares, all built from one idiomatic PyTorch model's weights.

``build_torch_model`` makes the idiomatic model (``TorchEncoder``) for a run;
``builders`` gives, for each implementation named on the command line (``IMPLS``),
a function turning that model into an ``Impl``: unfused (the plain library path
the fused GEMMs replace), torch (the model itself), torch-fastpath
(nn.TransformerEncoder's fused fast path, or a stand-in where it cannot serve the
preset), torch-compile (one row per mode), fusedenc (EncoderStack's plain call: automatic
CUDA graphs), fusedenc-eager (the same with them off), fusedenc-compile and
fusedenc-graph (EncoderStack.graph_runner).  bench/nps.py's docstring says what
each one is.  Also here: ``reference_forward``, the fp32/fp64 oracle of the
correctness check, and ``gemm_floor``, the four GEMMs of every layer alone.
The FP8 rows of ``--dtype fp8`` are bench/fp8_peers.py's (they build on these).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusedenc
from fusedenc.common.activations import apply_activation, torch_function
from fusedenc.tune.presets import Run
from fusedenc.tune.timing import capture_graph, time_calls

__all__ = [
    "IMPLS",
    "Impl",
    "TorchBlock",
    "TorchEncoder",
    "block_state_dicts",
    "build_torch_model",
    "builders",
    "fastpath_serves",
    "gemm_floor",
    "load_fusedenc_stack",
    "make_compile",
    "make_fastpath",
    "make_fusedenc",
    "make_fusedenc_compile",
    "make_fusedenc_eager",
    "make_fusedenc_graph",
    "make_unfused",
    "reference_forward",
]

#: The implementations, in the order they run.
IMPLS = ("unfused", "torch", "torch-fastpath", "torch-compile", "fusedenc", "fusedenc-eager", "fusedenc-compile",
         "fusedenc-graph", "fusedenc-gelu-pass", "fusedenc-folded", "fusedenc-unfolded",
         "fusedenc-unfolded-gelu-pass")  # fmt: skip
#: Rows run only when named: the plain call under switches the library sets otherwise, the A/B
#: rows of its defaults.  Name -> (the switches, what the row's note says).  "gelu-pass": the
#: Hopper GELU units off, GELU a pass after the GEMM (as FUSEDENC_SM90_GELU=0; the core's own
#: switch, without graph invalidation: the row's stack has its own graphs, captured with the
#: units off); "force" /
#: "off": LayerNorm folding at every batch size / at none (``auto`` folds only where the GEMMs
#: span four waves; the mode is part of every graph's key).
SWITCHED = {
    "fusedenc-gelu-pass": (("gelu-pass",), "the Hopper GELU units off (as FUSEDENC_SM90_GELU=0)"),
    "fusedenc-folded": (("force",), "LayerNorm folding forced at every batch size"),
    "fusedenc-unfolded": (("off",), "LayerNorm folding off at every batch size"),
    "fusedenc-unfolded-gelu-pass": (("off", "gelu-pass"), "LayerNorm folding off and the Hopper GELU units off"),
}
ON_REQUEST = tuple(SWITCHED)
#: The A/B rows of the Hopper GELU units (skipped where there are none to switch off).
GELU_UNIT_ROWS = tuple(name for name, (switches, _) in SWITCHED.items() if "gelu-pass" in switches)


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
        self.act = torch_function(activation)

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


def _dense_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x @ w.t() + b


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


def reference_forward(
    sds: list[dict[str, torch.Tensor]], x: torch.Tensor, run: Run, dtype: torch.dtype,
    linear: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:  # fmt: skip
    """The block's math written out in ``dtype`` (fp32, or fp64 for fp32 runs): the check's oracle.

    ``linear(x, w, b)``: the arithmetic of the four GEMMs (default ``x @ w^T + b`` in
    ``dtype``); the FP8 check passes FP8's emulated GEMM (bench/fp8_peers.py) to measure
    what FP8 alone costs on this net, everything else unchanged."""
    p = run.preset
    b, s, d = x.shape
    h_, dh = p.heads, run.head_dim
    x = x.to(dtype)
    lin = linear or _dense_linear
    with _full_precision_matmuls():
        for sd in sds:
            w = {k: v.to(dtype) for k, v in sd.items()}
            qkv = lin(x, w["qkv_weight"], w["qkv_bias"])
            q, k, v = qkv.view(b, s, 3, h_, dh).permute(2, 0, 3, 1, 4)
            probs = torch.softmax((q @ k.transpose(-1, -2)) * dh**-0.5, dim=-1)
            a = (probs @ v).transpose(1, 2).reshape(b, s, d)
            y = lin(a, w["out_weight"], w["out_bias"])
            h = F.layer_norm(x + p.alpha * y, (d,), w["norm1_weight"], w["norm1_bias"], p.eps)
            f = apply_activation(lin(h, w["ffn1_weight"], w["ffn1_bias"]), p.activation)
            g = lin(f, w["ffn2_weight"], w["ffn2_bias"])
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
    act = torch_function(p.activation)
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


def raise_recompile_limits(limit: int = 256) -> None:
    """Every (preset, batch size) is its own static graph; dynamo's default cap (8) would fall back to eager."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


def make_compile(model: nn.Module, mode: str, dynamic: bool, name: str = "torch-compile") -> Impl:
    """``torch.compile(model)`` in ``mode``: row ``name`` (default mode) or ``name:mode``."""
    import torch._dynamo

    raise_recompile_limits()
    compiled = torch.compile(model, mode=None if mode == "default" else mode, dynamic=True if dynamic else False)
    # Modes that replay CUDA graphs (cudagraph trees) need each call marked as a new step,
    # and their outputs are overwritten by the next call.
    cudagraphs = mode in ("reduce-overhead", "max-autotune")

    def call(x):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(x)

    name = name if mode == "default" else f"{name}:{mode}"
    impl = Impl(name, call, output_is_view=cudagraphs, cleanup=torch._dynamo.reset)
    impl.notes.append(
        f"mode {mode}, {'one dynamic-shape graph' if dynamic else 'one static graph per batch size'}; "
        "compile time = first call at each batch size (outside the timed region)"
    )
    impl.info = {"mode": mode, "dynamic": dynamic}
    return impl


def load_fusedenc_stack(model: TorchEncoder, run: Run, device: torch.device):
    """A fusedenc EncoderStack holding the torch model's weights (what every fusedenc row runs)."""
    from fusedenc.encoder.blocks import EncoderBlock, EncoderStack

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
    stack = load_fusedenc_stack(model, run, device)
    impl = Impl("fusedenc", stack)
    impl.info = {"attention_backend": {b: _attention_choice(run, b, device) for b in (min(batches), max(batches))}}
    impl.notes.append(
        "attention backend " + ", ".join(f"batch {b}: {n}" for b, n in impl.info["attention_backend"].items())
    )
    return impl


def make_fusedenc_eager(model: TorchEncoder, run: Run, device: torch.device) -> Impl:
    """The plain call with automatic CUDA graphs off: every launch issued by the host (the
    plain call before automatic graphs; ``fusedenc`` is the plain call as users make it)."""
    from fusedenc.graphs import auto as auto_graphs

    stack = load_fusedenc_stack(model, run, device)

    def call(x):
        with auto_graphs.disabled():
            return stack(x)

    impl = Impl("fusedenc-eager", call)
    impl.notes.append("EncoderStack plain call inside fusedenc.graphs.auto.disabled()")
    return impl


def make_fusedenc_compile(model: TorchEncoder, run: Run, device: torch.device, dynamic: bool) -> Impl:
    """``torch.compile(stack, fullgraph=True)`` of the fusedenc stack: what a user who compiles
    a model holding one gets (the stack is one fusedenc op in the graph)."""
    import torch._dynamo

    raise_recompile_limits()
    stack = load_fusedenc_stack(model, run, device)
    compiled = torch.compile(stack, fullgraph=True, dynamic=True if dynamic else False)
    impl = Impl("fusedenc-compile", compiled, cleanup=torch._dynamo.reset)
    impl.notes.append("torch.compile(EncoderStack, fullgraph=True), default mode; compile time outside the timed region")
    return impl


def make_fusedenc_graph(model: TorchEncoder, run: Run, device: torch.device, batches: list[int]) -> Impl:
    stack = load_fusedenc_stack(model, run, device)
    runner = stack.graph_runner(run.seq_len, batch_sizes=tuple(sorted(set(batches))))
    capture_s = runner.capture_all()
    impl = Impl("fusedenc-graph", runner, output_is_view=True)
    impl.info = {"capture_s": capture_s, "buckets": sorted(set(batches))}
    impl.notes.append(f"captured {len(set(batches))} batch-size graphs in {capture_s:.2f} s (outside the timed region)")
    return impl


def make_fusedenc_switched(model: TorchEncoder, run: Run, device: torch.device, name: str) -> Impl:
    """The plain call inside the switches of ``SWITCHED[name]``: an A/B row of ``fusedenc``."""
    from fusedenc import core
    from fusedenc.ops import norm_fold

    switches, note = SWITCHED[name]
    enter = {"gelu-pass": lambda: core.sm90_gelu_epilogue(False), "force": lambda: norm_fold.mode("force"),
             "off": lambda: norm_fold.mode("off")}  # fmt: skip
    stack = load_fusedenc_stack(model, run, device)

    def call(x):
        with contextlib.ExitStack() as on:
            for switch in switches:
                on.enter_context(enter[switch]())
            return stack(x)

    impl = Impl(name, call)
    impl.notes.append(f"EncoderStack plain call with {note}")
    return impl


def builders(
    names: list[str], run: Run, device: torch.device, batches: list[int], check_x: torch.Tensor,
    compile_modes: list[str], compile_dynamic: bool,
) -> dict[str, Callable[[TorchEncoder], Impl]]:
    """Row name -> function building that implementation from the torch model, in the order they run:
    ``names`` from ``IMPLS``; torch-compile gives one row per mode (default, then ``compile_modes``)."""
    out: dict[str, Callable[[TorchEncoder], Impl]] = {}
    for name in names:
        if name == "unfused":
            out[name] = lambda m: make_unfused(m, run)
        elif name == "torch":
            out[name] = lambda m: Impl("torch", m)
        elif name == "torch-fastpath":
            out[name] = lambda m: make_fastpath(m, run, device, check_x)
        elif name == "torch-compile":
            for mode in ["default"] + compile_modes:
                key = "torch-compile" if mode == "default" else f"torch-compile:{mode}"
                out[key] = lambda m, mode=mode: make_compile(m, mode, compile_dynamic)
        elif name == "fusedenc":
            out[name] = lambda m: make_fusedenc(m, run, device, batches)
        elif name == "fusedenc-eager":
            out[name] = lambda m: make_fusedenc_eager(m, run, device)
        elif name == "fusedenc-compile":
            out[name] = lambda m: make_fusedenc_compile(m, run, device, compile_dynamic)
        elif name == "fusedenc-graph":
            out[name] = lambda m: make_fusedenc_graph(m, run, device, batches)
        elif name in SWITCHED:
            out[name] = lambda m, name=name: make_fusedenc_switched(m, run, device, name)
    return out


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
            graph = capture_graph(fn, device)
            timing = time_calls(lambda _: graph.replay(), [None], reps=reps, device=device)
            del graph
        else:
            timing = time_calls(lambda _: fn(), [None], reps=reps, device=device)
        result["variants_ms"][name] = timing.ms
    best = min(result["variants_ms"], key=result["variants_ms"].get)
    result.update(ms=result["variants_ms"][best], via=best, method="graph" if device.type == "cuda" else "wall")
    return result
