"""The positions path on the GPU: planes expanded there from masks, and ``evaluate`` of the
network and of its graph runner, against the CPU planes and a plain forward."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fusedenc.lc0 import decode_policy, encode_planes, load_network
from fusedenc.lc0.encoding import encode_masks, expand_planes

sys.path.insert(0, str(Path(__file__).parent))
import lc0_writer  # noqa: E402
from test_lc0_positions import ALL_FORMATS, _random_positions  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_planes_expanded_on_the_gpu_equal_the_cpu_planes(fmt):
    positions = _random_positions(11 * fmt, 200) + ["startpos", "8/8/8/3k4/8/8/8/1K6 w - - 5 40"]
    masks, values, transforms = encode_masks(positions, fmt)
    cpu = expand_planes(masks, values, transforms)
    gpu = expand_planes(torch.from_numpy(masks.view(np.int64)).cuda(), torch.from_numpy(values).cuda(),
                        torch.from_numpy(transforms).cuda())
    assert torch.equal(gpu.cpu(), cpu)
    half = torch.full((len(positions), 112, 8, 8), float("nan"), dtype=torch.float16, device="cuda")
    expand_planes(torch.from_numpy(masks.view(np.int64)).cuda(), torch.from_numpy(values).cuda(),
                  torch.from_numpy(transforms).cuda(), out=half)
    assert torch.equal(half.cpu(), cpu.half())


@pytest.mark.parametrize("fmt", (1, 4, 133))
def test_evaluate_on_the_gpu_is_decode_of_the_forward(tmp_path, fmt):
    path = tmp_path / "net.pb.gz"
    lc0_writer.write_net(path, **{**lc0_writer.PRESETS["tiny"], "input_format": fmt, "seed": 77 + fmt})
    net = load_network(str(path), dtype=torch.float16, device="cuda")
    positions = _random_positions(5 + fmt, 150) + ["startpos"]
    planes = encode_planes(positions, fmt).cuda().half()
    with torch.inference_mode():
        heads = net(planes)
    expected = decode_policy(heads["policy"], positions, fmt)
    runner = net.graph_runner((64, 256))
    for got in (net.evaluate(positions), runner.evaluate(positions)):
        for e, pol, wdl in zip(got, expected, heads["wdl"].float().cpu()):
            assert e.moves == pol.moves or sorted(e.moves) == sorted(pol.moves)
            mine = dict(zip(e.moves, e.probs))
            assert all(abs(mine[m] - p) <= 1e-3 for m, p in zip(pol.moves, pol.probs))
            assert np.allclose(e.wdl, wdl.numpy(), atol=2e-3)
