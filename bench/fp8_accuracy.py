"""What FP8 costs in accuracy, before any FP8 kernel exists (the FP8 accuracy gates).

    python3 bench/fp8_accuracy.py [--presets t82,bt4,bert-base] [--batch 8] [--out results.txt]
    python3 bench/fp8_accuracy.py --presets "" --minilm --device cuda   # the trained MiniLM on real sentences

Runs each preset's post-LN stack (the nps presets' shapes and initialisation:
``EncoderStack.build``) in fp32 and in emulated reduced precision, on any device (CPU
is fine: a few seconds a configuration; ``--device cuda`` on an H100 adds the row-wise
peer's real kernel, ``torch._scaled_mm``, beside the emulation), and reports per-layer and final cosine
similarity and relative error ``||out - ref|| / ||ref||`` against the fp32 run:

  fp16                     every GEMM on fp16 operands, fp32 sums, fp16 outputs (what the
                           fp16 engines compute)
  fp8                      every GEMM on e4m3 operands, per-row activation and per-channel
                           weight scales (``fusedenc.fp8.rowwise``), fp32 sums, fp16 outputs: the
                           issue's row-wise peer (torchao-style ``_scaled_mm``) and the
                           math fusedenc's FP8 mode will use
  fp8, FFN2 fp16           the same with FFN2 kept in fp16
  fp8, ends fp16           the same with the first and last layer kept in fp16
  fp8 <gemm> only          one of QKV, out, FFN1, FFN2 in fp8, the other three in fp16:
                           where the error enters
  fp8, outliers            fp8 on a stack whose LayerNorm gammas have 1% of channels at
                           20x (activation outlier channels, as trained nets have), against
                           that stack's own fp32 run
  fp8 out/FFN2 only, outl. the outlier stack with only the out-projection and FFN2 in fp8
                           (the GEMMs that a LayerNorm feeds, QKV and FFN1, in fp16)
  fp8 1x128 blocks         e4m3 with one scale per 128 channels of a row (activations) or
                           of an output channel (weights), without and with the outliers
  fp8 + smooth, outliers   the same with the input channels of QKV and FFN1 (the GEMMs a
                           LayerNorm feeds) divided by sqrt(max|activation|/max|weight|) and
                           the weights multiplied by it (SmoothQuant: in an engine the factor
                           folds into the LayerNorm's gamma and beta; here it is measured per
                           batch)
  fp8, LN folded [outl.]   QKV and FFN1 with the LayerNorm before them folded in, as
                           fusedenc.encoder.fp8_fold runs them (its torch math; the library's FP8
                           mode when calibrated): their input is the un-normalized residual
                           sum z in e4m3 with static power-of-two per-column scales
                           (calibrated on another random batch, fusedenc.fp8.rowwise's headroom),
                           the weight W * gamma in e4m3 per output channel, and the epilogue
                           rstd * (z W'^T) + shift * colsum(W') + W beta + b; the
                           out-projection and FFN2 as in "fp8" (bench/NOTES.md)

Between ops every configuration rounds activations to fp16, as the engines store them;
attention and LayerNorm run in fp32 on those fp16 values.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import fusedenc
from fusedenc import EncoderStack
from fusedenc.common.activations import apply_activation
from fusedenc.encoder import fp8_fold
from fusedenc.fp8 import rowwise as fp8
from fusedenc.fp8.rowwise import dequantize, quantize_rows, scaled_linear
from fusedenc.ops import norm_fold

PRESETS = {
    # name: (layers, d_model, heads, d_ff, activation, lc0 alpha, tokens)
    "t82": (15, 768, 24, 2304, "swish", True, 64),
    "bt4": (15, 1024, 32, 1536, "mish", True, 64),
    "bert-base": (12, 768, 12, 3072, "gelu", False, 128),
    "tiny": (2, 64, 4, 128, "swish", True, 16),  # the smoke test's
}
GEMMS = ("qkv", "out", "ffn1", "ffn2")

Gemm = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def gemm_fp32(x, w, b):
    return F.linear(x, w, b)


def gemm_fp16(x, w, b):
    y = x.half().float() @ w.half().float().t()
    return (y if b is None else y + b.half().float()).half().float()


def gemm_fp8(x, w, b):
    return scaled_linear(quantize_rows(x), quantize_rows(w), None if b is None else b.half(), torch.float16).float()


def gemm_scaled_mm(x, w, b):
    """The row-wise peer's real kernel (``torch._scaled_mm`` with per-row and per-column
    scales; H100/Ada only), to hold the emulation to.  The bias is added after the GEMM."""
    qx, qw = quantize_rows(x), quantize_rows(w)
    args = (qx.q, qw.q.t())
    kw = {"scale_a": qx.scale[:, None].contiguous(), "scale_b": qw.scale[None, :].contiguous()}
    try:
        y = torch._scaled_mm(*args, **kw, out_dtype=torch.float16)
    except RuntimeError:  # some torch versions take row-wise scales with a bf16 output only
        y = torch._scaled_mm(*args, **kw, out_dtype=torch.bfloat16)
    y = y.float()
    return (y if b is None else y + b.half().float()).half().float()


def _blocks128(t: torch.Tensor) -> torch.Tensor:
    """``t`` through e4m3 with one scale per (row, 128 columns): quantized and restored."""
    rows, k = t.shape
    pad = (-k) % 128
    tb = F.pad(t.float(), (0, pad)).view(rows * ((k + pad) // 128), 128)
    return dequantize(quantize_rows(tb)).view(rows, k + pad)[:, :k]


def gemm_fp8_block(x, w, b):
    """Block scaling (one scale per 128 input channels of a row or an output channel, as
    cuBLASLt's 1 x 128 block-scaled FP8 GEMMs take): emulated as the fp32 GEMM of the
    restored operands, which is the block-scaled GEMM up to the order of fp32 sums."""
    y = _blocks128(x) @ _blocks128(w).t()
    return (y if b is None else y + b.half().float()).half().float()


def _round(t: torch.Tensor, on: bool) -> torch.Tensor:
    return t.half().float() if on else t


def gemm_fp8_folded(z, gamma, beta, w, b, col_scale, eps=1e-5):
    """``LN(z) @ w^T + b`` with the LayerNorm folded into an FP8 GEMM, as fusedenc.encoder.fp8_fold runs
    it (its torch math): ``z`` (the un-normalized sum, fp16 values) in e4m3 with static
    power-of-two column scales ``col_scale``, ``w * gamma * col_scale`` in e4m3 per output
    channel, fp32 sums, ``rstd * acc + shift * colsum + (w @ beta + b)``, rounded to fp16."""
    rstd, shift = norm_fold.stats(z, eps)
    rows = fp8_fold.CodedRows(norm_fold.NormedRows(z, rstd, shift, gamma, beta), fp8.e4m3_columns(z, 1.0 / col_scale),
                              col_scale)  # fmt: skip
    folded = fp8_fold.fold_weight(w, b, gamma, beta, col_scale)
    return fp8_fold.norm_linear(rows, folded, "none", out_dtype=torch.float16, fast_accum=False).float()


def forward(params, x, cfg, pick: Callable[[int, str], Gemm], round16: bool, smooth: bool = False,
            folded: Optional[dict] = None, sums: Optional[dict] = None):
    """The stack on ``x`` ``[B, S, D]`` in fp32 math; ``pick(layer, gemm)`` gives each GEMM's
    arithmetic.  Returns every layer's output.  ``folded``: {(layer, "qkv" | "ffn1"): column
    scales} runs those GEMMs as ``gemm_fp8_folded`` on the sum their LayerNorm normalizes;
    ``sums`` (a dict) receives each such sum's column amax (what ``folded``'s scales come from)."""
    layers, d, h, f, act, lc0, s = cfg
    alpha = (2 * layers) ** -0.25 if lc0 else 1.0
    bsz = x.shape[0]
    rows = _round(x.reshape(-1, d), round16)
    pending = None  # (sum, gamma, beta) of the LayerNorm that made ``rows``
    outs = []

    def seen(key, z):
        if sums is not None:
            amax = z.abs().amax(dim=0)
            sums[key] = amax if key not in sums else torch.maximum(sums[key], amax)

    for i, p in enumerate(params):
        def lin(name, inp, w, bias, norm=None):
            g = pick(i, name)
            if smooth and g is gemm_fp8 and name in ("qkv", "ffn1"):
                # SmoothQuant: move each input channel's range from activation to weight.
                a_max = inp.abs().amax(dim=0).clamp_min(1e-5)
                w_max = w.abs().amax(dim=0).clamp_min(1e-5)
                factor = (a_max / w_max).sqrt()
                return g(inp / factor, w * factor, bias)
            return g(inp, w, bias)

        if pending is not None:
            seen((i, "qkv"), pending[0])
        if folded is not None and pending is not None:
            qkv = gemm_fp8_folded(*pending, p["qkv_weight"], p["qkv_bias"], folded[(i, "qkv")])
        else:
            qkv = _round(lin("qkv", rows, p["qkv_weight"], p["qkv_bias"]), round16)
        q, k, v = qkv.view(bsz, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        a = _round(a.permute(0, 2, 1, 3).reshape(-1, d), round16)
        y = lin("out", a, p["out_weight"], p["out_bias"])
        z1 = _round(rows + alpha * y, round16)
        hid = _round(F.layer_norm(z1, (d,), p["norm1_weight"], p["norm1_bias"], 1e-5), round16)
        seen((i, "ffn1"), z1)
        if folded is not None:
            pre = gemm_fp8_folded(z1, p["norm1_weight"], p["norm1_bias"], p["ffn1_weight"], p["ffn1_bias"],
                                  folded[(i, "ffn1")])  # fmt: skip
        else:
            pre = lin("ffn1", hid, p["ffn1_weight"], p["ffn1_bias"])
        f1 = _round(apply_activation(pre, act), round16)
        g2 = lin("ffn2", f1, p["ffn2_weight"], p["ffn2_bias"])
        z2 = _round(hid + alpha * g2, round16)
        rows = _round(F.layer_norm(z2, (d,), p["norm2_weight"], p["norm2_bias"], 1e-5), round16)
        pending = (z2, p["norm2_weight"], p["norm2_bias"])
        outs.append(rows)
    return outs


def _params(cfg, seed: int, outliers: bool):
    layers, d, h, f, act, lc0, _ = cfg
    torch.manual_seed(seed)
    stack = EncoderStack.build(layers, d, h, f, activation=act, residual_alpha=(2 * layers) ** -0.25 if lc0 else 1.0,
                               dtype=torch.float32, device="cpu")  # fmt: skip
    params = [{n: (None if t is None else t.detach().clone()) for n, t in b._parameters.items()} for b in stack.blocks]
    if outliers:
        gen = torch.Generator().manual_seed(seed + 1)
        for p in params:
            for name in ("norm1_weight", "norm2_weight"):
                idx = torch.randperm(d, generator=gen)[: max(1, d // 100)]
                p[name][idx] *= 20.0
    return params


def _metrics(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    o, r = out.double().flatten(), ref.double().flatten()
    cos = torch.dot(o, r) / (o.norm() * r.norm())
    return cos.item(), ((o - r).norm() / r.norm()).item()


def run_preset(name: str, batch: int, seed: int, device: torch.device) -> list[str]:
    cfg = PRESETS[name]
    layers, d, h, f, act, _, s = cfg
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, s, d), generator=gen).to(device)
    lines = [f"== {name}: {layers} layers, D {d}, {h} heads, FFN {f}, {act}, {batch} x {s} tokens, seed {seed}"]
    lines.append(f"   {'configuration':24s} {'final cosine':>13s} {'final rel err':>14s} {'worst layer':>12s}  per-layer relative error")
    stacks = {o: [{n: None if t is None else t.to(device) for n, t in p.items()} for p in _params(cfg, seed, o)]
              for o in (False, True)}  # fmt: skip
    refs = {o: forward(stacks[o], x, cfg, lambda i, g: gemm_fp32, round16=False) for o in stacks}
    last = layers - 1
    configs = [
        ("fp16", False, False, lambda i, g: gemm_fp16),
        ("fp8", False, False, lambda i, g: gemm_fp8),
        ("fp8, FFN2 fp16", False, False, lambda i, g: gemm_fp16 if g == "ffn2" else gemm_fp8),
        ("fp8, ends fp16", False, False, lambda i, g: gemm_fp16 if i in (0, last) else gemm_fp8),
        *[(f"fp8 {one} only", False, False, lambda i, g, one=one: gemm_fp8 if g == one else gemm_fp16) for one in GEMMS],
        ("fp16, outliers", True, False, lambda i, g: gemm_fp16),
        ("fp8, outliers", True, False, lambda i, g: gemm_fp8),
        ("fp8 + smooth, outliers", True, True, lambda i, g: gemm_fp8),
        ("fp8 out/FFN2 only, outl.", True, False, lambda i, g: gemm_fp8 if g in ("out", "ffn2") else gemm_fp16),
        ("fp8 1x128 blocks", False, False, lambda i, g: gemm_fp8_block),
        ("fp8 1x128, outliers", True, False, lambda i, g: gemm_fp8_block),
    ]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        configs.insert(2, ("fp8 (torch._scaled_mm)", False, False, lambda i, g: gemm_scaled_mm))
    # The LN-folded FP8 rows' static column scales: the sums' column amax on another random
    # batch through the fp16 run, made into scales as calibration makes them.
    sample = torch.randn((batch, s, d), generator=gen).to(device)
    folded = {}
    for outl in stacks:
        amax: dict = {}
        forward(stacks[outl], sample, cfg, lambda i, g: gemm_fp16, round16=True, sums=amax)
        folded[outl] = {k: fp8.static_scales(a, power_of_two=True) for k, a in amax.items()}
    folded_rows = ("fp8, LN folded", "fp8, LN folded, outl.")
    configs += [(label, outl, False, lambda i, g: gemm_fp8) for label, outl in zip(folded_rows, (False, True))]
    for label, outl, smooth, pick in configs:
        fold = folded[outl] if label in folded_rows else None
        outs = forward(stacks[outl], x, cfg, pick, round16=True, smooth=smooth, folded=fold)
        per = [_metrics(o, r) for o, r in zip(outs, refs[outl])]
        cos, rel = per[-1]
        worst = max(range(layers), key=lambda i: per[i][1])
        trail = " ".join(f"{e * 100:.2f}" for _, e in per)
        lines.append(f"   {label:24s} {cos:13.6f} {rel * 100:13.3f}% {worst:>12d}  {trail}")
    return lines


#: Lc0 FP8 configurations (Lc0Network.quantize arguments) against the fp16 net.
LC0_CONFIGS = [
    ("fp8", {}),
    ("fp8, FFN2 fp16", {"keep": ("ffn2",)}),
    ("fp8, ends fp16", {"ends": True}),
    ("fp8, static FFN2 input", {"static": True}),  # calibration on 256 other random positions
    # One GEMM kind in FP8, the rest fp16: the least FP8 that still buys speed (the gate's
    # "which mixed configuration" question; on random-weight nets none reaches 99%).
    ("fp8, FFN1 only", {"keep": ("qkv", "out_proj", "ffn2")}),
    ("fp8, QKV only", {"keep": ("out_proj", "ffn1", "ffn2")}),
]


def run_lc0(preset: str, positions: int, seed: int, device: torch.device, chunk: int = 256) -> list[str]:
    """The FP8 Lc0 gate on a synthetic net of ``preset``'s shape: policy top-1 agreement
    (argmax over the 1858 moves) and the WDL's largest absolute difference, each FP8
    configuration against the same net in fp16, on ``positions`` random input planes.
    Random weights and planes: an indication, not a real net's statistics."""
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from lc0_writer import random_planes, write_preset  # the tests' writer: synthetic nets are test material

    from fusedenc.lc0 import load_network

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{preset}.pb.gz")
        write_preset(path, preset, seed=seed)
        net = load_network(path, dtype=torch.float16, device=device)
        net32 = load_network(path, dtype=torch.float32, device=device)
    gen = torch.Generator().manual_seed(seed)
    planes = [random_planes(min(chunk, positions - i), gen).to(device, torch.float16) for i in range(0, positions, chunk)]

    def run(model=net) -> tuple[torch.Tensor, torch.Tensor]:
        outs = [model(p.to(next(model.parameters()).dtype)) for p in planes]
        return torch.cat([o["policy"] for o in outs]).float(), torch.cat([o["wdl"] for o in outs]).float()

    pol16, wdl16 = run()
    pol32, wdl32 = run(net32)
    del net32
    n = len(net.blocks)
    def kld(pol, base) -> float:  # mean KL(base || pol) of the move distributions, nats
        lp, lb = torch.log_softmax(pol, -1), torch.log_softmax(base, -1)
        return (lb.exp() * (lb - lp)).sum(-1).mean().item()

    agree16 = (pol16.argmax(-1) == pol32.argmax(-1)).float().mean().item()
    top2 = torch.softmax(pol16, -1).topk(2, dim=-1).values
    margin = (pol16.topk(2, dim=-1).values[:, 0] - pol16.topk(2, dim=-1).values[:, 1]).median().item()
    lines = [f"== Lc0 {preset}-shaped synthetic net: {n} layers, {positions} random positions, seed {seed}",
             f"   fp16 policy: median top-1 probability {top2[:, 0].median().item():.4f} (uniform: {1 / pol16.shape[-1]:.4f}), "
             f"median top-1 logit margin {margin:.4f}: how close to ties the argmax sits on this net",
             f"   {'configuration':24s} {'policy top-1 agreement':>23s} {'WDL max |diff|':>15s} {'policy KLD':>11s}",
             f"   {'fp16 against fp32':24s} {agree16 * 100:22.2f}% {(wdl16 - wdl32).abs().max().item():15.4f}"
             f" {kld(pol16, pol32):11.2e}   (the metric's floor on this net)",
             "   against fp16:"]  # fmt: skip
    for label, cfg in LC0_CONFIGS:
        layers = range(1, n - 1) if cfg.get("ends") else None
        cal = random_planes(256, torch.Generator().manual_seed(seed + 1)).to(device, torch.float16) if cfg.get("static") else None
        net.quantize("fp8", keep=cfg.get("keep", ()), layers=layers, calibration=cal)
        pol, wdl = run()
        agree = (pol.argmax(-1) == pol16.argmax(-1)).float().mean().item()
        lines.append(f"   {label:24s} {agree * 100:22.2f}% {(wdl - wdl16).abs().max().item():15.4f} {kld(pol, pol16):11.2e}")
    net.quantize(None)
    return lines


