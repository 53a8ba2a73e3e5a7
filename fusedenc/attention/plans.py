"""Choosing a backend for a call and planning it: what runs, and everything decided once.

The first call with a new signature (shapes, strides, dtypes, devices,
alignment, scale, forced backend) validates the arguments, reads the tables
(once per architecture) and makes a ``Plan``; later calls with that signature
do a dict lookup and launch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable, NamedTuple, Optional

import torch

from ..fp8 import rowwise as fp8
from .backends import BACKENDS, FALLBACK_ORDER, AttentionBackend
from .call import ALIGN_BYTES, AttentionCall, describe_call, table_key, validate
from .tables import clear_tables, tables_for

__all__ = ["BACKEND_ENV", "Candidate", "Explanation", "Plan", "cache_info", "clear_cache", "decide", "plan_for", "run"]

#: Environment variable that forces a backend for every call (A/B runs).
BACKEND_ENV = "FUSEDENC_ATTENTION_BACKEND"
#: Bias rows handed to the fused kernels are padded to this many elements
#: (what SDPA itself does); the memory-efficient kernel rejects other strides.
_BIAS_ROW_ALIGN = 16


class Candidate(NamedTuple):
    name: str
    source: str  # "user table", "shipped table" or "fallback order"
    available: bool
    supported: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Which backend serves a call, and why."""

    backend: str
    reason: str
    key: dict
    call: AttentionCall
    user_table: Optional[str]  # path of the user table consulted, None if none was valid
    shipped_table: Optional[str]
    user_rule: Optional[dict]
    shipped_rule: Optional[dict]
    candidates: tuple[Candidate, ...]

    def __str__(self) -> str:
        lines = [f"attention backend: {self.backend} ({self.reason})", f"table key: {self.key}"]
        tables = (("user", self.user_table, self.user_rule), ("shipped", self.shipped_table, self.shipped_rule))
        for kind, path, rule in tables:
            lines.append(f"{kind} table: {path or 'none'}; rule: {rule.get('match') if rule else None}")
        for c in self.candidates:
            if c.available and c.supported:
                state = "ok"
            else:
                state = "not available" if not c.available else f"unsupported: {c.reason}"
            lines.append(f"  {c.name:15s} [{c.source}] {state}")
        return "\n".join(lines)


def _check_backend(b: AttentionBackend, call: AttentionCall) -> tuple[bool, bool, str]:
    if not b.available():
        return False, False, "not available (not installed, or no device it runs on)"
    ok, why = b.supports(call)
    return True, ok, why


def decide(call: AttentionCall, forced: Optional[str]) -> Explanation:
    """Which backend serves ``call`` (``forced``: the one named by ``backend=``), and why."""
    key = table_key(call)
    env = os.environ.get(BACKEND_ENV, "").strip() if forced is None else ""
    name = forced or env or None
    if name is not None:
        how = "forced by backend=" if forced else f"forced by {BACKEND_ENV}"
        if name not in BACKENDS:
            raise ValueError(f"{how}{name!r}: unknown attention backend; choose from {sorted(BACKENDS)}")
        b = BACKENDS[name]
        available, supported, why = _check_backend(b, call)
        if not (available and supported):
            raise ValueError(f"attention backend {name!r} ({how}) cannot serve this call: {why} (table key {key})")
        cand = (Candidate(name, "forced", True, True, ""),)
        return Explanation(name, how + name, key, call, None, None, None, None, cand)

    user, shipped = tables_for(call)
    user_rule = user.match(key) if user else None
    shipped_rule = shipped.match(key) if shipped else None
    order: list[tuple[str, str]] = []
    seen: set[str] = set()
    for source, names in (
        ("user table", user_rule["backends"] if user_rule else ()),
        ("shipped table", shipped_rule["backends"] if shipped_rule else ()),
        ("fallback order", FALLBACK_ORDER),
    ):
        for n in names:
            if n not in seen:
                seen.add(n)
                order.append((n, source))
    candidates = []
    chosen = None
    for n, source in order:
        available, supported, why = _check_backend(BACKENDS[n], call)
        candidates.append(Candidate(n, source, available, supported, why))
        if chosen is None and available and supported:
            chosen = (n, source)
    assert chosen is not None, "sdpa_math serves every call"
    return Explanation(
        chosen[0],
        f"first usable entry, from the {chosen[1]}",
        key,
        call,
        user.path if user else None,
        shipped.path if shipped else None,
        user_rule,
        shipped_rule,
        tuple(candidates),
    )


