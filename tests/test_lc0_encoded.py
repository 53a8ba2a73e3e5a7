"""fusedenc.lc0.encoded: the network from packed encodings to packed heads.

The oracle is the network's own forward on planes that ``encoding.encode_planes`` made from
the same positions: the packed row must carry the encoding exactly (CPU, fp32: equal heads),
and the GPU's graphs, whatever the bucket, must give the fp32 forward's heads within fp16's
tolerance, in the columns ``layout`` names, leaving rows past the batch untouched.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from lc0_writer import write_preset

from fusedenc.lc0 import Lc0Network, read_net
from fusedenc.lc0.encoded import ROW_BYTES, EncodedRunner, head_layout, input_views
from fusedenc.lc0.encoding import encode_masks, encode_planes
from fusedenc.lc0.positions import Position
from fusedenc.lc0.schema import InputFormat


def _positions(n: int, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pos, moves = Position.from_fen("startpos"), []
        for _ in range(rng.randrange(0, 30)):
            legal = pos.legal_moves()
            if not legal:
                break
            m = rng.choice(legal)
            moves.append(m)
            pos = pos.push(m)
        out.append(("startpos", moves))
    return out


def _packed(positions, fmt) -> torch.Tensor:
    masks, values, turns = encode_masks(positions, fmt)
    packed = torch.full((len(positions), ROW_BYTES), 0xAB, dtype=torch.uint8)
    m, v, t = input_views(packed.numpy())
    m[:], v[:], t[:] = masks, values, turns
    return packed


@pytest.fixture(scope="module", params=[InputFormat.CLASSICAL_112_PLANE,
                                        InputFormat.WITH_CANONICALIZATION_HECTOPLIES_ARMAGEDDON])
def net_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("encoded") / f"tiny-{int(request.param)}.pb.gz"
    write_preset(str(path), "tiny", seed=5, input_format=request.param)
    return read_net(str(path))


def test_input_views_round_trip():
    """The numpy and torch views of a packed row agree field by field (no copy, every byte
    of the row belongs to exactly one field)."""
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(rng.integers(0, 256, (7, ROW_BYTES), dtype=np.uint8))
    mn, vn, tn = input_views(raw.numpy())
    mt, vt, tt = input_views(raw)
    assert mn.shape == (7, 112) and vn.shape == (7, 112) and tn.shape == (7,)
    assert np.array_equal(mn.view(np.int64), mt.numpy()) and np.array_equal(tn, tt.numpy())
    assert np.array_equal(vn.view(np.uint32), vt.numpy().view(np.uint32))
    assert mn.nbytes + vn.nbytes + tn.nbytes == raw[0].numel() * 7
    assert mt.data_ptr() == raw.data_ptr()  # views, not copies


def test_cpu_launch_equals_forward_on_planes(net_file):
    net = Lc0Network(net_file, dtype=torch.float32, device="cpu")
    positions = _positions(37, seed=1)
    runner = EncodedRunner(net, [8, 64], graphs=True)  # no graphs on a CPU: runs eagerly
    assert not runner.graphs
    out = torch.full((64, runner.width), float("nan"))
    runner.launch(_packed(positions, net.input_format), out, len(positions))
    want = net(encode_planes(positions, net.input_format))
    for name, (col, w) in runner.layout.items():
        torch.testing.assert_close(out[:37, col:col + w], want[name], rtol=0, atol=0)
    assert out[37:].isnan().all()  # rows past the batch are not written
    assert set(runner.layout) == set(want) and runner.width == sum(v.shape[1] for v in want.values())


@pytest.mark.parametrize("sizes", [[], [0, 8], [8, -1], [8.0], [True]])
def test_bad_bucket_sizes_are_refused_without_graphs_too(net_file, sizes):
    net = Lc0Network(net_file, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="batch_sizes must be positive ints"):
        EncodedRunner(net, sizes, graphs=False)


def test_head_layout_without_wdl_or_moves_left(tmp_path):
    path = tmp_path / "value.pb.gz"
    write_preset(str(path), "tiny", wdl=False, moves_left=False)
    net = Lc0Network(read_net(str(path)), dtype=torch.float32, device="cpu")
    assert head_layout(net) == {"policy": (0, 1858), "value": (1858, 1)}


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_launch_matches_fp32_forward(net_file, graphs):
    """Every bucket (a batch below, at and between them) gives the fp32 network's heads within
    fp16's tolerance; rows past the batch are left as they were."""
    device = torch.device("cuda", torch.cuda.current_device())
    net16 = Lc0Network(net_file, dtype=torch.float16, device=device)
    net32 = Lc0Network(net_file, dtype=torch.float32, device=device)
    runner = EncodedRunner(net16, [1, 8, 32], graphs=graphs)
    assert runner.graphs == graphs
    stream = torch.cuda.Stream(device)
    for n in (1, 5, 8, 31, 32):
        positions = _positions(n, seed=100 + n)
        packed = _packed(positions, net16.input_format).pin_memory()
        out = torch.full((32, runner.width), float("nan"), dtype=torch.float16).pin_memory()
        with torch.cuda.stream(stream):
            runner.launch(packed, out, n)
        stream.synchronize()
        want = net32(encode_planes(positions, net32.input_format, dtype=torch.float32).to(device))
        for name, (col, w) in runner.layout.items():
            torch.testing.assert_close(out[:n, col:col + w].float(), want[name].cpu(), rtol=2e-2, atol=2e-2)
        assert out[n:].isnan().all()