#: The trained net's FP8 configurations, cheapest in accuracy last: (label, quantize() kwargs,
#: whether it is calibrated).  Calibrated rows use fast accumulation and fold the LayerNorms
#: where the Hopper kernels run, as the library's fastest FP8 mode does.
LC0_TRAINED_CONFIGS = [
    ("fp8 (default: row-wise)", {}, False),
    ("fp8 calibrated, LN folded", {"fast_accum": True}, True),
    ("fp8 calibrated, LN passes", {"fast_accum": True, "fold_norms": False}, True),
    ("fp8, FFN2 fp16", {"keep": ("ffn2",)}, False),
    ("fp8, QKV fp16", {"keep": ("qkv",)}, False),
    ("fp8, ends fp16", {"layers": "ends"}, False),
    ("fp8, first 2 fp16", {"layers": "first2"}, False),
    ("fp8 FFN only", {"keep": ("qkv", "out_proj")}, False),
    ("fp8 FFN1 only", {"keep": ("qkv", "out_proj", "ffn2")}, False),
]


def _positions_per_s(net, planes: torch.Tensor, batch: int, reps: int = 10) -> float:
    """``net``'s graph runner at ``batch`` positions: positions/s, median of ``reps`` replays."""
    runner = net.graph_runner(batch_sizes=(batch,))
    x = planes[:batch]
    for _ in range(3):
        runner(x)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del runner
    return batch / sorted(times)[len(times) // 2]


def run_lc0_trained(path: str, positions: int, device: torch.device, speed_batches=(256, 1024)) -> list[str]:
    """The trained net (``nets/``, ``tools/lc0_train.py``) on real positions from held-back
    games (``tests/data/lc0_trained``): fp32, bf16 and fp16 against fp32 (the trained-network
    acceptance: top-1 agreement, legal top moves, agreement with the engine, median top-1
    probability), then each FP8 configuration against fp16 (the Lc0 FP8 gate: top-1
    agreement >= 99%, WDL max |diff| <= 0.01), each with its positions/s at ``speed_batches``
    (graph runner, one run) on a GPU.  Every row goes through ``Lc0Network.evaluate``: the
    policy softmax over the legal moves, on the real board."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import lc0_trained  # the held-back positions and the comparisons: test material

    from fusedenc.lc0 import encode_planes, load_network

    held = lc0_trained.held_back(positions + 256)
    held, cal_held = held[:positions], held[positions:]  # calibration: 256 positions not judged
    histories = [h.history for h in held]
    nets = {dt: load_network(path, dtype=dt, device=device) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    evals = {dt: net.evaluate(histories) for dt, net in nets.items()}
    net = nets.pop(torch.float16)
    nets.clear()
    fmt = net.input_format
    lines = [f"== trained Lc0 net {os.path.basename(path)} ({len(net.blocks)} layers x {net.blocks[0].d_model}): "
             f"{len(held)} held-back positions (distinct, from engine games of another seed)",
             f"   {'precision':10s} {'top-1 vs fp32':>14s} {'WDL max|diff|':>14s} {'engine best':>12s} "
             f"{'median top-1 p':>15s} {'top legal':>10s}"]  # fmt: skip
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        a, st = lc0_trained.agreement(evals[dt], evals[torch.float32]), lc0_trained.strength(evals[dt], held)
        lines.append(f"   {name:10s} {a['top1_agreement'] * 100:13.2f}% {a['wdl_max_abs']:14.4f} "
                     f"{st['top1_engine_best'] * 100:11.2f}% {st['median_top1_prob']:15.4f} {str(st['top_move_legal']):>10s}")
    if device.type != "cuda":
        return lines + ["   (FP8 rows need a GPU whose core runs FP8)"]
    ok, why = fusedenc.core.fp8_status(device)
    if not ok:
        return lines + [f"   FP8 rows not run: {why}"]
    planes = encode_planes(histories[:max(speed_batches)], fmt, dtype=torch.float16).to(device)
    cal = encode_planes([h.history for h in cal_held], fmt, dtype=torch.float16).to(device)
    speed16 = {b: _positions_per_s(net, planes, b) for b in speed_batches}
    n = len(net.blocks)
    head = "   ".join(f"{'pos/s @' + str(b):>12s}" for b in speed_batches)
    lines += [f"   FP8 against fp16 (gate: top-1 >= 99%, WDL max <= 0.01); positions/s: graph runner, one run, "
              f"{torch.cuda.get_device_name(device)}",
              f"   {'configuration':28s} {'top-1':>8s} {'KL':>9s} {'WDL max':>8s} {'WDL mean':>9s} {'gate':>5s}   {head}",
              f"   {'fp16':28s} {'':>8s} {'':>9s} {'':>8s} {'':>9s} {'':>5s}   "
              + "   ".join(f"{speed16[b]:12.0f}" for b in speed_batches)]
    for label, kw, calibrated in LC0_TRAINED_CONFIGS:
        kw = dict(kw)
        layers = {"ends": range(1, n - 1), "first2": range(2, n)}.get(kw.pop("layers", None))
        net.quantize("fp8", layers=layers, calibration=cal if calibrated else None, **kw)
        a = lc0_trained.agreement(net.evaluate(histories), evals[torch.float16])
        passed = a["top1_agreement"] >= 0.99 and a["wdl_max_abs"] <= 0.01
        speed = [_positions_per_s(net, planes, b) for b in speed_batches]
        lines.append(f"   {label:28s} {a['top1_agreement'] * 100:7.2f}% {a['kl']:9.2e} {a['wdl_max_abs']:8.4f} "
                     f"{a['wdl_mean_abs']:9.5f} {'yes' if passed else 'no':>5s}   "
                     + "   ".join(f"{v:7.0f} {v / speed16[b]:4.2f}x" for v, b in zip(speed, speed_batches)))
    net.quantize(None)
    return lines


def run_hf_bert(batch: int, seed: int, device: torch.device, seq: int = 128) -> list[str]:
    """The FP8 HF BERT gate: a bert-base-shaped ``transformers.BertModel`` (random weights,
    BERT's own initialisation), patched with fusedenc and run in fp16, then with its blocks
    in FP8 (the modules' FP8 mode: kernels on a GPU, the reference math on CPU); the pooled
    output (``pooler_output``) and the last hidden states against the fp32 model."""
    import copy

    import transformers

    from fusedenc import EncoderBlock, patch_hf
    from fusedenc.fp8 import rowwise as fp8

    config = transformers.BertConfig(attn_implementation="sdpa")  # bert-base: 12 x 768, GELU
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        ref = transformers.BertModel(config).eval().to(device)
    model = patch_hf(copy.deepcopy(ref).half())
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, config.vocab_size, (batch, seq), generator=gen).to(device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    for i in range(1, batch, 2):  # padding in every other sequence, of different lengths
        mask[i, seq - 8 * i % seq:] = 0
    cal_ids = torch.randint(1000, config.vocab_size, (batch, seq), generator=gen).to(device)
    blocks = [m for m in model.modules() if isinstance(m, EncoderBlock)]

    def outputs(m):
        with torch.no_grad():
            o = m(input_ids=ids, attention_mask=mask)
        keep = mask.bool()
        return o.pooler_output.double(), o.last_hidden_state[keep].double()

    pool32, hid32 = outputs(ref)
    lines = [f"== HF BERT (transformers {transformers.__version__} BertModel, bert-base shape, random weights, "
             f"fusedenc.patch_hf): {batch} sequences of {seq} tokens, padded, seed {seed}",
             f"   {'configuration':24s} {'pooled cos':>11s} {'pooled rel':>11s} {'hidden cos':>11s} {'hidden rel':>11s}"]  # fmt: skip
    configs = [("fp16", None), ("fp8", {}), ("fp8, FFN2 fp16", {"keep": ("ffn2",)}), ("fp8, static FFN2 input", "static")]
    for label, cfg in configs:
        for b in blocks:
            b.quantize(None)
        if cfg == "static":
            cal = fp8.calibrate(blocks, lambda t: model(input_ids=t, attention_mask=torch.ones_like(t)), cal_ids)
            for b in blocks:
                b.quantize("fp8", calibration=cal)
        elif cfg is not None:
            for b in blocks:
                b.quantize("fp8", **cfg)
        pool, hid = outputs(model)
        (pc, pr), (hc, hr) = _metrics(pool, pool32), _metrics(hid, hid32)
        lines.append(f"   {label:24s} {pc:11.6f} {pr * 100:10.2f}% {hc:11.6f} {hr * 100:10.2f}%")
    return lines


# ------------------------------------------------------------ MiniLM (a real model) ----

MINILM_SENTENCES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "data", "real_sentences", "sentences.txt.gz")  # fmt: skip


def run_minilm(n: Optional[int], batch: int, device: torch.device, calibration_sentences: int = 256) -> list[str]:
    """The real-model FP8 report: the trained all-MiniLM-L6-v2 (``fusedenc[real-models]``,
    ``fusedenc.hf.real_models``) patched with fusedenc in fp16, then with its blocks in each FP8
    configuration, on the first ``n`` real sentences of ``MINILM_SENTENCES`` (default 2000
    on a GPU, 128 on CPU, where the FP8 reference math runs), ``batch`` a batch in file order
    (padded).  Per configuration: the sentence embeddings' (mean pooled and normalized, as
    sentence-transformers) cosine to the unpatched fp32 model's, worst and mean, and retrieval
    agreement (each sentence's nearest neighbour among the others, against fp32's).  The
    calibrated rows calibrate on the ``calibration_sentences`` that follow (not evaluated).
    "LN folded" runs the same blocks as one ``EncoderStack`` after HF's embeddings, with
    LayerNorm folding forced (``fusedenc.encoder.fp8_fold``; torch math where no kernel applies:
    patch_hf's per-layer blocks never fold, and the Hopper FP8 epilogue lacks exact GELU)."""
    import copy
    import gzip

    from fusedenc import EncoderBlock, EncoderStack, patch_hf
    from fusedenc.hf import real_models
    from fusedenc.testing import layer_norm_folding

    try:
        real_models.minilm_dir()
    except real_models.RealModelMissing as e:
        return [f"== MiniLM: not run: {e}"]
    n = n or (2000 if device.type == "cuda" else 128)
    with gzip.open(MINILM_SENTENCES, "rt", encoding="utf-8") as fh:
        lines_all = fh.read().splitlines()
    sentences, cal_sentences = lines_all[:n], lines_all[n:n + calibration_sentences]
    ref, tok = real_models.load_minilm(device, torch.float32)
    emb32 = real_models.mean_pooled_embeddings(ref, tok, sentences, batch)
    nn32, margin = real_models.nearest_neighbours(emb32)
    model = patch_hf(copy.deepcopy(ref).half())
    del ref
    blocks = [m for m in model.modules() if isinstance(m, EncoderBlock)]
    stack = EncoderStack(blocks)  # the same blocks as one stack: where LayerNorms fold into the FP8 GEMMs

    def via_stack(input_ids, attention_mask, token_type_ids=None):
        x = model.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        return stack(x, key_padding_mask=attention_mask == 0)

    def run_calibration(texts):  # fp8.calibrate's run(sample): the patched model on padded batches
        for i in range(0, len(texts), batch):
            enc = tok(texts[i:i + batch], padding=True, truncation=True, return_tensors="pt",
                      max_length=real_models.minilm_settings()["max_seq_length"])  # fmt: skip
            model(**{k: v.to(device) for k, v in enc.items()})

    lengths = sorted(len(ids) for ids in tok(sentences)["input_ids"])
    lines = [f"== all-MiniLM-L6-v2 (6 x 384, trained; fusedenc.patch_hf, fp16 body): {n} real sentences "
             f"(tests/data/real_sentences; {lengths[0]}-{lengths[-1]} tokens, median {lengths[len(lengths) // 2]}), "
             f"{batch} a batch, padded; calibration on the next {len(cal_sentences)}",
             f"   fp32 nearest-neighbour margins (best minus second-best cosine): median {margin.median().item():.4f}, "
             f"{int((margin < 1e-3).sum())} of {n} below 0.001 (near-ties any error may flip)",
             f"   {'configuration':28s} {'worst cos':>10s} {'mean cos':>10s} {'retrieval agreement':>20s}"]  # fmt: skip
    configs = [
        ("fp16", None, {}),
        ("fp8", "fp8", {}),
        ("fp8, FFN2 fp16", "fp8", {"keep": ("ffn2",)}),
        ("fp8, ends fp16", "ends", {}),
        ("fp8, static FFN2 input", "fp8", {"calibrate": True}),
        ("fp8, calibrated, fast acc.", "fp8", {"calibrate": True, "fast_accum": True}),
        ("fp8, LN folded (stack)", "fp8", {"calibrate": True, "fast_accum": True, "stack": True}),
    ]
    for label, mode, cfg in configs:
        kw = {k: v for k, v in cfg.items() if k in ("keep", "fast_accum")}
        for b in blocks:
            b.quantize(None)
        if cfg.get("calibrate"):
            kw["calibration"] = fp8.calibrate(blocks, run_calibration, cal_sentences)
        for i, b in enumerate(blocks):
            if mode == "fp8" or (mode == "ends" and 0 < i < len(blocks) - 1):
                b.quantize("fp8", **kw)
        if cfg.get("stack"):
            with layer_norm_folding("force"):
                probe = torch.zeros(1, blocks[0].d_model, dtype=torch.float16, device=device)
                label += "" if fp8_fold.applies(blocks, probe) else " (did not fold!)"
                emb = real_models.mean_pooled_embeddings(via_stack, tok, sentences, batch, device)
        else:
            emb = real_models.mean_pooled_embeddings(model, tok, sentences, batch)
        cos = F.cosine_similarity(emb.double(), emb32.double(), dim=1)
        agree = (real_models.nearest_neighbours(emb)[0] == nn32).double().mean().item()
        lines.append(f"   {label:28s} {cos.min().item():10.6f} {cos.mean().item():10.6f} {agree * 100:19.2f}%")
    for b in blocks:
        b.quantize(None)
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="t82,bt4,bert-base")
    ap.add_argument("--batch", type=int, default=8, help="positions / sequences per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the report here")
    ap.add_argument("--device", default="cpu", help="cpu (emulation only) or cuda (adds the torch._scaled_mm row on sm89+)")
    ap.add_argument("--lc0", default="", help="also Lc0 synthetic nets of these shapes (tiny,t82,bt4): policy/WDL gates")
    ap.add_argument("--positions", type=int, default=1024, help="positions for the Lc0 gates")
    ap.add_argument("--lc0-net", help="the trained Lc0 net (nets/fusedenc-lc0-8x256.pb.gz): acceptance and FP8 "
                    "gate on held-back real positions")
    ap.add_argument("--lc0-net-positions", type=int, default=10000, help="held-back positions for --lc0-net")
    ap.add_argument("--hf-bert", action="store_true", help="also the HF BERT gate (transformers BertModel, pooled output)")
    ap.add_argument("--minilm", action="store_true", help="also the trained all-MiniLM-L6-v2 on real sentences "
                    "(needs fusedenc[real-models]): embedding cosine and retrieval agreement against fp32")
    ap.add_argument("--minilm-sentences", type=int,
                    help="sentences for --minilm (default 2000 on cuda; 128 on cpu: minutes of FP8 reference math)")
    ap.add_argument("--minilm-batch", type=int, default=64, help="sentences a batch for --minilm (padded)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference and the emulation stay fp32
    names = [n for n in args.presets.split(",") if n]
    bad = [n for n in names if n not in PRESETS]
    if bad:
        ap.error(f"unknown preset(s) {bad}; choose from {sorted(PRESETS)}")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    how = ("the Lc0 gates run the modules' FP8 mode (the kernels)" if device.type == "cuda" else
           "the Lc0 gates run the modules' FP8 mode (its CPU reference math)")
    head = (f"fusedenc FP8 accuracy on {where}, torch {torch.__version__}, fusedenc {fusedenc.__version__}: stacks "
            f"emulated (fusedenc.fp8.rowwise's e4m3 codes and scales, fp32 sums; per-layer numbers are percent relative "
            f"error against the fp32 run); {how}")
    lines = [head, ""]
    for n in names:
        lines += run_preset(n, args.batch, args.seed, device) + [""]
    for n in [n for n in args.lc0.split(",") if n]:
        lines += run_lc0(n, args.positions, args.seed, device) + [""]
    if args.lc0_net:
        lines += run_lc0_trained(args.lc0_net, args.lc0_net_positions, device) + [""]
    if args.hf_bert:
        lines += run_hf_bert(args.batch, args.seed, device) + [""]
    if args.minilm:
        lines += run_minilm(args.minilm_sentences, args.minilm_batch, device) + [""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
