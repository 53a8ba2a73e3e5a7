"""lc0's training-data frames (``fusedenc.lc0.trainingdata``), on the CPU.

The layout is checked against offsets worked out by hand from lc0's headers; the planes
against ``encode_planes`` of the positions the frames were written from, for every input
format, and against a few raw bytes worked out by hand from lc0's writer (the bit order of
the planes, the castling, side-to-move and en-passant bytes); the other fields bit for bit;
a tiny net gives the same heads on both; and each kind of damaged file is refused by name.
Two files lc0 itself wrote (tests/data/lc0_selfplay) replay as the games lc0 printed.
"""

from __future__ import annotations

import gzip
import io
import random
import tarfile

import numpy as np
import pytest
import torch
from helpers import random_game
from lc0_writer import write_preset

from fusedenc.lc0 import Lc0FileError, Lc0FormatError, encode_planes, load_network
from fusedenc.lc0.encoding import FLIP, MIRROR, TRANSPOSE, encode_masks, expand_planes
from fusedenc.lc0.policy import policy_indices
from fusedenc.lc0.positions import prepare
from fusedenc.lc0.schema import InputFormat
from fusedenc.lc0.trainingdata import (
    FRAME_SIZES,
    V6_FRAME,
    V7_FRAME,
    FrameChunk,
    frame_targets,
    frames_to_planes,
    read_frames,
    write_frames,
)

ALL_FORMATS = (1, 2, 3, 4, 5, 132, 133)


def _positions() -> list:
    """Positions we know (start, castling rights, en passant, Black to move, repetitions,
    rule-50, pawnless endgames that get every board turn) and some from random games."""
    rng = random.Random(2024)
    known = [
        "startpos",
        ("startpos", ["e2e4"]),  # Black to move, all castling rights
        ("startpos", ["e2e4", "c7c5", "e4e5", "d7d5"]),  # en passant d6 with history
        ("startpos", ["g1f3", "g8f6", "f3g1", "f6g8", "g1f3"]),  # a repetition, Black to move
        "r3k2r/p1ppqpb1/bn2pnp1/3PN3/1p2P3/2N2Q1p/PPPBBPPP/R3K2R w Kq - 3 12",  # partial rights
        "r3k2r/8/8/8/8/8/8/R3K2R b Qk - 41 70",
        "4k3/8/8/2pP4/8/8/8/2K5 w - c6 0 1",  # en passant with the board flipped
        "8/8/8/8/8/2k5/8/K7 b - - 7 40",  # pawnless, Black to move
        "K7/8/8/8/8/8/8/6qk w - - 0 1",
        "8/8/8/3k4/8/8/1K6/R7 w - - 12 50",
        "7k/8/8/8/8/5K2/8/3Q4 w - - 0 1",  # our king on the long diagonal: transpose tie-break
    ]
    games = []
    for g in range(6):
        game = random_game(rng, rng.randint(10, 80))
        games += rng.sample(game, 3)
    for start in ("8/8/2k5/8/8/4K3/8/3QR3 w - - 0 1", "8/1n6/3k4/8/8/4K3/8/2B1R3 b - - 0 1"):
        game = random_game(rng, 40, start)
        games += rng.sample(game, 6)
    return known + games


POSITIONS = _positions()