# ------------------------------------------------------------ plans ----


def _bias_direct_ok(bias: torch.Tensor, dtype: torch.dtype, aligned: bool) -> bool:
    """Whether the kernel can read the caller's bias as it is."""
    if bias.dtype != dtype or bias.stride(-1) != 1:
        return False
    if not aligned:
        return True
    return bias.data_ptr() % ALIGN_BYTES == 0 and all(
        st % _BIAS_ROW_ALIGN == 0 for sz, st in zip(bias.shape[1:-1], bias.stride()[1:-1]) if sz > 1
    ) and (bias.shape[0] == 1 or bias.stride(0) % _BIAS_ROW_ALIGN == 0)


_consts: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """0-dim -inf and 0 on ``device`` (CPU scalars would be copied to the GPU on every call,
    which CUDA-graph capture forbids).  Made once per device and dtype outside capture; inside
    a capture they are made in the graph's pool and not kept."""
    c = _consts.get((device, dtype))
    if c is None:
        c = (torch.full((), -math.inf, dtype=dtype, device=device), torch.zeros((), dtype=dtype, device=device))
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # readable from any stream from now on
            _consts[(device, dtype)] = c
    return c


def _make_bias_fn(call: AttentionCall, backend: AttentionBackend, attn_bias) -> Callable:
    """A function (bias, mask) -> additive [B, H, S, S] bias in q's dtype, or None."""
    b, s, h = call.batch, call.seq, call.heads
    dtype = call.dtype
    full = (b, h, s, s)
    if not backend.accepts_bias or not (call.has_bias or call.has_mask):
        return lambda bias, mask: None
    sp = -(-s // _BIAS_ROW_ALIGN) * _BIAS_ROW_ALIGN if backend.aligned_bias else s

    if call.has_bias and not call.has_mask:
        if _bias_direct_ok(attn_bias, dtype, backend.aligned_bias):
            if call.bias_batch == b:
                return lambda bias, mask: bias
            return lambda bias, mask: bias.expand(full)

        def copied(bias, mask):  # cast and/or re-pad once
            buf = torch.empty((call.bias_batch, h, s, sp), dtype=dtype, device=bias.device)[..., :s]
            buf.copy_(bias)
            return buf.expand(full)

        return copied

    if call.has_mask and not call.has_bias:

        def mask_only(bias, mask):  # one kernel: [B, 1, 1, S] of -inf / 0, broadcast over heads and queries
            buf = torch.empty((b, 1, 1, sp), dtype=dtype, device=mask.device)[..., :s]
            neg_inf, zero = _constants(mask.device, dtype)
            torch.where(mask.reshape(b, 1, 1, s), neg_inf, zero, out=buf)
            return buf.expand(full)

        return mask_only

    if call.bias_dtype == dtype and attn_bias.stride(-1) == 1 and sp == s:

        def bias_and_mask(bias, mask):  # one kernel, broadcast over batch; rows need no padding
            return bias.masked_fill(mask.reshape(b, 1, 1, s), -math.inf)

        return bias_and_mask

    def bias_copy_and_mask(bias, mask):  # cast and/or pad rows, then mask: two kernels
        buf = torch.empty((b, h, s, sp), dtype=dtype, device=bias.device)[..., :s]
        buf.copy_(bias)
        return buf.masked_fill_(mask.reshape(b, 1, 1, s), -math.inf)

    return bias_copy_and_mask


def _device_codes(call: AttentionCall) -> fp8.Fp8Format:
    """The e4m3 flavour of the call's device (``fusedenc.fp8.rowwise.format_for``)."""
    return fp8.format_for(torch.device(call.device_type, call.device_index if call.device_type == "cuda" else None))


class Plan:
    """Everything decided for one call signature; ``run`` is the per-call hot path."""

    __slots__ = ("backend", "kernel", "bias_fn", "scale", "rows", "cols", "bshd", "bshd_input", "native_mask", "empty",
                 "writes_e4m3")  # fmt: skip

    def __init__(self, call: AttentionCall, backend: AttentionBackend, attn_bias, scale):
        self.backend = backend
        self.kernel = backend.kernel
        self.native_mask = backend.native_mask
        # run(..., out_scale=) allowed: the kernels write OCP e4m3 codes, so not on an MI300
        # (FNUZ codes there: the caller's pass quantizes instead).
        self.writes_e4m3 = (backend.native_mask and backend.writes_e4m3
                            and _device_codes(call).dtype == torch.float8_e4m3fn)  # fmt: skip
        self.bias_fn = None if backend.native_mask else _make_bias_fn(call, backend, attn_bias)
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(call.head_dim)
        b, s, h, d = call.batch, call.seq, call.heads, call.head_dim
        self.rows, self.cols = b * s, h * d
        # [B, H, S, Dh] strides of a tensor whose memory is [B, S, H, Dh]
        self.bshd = (s * h * d, d, h * d, 1)
        self.bshd_input = backend.bshd_input
        self.empty = b * s == 0

    def run(self, q, k, v, attn_bias, key_padding_mask, out_scale=None):
        """The attention output as ``[B*S, H*Dh]`` rows; ``out_scale`` (only where
        ``writes_e4m3``): float32 ``[H*Dh]``, the rows then e4m3 codes of ``out * out_scale``."""
        if self.empty:
            return q.new_empty((self.rows, self.cols), dtype=q.dtype if out_scale is None else fp8.format_for(q).dtype)
        if self.native_mask:  # bias and mask go in as the caller gave them; [B, S, H, Dh] comes out
            if out_scale is not None:
                out = self.kernel(q, k, v, attn_bias, self.scale, key_padding_mask, out_scale=out_scale)
            else:
                out = self.kernel(q, k, v, attn_bias, self.scale, key_padding_mask)
            return out.reshape(self.rows, self.cols)  # a view: the kernel wrote it densely
        bias = self.bias_fn(attn_bias, key_padding_mask)
        if self.bshd_input:
            out = self.kernel(q, k, v, bias, self.scale)  # [B, S, H, Dh]
            return out.reshape(self.rows, self.cols)  # a view when the kernel wrote it densely
        out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias, self.scale)
        if out.stride() == self.bshd:  # flash, efficient, cuDNN: already [B, S, H, Dh] in memory
            return out.as_strided((self.rows, self.cols), (self.cols, 1))
        # math: one copy into dense rows.  Not reshape(): when the copy is not needed reshape
        # returns a view whose strides need not be row-major (B == 1, Dh == 1 gave column
        # stride S), and the output projection reads the result as dense rows.
        return out.transpose(1, 2).contiguous().view(self.rows, self.cols)


