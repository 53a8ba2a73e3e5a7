"""fusedenc.lc0.gamefiles: SAN to UCI, the PGN reader and the EPD reader.

SAN cases are written against hand-made positions whose legal moves are known (which
pieces can reach the square, which promotions exist); PGN and EPD texts carry every
construct the readers must skip or read.  Where python-chess is installed, random games
are also written in SAN by it and read back (a cross-check by an independent writer).
"""

from __future__ import annotations

import io
import random

import pytest

from fusedenc.lc0.gamefiles import parse_epd_line, read_epd, read_pgn, san_to_uci
from fusedenc.lc0.positions import Position

TWO_KNIGHTS = "4k3/8/8/8/8/5N2/8/1N2K3 w - - 0 1"  # b1 and f3 both reach d2
TWO_ROOKS = "4k3/8/8/R7/8/8/8/R3K3 w - - 0 1"  # a1 and a5 both reach a3
THREE_QUEENS = "4k3/8/8/8/8/Q7/8/Q1Q1K3 w - - 0 1"  # a1, c1 and a3 all reach b2
PROMOTION = "3r2k1/4P3/8/8/8/8/8/4K3 w - - 0 1"  # e7 pushes to e8 or takes on d8
CASTLING = "r3k2r/8/8/8/8/8/8/R3K2R w KQkq - 0 1"
EN_PASSANT = "4k3/8/8/3pP3/8/8/8/4K3 w - d6 0 1"
PAWN_OR_BISHOP = "4k3/8/8/4b3/1p6/2N5/8/4K3 b - - 0 1"  # b4 pawn and e5 bishop both take c3


@pytest.mark.parametrize(
    "fen, san, uci",
    [
        (TWO_KNIGHTS, "Nbd2", "b1d2"),
        (TWO_KNIGHTS, "Nfd2", "f3d2"),
        (TWO_KNIGHTS, "Nf3d2", "f3d2"),  # a redundant full-square disambiguation
        (TWO_KNIGHTS, "Ng5", "f3g5"),
        (TWO_ROOKS, "R1a3", "a1a3"),
        (TWO_ROOKS, "R5a3", "a5a3"),
        (THREE_QUEENS, "Qa1b2", "a1b2"),
        (THREE_QUEENS, "Qcb2", "c1b2"),
        (THREE_QUEENS, "Q3b2", "a3b2"),
        (PROMOTION, "e8=Q+", "e7e8q"),
        (PROMOTION, "e8Q", "e7e8q"),  # without '='
        (PROMOTION, "e8=N", "e7e8n"),  # under-promotion
        (PROMOTION, "e8=r", "e7e8r"),  # a lower-case piece, as some tools write
        (PROMOTION, "exd8=Q+", "e7d8q"),  # capture-promotion
        (PROMOTION, "exd8=B", "e7d8b"),
        (CASTLING, "O-O", "e1g1"),
        (CASTLING, "O-O-O", "e1c1"),
        (CASTLING, "0-0", "e1g1"),
        (CASTLING, "0-0-0+", "e1c1"),
        (CASTLING.replace(" w ", " b "), "O-O", "e8g8"),
        (CASTLING.replace(" w ", " b "), "O-O-O", "e8c8"),
        (EN_PASSANT, "exd6", "e5d6"),
        (EN_PASSANT, "exd6!", "e5d6"),
        (PAWN_OR_BISHOP, "bxc3", "b4c3"),  # lower-case b: the b-pawn
        (PAWN_OR_BISHOP, "Bxc3+", "e5c3"),  # upper-case B: the bishop
        (PAWN_OR_BISHOP, "Bc3", "e5c3"),  # capture mark omitted
        ("startpos", "e4!?", "e2e4"),
        ("startpos", "Nf3?!", "g1f3"),
        ("startpos", "Nc3!!", "b1c3"),
        ("startpos", "a3??", "a2a3"),
    ],
)
def test_san_to_uci(fen, san, uci):
    pos = Position.startpos() if fen == "startpos" else Position.from_fen(fen)
    assert san_to_uci(pos, san) == uci
    assert uci in pos.legal_moves()


@pytest.mark.parametrize(
    "fen, san, words",
    [
        (TWO_KNIGHTS, "Nd2", ["ambiguous", "b1d2", "f3d2"]),
        (TWO_ROOKS, "Ra3", ["ambiguous", "a1a3", "a5a3"]),
        (THREE_QUEENS, "Qab2", ["ambiguous", "a1b2", "a3b2"]),
        (THREE_QUEENS, "Q1b2", ["ambiguous", "a1b2", "c1b2"]),
        (PROMOTION, "e8", ["not a legal move", "promotion piece"]),
        (PROMOTION, "e8=K", ["not a move in SAN"]),
        ("4k3/8/8/8/8/8/8/R3K2R w - - 0 1", "O-O", ["castling kingside is not legal"]),
        ("startpos", "e5", ["not a legal move"]),
        ("startpos", "Ke2", ["not a legal move"]),
        ("startpos", "hello", ["not a move in SAN"]),
        ("startpos", "", ["not a move in SAN"]),
    ],
)
def test_san_to_uci_refuses(fen, san, words):
    pos = Position.startpos() if fen == "startpos" else Position.from_fen(fen)
    with pytest.raises(ValueError) as info:
        san_to_uci(pos, san)
    for w in words:
        assert w in str(info.value), str(info.value)