def test_the_layouts_are_lc0s_field_by_field():
    """Offsets worked out by hand from trainingdata_v6.h / _v7.h (packed, little-endian)."""
    assert V6_FRAME.itemsize == FRAME_SIZES[6] == 8356
    assert V7_FRAME.itemsize == FRAME_SIZES[7] == 8396
    expected_v6 = {
        "version": 0, "input_format": 4, "probabilities": 8, "planes": 8 + 1858 * 4,
        "castling_us_ooo": 8272, "castling_us_oo": 8273, "castling_them_ooo": 8274, "castling_them_oo": 8275,
        "side_to_move_or_enpassant": 8276, "rule50_count": 8277, "invariance_info": 8278, "dummy": 8279,
        "root_q": 8280, "best_q": 8284, "root_d": 8288, "best_d": 8292, "root_m": 8296, "best_m": 8300,
        "plies_left": 8304, "result_q": 8308, "result_d": 8312, "played_q": 8316, "played_d": 8320,
        "played_m": 8324, "orig_q": 8328, "orig_d": 8332, "orig_m": 8336, "visits": 8340, "played_idx": 8344,
        "best_idx": 8346, "policy_kld": 8348, "q_st": 8352,
    }  # fmt: skip
    assert {k: V6_FRAME.fields[k][1] for k in V6_FRAME.names} == expected_v6
    assert list(V6_FRAME.names) == list(expected_v6)  # in the header's order
    expected_v7 = {**expected_v6, "d_st": 8356, "opp_played_idx": 8360, "next_played_idx": 8362, "reserved": 8364}
    assert {k: V7_FRAME.fields[k][1] for k in V7_FRAME.names} == expected_v7
    assert V6_FRAME["planes"].base.str == "<u8" and V6_FRAME["played_idx"].base.str == "<u2"
    assert V7_FRAME["reserved"].shape == (8,) and V6_FRAME["probabilities"].shape == (1858,)


@pytest.mark.parametrize("version", [6, 7])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_planes_from_frames_equal_encode_planes(tmp_path, fmt, version):
    path = tmp_path / "game.gz"
    write_frames(path, POSITIONS, fmt, version=version)
    chunk = read_frames(path)
    assert isinstance(chunk, FrameChunk) and chunk.version == version and len(chunk) == len(POSITIONS)
    got = frames_to_planes(chunk)
    want = encode_planes(POSITIONS, fmt).numpy()
    assert got.dtype == np.float32 and got.shape == (len(POSITIONS), 112, 8, 8)
    for i in range(len(POSITIONS)):
        bad = np.nonzero((got[i] != want[i]).any(axis=(1, 2)))[0]
        assert bad.size == 0, f"format {fmt}, position {i} ({POSITIONS[i]}): planes {bad.tolist()} differ"


def test_the_positions_reach_every_case():
    """The round trip above is only as good as its positions: they must reach every board
    turn, castling, en passant with and without a flip, Black to move and repetitions."""
    masks, _, transforms = encode_masks(POSITIONS, 3)
    turns = {int(t) for t in transforms}
    assert {0, FLIP, FLIP | MIRROR, TRANSPOSE, FLIP | TRANSPOSE}.issubset(turns), sorted(turns)
    assert (masks[:, 108] != 0).sum() >= 2  # en passant
    assert ((masks[:, 108] != 0) & ((transforms & FLIP) != 0)).any()
    assert (masks[:, 12] != 0).any()  # a repetition
    current = prepare(POSITIONS).current
    assert (current.turn == 1).sum() >= 3 and (current.castling != 0).sum() >= 4 and (current.rule50 > 0).sum() >= 3


def _frames(tmp_path, positions, fmt, **kw):
    path = tmp_path / f"f{fmt}.gz"
    return write_frames(path, positions, fmt, **kw), path


