"""The PyTorch reference of a whole Lc0 net (fusedenc/lc0/reference.py) on synthetic nets.

What can be checked without lc0 itself: shapes, finiteness, the heads' own invariants
(WDL sums to 1, moves left >= 0), fp32 against fp64, the policy gather against the move
encoding (a plain move's logit is its from/to attention score), and the promotion logits
against the independent construction in ``moves.attention_policy_logits``.  The outside
oracle (lc0's own converter) is issue 19's next step.
"""

from __future__ import annotations

import math

import pytest
import torch
from lc0_writer import random_planes, write_preset

from fusedenc.lc0 import moves, read_net
from fusedenc.lc0.reference import reference_forward


@pytest.fixture(scope="module")
def tiny_net(tmp_path_factory):
    path = tmp_path_factory.mktemp("lc0") / "tiny.pb.gz"
    write_preset(path, "tiny", seed=7)
    return read_net(str(path))


def test_outputs_have_the_heads_shapes_and_invariants(tiny_net, gen):
    out = reference_forward(tiny_net, random_planes(3, gen, torch.float64))
    assert out["policy"].shape == (3, moves.NUM_POLICY_MOVES)
    assert out["wdl"].shape == (3, 3) and out["moves_left"].shape == (3, 1)
    for name, t in out.items():
        assert torch.isfinite(t).all(), (name, gen.seed_value)
    torch.testing.assert_close(out["wdl"].sum(-1), torch.ones(3, dtype=torch.float64))
    assert (out["moves_left"] >= 0).all()


def test_float32_agrees_with_float64(tiny_net, gen):
    planes = random_planes(2, gen, torch.float64)
    hi = reference_forward(tiny_net, planes)
    lo = reference_forward(tiny_net, planes.float())
    for name in hi:
        torch.testing.assert_close(lo[name].double(), hi[name], rtol=1e-4, atol=1e-4, msg=f"{name} seed {gen.seed_value}")


def test_batch_rows_are_independent(tiny_net, gen):
    planes = random_planes(4, gen, torch.float64)
    whole = reference_forward(tiny_net, planes)
    one = reference_forward(tiny_net, planes[2:3])
    for name in whole:
        torch.testing.assert_close(whole[name][2:3], one[name], rtol=1e-12, atol=1e-12)


def test_policy_logits_follow_the_move_encoding(tiny_net, gen, monkeypatch):
    """A plain move's logit is its (from, to) attention score; promotions add the promotion
    logits exactly as the independently written ``moves.attention_policy_logits`` builds them."""
    seen = {}
    real_gather = moves.gather_policy

    def spy(flat):
        seen["flat"] = flat
        return real_gather(flat)

    monkeypatch.setattr(moves, "gather_policy", spy)
    out = reference_forward(tiny_net, random_planes(2, gen, torch.float64))
    flat = seen["flat"]  # [B, 67 * 64] as the converter lays it out
    square = flat[:, : 64 * 64].view(2, 64, 64)
    for uci in ("a1b1", "e2e4", "g1f3", "h8a1", "b7c8"):
        frm, to = moves.square_index(uci[:2]), moves.square_index(uci[2:4])
        assert torch.equal(out["policy"][:, moves.move_index(uci)], square[:, frm, to]), uci
    # Promotions: the gathered logit is the promotion block's entry for (from file, to file, piece).
    promo = flat[:, 64 * 64 :].reshape(2, 8, 24)  # [B, from file, 3 * to file + piece]
    for f in range(8):
        for g in range(max(0, f - 1), min(8, f + 2)):
            for p, piece in enumerate("qrb"):
                uci = f"{'abcdefgh'[f]}7{'abcdefgh'[g]}8{piece}"
                assert torch.equal(out["policy"][:, moves.move_index(uci)], promo[:, f, 3 * g + p]), uci


def test_promotion_layout_matches_the_move_modules_construction(gen):
    """reference.py's promotion arithmetic against ``moves.attention_policy_logits``, on random
    square logits and promotion-key projections (two independent writings of converter.cc)."""
    from fusedenc.lc0 import reference

    b, pd = 2, 16
    q = torch.randn((b, 64, pd), generator=gen, dtype=torch.float64)
    w4 = torch.randn((4, pd), generator=gen, dtype=torch.float64)
    head = {
        "ip_pol_w": torch.eye(pd, dtype=torch.float64).flatten(), "ip_pol_b": torch.zeros(pd, dtype=torch.float64),
        "ip2_pol_w": torch.eye(pd, dtype=torch.float64).flatten(), "ip2_pol_b": torch.zeros(pd, dtype=torch.float64),
        "ip3_pol_w": torch.eye(pd, dtype=torch.float64).flatten(), "ip3_pol_b": torch.zeros(pd, dtype=torch.float64),
        "ip4_pol_w": w4.flatten(),
    }  # fmt: skip
    # With identity projections and activation "none", the head's q and k are its input: feed q
    # for both and compare against the move module's construction from q q^T.
    got = reference._policy(q, head, "none", "none", "none", None, 1e-3)
    square = (q @ q.transpose(1, 2)) / math.sqrt(pd)
    promotion_keys = q[:, 56:64, :] @ w4.t()
    want = moves.gather_policy(moves.attention_policy_logits(square, promotion_keys))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_bad_planes_are_refused_before_any_work(tiny_net):
    with pytest.raises(ValueError, match=r"planes must be \[B, 112, 8, 8\]"):
        reference_forward(tiny_net, torch.zeros(2, 111, 8, 8))


def test_the_reference_traces_as_one_graph(tiny_net):
    """The torch peer of bench/lc0.py is torch.compile of the reference: a graph break (e.g. in
    the policy gather) would make that peer slower than a user's compiled net, an unfair baseline."""
    import torch._dynamo as dynamo

    from fusedenc.lc0.reference import ReferenceNetwork

    explanation = dynamo.explain(ReferenceNetwork(tiny_net))(torch.zeros(2, 112, 8, 8))
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
