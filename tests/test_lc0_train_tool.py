"""``tools/lc0_train.py``'s model is the net file's layout: a tiny model, every parameter moved
off its initial value, exported through fusedenc's writer and loaded with ``load_network``
(CPU, fp32), gives the model's own outputs; and the training data's planes, built from
whole games at once, are ``encode_planes`` of the same histories.  Uses the held-back games
of ``tests/data/lc0_trained`` (no engine, no python-chess)."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "lc0_trained")


@pytest.fixture(scope="module")
def tool():
    path = os.path.join(ROOT, "tools", "lc0_train.py")
    spec = importlib.util.spec_from_file_location("lc0_train_tool", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lc0_train_tool"] = module
    spec.loader.exec_module(module)
    return module


def _tiny(tool, input_format=1):
    torch.manual_seed(0)
    cfg = tool.ModelConfig(layers=2, d_model=32, heads=2, d_ff=64, smolgen=(4, 16, 16), embedding_dense=4,
                           policy_d_model=32, input_format=input_format)
    model = tool.Lc0Model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def test_export_reproduces_model(tool, tmp_path):
    from fusedenc.lc0 import load_network

    model = _tiny(tool)
    games = list(tool.lc0_games.read_games(tool.find_parts([DATA])))[:3]
    arrays = tool.build_arrays(games, 1)
    pick = np.linspace(0, len(arrays["rule50"]) - 1, 48).astype(np.int64)
    data = tool.DeviceData({k: v[pick] for k, v in arrays.items()}, torch.device("cpu"))
    planes = data.planes(torch.arange(len(pick)))
    path = str(tmp_path / "net.pb.gz")
    tool.write_net_file(model, path, "FLOAT32")
    net = load_network(path, device="cpu", dtype=torch.float32)
    mine = model.outputs(planes)
    with torch.no_grad():
        theirs = net(planes)
    for head in ("policy", "wdl", "moves_left"):
        diff = (mine[head] - theirs[head]).abs().max() / theirs[head].abs().max()
        assert diff <= 1e-4, (head, float(diff))


def test_dataset_planes_and_targets(tool):
    from fusedenc.lc0 import encode_planes

    games = list(tool.lc0_games.read_games(tool.find_parts([DATA])))[:2]
    arrays = tool.build_arrays(games, 1)
    assert len(arrays["rule50"]) == sum(len(g["moves"]) for g in games)
    data = tool.DeviceData(arrays, torch.device("cpu"))
    index = torch.arange(0, len(arrays["rule50"]), 7)
    hist = [(games[g]["start"], games[g]["moves"][:p])
            for g, p in zip(arrays["game"][index.numpy()].tolist(), arrays["ply"][index.numpy()].tolist())]
    assert torch.equal(data.planes(index), encode_planes(hist, 1))
    # Column 0 is the engine's best move, a legal move with a policy index; plies left counts down.
    assert (arrays["pol_idx"][:, 0] >= 0).all()
    first = arrays["game"] == 0
    assert arrays["plies_left"][first][0] == len(games[0]["moves"]) and arrays["plies_left"][first][-1] == 1
    ns = type("A", (), {"policy_temp": 60.0, "best_weight": 0.5, "result_weight": 0.25})()
    t = data.targets(index, ns)
    assert torch.allclose(t["policy"].sum(-1), torch.ones(len(index)), atol=1e-5)
    assert torch.allclose(t["wdl"].sum(-1), torch.ones(len(index)), atol=1e-5)
    assert (t["policy"].argmax(-1) == t["best"]).all()