def test_raw_bytes_are_lc0s(tmp_path):
    """Bytes worked out by hand from lc0's writer: plane bits reversed within each byte, the
    castling bytes, the side-to-move / en-passant byte, rule 50 and invariance_info."""
    positions = ["startpos", ("startpos", ["e2e4"]), "4k3/8/8/2pP4/8/8/8/2K5 w - c6 0 1",
                 "r3k2r/8/8/8/8/8/8/R3K2R b Qk - 41 70"]  # fmt: skip
    classical, _ = _frames(tmp_path, positions, 1)
    start = classical["planes"][0]
    # Our queen on d1 (lc0 bit 3) and king on e1 (bit 4) are stored bit-reversed: 0x10, 0x08.
    assert int(start[4]) == 0x10 and int(start[5]) == 0x08
    assert int(start[11]) == 0x08 << 56  # their king on e8, in our view rank 8
    assert int(start[0]) == 0xFF00 and int(start[12]) == 0  # our pawns; no repetition
    assert [int(classical[k][0]) for k in ("castling_us_ooo", "castling_us_oo", "castling_them_ooo",
                                           "castling_them_oo")] == [1, 1, 1, 1]  # fmt: skip
    assert classical["side_to_move_or_enpassant"].tolist() == [0, 1, 0, 1]
    assert classical["rule50_count"].tolist() == [0, 0, 0, 41]
    assert classical["invariance_info"].tolist() == [0, 0, 0, 0]
    # Black to move with Q and k: we (Black) may castle kingside only, they (White) queenside.
    assert [int(classical[k][3]) for k in ("castling_us_ooo", "castling_us_oo", "castling_them_ooo",
                                           "castling_them_oo")] == [0, 1, 1, 0]  # fmt: skip

    rooks, _ = _frames(tmp_path, positions, 2)
    # From format 2 on, a rook's file as a mask: a-file rook 1, h-file rook 128.
    assert [int(rooks[k][0]) for k in ("castling_us_ooo", "castling_us_oo", "castling_them_ooo",
                                       "castling_them_oo")] == [1, 128, 1, 128]  # fmt: skip
    assert rooks["side_to_move_or_enpassant"].tolist() == [0, 1, 0, 1]

    canonical, _ = _frames(tmp_path, positions, 4)
    # c6 en passant is file c (4), but our king on c1 flips the board: file f (32).
    assert canonical["side_to_move_or_enpassant"].tolist() == [0, 0, 0x20, 0]
    assert canonical["invariance_info"].tolist() == [0, 0x80, FLIP, 0x80]  # turn bits | Black to move
    assert canonical["version"].tolist() == [6] * 4 and canonical["input_format"].tolist() == [4] * 4


@pytest.mark.parametrize("fmt", [3, 133])
def test_undo_transform_gives_lc0_readers_unturned_planes(tmp_path, fmt):
    frames, _ = _frames(tmp_path, POSITIONS, fmt)
    masks, values, transforms = encode_masks(POSITIONS, fmt)
    unturned = expand_planes(masks, values, np.zeros_like(transforms)).numpy()
    got = frames_to_planes(frames, undo_transform=True)
    assert np.array_equal(got, unturned)
    turned = transforms != 0
    assert turned.sum() >= 5
    # Not vacuous: the turned positions' planes differ from the net's view.
    assert not np.array_equal(frames_to_planes(frames)[turned], got[turned])


@pytest.mark.parametrize("version", [6, 7])
def test_policies_and_results_come_back_bit_for_bit(tmp_path, version):
    rng = np.random.default_rng(7)
    n = len(POSITIONS)
    policies = rng.standard_normal((n, 1858)).astype(np.float32)
    policies[0, :5] = [-1.0, -0.0, np.nan, np.inf, 1e-45]  # odd floats survive as bits
    floats = ["root_q", "best_q", "root_d", "best_d", "root_m", "best_m", "plies_left", "result_q", "result_d",
              "played_q", "played_d", "played_m", "orig_q", "orig_d", "orig_m", "policy_kld", "q_st"]
    results = {name: rng.standard_normal(n).astype(np.float32) for name in floats}
    results["visits"] = rng.integers(0, 2**32, n, dtype=np.uint64)
    results["played_idx"] = rng.integers(0, 1858, n)
    results["best_idx"] = rng.integers(0, 1858, n)
    if version == 7:
        results["d_st"] = rng.standard_normal(n).astype(np.float32)
        results["opp_played_idx"] = rng.integers(0, 65536, n)
        results["next_played_idx"] = rng.integers(0, 65536, n)
        results["reserved"] = rng.standard_normal((n, 8)).astype(np.float32)
    path = tmp_path / "r.gz"
    write_frames(path, POSITIONS, 132, policies=policies, results=results, version=version)
    targets = frame_targets(read_frames(path))
    assert targets["probabilities"].view(np.uint32).tolist() == policies.view(np.uint32).tolist()
    for name, want in results.items():
        got = targets[name]
        if got.dtype.kind == "f":
            assert np.array_equal(got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32)), name
        else:
            assert got.tolist() == np.asarray(want).tolist(), name
    q, d = targets["result_q"], targets["result_d"]
    assert np.allclose(targets["result_wdl"], np.stack([(1 - d + q) / 2, d, (1 - d - q) / 2], axis=1))
    assert targets["black_to_move"].tolist() == (prepare(POSITIONS).current.turn == 1).tolist()


