"""``load_network`` / ``Lc0Network`` against the PyTorch reference of the whole net.

The rule is the project's: ``|out - ref64| <= 2 * |ref_same_dtype - ref64| + atol``, with
``ref64`` the reference in float64 and ``ref_same_dtype`` the reference in the network's
dtype.  CPU tests use float32 (the ops run their references there); GPU tests fp16 on the
native path, at the tiny and the t82 shape.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from lc0_writer import random_planes, write_preset

from fusedenc.common.dtypes import ATOL
from fusedenc.lc0 import Lc0FileError, Lc0GraphRunner, load_network, read_net
from fusedenc.lc0.reference import reference_forward
from fusedenc.testing import layer_norm_folding


def _check(path, dtype, device, batch, gen, run=None):
    """``run`` (default: the network itself) on fresh planes against the reference, by the rule."""
    net = load_network(str(path), dtype=dtype, device=device)
    run = net if run is None else run(net)
    planes = random_planes(batch, gen)
    file = read_net(str(path))
    ref64 = reference_forward(file, planes.double())
    same = reference_forward(file, planes.to(device=device, dtype=dtype))
    out = run(planes.to(device=device, dtype=dtype))
    assert set(out) == set(ref64), (set(out), set(ref64))
    for name, ref in ref64.items():
        err = (out[name].double().cpu() - ref).abs().max().item()
        base = (same[name].double().cpu() - ref).abs().max().item()
        bound = 2 * base + ATOL[dtype]
        assert err <= bound, f"{name}: max|out - ref64| {err:.3g} > {bound:.3g} ({dtype}, seed {gen.seed_value})"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("lc0") / "tiny.pb.gz"
    write_preset(path, "tiny", seed=11)
    return path


def test_tiny_net_matches_the_reference_on_cpu(tiny_path, gen):
    _check(tiny_path, torch.float32, "cpu", 3, gen)


def test_the_folded_path_matches_the_reference_on_cpu(tiny_path, gen):
    """The LayerNorms folded (torch's form of the algebra the Hopper kernels run), from the
    embedding FFN's, left pending into layer 0, to the body's last."""
    with layer_norm_folding("force"):
        _check(tiny_path, torch.float32, "cpu", 3, gen)


def test_the_folded_path_leaves_the_embedding_norm_pending(tiny_path, gen, monkeypatch):
    """With folding on, the embedding FFN's second GEMM is the residual GEMM with statistics
    (its LayerNorm pending into layer 0), not the LayerNorm pass."""
    from fusedenc.ops import norm_fold

    net = load_network(str(tiny_path), dtype=torch.float32, device="cpu")
    calls = []
    real = norm_fold.residual_linear
    monkeypatch.setattr(norm_fold, "residual_linear", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(net.emb_ffn_ln, "forward", lambda *a, **k: pytest.fail("the embedding LayerNorm ran as a pass"))
    with layer_norm_folding("force"):
        net(random_planes(2, gen))
    assert calls and calls[0] is net.emb_ffn.dense2.weight


def test_bad_input_is_refused(tiny_path):
    net = load_network(str(tiny_path), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"planes must be \[B, 112, 8, 8\]"):
        net(torch.zeros(2, 112, 8))
    with pytest.raises(TypeError, match="planes are torch.float64"):
        net(torch.zeros(2, 112, 8, 8, dtype=torch.float64))
    assert net(torch.zeros(0, 112, 8, 8))["policy"].shape == (0, 1858)


def test_a_bad_file_fails_before_any_device_work(tmp_path):
    """A damaged file names the problem, even when the device asked for does not exist here."""
    bad = tmp_path / "bad.pb.gz"
    bad.write_bytes(b"not a network")
    with pytest.raises(Lc0FileError):
        load_network(str(bad), device="cuda:7")


@pytest.mark.gpu
def test_tiny_net_fp16_on_the_gpu(tiny_path, gen):
    _check(tiny_path, torch.float16, "cuda", 8, gen)


@pytest.mark.gpu
def test_t82_shaped_net_fp16_on_the_gpu(tmp_path, gen):
    path = tmp_path / "t82.pb.gz"
    write_preset(path, "t82", seed=5)
    _check(path, torch.float16, "cuda", 16, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("preset, batch", [("tiny", 8), ("t82", 16)])
@pytest.mark.parametrize("side_sms", [0, 8])
def test_the_folded_body_with_smolgen_beside_qkv(tmp_path, preset, batch, side_sms, gen):
    """The body's LayerNorms folded into its GEMMs (forced at these small sizes), each layer's
    smolgen before its block (0) or on a side stream on 8 SMs while the QKV GEMM runs on
    the rest: eager and as a graph, held to the reference like the plain path."""

    def beside(net):
        net.smolgen_side_sms = side_sms
        return net

    path = tmp_path / f"{preset}.pb.gz"
    write_preset(path, preset, seed=7)
    with layer_norm_folding("force"):
        _check(path, torch.float16, "cuda", batch, gen, run=beside)
        _check(path, torch.float16, "cuda", batch, gen, run=lambda net: beside(net).graph_runner((batch,)))


@pytest.mark.gpu
def test_by_default_smolgen_goes_beside_qkv_only_inside_a_graph(tmp_path, gen):
    """The default (None): each layer's smolgen before its block when the net runs eagerly
    (the side stream's switches cost host time that eager calls are bound by), beside the
    QKV GEMM while a CUDA graph is captured; both held to the reference."""
    path = tmp_path / "tiny.pb.gz"
    write_preset(path, "tiny", seed=7)
    nets = []

    def keep(net):
        nets.append(net)
        return net

    with layer_norm_folding("force"):
        _check(path, torch.float16, "cuda", 16, gen, run=keep)
        assert not nets[0]._side_streams, "an eager call took the side stream"
        _check(path, torch.float16, "cuda", 16, gen, run=lambda net: keep(net).graph_runner((16,)))
        assert nets[1]._side_streams, "the captured graph ran smolgen before each block"


@pytest.mark.gpu
def test_a_side_sm_count_that_leaves_qkv_nothing_is_refused(tiny_path, gen):
    net = load_network(str(tiny_path), dtype=torch.float16, device="cuda")
    planes = random_planes(4, gen).to("cuda", torch.float16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with layer_norm_folding("force"):
        for bad in (sms, -1, 2.5, True):
            net.smolgen_side_sms = bad
            with pytest.raises(ValueError, match="smolgen_side_sms must be None or an int"):
                net(planes)
        net.smolgen_side_sms = sms - 1  # the most it may take: QKV keeps one SM
        assert torch.isfinite(net(planes)["policy"]).all()


def test_an_lc0_net_copies_and_pickles_without_its_streams(tiny_path):
    import copy
    import io

    net = load_network(str(tiny_path), dtype=torch.float32, device="cpu")
    planes = random_planes(2, torch.Generator().manual_seed(3))
    twin = copy.deepcopy(net)
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (twin, loaded):
        assert torch.equal(other(planes)["policy"], net(planes)["policy"])


def test_the_graph_runner_refuses_what_it_cannot_run(tiny_path):
    net = load_network(str(tiny_path), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="CUDA graphs need the network on a GPU"):
        net.graph_runner()
    with pytest.raises(TypeError, match="net must be an Lc0Network"):
        Lc0GraphRunner(torch.nn.Linear(2, 2), (1,))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5, 16, 37])
def test_the_graph_runner_matches_the_reference(tiny_path, batch, gen):
    """Buckets 1, 8 and 16: a batch below its bucket is padded, one above the largest runs
    in chunks; each output is held to the fp64 reference like the eager network."""
    _check(tiny_path, torch.float16, "cuda", batch, gen, run=lambda net: net.graph_runner((1, 8, 16)))


@pytest.mark.gpu
def test_the_graph_runner_checks_planes_and_replays_fresh_inputs(tiny_path, gen):
    net = load_network(str(tiny_path), dtype=torch.float16, device="cuda")
    runner = net.graph_runner((4,))
    with pytest.raises(ValueError, match=r"planes must be \[B, 112, 8, 8\]"):
        runner(torch.zeros(2, 112, 8, device="cuda", dtype=torch.float16))
    with pytest.raises(TypeError, match="planes are torch.float32"):
        runner(torch.zeros(2, 112, 8, 8, device="cuda"))
    assert runner(torch.zeros(0, 112, 8, 8, device="cuda", dtype=torch.float16))["policy"].shape == (0, 1858)
    # Two different inputs through the same graph: each result is that input's, not the first's.
    a, b = (random_planes(3, gen).to("cuda", torch.float16) for _ in range(2))
    first = {k: v.clone() for k, v in runner(a).items()}
    second = runner(b)
    eager_a, eager_b = net(a), net(b)
    for name in first:
        torch.testing.assert_close(first[name], eager_a[name], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(second[name], eager_b[name], rtol=2e-2, atol=2e-2)
    assert not torch.equal(first["policy"], second["policy"])


# Run in a child process: without the fix a replay faults, and a CUDA fault ends the process.
_REPLAYS_AFTER_TORCH_CLEARS_CUBLAS = """
import sys, torch
from lc0_writer import random_planes
from fusedenc.lc0 import load_network
net = load_network(sys.argv[1], dtype=torch.float16, device="cuda")
x = random_planes(int(sys.argv[2]), torch.Generator().manual_seed(0)).to("cuda", torch.float16)
runner = net.graph_runner((x.shape[0],))
want = {k: v.clone() for k, v in runner(x).items()}
# Another graph with a torch matmul, then dropped: torch's cached cuBLAS workspace for the
# capture stream now lies in that graph's pool, which nothing else holds.
a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
a @ a
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    a @ a
del g
runner = net.graph_runner((x.shape[0],))
runner.capture_all()
# What torch.compile's CUDA graphs do around each of their captures; then memory goes back.
torch._C._cuda_clearCublasWorkspaces()
torch.cuda.empty_cache()
for _ in range(3):
    got = runner(x)
torch.cuda.synchronize()
for name in want:
    torch.testing.assert_close(got[name], want[name], rtol=1e-2, atol=1e-2)  # same kernels; cuBLAS may differ in order
print("replays ok")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("preset, batch", [("tiny", 64), ("t82", 256)])
def test_graph_replays_survive_torch_clearing_its_cublas_workspaces(tmp_path, preset, batch):
    """A runner captured while torch's cached cuBLAS workspace lay in a dropped graph's pool
    still replays after torch clears that cache (as torch.compile does): the capture makes
    its own (``graphs.own_cublas_workspace``).  Found on an H100: "unspecified launch
    failure" at the first replay after torch.compile ran."""
    path = tmp_path / f"{preset}.pb.gz"
    write_preset(path, preset, seed=3)
    script = tmp_path / "replays.py"
    script.write_text(_REPLAYS_AFTER_TORCH_CLEARS_CUBLAS)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(script), str(path), str(batch)], capture_output=True, text=True,
                          timeout=900, env=env)  # fmt: skip
    assert proc.returncode == 0 and "replays ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_the_command_line_describes_a_net_and_refuses_a_bad_file(tiny_path, tmp_path, capsys):
    from fusedenc.lc0.__main__ import main

    assert main([str(tiny_path), "--no-bench"]) == 0
    out = capsys.readouterr().out
    assert '"layers": 2' in out and '"d_model": 64' in out and '"smolgen"' in out
    bad = tmp_path / "bad.pb.gz"
    bad.write_bytes(b"\x1f\x8b not really gzip")
    assert main([str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err
