"""The encoder shapes that ``tune`` measures and the benchmarks run, and their arithmetic.

A preset is one network shape; a *run* is a preset at one sequence length
(``bert-base`` is two runs, at 128 and 512 tokens).  ``expand`` turns the
names given on the command line into runs; ``block_gemms`` lists the four
GEMMs one EncoderBlock issues for a batch (what ``tune gemm`` measures).
"""

from __future__ import annotations

import dataclasses

import torch

from ..common import dtypes

__all__ = ["GPU_PRESETS", "PRESETS", "GemmProblem", "Preset", "Run", "block_gemms", "expand", "select_runs"]


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    layers: int
    d_model: int
    heads: int
    d_ff: int
    activation: str  # a fusedenc activation name (fusedenc.ACTIVATIONS)
    alpha: float  # post-LN residual scale: h = LN(x + alpha * sublayer(x))
    eps: float
    seq_lens: tuple[int, ...]
    unit: str  # what one batch element is: "positions" (Lc0 bodies: one 64-token board) or "sequences"
    dtype: torch.dtype = torch.float16
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Run:
    """One preset at one sequence length and dtype: the unit the benchmarks report."""

    preset: Preset
    seq_len: int
    name: str
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return self.preset.d_model // self.preset.heads

    @property
    def rate_unit(self) -> str:
        """What the throughput counts: batch elements per second, spelled out ("positions/s" for
        the Lc0 bodies, "sequences/s" for BERT's).  Not Lc0's "nps": a reader of a table or plot
        should not need to know that nps means positions per second, and BERT has no nodes."""
        return f"{self.preset.unit}/s"

    def tokens(self, batch: int) -> int:
        return batch * self.seq_len

    def gemm_flops(self, batch: int) -> int:
        """FLOPs of the four GEMMs (QKV, output projection, FFN1, FFN2) over all layers."""
        p = self.preset
        t, d, f = self.tokens(batch), p.d_model, p.d_ff
        return p.layers * 2 * t * (3 * d * d + d * d + 2 * d * f)

    def attention_flops(self, batch: int) -> int:
        """FLOPs of q k^T and p v over all layers (softmax not counted)."""
        p = self.preset
        return p.layers * 4 * batch * self.seq_len * self.seq_len * p.d_model

    def flops(self, batch: int) -> int:
        return self.gemm_flops(batch) + self.attention_flops(batch)

    def config(self) -> dict:
        """What the JSON records about the run."""
        p = self.preset
        return {
            "preset": p.name, "layers": p.layers, "d_model": p.d_model, "heads": p.heads,
            "head_dim": self.head_dim, "d_ff": p.d_ff, "activation": p.activation, "alpha": p.alpha,
            "eps": p.eps, "seq_len": self.seq_len, "unit": p.unit, "dtype": str(self.dtype).replace("torch.", ""),
            "note": p.note,
        }  # fmt: skip

    def describe(self) -> str:
        p = self.preset
        form = f"post-LN alpha {p.alpha:.4g}" + (f" = (2*{p.layers})**-0.25" if p.alpha != 1.0 else "")
        return (
            f"{self.name}: {p.layers} layers, d_model {p.d_model}, {p.heads} heads (head dim {self.head_dim}), "
            f"FFN {p.d_ff}, {p.activation}, {form}, eps {p.eps:g}, {self.seq_len} tokens per "
            f"{p.unit[:-1]}, {str(self.dtype).replace('torch.', '')}"
        )


