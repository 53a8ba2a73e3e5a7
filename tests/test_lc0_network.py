"""``load_network`` / ``Lc0Network`` against the PyTorch reference of the whole net.

The rule is the project's: ``|out - ref64| <= 2 * |ref_same_dtype - ref64| + atol``, with
``ref64`` the reference in float64 and ``ref_same_dtype`` the reference in the network's
dtype.  CPU tests use float32 (the ops run their references there); GPU tests fp16 on the
native path, at the tiny and the t82 shape.
"""

from __future__ import annotations

import pytest
import torch
from lc0_writer import random_planes, write_preset

from fusedenc.dtypes import ATOL
from fusedenc.lc0 import Lc0FileError, load_network, read_net
from fusedenc.lc0.reference import reference_forward


def _check(path, dtype, device, batch, gen):
    net = load_network(str(path), dtype=dtype, device=device)
    planes = random_planes(batch, gen)
    file = read_net(str(path))
    ref64 = reference_forward(file, planes.double())
    same = reference_forward(file, planes.to(device=device, dtype=dtype))
    out = net(planes.to(device=device, dtype=dtype))
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


def test_the_command_line_describes_a_net_and_refuses_a_bad_file(tiny_path, tmp_path, capsys):
    from fusedenc.lc0.__main__ import main

    assert main([str(tiny_path), "--no-bench"]) == 0
    out = capsys.readouterr().out
    assert '"layers": 2' in out and '"d_model": 64' in out and '"smolgen"' in out
    bad = tmp_path / "bad.pb.gz"
    bad.write_bytes(b"\x1f\x8b not really gzip")
    assert main([str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err