def test_results_as_q_d_pairs_and_defaults(tmp_path):
    n = len(POSITIONS)
    qd = np.stack([np.linspace(-1, 1, n), np.linspace(0, 1, n)], axis=1).astype(np.float32)
    path = tmp_path / "qd.gz"
    write_frames(path, POSITIONS, 1, results=qd, version=7)
    t = frame_targets(read_frames(path))
    assert t["result_q"].tolist() == qd[:, 0].tolist() and t["result_d"].tolist() == qd[:, 1].tolist()
    assert np.isnan(t["orig_q"]).all() and (t["opp_played_idx"] == 65535).all()
    # The default policy: a uniform share over the legal moves (in the net's frame), -1 elsewhere.
    _, indices, starts, counts = policy_indices(POSITIONS, 1)
    probs = t["probabilities"]
    for b in range(n):
        legal = indices[starts[b]:starts[b] + counts[b]]
        assert np.allclose(probs[b, legal], 1.0 / counts[b])
        assert (np.delete(probs[b], legal) == -1).all()
        assert t["best_idx"][b] in legal
    with pytest.raises(ValueError, match="results cannot set 'rule50_count'"):
        write_frames(tmp_path / "x.gz", POSITIONS, 1, results={"rule50_count": np.zeros(n)})
    with pytest.raises(ValueError, match=r"results\['played_idx'\] must be integers in 0..65535"):
        write_frames(tmp_path / "x.gz", POSITIONS, 1, results={"played_idx": np.full(n, 70000)})
    with pytest.raises(ValueError, match="policies must be"):
        write_frames(tmp_path / "x.gz", POSITIONS, 1, policies=np.zeros((n, 1857), np.float32))
    with pytest.raises(Lc0FormatError):
        write_frames(tmp_path / "x.gz", POSITIONS, 7)


def _gz_bytes(raw: bytes) -> bytes:
    return gzip.compress(raw, mtime=0)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_a_tar_of_two_games_reads_as_both(tmp_path):
    a = write_frames(tmp_path / "a.gz", POSITIONS[:5], 1)
    b = write_frames(tmp_path / "b.gz", POSITIONS[5:12], 1)
    path = tmp_path / "chunks.tar"
    with tarfile.open(path, "w") as tar:
        dir_info = tarfile.TarInfo("games")
        dir_info.type = tarfile.DIRTYPE
        tar.addfile(dir_info)
        tar.add(tmp_path / "a.gz", arcname="games/a.gz")
        _add(tar, "LICENSE", b"GPL\n")  # lc0's tars may carry one: not frames, passed over
        tar.add(tmp_path / "b.gz", arcname="games/b.gz")
    chunks = list(read_frames(path))
    assert [len(c) for c in chunks] == [5, 7]
    assert chunks[0].source.endswith("member 'games/a.gz'") and chunks[1].source.endswith("member 'games/b.gz'")
    assert chunks[0].frames.tobytes() == a.tobytes() and chunks[1].frames.tobytes() == b.tobytes()
    planes = np.concatenate([frames_to_planes(c) for c in chunks])
    assert np.array_equal(planes, encode_planes(POSITIONS[:12], 1).numpy())


