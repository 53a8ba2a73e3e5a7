"""fusedenc's PyTorch reference of a whole Lc0 net (fusedenc/lc0/reference.py) against lc0 itself.

The fixtures in ``tests/data/lc0/`` are small synthetic nets (``<name>.pb.gz``, random weights
from ``tests/lc0_writer.py``) and what lc0's own ONNX converter made of them (``<name>.npz``):
the input ``planes [4, 112, 8, 8]`` and lc0's ``policy [4, 1858]``, ``wdl [4, 3]`` (or
``value [4, 1]``) and ``moves_left [4, 1]``, all float32.  This file checks that
``reference_forward(read_net(net), planes)`` gives lc0's outputs, so the reader, the
activations, the LayerNorm eps values, gates, smolgen, the promotion logits and the
1858-move gather are checked against lc0 rather than against our reading of its source.

How the references were made (nothing of lc0 is in this repository: no code, no binary,
no ONNX file, no build script):

* lc0 ``LeelaChessZero/lc0`` at commit ``909a40826db9e8b221d9209a487daba6ab57e3b7``
  (2026-04-20, "show correct castling move for frc (#2376)"; reports itself as
  ``v0.33.0-dev+git.909a4082``), built CPU-only on Debian 12 (x86_64, gcc 12.2.0) with meson
  1.12.1 and ninja 1.13.2 from pip and Debian's ``libabsl-dev`` (20220623.1-1+deb12u2) and
  ``zlib1g-dev`` (1.2.13), no subproject downloaded::

      meson setup build --buildtype release -Dbuild_backends=false -Dgtest=false \\
          -Db_lto=false -Dnative_arch=false -Donnx=false --wrap-mode=nodownload
      ninja -C build        # 82 steps, about 3.5 minutes on 2 cores

  (``-Dbuild_backends=false`` leaves out every NN backend; ``leela2onnx`` and its converter,
  ``src/neural/onnx/converter.cc``, are built regardless.)
* each net converted with lc0's defaults (ONNX opset 17, float32 data type, inputs
  ``/input/planes``, outputs ``/output/policy``, ``/output/wdl`` or ``/output/value``,
  ``/output/mlh``)::

      lc0 leela2onnx --input=<name>.pb.gz --output=<name>.onnx

* run with onnxruntime 1.32.0 (``CPUExecutionProvider``, default session options; onnx
  1.23.2, numpy 2.4.6) on the planes of ``_planes()`` below, and saved with
  ``numpy.savez_compressed`` (outputs cast to float32, which they already were).

The nets (``lc0_writer.write_net(path, compresslevel=9, **spec)``, all with ``layers=2,
d_model=16, d_ff=32, embedding_dense=1, value_channels=1, value_hidden=128, mlh_channels=1,
mlh_hidden=8``; ``value_hidden`` must be 128, the size lc0's ONNX converter assumes):

* ``lc0_linear16_mish_smolgen``: ``heads=2, encoding="LINEAR16", smolgen=(2, 8, 2),
  default_activation="mish", ffn_activation="swish", smolgen_activation="swish", seed=1901``
  (multi-head format, network 7; WDL; moves left);
* ``lc0_float16_relu_gated``: ``heads=4, encoding="FLOAT16", smolgen=(2, 8, 2),
  default_activation="relu", ffn_activation="relu2", smolgen_activation="selu", gating=True,
  policy_d_model=8, seed=1902`` (network 7; WDL; moves left, clamped to 0 by its final relu
  in three of the four positions);
* ``lc0_bfloat16_single_head``: ``heads=2, encoding="BFLOAT16", smolgen=None,
  default_activation="mish", head_format="single", wdl=False, moves_left=False, seed=1903``
  (single-head format, network 6; classical tanh value; FFN and smolgen activations DEFAULT).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from fusedenc.lc0 import load_network, read_net
from fusedenc.lc0.reference import reference_forward

DATA = pathlib.Path(__file__).resolve().parent / "data" / "lc0"

#: Fixture name -> what the file must say about itself (a guard against a swapped or
#: regenerated file quietly testing something else).
FIXTURES = {
    "lc0_linear16_mish_smolgen": dict(
        encoding="LINEAR16", network=7, heads=2, smolgen=True, gates=False,
        activations={"default": "mish", "ffn": "swish", "smolgen": "swish", "policy": "mish"},
        outputs={"policy", "wdl", "moves_left"}),
    "lc0_float16_relu_gated": dict(
        encoding="FLOAT16", network=7, heads=4, smolgen=True, gates=True,
        activations={"default": "relu", "ffn": "relu2", "smolgen": "selu", "policy": "relu"},
        outputs={"policy", "wdl", "moves_left"}),
    "lc0_bfloat16_single_head": dict(
        encoding="BFLOAT16", network=6, heads=2, smolgen=False, gates=False,
        activations={"default": "mish", "ffn": "mish", "smolgen": "mish", "policy": "mish"},
        outputs={"policy", "value"}),
}  # fmt: skip

# Tolerances.  lc0's outputs are float32 (an f32 ONNX model run by onnxruntime); their rounding
# error is frozen into the fixtures, and the float64 reference is exact to ~1e-15, so the
# difference is lc0's own float32 error: measured at most 1.13e-6 on policy logits (which reach
# 3.1) and 7.5e-8 on wdl / value / moves left.  The bound, max |ours - lc0| <= TOL * max(1,
# max |lc0|) per output, is ~9x above that noise and cannot flake (the fixtures are fixed; the
# float64 side varies by ~1e-15 between machines).  It is far below the smallest plausible
# slip measured (in the same units, max |diff| / max(1, max |lc0|)): the body's LayerNorm eps
# 1e-6 instead of lc0's 1e-3 for PE_DENSE nets gives 4.7e-4 to 9.7e-4 (47x the bound); every
# LayerNorm at eps 1e-5, swapped activations, no queen logit in the promotions, alpha 1, a
# dropped or transposed smolgen bias give 4e-3 to 0.6.  The float32 reference adds its own rounding (measured 1.2e-6, BLAS
# order varies between CPUs), hence a looser bound there, still 10x below the eps slip.
TOL_FLOAT64 = 1e-5
TOL_FLOAT32 = 5e-5


def _planes(seed: int = 19, batch: int = 4) -> np.ndarray:
    """The input planes the fixtures were made on (also stored in each ``.npz``): sparse 0/1
    piece and history planes, whole castling and side-to-move planes, a rule-50-like scalar
    plane, plane 110 zero and the all-ones plane 111."""
    rng = np.random.default_rng(seed)
    p = np.zeros((batch, 112, 8, 8), np.float32)
    p[:, :104] = rng.random((batch, 104, 8, 8)) < 0.08
    p[:, 104:108] = rng.random((batch, 4, 1, 1)) < 0.5
    p[:, 108] = rng.random((batch, 1, 1)) < 0.5
    p[:, 109] = rng.integers(0, 100, (batch, 1, 1)) / 99.0
    p[:, 111] = 1.0
    return p


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def fixture(request):
    name = request.param
    net = read_net(str(DATA / f"{name}.pb.gz"))
    with np.load(DATA / f"{name}.npz") as z:
        arrays = {k: torch.from_numpy(z[k]) for k in z.files}
    return name, net, arrays


def _check(name, out, lc0, tol):
    planes_free = {k: v for k, v in lc0.items() if k != "planes"}
    assert set(out) == set(planes_free), (name, sorted(out), sorted(planes_free))
    for key, want in planes_free.items():
        got = out[key]
        assert got.shape == want.shape, (name, key, tuple(got.shape), tuple(want.shape))
        want = want.double()
        diff = (got.double() - want).abs().max().item()
        bound = tol * max(1.0, want.abs().max().item())
        assert diff <= bound, f"{name}: {key} differs from lc0 by {diff:.3e} (bound {bound:.1e})"


def test_fixture_is_what_it_claims(fixture):
    name, net, lc0 = fixture
    want = FIXTURES[name]
    assert net.layer_encodings.keys() == {want["encoding"]}, net.layer_encodings
    assert int(net.network) == want["network"]
    assert net.weights["headcount"] == want["heads"]
    assert ("smolgen_w" in net.weights) == want["smolgen"]
    assert ("ip_mult_gate" in net.weights) == want["gates"]
    assert net.activation_names() == want["activations"]
    assert set(lc0) - {"planes"} == want["outputs"]
    for key, t in lc0.items():
        assert t.dtype == torch.float32 and torch.isfinite(t).all(), (name, key)
    # The planes are the documented ones, so the fixtures can be remade from this docstring.
    np.testing.assert_array_equal(lc0["planes"].numpy(), _planes())


def test_reference_float64_matches_lc0(fixture):
    name, net, lc0 = fixture
    out = reference_forward(net, lc0["planes"].double())
    _check(name, out, lc0, TOL_FLOAT64)


def test_reference_float32_matches_lc0(fixture):
    name, net, lc0 = fixture
    out = reference_forward(net, lc0["planes"])
    for t in out.values():
        assert t.dtype == torch.float32
    _check(name, out, lc0, TOL_FLOAT32)


def test_outputs_are_not_degenerate(fixture):
    """The comparison means something: lc0's policy logits spread out, its WDL is a proper
    distribution that is not uniform, and the positions give different outputs."""
    name, _, lc0 = fixture
    policy = lc0["policy"].double()
    assert (policy.std(dim=1) > 0.1).all(), name
    assert (policy[1:] - policy[:1]).abs().amax(dim=1).min() > 1e-2, name
    if "wdl" in lc0:
        wdl = lc0["wdl"].double()
        torch.testing.assert_close(wdl.sum(-1), torch.ones(wdl.shape[0], dtype=torch.float64), rtol=0, atol=1e-6)
        assert (wdl - 1 / 3).abs().max() > 1e-2, name
    if "moves_left" in lc0:
        assert (lc0["moves_left"] >= 0).all() and (lc0["moves_left"] > 0).any(), name


def test_the_fast_network_matches_lc0_on_cpu(fixture):
    """``load_network``'s Lc0Network (float32 on CPU: the ops run their references, the
    layout, gathers and head wiring are the fast path's own) against lc0 itself."""
    name, _, lc0 = fixture
    net = load_network(str(DATA / f"{name}.pb.gz"), dtype=torch.float32, device="cpu")
    _check(name, net(lc0["planes"]), lc0, TOL_FLOAT32)