PGN = r"""[Event "Test \"quoted\" game"]
[Site "?"]
[Result "1-0"]

1. e4 e5 2. Nf3 {a comment that
spans two lines, with (parentheses) and 3. Qxf7 inside} Nc6 (2... d6 3. d4 (3. Bc4
Be7) exd4) 3. Bb5 $1 a6!? 4. Ba4 Nf6 5. O-O Be7 6. Re1 b5 7. Bb3 d6 8. c3 O-O
; a comment to the end of the line: 9. Qxd8
9. h3 Na5 10. Bc2 c5 11. d4 Qc7 12.Nbd2 cxd4 13. cxd4 Nc6 14. Nb3 a5 15. Be3 a4 16. Nbd2 Bd7
17. Rc1 Qb7 18. Qe2 Rfe8 19. Bd3 Bf8 20. d5 Nb4 21. Bb1 Rac8 22. Rxc8 Rxc8 23. a3 Na6 1-0

% an escape line, skipped

[Event "From a FEN"]
[SetUp "1"]
[FEN "3r2k1/4P3/8/8/8/8/8/4K3 w - - 0 1"]
[Result "*"]

1. exd8=N Kf8 2. Nb7 $14 Ke7 +- 3. Kd2 *

1. d4 d5 2. c4 dxc4 3. e4 0-1
"""


def test_pgn_games():
    games = list(read_pgn(io.StringIO(PGN)))
    assert [g.number for g in games] == [1, 2, 3]
    g1, g2, g3 = games
    assert g1.headers["Event"] == 'Test "quoted" game' and g1.result == "1-0" and g1.start_fen == "startpos"
    assert g1.moves[:10] == ["e2e4", "e7e5", "g1f3", "b8c6", "f1b5", "a7a6", "b5a4", "g8f6", "e1g1", "f8e7"]
    assert len(g1.moves) == 46 and g1.moves[22] == "b1d2" and g1.moves[-1] == "b4a6"
    assert g1.sans[8] == "O-O" and len(g1.positions) == 47
    assert g2.start_fen == "3r2k1/4P3/8/8/8/8/8/4K3 w - - 0 1" and g2.result == "*"
    assert g2.moves == ["e7d8n", "g8f8", "d8b7", "f8e7", "e1d2"]
    assert g3.headers == {"Result": "0-1"} and g3.moves == ["d2d4", "d7d5", "c2c4", "d5c4", "e2e4"]
    # Each game's positions are its moves replayed: the last one is the game's end.
    end = Position.startpos()
    for m in g1.moves:
        end = end.push(m)
    assert g1.positions[-1].fen() == end.fen()
    assert g1.history(3) == ("startpos", g1.moves[:3])


def test_pgn_reads_files_and_games_without_results(tmp_path):
    path = tmp_path / "games.pgn"
    path.write_text('[Event "a"]\n\n1. e4 e5\n\n[Event "b"]\n\n1. d4\n', encoding="utf-8")
    games = list(read_pgn(str(path)))
    assert [g.moves for g in games] == [["e2e4", "e7e5"], ["d2d4"]]
    assert [g.headers["Event"] for g in games] == ["a", "b"]
    assert [g.line for g in games] == [1, 5]


@pytest.mark.parametrize(
    "text, words",
    [
        ('[Event "a"]\n\n1. e4 e5 *\n\n[Event "b"]\n\n1. e4 e5 2. Ke3 *\n', ["game 2", "line 7", "move 2 (white)", "'Ke3'"]),
        ("1. e4 e5 2. Nf3 Nc6 3. Nf5 *", ["game 1", "'Nf5'", "not a legal move"]),
        ('[FEN "4k3/8/8/8/8/5N2/8/1N2K3 w - - 0 1"]\n1. Nd2 *', ["game 1", "'Nd2'", "ambiguous"]),
        ('[FEN "not a fen"]\n1. e4 *', ["game 1", "bad [FEN] tag"]),
        ("1. e4 -- 2. d4 *", ["null move"]),
        ("1. e4 (1. d4 e5 *", ["inside a variation"]),
        ("1. e4 ) e5 *", ["')' without"]),
    ],
)
def test_pgn_errors_name_the_game_and_move(text, words):
    with pytest.raises(ValueError) as info:
        list(read_pgn(io.StringIO(text)))
    for w in words:
        assert w in str(info.value), str(info.value)


def test_pgn_missing_file():
    with pytest.raises(OSError):
        list(read_pgn("/nonexistent/games.pgn"))


