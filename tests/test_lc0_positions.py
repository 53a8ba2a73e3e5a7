"""Chess positions, lc0's input planes and policy decoding, from the rules (CPU).

The outside oracles are the public perft tables (move generation), python-chess where it is
installed (legal moves and FENs over random games), and lc0 itself
(``test_lc0_position_oracle.py``, on fixtures made with lc0's own encoder).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import random_game

from fusedenc.lc0 import Lc0FormatError, Position, decode_policy, encode_planes, load_network, prepare
from fusedenc.lc0 import board as B
from fusedenc.lc0.encoding import GATHER, SQUARE_MAP, encode_masks
from fusedenc.lc0.moves import POLICY_MOVES
from fusedenc.lc0.policy import policy_indices
from fusedenc.lc0.positions import STARTPOS_FEN, parse_fens
from fusedenc.lc0.reference import reference_forward

sys.path.insert(0, str(Path(__file__).parent))
import lc0_writer  # noqa: E402

# Public perft tables (depth 1, 2, 3, ...).
PERFT = [
    (STARTPOS_FEN, [20, 400, 8902, 197281]),
    ("r3k2r/p1ppqpb1/bn2pnp1/3PN3/1p2P3/2N2Q1p/PPPBBPPP/R3K2R w KQkq - 0 1", [48, 2039, 97862]),
    ("8/2p5/3p4/KP5r/1R3p1k/8/4P1P1/8 w - - 0 1", [14, 191, 2812, 43238]),
    ("r3k2r/Pppp1ppp/1b3nbN/nP6/BBP1P3/q4N2/Pp1P2PP/R2Q1RK1 w kq - 0 1", [6, 264, 9467]),
    ("r2q1rk1/pP1p2pp/Q4n2/bbp1p3/Np6/1B3NBn/pPPP1PPP/R3K2R b KQ - 0 1", [6, 264, 9467]),  # position 4 mirrored
    ("rnbq1k1r/pp1Pbppp/2p5/8/2B5/8/PPP1NnPP/RNBQK2R w KQ - 1 8", [44, 1486, 62379]),
    ("r4rk1/1pp1qppp/p1np1n2/2b1p1B1/2B1P1b1/P1NP1N2/1PP1QPPP/R4RK1 w - - 0 10", [46, 2079, 89890]),
]
ALL_FORMATS = (1, 2, 3, 4, 5, 132, 133)


@pytest.mark.parametrize("fen,counts", PERFT, ids=[f"perft{i}" for i in range(len(PERFT))])
def test_perft_matches_the_public_tables(fen, counts):
    boards = parse_fens([fen])
    got = [int(B.perft(boards, depth)[0]) for depth in range(1, len(counts) + 1)]
    assert got == counts


def test_perft_of_a_batch_is_per_board():
    fens = [f for f, _ in PERFT]
    got = B.perft(parse_fens(fens), 2)
    assert got.tolist() == [c[1] for _, c in PERFT]


@pytest.mark.slow
def test_legal_moves_and_fens_agree_with_python_chess():
    chess = pytest.importorskip("chess")
    rng = random.Random(1234)
    checked = 0
    for game in range(40):
        board = chess.Board()
        p = Position.startpos()
        for _ in range(rng.randint(20, 160)):
            ours = p.legal_moves()
            theirs = sorted(m.uci() for m in board.legal_moves)
            assert ours == theirs, board.fen()
            assert p.fen().split()[:3] == board.fen().split()[:3]
            assert p.is_check() == board.is_check()
            checked += 1
            if not ours:
                break
            move = rng.choice(ours)
            p = p.push(move)
            board.push_uci(move)
        # the python-chess board itself is accepted as a position, history and all
        batch = prepare([board])
        assert batch.states.key()[-1].tolist() == prepare([p]).states.key()[-1].tolist()
    assert checked > 2000


def test_fen_round_trip_and_fields():
    fen = "r3k2r/p1ppqpb1/bn2pnp1/3PN3/1p2P3/2N2Q1p/PPPBBPPP/R3K2R b Kq - 17 42"
    p = Position.from_fen(fen)
    assert p.fen() == fen and p.turn == "b" and p.rule50 == 17
    assert Position.from_fen("startpos").fen() == STARTPOS_FEN
    assert Position.from_fen("8/8/8/8/8/8/8/K6k w - -").fen() == "8/8/8/8/8/8/8/K6k w - - 0 1"  # EPD's four fields
    assert p.piece_at("e8") == "k" and p.piece_at("e1") == "K" and p.piece_at("e4") == "P" and p.piece_at("a3") is None


@pytest.mark.parametrize(
    "fen,words",
    [
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0", None),  # 5 fields are fine
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP w KQkq - 0 1", "7 ranks"),
        ("rnbqkbnr/pppppppp/9/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1", "no piece: 9"),
        ("rnbqkbnr/pppppppp/44p/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1", "9 squares"),
        ("rnbqkbnr/ppppxppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1", "no piece: x"),
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR x KQkq - 0 1", "side to move"),
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkqA - 0 1", "Chess960"),
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBN1 w KQkq - 0 1", "castling right K"),
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQ1BNR w KQkq - 0 1", "white has 0 kings"),
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq e6 0 1", "en-passant square e6"),
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq e3 0 1", "wrong rank"),
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - x 1", "integers"),
        ("Pnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1", "first or last rank"),
        ("4k2R/8/8/8/8/8/8/4K3 w - - 0 1", "not to move is in check"),
        ("4k3/4Q3/8/8/8/8/8/4K3 w - - 0 1", "not to move is in check"),
        ("4k3/8/8/8/8/8/8/4K3 w - - -1 1", "halfmove clock"),
        ("7K/8/3B4/2Q1k3/1b3B2/4Q3/3b4/8 b - - 18 28", "in check from 4 pieces"),
    ],
)
def test_bad_fens_are_refused_naming_the_position(fen, words):
    if words is None:
        Position.from_fen(fen)
        return
    with pytest.raises(ValueError) as info:
        prepare(["startpos", fen])
    assert "position 1" in str(info.value) and words in str(info.value), str(info.value)


def test_illegal_history_moves_are_refused_naming_move_and_position():
    with pytest.raises(ValueError, match=r"position 0 .*move 3 \(e1g1\) is illegal"):
        prepare([("startpos", ["e2e4", "e7e5", "e1g1"])])
    with pytest.raises(ValueError, match="not a move in UCI"):
        prepare([("startpos", ["e2e4", "e7e9"])])
    with pytest.raises(ValueError, match="not a legal move"):
        Position.startpos().push("e2e5")
    with pytest.raises(ValueError, match="a position is a FEN string"):
        prepare([42])
    with pytest.raises(ValueError, match="wrap a single position"):
        prepare("startpos")


def test_moves_castling_en_passant_and_promotion():
    p = Position.from_fen("r3k2r/8/8/8/8/8/8/R3K2R w KQkq - 0 1")
    assert {"e1g1", "e1c1"} <= set(p.legal_moves())
    assert p.push("e1h1").fen() == p.push("e1g1").fen() == "r3k2r/8/8/8/8/8/8/R4RK1 b kq - 1 1"  # lc0's spelling
    assert p.push("e1c1").fen() == "r3k2r/8/8/8/8/8/8/2KR3R b kq - 1 1"
    assert p.push("a1a8").fen() == "R3k2r/8/8/8/8/8/8/4K2R b Kk - 0 1"  # rook takes rook: both sides lose a right
    ep = Position.startpos().push("e2e4").push("a7a6").push("e4e5").push("d7d5")
    assert ep.fen().split()[3] == "d6" and "e5d6" in ep.legal_moves()
    assert ep.push("e5d6").piece_at("d5") is None
    quiet = Position.startpos().push("e2e4")
    assert quiet.fen().split()[3] == "-"  # no black pawn can take: lc0 keeps no en-passant square
    promo = Position.from_fen("7k/P7/8/8/8/8/8/K7 w - - 0 1")
    assert {"a7a8q", "a7a8r", "a7a8b", "a7a8n"} <= set(promo.legal_moves())
    assert promo.push("a7a8n").piece_at("a8") == "N"


def test_repetitions_are_counted_as_lc0_counts_them():
    shuffle = ["g1f3", "g8f6", "f3g1", "f6g8"] * 3
    p = Position.startpos()
    counts = []
    for m in shuffle:
        p = p.push(m)
        counts.append(p.repetitions)
    assert counts == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    batch = prepare([("startpos", shuffle)])
    assert batch.repetitions.tolist() == [0] + counts
    # the same squares with other castling rights are another position
    q = Position.startpos()
    for m in ["e2e4", "e7e5", "e1e2", "e8e7", "e2e1", "e7e8", "e1e2", "e8e7"]:
        q = q.push(m)
    assert q.repetitions == 1  # equal to the position after e1e2 e8e7, not to the start


def _planes_of(fen, fmt, moves=()):
    return encode_planes([(fen, list(moves))], fmt)[0]


def test_planes_of_the_start_position():
    for fmt in ALL_FORMATS:
        x = _planes_of("startpos", fmt)
        assert x.shape == (112, 8, 8) and x.dtype == torch.float32
        assert x[0].sum() == 8 and x[0, 1].sum() == 8  # our pawns on rank 2
        assert x[11, 7, 4] == 1 and x[11].sum() == 1  # their king on e8
        assert x[13:104].sum() == 0  # the standard start: no history filled in
        assert (x[111] == 1).all() and (x[109] == 0).all()
        if fmt == 1:
            assert all((x[p] == 1).all() for p in (104, 105, 106, 107)) and (x[108] == 0).all()
        else:
            assert x[104].flatten().nonzero().flatten().tolist() == [0, 56]  # a1 and a8 rooks
            assert x[105].flatten().nonzero().flatten().tolist() == [7, 63]


def test_planes_with_black_to_move_mirror_the_board_and_mark_the_side():
    x = _planes_of("startpos", 1, ["e2e4"])
    assert x[3, 0, 0] == 1 and x[3, 0, 7] == 1  # black's rooks seen on our first rank
    assert x[6, 4, 4] == 1  # white's e4 pawn seen on e5
    assert (x[108] == 1).all()  # classical: black to move
    y = _planes_of("startpos", 132, ["e2e4"])
    assert (y[110] == 1).all() and (y[108] == 0).all()  # armageddon: black to move


def test_rule50_hectoplies_and_history_fill():
    fen = "4k3/8/8/8/8/8/4P3/4K3 w - - 37 60"
    assert (_planes_of(fen, 1)[109] == 37).all()
    assert torch.allclose(_planes_of(fen, 4)[109], torch.full((8, 8), np.float32(37) / np.float32(100)))
    classical = _planes_of(fen, 1)
    for step in range(1, 8):  # a FEN's missing history: copies of the FEN's position
        assert torch.equal(classical[13 * step: 13 * step + 12], classical[:12])
    # the canonical formats stop at the last capture or pawn move (here: never within 37 plies,
    # so the copies stay) -- but a zeroing FEN stops at once
    assert _planes_of("4k3/8/8/8/8/8/4P3/4K3 w - - 0 60", 4)[13:104].sum() == 0
    assert _planes_of("4k3/8/8/8/8/8/4P3/4K3 w - - 0 60", 1)[13:104].sum() > 0


def test_en_passant_copies_show_the_pawn_before_its_push():
    fen = "4k3/8/8/3pP3/8/8/8/4K3 w - d6 0 2"
    x = _planes_of(fen, 1)
    assert x[6, 4, 3] == 1 and x[13 + 6, 6, 3] == 1 and x[13 + 6, 4, 3] == 0  # d5 now, d7 before
    c = _planes_of(fen, 3)
    assert c[108].flatten().nonzero().flatten().tolist() == [8 * 7 + 3]  # the d file, on rank 8
    assert c[13:104].sum() == 0  # en passant stops the canonical history


def test_canonical_turns_put_our_king_on_the_right():
    # no castling rights, king on the a-d files: flipped left-right
    x = _planes_of("8/8/8/8/8/2k5/8/K7 w - - 0 1", 3)
    king = x[5].flatten().nonzero().flatten().tolist()
    assert len(king) == 1 and king[0] % 8 >= 4 and king[0] // 8 <= 3
    _, _, t = encode_masks(["8/8/8/8/8/2k5/8/K7 w - - 0 1", "4k3/8/8/8/8/8/8/K7 w - - 0 1",
                            "4k3/8/8/8/8/8/P7/K7 w - - 0 1", "r3k3/8/8/8/8/8/8/K7 w q - 0 1",
                            "8/8/8/8/8/8/8/K1k5 w - - 0 1"], 3)
    assert t[0] & 1 and t[1] & 1 and t[2] == 1 and t[3] == 0  # pawns: only the flip; castling: nothing
    assert t[4] & 4 or t[4] in (1, 3)  # the king on a1 next to its rival: turned somehow, deterministically


def test_unsupported_input_formats_are_refused_by_name():
    with pytest.raises(Lc0FormatError, match="UNKNOWN"):
        encode_planes(["startpos"], 0)
    with pytest.raises(Lc0FormatError, match="99"):
        encode_planes(["startpos"], 99)
    assert torch.equal(encode_planes(["startpos"], "WITH_CANONICALIZATION_V2"), encode_planes(["startpos"], 5))


def _random_positions(seed: int, count: int) -> list[Position]:
    rng = random.Random(seed)
    starts = [STARTPOS_FEN, PERFT[1][0], "8/2p5/3p4/KP5r/1R3p1k/8/4P1P1/8 w - - 0 1", "8/8/4k3/8/8/8/3K4/8 w - - 10 50",
              "8/3k4/8/8/2Q5/8/5K2/8 b - - 3 70"]
    out: list[Position] = []
    while len(out) < count:
        game = random_game(rng, rng.randint(1, 80), rng.choice(starts))
        out.extend(p for p in game[1:] if p.legal_moves())
    return out[:count]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_policy_indices_point_at_our_pieces_in_the_planes(fmt):
    """Whatever turn a canonical format gives the board, each legal move's policy entry
    starts on a square where the planes show one of our pieces (and castling ends on our
    rook): the net sees its moves where it sees its pieces."""
    # Random games rarely keep both castlings legal: positions where both sides can castle
    # both ways, for each side to move, are added.
    castles = [Position(fen) for fen in ("r3k2r/pppppppp/8/8/8/8/PPPPPPPP/R3K2R w KQkq - 0 1",
                                         "r3k2r/pppppppp/8/8/8/8/PPPPPPPP/R3K2R b KQkq - 0 1")]
    positions = _random_positions(7 + fmt, 300) + castles
    planes = encode_planes(positions, fmt).reshape(len(positions), 112, 64)
    moves, indices, starts, counts = policy_indices(positions, fmt)
    rows = np.repeat(np.arange(len(positions)), counts)
    net_from = np.array([B.move_code(POLICY_MOVES[i][:4]) & 63 for i in indices])
    net_to = np.array([(B.move_code(POLICY_MOVES[i][:4]) >> 6) & 63 for i in indices])
    ours = planes[:, 0:6].sum(dim=1).numpy()  # [n, 64]
    assert (ours[rows, net_from] == 1).all()
    # Castling (the king moving two files on the real board) is encoded king-takes-rook: its
    # entry ends on one of our rooks (plane 3); every other move ends where we have no piece.
    real = np.asarray(moves, dtype=np.int64)
    king_moves = planes[:, 5].numpy()[rows, net_from] == 1
    castling = king_moves & (np.abs((real & 7) - ((real >> 6) & 7)) == 2)
    assert castling.sum() >= 2 * len(castles), "the castling positions' castlings (O-O, O-O-O) are missing"
    assert (planes[:, 3].numpy()[rows, net_to][castling] == 1).all(), "a castling does not end on our rook"
    assert (ours[rows, net_to][~castling] == 0).all(), "a move ends on a square holding one of our pieces"
    theirs = planes[:, 6:12].sum(dim=1).numpy()
    assert (theirs[rows, net_to] == 1).any(), "no capture among the moves: the planes' sides may be swapped"
    # every legal move has its own entry
    for b in range(len(positions)):
        s, c = starts[b], counts[b]
        assert len(set(indices[s: s + c].tolist())) == c


def test_decode_policy_is_a_softmax_over_legal_moves_only():
    positions = _random_positions(99, 64) + ["startpos"]
    logits = torch.randn(len(positions), 1858, generator=torch.Generator().manual_seed(5))
    out = decode_policy(logits, positions, 4)
    moves, indices, starts, counts = policy_indices(positions, 4)
    for b, pol in enumerate(out):
        assert sorted(pol.moves) == sorted(Position(*_history(positions[b])).legal_moves())
        assert abs(float(pol.probs.sum()) - 1) < 1e-5 and (np.diff(pol.probs) <= 0).all()
        ref = torch.softmax(logits[b, torch.as_tensor(pol.indices)].double(), 0).numpy()
        assert np.allclose(pol.probs, ref, rtol=1e-5, atol=1e-7)
    hot = decode_policy(logits, positions, 4, temperature=0.25)
    for b, h in enumerate(hot):  # the logits divided by the temperature, then the softmax
        ref = torch.softmax(logits[b, torch.as_tensor(h.indices)].double() / 0.25, 0).numpy()
        assert np.allclose(h.probs, ref, rtol=1e-5, atol=1e-7), f"position {b} at temperature 0.25"
    assert all(h.probs[0] > p.probs[0] for h, p in zip(hot, out) if len(p.moves) > 1 and p.probs[0] < 0.999)
    # a logit that favours one move makes it the first
    target = torch.full((1, 1858), -5.0)
    start_moves = policy_indices(["startpos"], 4)
    target[0, int(start_moves[1][3])] = 10.0
    assert decode_policy(target, ["startpos"], 4)[0].moves[0] == B.UCI_TEXT[int(start_moves[0][3])]
    with pytest.raises(ValueError, match="temperature"):
        decode_policy(logits, positions, 4, temperature=0)
    with pytest.raises(ValueError, match="logits must be"):
        decode_policy(logits[:3], positions, 4)


def _history(p):
    return (p.start_fen, list(p.moves)) if isinstance(p, Position) else (p, [])


def test_mate_and_stalemate_decode_to_no_moves():
    mate = ("startpos", ["f2f3", "e7e5", "g2g4", "d8h4"])
    stalemate = "7k/5Q2/6K1/8/8/8/8/8 b - - 0 1"
    out = decode_policy(torch.zeros(2, 1858), [mate, stalemate], 1)
    assert out[0].moves == [] and out[1].moves == [] and len(out[0].probs) == 0


def test_network_evaluate_runs_the_reference_path(tmp_path):
    path = tmp_path / "net.pb.gz"
    lc0_writer.write_net(path, **{**lc0_writer.PRESETS["tiny"], "input_format": 4, "seed": 4242})
    net = load_network(str(path), dtype=torch.float32, device="cpu")
    positions = _random_positions(3, 20) + ["startpos", ("startpos", ["e2e4", "c7c5"])]
    got = net.evaluate(positions)
    planes = encode_planes(positions, 4)
    from fusedenc.lc0 import read_net

    ref = reference_forward(read_net(str(path)), planes)
    policies = decode_policy(ref["policy"], positions, 4)
    for e, pol, wdl in zip(got, policies, ref["wdl"]):
        assert e.moves == pol.moves or sorted(e.moves) == sorted(pol.moves)
        ours = dict(zip(e.moves, e.probs))
        assert all(abs(ours[m] - p) < 1e-4 for m, p in zip(pol.moves, pol.probs))
        assert np.allclose(e.wdl, wdl.numpy(), atol=1e-5) and abs(e.q - float(wdl[0] - wdl[2])) < 1e-5
        assert e.best_move in e.moves and e.moves_left is not None
    with pytest.raises(ValueError, match="position 1"):
        net.evaluate(["startpos", "not a fen"])


def test_expanded_planes_gather_matches_the_square_map():
    for t in range(8):  # GATHER[t] undoes SQUARE_MAP[t], both ways
        assert (SQUARE_MAP[t][GATHER[t]] == np.arange(64)).all() and (GATHER[t][SQUARE_MAP[t]] == np.arange(64)).all()
    assert not (GATHER[1:] == np.arange(64)).all(axis=1).any(), "a transform other than 0 is the identity"