_plans: dict[tuple, Plan] = {}
_MAX_PLANS = 4096


def _signature(q, k, v, attn_bias, key_padding_mask, scale, backend) -> tuple:
    # Everything validation and the decision depend on; cheap attribute reads only.
    sig = (
        type(q), type(k), type(v), q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
        q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15,
        scale, backend,
    )  # fmt: skip
    if attn_bias is not None:
        b = attn_bias
        sig += (type(b), b.dtype, b.device, b.shape, b.stride(), b.data_ptr() & 15)
    else:
        sig += (None,)
    if key_padding_mask is not None:
        sig += (type(key_padding_mask), key_padding_mask.dtype, key_padding_mask.device, key_padding_mask.shape)
    return sig


def plan_for(q, k, v, attn_bias, key_padding_mask, scale, backend) -> Plan:
    """The plan of a call: made (after validating every argument) on the first call with its
    signature, a dict lookup afterwards.  ``plan.run(q, k, v, attn_bias, key_padding_mask)``
    launches it; the encoder's native path keeps the plan of its call signature."""
    try:
        sig = _signature(q, k, v, attn_bias, key_padding_mask, scale, backend)
        plan = _plans.get(sig)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, or unhashable scale: validation says which
        sig, plan = None, None
    if plan is not None:
        return plan
    validate(q, k, v, attn_bias, key_padding_mask, scale, backend, BACKENDS)
    call = describe_call(q, k, v, attn_bias, key_padding_mask)
    chosen = decide(call, backend)
    plan = Plan(call, BACKENDS[chosen.backend], attn_bias, scale)
    if sig is not None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[sig] = plan
    return plan


def run(q, k, v, attn_bias, key_padding_mask, scale, backend) -> torch.Tensor:
    """Plan (or look up) and launch one call."""
    return plan_for(q, k, v, attn_bias, key_padding_mask, scale, backend).run(q, k, v, attn_bias, key_padding_mask)


def clear_cache() -> None:
    """Forget loaded tables, cached plans and constants (re-reads tables and FUSEDENC_ATTENTION_BACKEND)."""
    clear_tables()
    _plans.clear()
    _consts.clear()


def cache_info() -> dict[str, int]:
    """How many plans and device constants are cached (tests, diagnostics)."""
    return {"plans": len(_plans), "constants": len(_consts)}