def test_san_round_trip_with_python_chess():
    """Random games written in SAN by python-chess (an independent writer) read back to the same moves."""
    chess = pytest.importorskip("chess")
    rng = random.Random(7)
    for _ in range(5):
        board = chess.Board()
        sans = []
        for _ in range(rng.randrange(20, 80)):
            moves = list(board.legal_moves)
            if not moves:
                break
            # Prefer promotions, castling and captures so the rare forms show up.
            special = [m for m in moves if m.promotion or board.is_castling(m) or board.is_capture(m)]
            m = rng.choice(special if special and rng.random() < 0.5 else moves)
            sans.append(board.san(m))
            board.push(m)
        text = " ".join(f"{i // 2 + 1}. {s}" if i % 2 == 0 else s for i, s in enumerate(sans)) + " *"
        [game] = read_pgn([text])
        assert game.moves == [m.uci() for m in board.move_stack]


def test_epd_line_operations():
    rec = parse_epd_line('rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq e3 bm e5 c5; id "Sicilian; or not"; '
                         'c0 "a comment";  hmvc 3; fmvn 12;', line=7)  # fmt: skip
    assert rec.line == 7
    assert rec.fen == "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq e3 3 12"
    assert rec.ops["bm"] == ["e5", "c5"] and rec.id == "Sicilian; or not" and rec.ops["c0"] == ["a comment"]
    assert rec.best_moves_uci() == ["e7e5", "c7c5"]


def test_epd_reader(tmp_path):
    path = tmp_path / "suite.epd"
    path.write_text(
        "# a comment line\n"
        "\n"
        "r3k2r/p1ppqpb1/bn2pnp1/3PN3/1p2P3/2N2Q1p/PPPBBPPP/R3K2R w KQkq - id \"kiwipete\"\n"  # no final ';'
        "8/8/8/8/8/8/8/k6K w - - 5 40 id \"with counters\";\n"  # a FEN's counters, then operations
        "4k3/8/8/8/8/8/8/4K3 b - -\n",  # no operations at all
        encoding="utf-8",
    )
    records = list(read_epd(str(path)))
    assert [r.line for r in records] == [3, 4, 5]
    assert [r.id for r in records] == ["kiwipete", "with counters", None]
    assert records[0].fen.endswith(" w KQkq - 0 1")
    assert records[1].fen == "8/8/8/8/8/8/8/k6K w - - 5 40"
    assert records[2].ops == {}
    assert len(Position.from_fen(records[0].fen).legal_moves()) == 48  # Kiwipete's perft(1)


@pytest.mark.parametrize(
    "line, words",
    [
        ("8/8/8 w - -", ["line 1", "not a FEN board field"]),
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR x KQkq -", ["side to move"]),
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w", ["4 FEN fields"]),
        ('rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - id "open', ["unterminated"]),
        ("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - hmvc x;", ["hmvc"]),
    ],
)
def test_epd_errors(line, words):
    with pytest.raises(ValueError) as info:
        list(read_epd([line]))
    for w in words:
        assert w in str(info.value), str(info.value)


def test_epd_bad_best_move_names_the_line():
    [rec] = read_epd(["", "", "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - bm Ke2;"])
    with pytest.raises(ValueError, match="EPD line 3: bm 'Ke2'"):
        rec.best_moves_uci()


@pytest.mark.slow
def test_many_games_read_in_batches_agree_with_python_chess():
    """More games than one conversion batch, random legal games written by python-chess:
    every move, every position's FEN and the end state as python-chess has them; a bad move
    in a later game comes after every game before it."""
    chess = pytest.importorskip("chess")
    pgn = pytest.importorskip("chess.pgn")

    rng = random.Random(7)
    text = io.StringIO()
    for _ in range(300):
        board, game = chess.Board(), pgn.Game()
        node = game
        for _ in range(rng.randint(1, 120)):
            legal = list(board.legal_moves)
            if not legal:
                break
            move = rng.choice(legal)
            node = node.add_variation(move)
            board.push(move)
        print(game, file=text, end="\n\n")
    source = text.getvalue()
    ours = list(read_pgn(io.StringIO(source)))
    theirs = io.StringIO(source)
    assert len(ours) == 300
    for g in ours:
        ref = pgn.read_game(theirs)
        board = ref.board()
        assert g.moves == [m.uci() for m in ref.mainline_moves()]
        assert len(g.fens) == len(g.moves) + 1
        for fen, move in zip(g.fens, list(ref.mainline_moves()) + [None]):
            assert fen.split()[:3] == board.fen().split()[:3] and fen.split()[4:] == board.fen().split()[4:]
            if move is not None:
                board.push(move)
        assert g.ended == (not any(board.legal_moves))
    games = source.split("\n\n[Event")
    assert "\n\n1. " in games[279]
    games[279] = games[279].replace("\n\n1. ", "\n\n1. Ke4 ", 1)  # game 280 starts with an illegal move
    seen = []
    with pytest.raises(ValueError, match=r"game 280 .*Ke4"):
        for g in read_pgn(io.StringIO("\n\n[Event".join(games))):
            seen.append(g.number)
    assert seen == list(range(1, 280))