def test_an_uncompressed_file_of_frames_reads_too(tmp_path):
    frames = write_frames(tmp_path / "a.gz", POSITIONS[:3], 5, version=7)
    raw = tmp_path / "a.raw"
    raw.write_bytes(frames.tobytes())
    chunk = read_frames(raw)
    assert chunk.version == 7 and chunk.frames.tobytes() == frames.tobytes()


def _refused(path, *words, **kw):
    with pytest.raises(Lc0FileError) as info:
        got = read_frames(path, **kw)
        if not isinstance(got, FrameChunk):
            list(got)
    message = str(info.value)
    assert str(path) in message, message
    for w in words:
        assert w in message, message
    return message


def test_damaged_files_are_refused_by_name(tmp_path):
    frames = write_frames(tmp_path / "good.gz", POSITIONS[:4], 1)
    raw = frames.tobytes()
    good = (tmp_path / "good.gz").read_bytes()

    cut = tmp_path / "cut.gz"
    cut.write_bytes(good[: len(good) // 2])
    _refused(cut, "truncated gzip")

    short = tmp_path / "short.gz"
    short.write_bytes(_gz_bytes(raw[:-100]))
    _refused(short, "truncated", "not a whole number of V6 frames (8356 bytes each)", "3 frames and 8256 bytes over")

    v5 = bytearray(raw)
    v5[0:4] = (5).to_bytes(4, "little")
    old = tmp_path / "v5.gz"
    old.write_bytes(_gz_bytes(bytes(v5)))
    _refused(old, "frame 0 has version 5")

    mixed = bytearray(raw)
    mixed[2 * 8356: 2 * 8356 + 4] = (7).to_bytes(4, "little")
    m = tmp_path / "mixed.gz"
    m.write_bytes(_gz_bytes(bytes(mixed)))
    _refused(m, "frame 2 has version 7 where frame 0 has 6", "mixed versions")

    # V7-sized frames that say version 6: the sizes do not divide.
    v7 = write_frames(tmp_path / "v7.gz", POSITIONS[:4], 1, version=7)
    wrong = bytearray(v7.tobytes())
    for i in range(4):
        wrong[i * 8396: i * 8396 + 4] = (6).to_bytes(4, "little")
    w = tmp_path / "wrong_size.gz"
    w.write_bytes(_gz_bytes(bytes(wrong)))
    _refused(w, "not a whole number of V6 frames")

    text = tmp_path / "notes.gz"
    text.write_bytes(b"hello, these are not frames\n" * 30)
    _refused(text, "not gzip", "68 65 6c 6c")

    empty = tmp_path / "empty.gz"
    empty.write_bytes(_gz_bytes(b""))
    _refused(empty, "no frames")

    corrupt = bytearray(good)
    corrupt[len(corrupt) // 2] ^= 0xFF
    c = tmp_path / "corrupt.gz"
    c.write_bytes(bytes(corrupt))
    _refused(c, "gzip")

    _refused(tmp_path / "good.gz", "max_bytes limit", max_bytes=3 * 8356)
    assert len(read_frames(tmp_path / "good.gz", max_bytes=4 * 8356)) == 4


def test_a_bomb_stops_at_the_limit(tmp_path):
    bomb = tmp_path / "bomb.gz"
    frame = np.zeros(1, V6_FRAME)
    frame["version"] = 6
    with gzip.open(bomb, "wb") as f:
        for _ in range(64):
            f.write(frame.tobytes() * 256)  # 137 MB of frames in a file of ~150 KB
    assert bomb.stat().st_size < 1 << 20
    _refused(bomb, "more than 1048576 bytes", max_bytes=1 << 20)


def test_a_tar_with_a_bad_member_is_refused_naming_it(tmp_path):
    good = write_frames(tmp_path / "a.gz", POSITIONS[:2], 1).tobytes()
    cases = {
        "cut.gz": _gz_bytes(good)[:-10],
        "short.gz": _gz_bytes(good[:-4]),
        "text.gz": b"nothing to see here" * 40,
        "v7.gz": _gz_bytes(write_frames(tmp_path / "v7.gz", POSITIONS[:2], 1, version=7).tobytes()),
    }
    words = {"cut.gz": "truncated gzip", "short.gz": "not a whole number", "text.gz": "not gzip",
             "v7.gz": "V7 frames where the tar's first member has V6"}  # fmt: skip
    for bad, data in cases.items():
        path = tmp_path / f"with_{bad}.tar"
        with tarfile.open(path, "w") as tar:
            _add(tar, "ok.gz", _gz_bytes(good))
            _add(tar, bad, data)
        message = _refused(path, f"member '{bad}'", words[bad])
        assert "ok.gz" not in message

    # A tar cut inside a member's data, and one cut after it.
    big = _gz_bytes(write_frames(tmp_path / "big.gz", POSITIONS, 1).tobytes())
    path = tmp_path / "cut.tar"
    with tarfile.open(path, "w") as tar:
        _add(tar, "ok.gz", _gz_bytes(good))
        _add(tar, "big.gz", big)
    data = path.read_bytes()
    second = data.index(b"big.gz") + 512  # the second member's data
    path.write_bytes(data[: second + len(big) // 2])
    _refused(path, "member 'big.gz': the tar ends inside this member")
    path.write_bytes(data[: second + len(big) + 10])
    _refused(path, "a damaged tar after member 'big.gz'")

    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w") as tar:
        _add(tar, "LICENSE", b"x")
    _refused(empty, "no member holding frames")

    targz = tmp_path / "games.tar.gz"
    with tarfile.open(targz, "w:gz") as tar:
        _add(tar, "ok.gz", _gz_bytes(good))
    _refused(targz, "tar inside gzip")


def test_an_input_format_lc0_does_not_have_is_refused_naming_the_frame(tmp_path):
    frames, path = _frames(tmp_path, POSITIONS[:3], 1)
    data = bytearray(frames.tobytes())
    data[8356 + 4: 8356 + 8] = (42).to_bytes(4, "little")
    path.write_bytes(_gz_bytes(bytes(data)))
    with pytest.raises(Lc0FormatError, match=r"f1\.gz: frame 1: input format 42"):
        frames_to_planes(read_frames(path))
    with pytest.raises(TypeError, match="V6_FRAME"):
        frames_to_planes(np.zeros(3, np.float32))


@pytest.mark.parametrize("fmt", [1, 132])
def test_a_net_gives_the_same_heads_on_frame_planes(tmp_path, fmt):
    net_path = tmp_path / f"tiny_{fmt}.pb.gz"
    write_preset(net_path, "tiny", seed=5, input_format=InputFormat(fmt))
    net = load_network(str(net_path), dtype=torch.float32, device="cpu")
    assert int(net.input_format) == fmt
    write_frames(tmp_path / "g.gz", POSITIONS, fmt)
    from_frames = torch.from_numpy(frames_to_planes(read_frames(tmp_path / "g.gz")))
    with torch.inference_mode():
        got = net(from_frames)
        want = net(encode_planes(POSITIONS, fmt))
    assert set(got) == set(want) and {"policy", "wdl"} <= set(got)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # Not vacuous: the net tells the positions apart.
    assert not torch.equal(got["policy"][0], got["policy"][1])


# ------------------------------------------------------------ files lc0 wrote ----

#: Two self-play games written by lc0 itself (tests/data/lc0_selfplay/README.md): the file,
#: the result, and the moves as lc0 printed them (castling as the king taking its rook).
LC0_GAMES = {
    "game_whitewon.gz": (1, (
    "d2d4 d7d5 c2c4 d5c4 e2e3 b7b5 d1f3 c7c6 a2a4 e7e5 a4b5 f8b4 c1d2 b4d2 b1d2 e5d4 f1c4 g8f6 g1e2 c8g4 f3f4 "
    "e8h8 e1h1 b8d7 e2d4 f6e4 d2e4 g4h5 f4g5 h5g6 g5d8 c6c5 d8d7 c5d4 e4f6 g8h8 f6d5 a8c8 e3d4 f8d8 d7a7 g6e4 "
    "d5b6 c8c4 b6c4 e4d3 a7c7 d8g8 d4d5 g8f8 c7c5 f8d8 a1e1 d8g8 e1e2 g8b8 e2e3 d3c4 e3e8 b8e8 c5c4 h7h6 d5d6 "
    "e8f8 b2b4 g7g5 d6d7 f7f5 c4c8 h8g7 c8f8 g7g6 f8f5 g6g7 d7d8q h6h5 d8f8"
    ).split()),
    "game_blackwon.gz": (-1, (
    "d2d4 d7d5 c2c4 d5c4 e2e3 a7a6 d1c2 e7e5 f1c4 e5d4 g1f3 b8c6 e3d4 c6d4 c4f7 e8f7 c2e4 c8f5 f3g5 f7g6 e4d4 "
    "d8d4 b1d2 f8c5 e1h1 h7h6 g5f3 d4d5 f3e5 g6h7 d2f3 a8e8 f1e1 g8f6 c1f4 f6h5 a1d1 d5a2 f4e3 c5b4 e1f1 a2b2 "
    "d1d5 b2b3 f1d1 f5c2 d1f1 b3d5 f1a1 h5f4 e3f4 b4c3 a1c1 c2d1 h2h3 h8f8 f4g3 e8e5 c1d1 d5d1 g1h2 f8f3 g3e5 "
    "c3e5 g2g3 f3f2"
    ).split()),
}


@pytest.mark.parametrize("name", sorted(LC0_GAMES))
def test_files_lc0_wrote_replay_as_the_games_it_printed(name):
    """lc0's own V6 self-play file, frame by frame against the game lc0 printed: the planes are
    fusedenc's encoding of the position with its history, the moves the frame marks legal are
    fusedenc's legal moves, the played move is lc0's next move, and the result is the game's
    from the side to move."""
    from pathlib import Path

    from fusedenc.lc0 import Position
    from fusedenc.lc0.board import move_uci

    white_result, moves = LC0_GAMES[name]
    chunk = read_frames(Path(__file__).parent / "data" / "lc0_selfplay" / name)
    assert chunk.version == 6 and len(chunk) == len(moves)
    planes = frames_to_planes(chunk.frames)
    targets = frame_targets(chunk.frames)
    assert (chunk.frames["input_format"] == InputFormat.CLASSICAL_112_PLANE).all()
    position = Position.startpos()
    for k, move in enumerate(moves):
        history = ("startpos", moves[:k])
        want = encode_planes([history], InputFormat.CLASSICAL_112_PLANE)[0].numpy()
        np.testing.assert_array_equal(planes[k].reshape(want.shape), want, err_msg=f"{name} frame {k}")
        legal_moves, indices, _, _ = policy_indices([history], InputFormat.CLASSICAL_112_PLANE)
        marked = np.nonzero(targets["probabilities"][k] >= 0)[0]
        assert sorted(indices.tolist()) == marked.tolist(), f"{name} frame {k}: legal moves"
        played = np.nonzero(indices == int(targets["played_idx"][k]))[0]
        assert len(played) == 1, f"{name} frame {k}: played_idx is not one legal move"
        after = position.push(move)
        assert position.push(move_uci(int(legal_moves[played[0]]))).fen() == after.fen(), f"{name} frame {k}"
        # result_wdl is the game's result from the side to move's view
        us = white_result if k % 2 == 0 else -white_result
        np.testing.assert_array_equal(targets["result_wdl"][k], [us == 1, 0, us == -1])
        position = after