def _lc0_alpha(layers: int) -> float:
    return (2 * layers) ** -0.25


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("t82", 15, 768, 24, 2304, "swish", _lc0_alpha(15), 1e-5, (64,), "positions",
               note="Lc0 T82-like body (no smolgen, no embedding)"),
        Preset("bt4", 15, 1024, 32, 1536, "mish", _lc0_alpha(15), 1e-5, (64,), "positions",
               note="Lc0 BT4-like body (no smolgen, no embedding)"),
        Preset("bert-base", 12, 768, 12, 3072, "gelu", 1.0, 1e-12, (128, 512), "sequences",
               note="BERT-base encoder stack (no embeddings, no padding mask)"),
        # The other ends of the embedding models people run (not run by default): all-MiniLM-L6's
        # shape, and bge-large / e5-large's.
        Preset("minilm", 6, 384, 12, 1536, "gelu", 1.0, 1e-12, (128, 512), "sequences",
               note="all-MiniLM-L6-shaped encoder stack (no embeddings, no padding mask)"),
        Preset("bge-large", 24, 1024, 16, 4096, "gelu", 1.0, 1e-12, (128, 512), "sequences",
               note="bge-large / e5-large-shaped encoder stack (no embeddings, no padding mask)"),
        # Small enough for a 2-core CPU in seconds; same Lc0 form as t82 (swish, alpha != 1).
        Preset("tiny", 2, 64, 4, 128, "swish", _lc0_alpha(2), 1e-5, (16,), "positions",
               note="CPU smoke configuration, Lc0 form"),
        # The BERT form in miniature: relu/gelu and alpha = 1, so nn.TransformerEncoder's
        # fast path can serve it (exercises that branch on CPU).
        Preset("tiny-bert", 2, 64, 4, 128, "gelu", 1.0, 1e-12, (16,), "sequences",
               note="CPU smoke configuration, BERT form"),
    )
}  # fmt: skip


#: What runs by default on a GPU (the tiny presets are CPU smoke configurations).
GPU_PRESETS = ("t82", "bt4", "bert-base")


def select_runs(preset_names: list[str], dtype_name: str | None, on_gpu: bool) -> list[Run]:
    """The benchmarks' ``--preset``/``--dtype`` -> runs: t82, bt4, bert-base on a GPU and tiny
    without one by default; the presets' float16 unless ``--dtype``, float32 on CPU.
    ``ValueError`` names an unknown preset."""
    names = preset_names or (list(GPU_PRESETS) if on_gpu else ["tiny"])
    dtype = dtypes.BY_NAME[dtype_name] if dtype_name else (None if on_gpu else torch.float32)
    return expand(names, dtype)


def expand(names: list[str], dtype: torch.dtype | None = None) -> list[Run]:
    """Preset names -> runs.  ``bert-base`` gives one run per sequence length;
    ``bert-base-s512`` (any ``NAME-sLEN``) one run at that length.  ``dtype``
    overrides the presets' own (float16)."""
    runs: list[Run] = []
    for name in names:
        if name in PRESETS:
            p, seqs, single = PRESETS[name], PRESETS[name].seq_lens, len(PRESETS[name].seq_lens) == 1
        else:
            base, sep, s = name.rpartition("-s")
            if not (sep and base in PRESETS and s.isdigit() and int(s) > 0):
                raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)} (or NAME-sLEN)")
            p, seqs, single = PRESETS[base], (int(s),), False
        for s in seqs:
            runs.append(Run(p, s, p.name if single else f"{p.name}-s{s}", dtype or p.dtype))
    return runs


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """One GEMM of an EncoderBlock: D[m, n] = act(alpha * A[m, k] @ W[n, k]^T + b) (+ residual)."""

    name: str  # qkv, out_proj, ffn1, ffn2
    m: int
    n: int
    k: int
    bias: bool
    activation: str
    residual: bool
    alpha: float


def block_gemms(preset: Preset, batch: int, norm_first: bool = False, seq_len: int | None = None) -> list[GemmProblem]:
    """The four GEMMs ``EncoderBlock``'s native path issues (``EncoderBlock._run``) for ``batch``
    sequences of ``seq_len`` tokens (default the preset's first length): dense rows
    (lda = k, ldw = k, ldd = n), outputs from ``torch.empty``."""
    t = batch * (seq_len or preset.seq_lens[0])
    d, f, act = preset.d_model, preset.d_ff, preset.activation
    if not norm_first:  # post-LN: every GEMM has its bias; the residual goes through the LayerNorm
        return [
            GemmProblem("qkv", t, 3 * d, d, True, "none", False, 1.0),
            GemmProblem("out_proj", t, d, d, True, "none", False, 1.0),
            GemmProblem("ffn1", t, f, d, True, act, False, 1.0),
            GemmProblem("ffn2", t, d, f, True, "none", False, 1.0),
        ]
    # pre-LN: the out-projection's bias rides in the LayerNorm; FFN2 carries the residual and alpha.
    return [
        GemmProblem("qkv", t, 3 * d, d, True, "none", False, 1.0),
        GemmProblem("out_proj", t, d, d, False, "none", False, 1.0),
        GemmProblem("ffn1", t, f, d, True, act, False, 1.0),
        GemmProblem("ffn2", t, d, f, True, "none", True, preset.alpha),
    ]
