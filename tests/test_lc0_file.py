"""The Lc0 network file layer (fusedenc.lc0): wire format, schema, weight encodings,
``read_net`` / ``describe`` / ``check_supported``, and a clear error for each bad file.

CPU only and fast: synthetic nets from ``lc0_writer`` (the tiny preset); one test reads
a BT4-sized net to keep loading at seconds.
"""

from __future__ import annotations

import copy
import gzip
import math
import struct
import time

import pytest
import torch
from lc0_writer import PRESETS, build_net, encode_net, write_preset

from fusedenc.common.activations import LC0_ACTIVATIONS
from fusedenc.lc0 import (
    Lc0FileError,
    Lc0FormatError,
    check_supported,
    decode_layer,
    expect_shape,
    expected_shapes,
    read_net,
)
from fusedenc.lc0.protobuf import UNKNOWN_FIELDS, Field, decode, encode, encode_varint
from fusedenc.lc0.schema import (
    SCHEMA,
    ActivationFunction,
    InputEmbeddingFormat,
    LayerEncoding,
    NetworkStructure,
)
from fusedenc.lc0.weights import encode_layer

ENCODINGS = ["LINEAR16", "FLOAT16", "BFLOAT16", "FLOAT32"]


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset's ``Net`` message and the values written; copy before editing."""
    return build_net(**PRESETS["tiny"])


def read_message(net: dict):
    return read_net(encode_net(net))


def edited(tiny, edit) -> dict:
    net = copy.deepcopy(tiny[0])
    edit(net, net["weights"])
    return net


def supported_problems(net: dict) -> str:
    with pytest.raises(Lc0FormatError) as info:
        check_supported(read_message(net))
    return str(info.value)


# -- schema ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message, number, name",
    [
        ("Net", 1, "magic"), ("Net", 4, "format"), ("Net", 10, "weights"),
        ("Format", 2, "network_format"),
        ("NetworkFormat", 3, "network"), ("NetworkFormat", 7, "default_activation"),
        ("NetworkFormat", 8, "smolgen_activation"), ("NetworkFormat", 9, "ffn_activation"),
        ("NetworkFormat", 10, "input_embedding"),
        ("Weights.Layer", 1, "min_val"), ("Weights.Layer", 2, "max_val"), ("Weights.Layer", 3, "params"),
        ("Weights.Layer", 4, "encoding"), ("Weights.Layer", 5, "dims"),
        ("Weights", 37, "ip_emb_preproc_w"), ("Weights", 38, "ip_emb_preproc_b"), ("Weights", 25, "ip_emb_w"),
        ("Weights", 26, "ip_emb_b"), ("Weights", 39, "ip_emb_ln_gammas"), ("Weights", 40, "ip_emb_ln_betas"),
        ("Weights", 33, "ip_mult_gate"), ("Weights", 34, "ip_add_gate"), ("Weights", 41, "ip_emb_ffn"),
        ("Weights", 42, "ip_emb_ffn_ln_gammas"), ("Weights", 43, "ip_emb_ffn_ln_betas"),
        ("Weights", 27, "encoder"), ("Weights", 28, "headcount"), ("Weights", 35, "smolgen_w"),
        ("Weights", 44, "value_heads"), ("Weights", 45, "policy_heads"),
        ("Weights.EncoderLayer", 1, "mha"), ("Weights.EncoderLayer", 4, "ffn"), ("Weights.EncoderLayer", 6, "ln2_betas"),
        ("Weights.MHA", 1, "q_w"), ("Weights.MHA", 8, "dense_b"), ("Weights.MHA", 9, "smolgen"),
        ("Weights.MHA", 10, "rpe_q"), ("Weights.FFN", 3, "dense2_w"),
        ("Weights.Smolgen", 1, "compress"), ("Weights.Smolgen", 6, "dense2_w"), ("Weights.Smolgen", 9, "ln2_betas"),
    ],
)  # fmt: skip
def test_schema_has_the_field_numbers_of_net_proto(message, number, name):
    assert SCHEMA[message][number].name == name


def test_schema_is_one_consistent_table():
    for message, fields in SCHEMA.items():
        names = [f.name for f in fields.values()]
        assert len(names) == len(set(names)), message
        for number, f in fields.items():
            assert isinstance(f, Field) and number > 0
            assert f.kind in SCHEMA or f.kind in ("uint32", "enum", "float", "fixed32", "bytes", "string"), (message, f)
            assert (f.kind == "enum") == (f.enum is not None), (message, f)
    assert SCHEMA["Weights.Layer"][5].repeated and SCHEMA["Weights"][27].repeated


def test_activation_enum_matches_fusedenc_names():
    """``LC0_ACTIVATIONS`` (fusedenc.common.activations) and net.proto's enum agree on every value."""
    for value, name in LC0_ACTIVATIONS.items():
        assert ActivationFunction(value).name.lower().replace("_", "") == name
    assert set(ActivationFunction) - set(LC0_ACTIVATIONS) == {ActivationFunction.DEFAULT, ActivationFunction.SOFTMAX}
    assert [int(e) for e in InputEmbeddingFormat] == [0, 1, 2]
    assert {6, 7, 134} <= {int(e) for e in NetworkStructure}


# -- wire format ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**32 - 1, 2**63, 2**64 - 1])
def test_varints_round_trip(value):
    schema = {"M": {1: Field("x", "uint64")}}
    assert decode(encode({"x": value}, "M", schema), "M", schema) == {"x": value}


def test_negative_int32_and_enum_travel_as_ten_bytes():
    schema = {"M": {1: Field("x", "int32"), 2: Field("e", "enum", enum=ActivationFunction)}}
    data = encode({"x": -5, "e": -1}, "M", schema)
    assert len(data) == 2 * (1 + 10)
    assert decode(data, "M", schema) == {"x": -5, "e": -1}


def test_repeated_numbers_are_read_packed_or_not():
    layer = {"dims": [3, 300, 70000]}
    unpacked = encode(layer, "Weights.Layer", SCHEMA)
    packed = encode(layer, "Weights.Layer", SCHEMA, packed=True)
    assert unpacked != packed
    assert decode(unpacked, "Weights.Layer", SCHEMA) == layer == decode(packed, "Weights.Layer", SCHEMA)
    assert decode(packed + unpacked, "Weights.Layer", SCHEMA) == {"dims": [3, 300, 70000] * 2}


def test_unknown_fields_of_every_wire_type_are_skipped_and_listed():
    data = (
        encode_varint(99 << 3 | 0) + encode_varint(12345)
        + encode_varint(98 << 3 | 1) + b"\0" * 8
        + encode({"min_val": 1.5}, "Weights.Layer", SCHEMA)
        + encode_varint(97 << 3 | 2) + encode_varint(3) + b"abc"
        + encode_varint(96 << 3 | 5) + b"\0" * 4
    )  # fmt: skip
    assert decode(data, "Weights.Layer", SCHEMA) == {"min_val": 1.5, UNKNOWN_FIELDS: [96, 97, 98, 99]}


def test_a_singular_message_seen_twice_is_merged():
    first = encode({"q_w": {"min_val": 1.0}, "smolgen": {"compress": {"dims": [1]}}}, "Weights.MHA", SCHEMA)
    second = encode({"q_w": {"max_val": 2.0}, "smolgen": {"compress": {"dims": [2]}}}, "Weights.MHA", SCHEMA)
    merged = decode(first + second, "Weights.MHA", SCHEMA)
    assert merged == {"q_w": {"min_val": 1.0, "max_val": 2.0}, "smolgen": {"compress": {"dims": [1, 2]}}}


def test_bytes_are_not_copied():
    data = encode({"params": b"\x01\x02\x03\x04"}, "Weights.Layer", SCHEMA)
    params = decode(data, "Weights.Layer", SCHEMA)["params"]
    assert isinstance(params, memoryview) and params == b"\x01\x02\x03\x04"


Q_W = "weights.encoder[3].mha.q_w"


@pytest.mark.parametrize(
    "data, words",
    [
        (b"\x08\x80", ["truncated varint", Q_W]),
        (b"\x1a\x05ab", ["says 5 bytes", "past the end", Q_W]),
        (b"\x0d\x00\x00", ["runs past the end", Q_W]),
        (b"\x18\x01", [f"{Q_W}.params", "wire type 0", "wire type 2"]),
        (b"\x0a\x00", [f"{Q_W}.min_val", "wire type 2", "travels as wire type 5"]),
        (bytes([3 << 3 | 6]) + b"\x00", ["wire type 6", Q_W]),
        (bytes([3 << 3 | 7]), ["wire type 7", Q_W]),
        (bytes([3 << 3 | 3]), ["wire type 3 (group start)", Q_W]),
        (b"\x00\x00", ["field number 0", Q_W]),
        (b"\x08" + b"\xff" * 11, ["longer than 10 bytes", Q_W]),
    ],
)
def test_malformed_wire_data_is_an_error_naming_the_field(data, words):
    with pytest.raises(Lc0FileError) as info:
        decode(data, "Weights.Layer", SCHEMA, path=Q_W)
    for word in words:
        assert word in str(info.value)


def test_encode_refuses_names_that_are_not_fields():
    with pytest.raises(KeyError, match="q_weight"):
        encode({"q_weight": {}}, "Weights.MHA", SCHEMA)


# -- weight layers --------------------------------------------------------------------------


@pytest.mark.parametrize("dims", [False, True])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_layer_round_trips_within_its_encoding(encoding, dims):
    values = torch.randn(7, 13, generator=torch.Generator().manual_seed(1)) * 3
    layer = encode_layer(values, encoding, dims=dims)
    data = encode(layer, "Weights.Layer", SCHEMA)
    decoded = decode_layer(decode(data, "Weights.Layer", SCHEMA), "w")
    assert decoded.dtype == torch.float32
    assert decoded.shape == ((7, 13) if dims else (91,))
    decoded, flat = decoded.reshape(-1), values.reshape(-1)
    if encoding == "LINEAR16":
        lo, hi = flat.min().item(), flat.max().item()
        step = (hi - lo) / 65535
        codes = torch.tensor(struct.unpack("<91H", layer["params"]), dtype=torch.float64)
        grid = lo + codes * step  # the value each stored code stands for
        assert (decoded.double() - grid).abs().max() <= 1e-6 * (hi - lo)
        assert (decoded - flat).abs().max() <= step / 2 + 1e-6 * (hi - lo)
        assert decoded.min().item() == lo and decoded.max().item() == hi  # the ends are exact
    elif encoding == "FLOAT16":
        assert torch.equal(decoded, flat.half().float())
    elif encoding == "BFLOAT16":
        assert torch.equal(decoded, flat.bfloat16().float())
    else:
        assert torch.equal(decoded, flat)


def test_linear16_is_lc0s_formula_on_little_endian_codes():
    codes = [0, 65535, 32768, 1, 256]
    layer = {"min_val": -1.0, "max_val": 3.0, "params": struct.pack("<5H", *codes)}  # encoding absent: LINEAR16
    decoded = decode_layer(layer, "w")
    theta = torch.tensor(codes, dtype=torch.float32) / 65535.0
    expected = -1.0 * (1.0 - theta) + 3.0 * theta
    assert torch.allclose(decoded, expected, rtol=0, atol=1e-6)
    assert decoded[0].item() == -1.0 and decoded[1].item() == 3.0
    assert abs(decoded[3].item() - (-1.0 + 4.0 / 65535)) < 1e-6  # b"\x01\x00" is code 1, not 256


def test_an_empty_layer_is_an_empty_tensor():
    assert decode_layer({}, "w").shape == (0,)
    assert decode_layer({"encoding": int(LayerEncoding.FLOAT16), "dims": [0, 4]}, "w").shape == (0, 4)


@pytest.mark.parametrize(
    "layer, words",
    [
        ({"encoding": 9, "params": b"\0\0"}, ["unknown layer encoding 9", "not in net.proto"]),
        ({"encoding": 0, "params": b"\0\0"}, ["unknown layer encoding 0", "UNKNOWN_ENCODING"]),
        ({"encoding": 4, "params": b"\0" * 6}, ["6 bytes of FLOAT32", "whole number"]),
        ({"params": b"\0" * 4, "min_val": 0.0}, ["LINEAR16", "no max_val"]),
        ({"params": b"\0" * 4}, ["no min_val or max_val"]),
        ({"params": b"\0" * 4, "min_val": float("nan"), "max_val": 1.0}, ["not finite"]),
        ({"encoding": 2, "params": b"\0" * 8, "dims": [3, 1]}, ["dims [3, 1] hold 3 values", "4 FLOAT16 values"]),
        ({"encoding": 4, "params": struct.pack("<2f", 1.0, float("inf"))}, ["1 of 2 FLOAT32 values", "infinite"]),
    ],
)
def test_a_bad_layer_is_an_error_naming_it(layer, words):
    with pytest.raises(Lc0FileError) as info:
        decode_layer(layer, Q_W)
    assert str(info.value).startswith(Q_W + ":")
    for word in words:
        assert word in str(info.value)


def test_expect_shape_views_or_names_the_mismatch():
    t = torch.arange(12.0)
    assert expect_shape(t, (3, 4), "w").shape == (3, 4)
    assert expect_shape(t.view(4, 3), [3, 4], "w").shape == (3, 4)  # only the count matters, as in lc0
    with pytest.raises(Lc0FormatError, match=r"weights\.ip_emb_w: has 12 values .* expected shape \(5, 2\) = 10"):
        expect_shape(t, (5, 2), "weights.ip_emb_w")


# -- whole files ----------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_encoding_round_trips_through_a_file(tmp_path, encoding):
    path = tmp_path / "tiny.pb.gz"
    values = write_preset(path, "tiny", encoding=encoding)
    net = read_net(path)
    check_supported(net)
    shapes = expected_shapes(net)
    assert set(shapes) == set(values)  # the writer and the reader agree on lc0's layers and shapes
    assert net.layer_encodings == {encoding: len(values)}
    for p, written in values.items():
        assert shapes[p] == tuple(written.shape), p
        got = net.get(p).reshape(-1)
        flat = written.reshape(-1)
        if encoding == "LINEAR16":
            # the nearest code, then lc0's float32 formula (a few float32 roundings of the range's ends)
            lo, hi = flat.min().item(), flat.max().item()
            tolerance = (hi - lo) / 65535 / 2 + 4 * torch.finfo(torch.float32).eps * max(abs(lo), abs(hi))
            assert (got - flat).abs().max().item() <= tolerance, p
        elif encoding == "FLOAT16":
            assert torch.equal(got, flat.half().float()), p
        elif encoding == "BFLOAT16":
            assert torch.equal(got, flat.bfloat16().float()), p
        else:
            assert torch.equal(got, flat), p


def test_dims_in_the_file_shape_the_tensors(tiny):
    net = read_message(build_net(**PRESETS["tiny"], dims=True)[0])
    assert net.get("weights.encoder[1].mha.smolgen.dense1_w").shape == (32, 64 * 8)
    assert net.get("weights.smolgen_w").shape == (4096, 32)
    check_supported(net)


def test_describe_the_tiny_net(tmp_path):
    path = tmp_path / "tiny.pb.gz"
    write_preset(path, "tiny")
    d = read_net(path).describe()
    assert d["source"] == str(path)
    assert d["network"] == "ATTENTIONBODY_WITH_MULTIHEADFORMAT" == d["stored_network"]
    assert d["embedding"] == "PE_DENSE" and d["embedding_dense_size"] == 16
    assert (d["layers"], d["d_model"], d["heads"], d["d_ff"], d["embedding_d_ff"]) == (2, 64, 4, 128, 128)
    assert d["activations"] == {"default": "mish", "ffn": "swish", "smolgen": "swish", "policy": "mish"}
    assert d["smolgen"] == {"hidden_channels": 8, "hidden_size": 32, "gen_size": 32}
    assert d["policy"] == {"format": "ATTENTION", "heads": ["vanilla"], "embedding_size": 64, "d_model": 64,
                           "encoder_layers": 0}  # fmt: skip
    assert d["value"] == {"format": "WDL", "wdl": True, "heads": ["winner"], "channels": 32, "hidden": 128}
    assert d["moves_left"] == {"format": "V1", "channels": 8, "hidden": 128}
    assert d["input_gating"] is False and d["residual_blocks"] == 0
    layer = 4 * (64 * 64 + 64) + 4 * 64 + 2 * 64 * 128 + 128 + 64
    smolgen = 8 * 64 + 32 * 512 + 32 * 3 + 128 * 32 + 128 * 3
    embedding = 1024 * 768 + 1024 + 64 * 128 + 64 * 3 + 2 * 64 * 128 + 128 + 64 + 2 * 64
    heads = (64 * 64 + 64) * 3 + 4 * 64 + (32 * 64 + 32 + 128 * 2048 + 128 + 3 * 128 + 3)
    mlh = 8 * 64 + 8 + 128 * 512 + 128 + 128 + 1
    assert d["parameters"] == 2 * (layer + smolgen) + 4096 * 32 + embedding + heads + mlh
    assert d["encodings"] == {"LINEAR16": 82}
    assert d["min_version"] == "0.31.0" and d["notes"] == [] and d["unknown_fields"] == []


def test_heads_resolve_as_lc0_builds_them(tiny):
    net = read_message(build_net(**PRESETS["tiny"], policy_heads=("vanilla", "optimistic"),
                                 value_heads=("winner", "q", "st"), gating=True)[0])  # fmt: skip
    check_supported(net)
    policy = net.policy_heads()
    assert list(policy) == ["vanilla", "optimistic"]
    assert policy["vanilla"]["ip_pol_w"] is net.get("weights.policy_heads.ip_pol_w")  # the shared embedding
    assert policy["optimistic"]["ip2_pol_w"] is net.get("weights.policy_heads.optimistic_st.ip2_pol_w")
    assert list(net.value_heads()) == ["winner", "q", "st"]
    d = net.describe()
    assert d["policy"]["heads"] == ["vanilla", "optimistic"] and d["input_gating"] is True
    assert expected_shapes(net)["weights.ip_mult_gate"] == (64, 64)


def test_the_single_head_format_is_supported():
    net = read_message(build_net(**PRESETS["tiny"], head_format="single", wdl=False, moves_left=False)[0])
    check_supported(net)
    assert net.network == NetworkStructure.ATTENTIONBODY_WITH_HEADFORMAT
    assert net.policy_heads()["vanilla"]["ip4_pol_w"] is net.get("weights.ip4_pol_w")
    assert net.value_heads()["winner"]["ip2_val_w"].numel() == 128  # classical value: one output
    assert net.describe()["moves_left"] is None


def test_older_format_fields_are_upgraded_as_lc0_does(tiny):
    def network(value, drop_embedding=False):
        def edit(net, w):
            net["format"]["network_format"]["network"] = value
            if drop_embedding:
                del net["format"]["network_format"]["input_embedding"]
        return edit

    legacy = read_message(edited(tiny, network(134)))
    assert legacy.network == NetworkStructure.ATTENTIONBODY_WITH_MULTIHEADFORMAT
    assert legacy.stored_format["network"] == 134 and "134" in legacy.format_notes[0]
    check_supported(legacy)

    multi_as_6 = read_message(edited(tiny, network(6, drop_embedding=True)))
    assert multi_as_6.network == NetworkStructure.ATTENTIONBODY_WITH_MULTIHEADFORMAT
    assert multi_as_6.input_embedding == InputEmbeddingFormat.PE_DENSE
    check_supported(multi_as_6)

    old = read_message(edited(tiny, network(4, drop_embedding=True)))  # SE_WITH_HEADFORMAT + encoders + smolgen
    assert old.network == NetworkStructure.ATTENTIONBODY_WITH_MULTIHEADFORMAT
    assert (old.ffn_activation, old.smolgen_activation) == (ActivationFunction.RELU_2, ActivationFunction.SWISH)
    assert len(old.format_notes) == 3


def test_an_uncompressed_net_is_read_too(tiny):
    net = read_net(encode_net(tiny[0], gzipped=False))
    check_supported(net)
    assert net.describe()["layers"] == 2


def test_gzip_members_are_joined_and_trailing_bytes_ignored_as_zlib_does(tiny):
    payload = encode_net(tiny[0], gzipped=False)
    half = len(payload) // 2
    data = gzip.compress(payload[:half]) + gzip.compress(payload[half:]) + b"\0" * 16
    assert read_net(data).describe()["layers"] == 2


def test_unknown_fields_are_reported_not_dropped_silently(tiny):
    payload = encode_net(tiny[0], gzipped=False) + encode_varint(111 << 3) + encode_varint(7)
    assert read_net(payload).unknown_fields == ("Net#111",)


# -- bad files: each one a clear error ------------------------------------------------------


def test_not_gzip():
    with pytest.raises(Lc0FileError, match="not a gzip file .* starts with 68 65 6c 6c"):
        read_net(b"hello, not a network")
    with pytest.raises(Lc0FileError, match="not a gzip file"):
        read_net(b"")


def test_truncated_gzip(tiny):
    data = encode_net(tiny[0])
    with pytest.raises(Lc0FileError, match="truncated gzip"):
        read_net(data[: len(data) // 2])
    with pytest.raises(Lc0FileError, match="truncated gzip"):
        read_net(data[:-4])  # the length field of the trailer is missing


def test_corrupt_gzip(tiny):
    data = bytearray(encode_net(tiny[0]))
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(Lc0FileError, match="corrupt gzip"):
        read_net(bytes(data))


def test_truncated_protobuf(tiny):
    payload = encode_net(tiny[0], gzipped=False)
    with pytest.raises(Lc0FileError, match=r"weights.*past the end of its data"):
        read_net(gzip.compress(payload[: len(payload) - 1000]))


def test_wrong_or_missing_magic(tiny):
    with pytest.raises(Lc0FileError, match="wrong magic: expected 0x1c0, found 0x1c1"):
        read_message(edited(tiny, lambda net, w: net.update(magic=0x1C1)))
    with pytest.raises(Lc0FileError, match="no magic"):
        read_message(edited(tiny, lambda net, w: net.pop("magic")))


def test_protobuf_junk_that_is_not_a_net():
    with pytest.raises(Lc0FileError, match="not an Lc0 network .* magic 0x1c0"):
        read_net(gzip.compress(b"\x0a\xff\xff\xff\x0f"))


def test_a_layer_whose_bytes_do_not_match_its_dims(tiny):
    def edit(net, w):
        w["encoder"][1]["mha"]["q_w"]["dims"] = [64, 63]

    with pytest.raises(Lc0FileError, match=r"weights\.encoder\[1\]\.mha\.q_w: dims \[64, 63\] hold 4032 values"):
        read_message(edited(tiny, edit))


def test_a_layer_with_an_odd_byte_count(tiny):
    def edit(net, w):
        w["ip_emb_w"]["params"] = w["ip_emb_w"]["params"][:-1]

    with pytest.raises(Lc0FileError, match=r"weights\.ip_emb_w: .* not a whole number"):
        read_message(edited(tiny, edit))


def test_a_layer_whose_size_does_not_match_the_net(tiny):
    def edit(net, w):
        w["encoder"][0]["ffn"]["dense2_w"]["params"] = w["encoder"][0]["ffn"]["dense2_w"]["params"][:-128]
        w["value_heads"]["winner"]["ip1_val_w"]["params"] += b"\0\0"

    message = supported_problems(edited(tiny, edit))
    assert "weights.encoder[0].ffn.dense2_w: has 8128 values, expected shape (64, 128) = 8192 values" in message
    assert "weights.value_heads.winner.ip1_val_w: has 262145 values, expected shape (128, 2048)" in message


def test_an_unknown_encoding(tiny):
    def edit(net, w):
        w["encoder"][0]["mha"]["smolgen"]["dense1_w"]["encoding"] = 5

    with pytest.raises(Lc0FileError, match=r"weights\.encoder\[0\]\.mha\.smolgen\.dense1_w: unknown layer encoding 5"):
        read_message(edited(tiny, edit))


def test_missing_required_fields_are_each_named(tiny):
    def edit(net, w):
        del w["encoder"][1]["ffn"]["dense2_w"]
        del w["value_heads"]["winner"]["ip2_val_b"]
        del w["policy_heads"]["vanilla"]["ip4_pol_w"]
        del w["smolgen_w"]
        del w["headcount"]
        w["ip_emb_ln_gammas"]["params"] = b""  # an empty layer counts as missing, as in lc0

    message = supported_problems(edited(tiny, edit))
    for path in ("weights.encoder[1].ffn.dense2_w", "weights.value_heads.winner.ip2_val_b",
                 "weights.policy_heads.vanilla.ip4_pol_w", "weights.smolgen_w", "weights.ip_emb_ln_gammas"):  # fmt: skip
        assert f"{path}: missing" in message
    assert "weights.headcount: missing" in message


def test_pe_map_is_refused_by_name(tiny):
    message = supported_problems(build_net(**PRESETS["tiny"], embedding="PE_MAP")[0])
    assert "input embedding PE_MAP" in message and "position-encoding table" in message


def test_no_embedding_on_an_attention_body_is_refused(tiny):
    assert "input embedding NONE" in supported_problems(build_net(**PRESETS["tiny"], embedding="NONE")[0])


def test_relative_position_encodings_are_refused(tiny):
    def edit(net, w):
        w["encoder"][1]["mha"]["rpe_k"] = encode_layer(torch.ones(64 * 64))

    message = supported_problems(edited(tiny, edit))
    assert "weights.encoder[1].mha.rpe_k: relative position encodings are not supported" in message


@pytest.mark.parametrize(
    "network, words",
    [
        (2, ["SE_WITH_HEADFORMAT (4)", "residual (convolutional) body"]),  # SE is read as 4
        (3, ["CLASSICAL_WITH_HEADFORMAT (3)", "attention-body"]),
        (5, ["ONNX (5)"]),
        (99, ["network format 99 (not in net.proto)", "not a network format fusedenc knows"]),
        (0, ["UNKNOWN (0)"]),
    ],
)
def test_bodies_that_are_not_attention_bodies_are_refused(tiny, network, words):
    def edit(net, w):
        net["format"]["network_format"]["network"] = network

    message = supported_problems(edited(tiny, edit))
    for word in words:
        assert word in message


def test_a_net_without_format_is_an_old_residual_net(tiny):
    message = supported_problems(edited(tiny, lambda net, w: net.pop("format")))
    assert "CLASSICAL_WITH_HEADFORMAT" in message


def test_activations_fusedenc_lacks_are_refused(tiny):
    def edit(net, w):
        net["format"]["network_format"]["ffn_activation"] = int(ActivationFunction.SOFTMAX)
        net["format"]["network_format"]["default_activation"] = 7

    message = supported_problems(edited(tiny, edit))
    assert "ffn_activation SOFTMAX is not an elementwise activation" in message
    assert "default_activation 7 (not in net.proto)" in message
    net = read_message(edited(tiny, edit))
    with pytest.raises(Lc0FormatError, match="default_activation 7"):
        net.activation_names()
    assert net.describe()["activations"]["ffn"] == "unsupported: SOFTMAX"


def test_an_onnx_only_file_is_refused(tiny):
    def edit(net, w):
        del net["weights"]
        net["onnx_model"] = {"model": b"onnx bytes", "data_type": 1}

    message = supported_problems(edited(tiny, edit))
    assert "no weights (it carries an ONNX model" in message


# -- a BT4-sized net ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_bt4_sized_net_reads_in_seconds(tmp_path):
    path = tmp_path / "bt4.pb.gz"
    write_preset(path, "bt4", keep_values=False)
    start = time.perf_counter()
    net = read_net(path)
    seconds = time.perf_counter() - start
    check_supported(net)
    d = net.describe()
    assert (d["layers"], d["d_model"], d["heads"], d["d_ff"], d["embedding_dense_size"]) == (15, 1024, 32, 1536, 512)
    assert d["smolgen"] == {"hidden_channels": 32, "hidden_size": 256, "gen_size": 256}
    assert d["activations"] == {"default": "mish", "ffn": "mish", "smolgen": "swish", "policy": "mish"}
    assert d["parameters"] > 180_000_000
    assert seconds < 60, f"reading a BT4-sized net took {seconds:.1f} s"
    assert math.isfinite(float(net.get("weights.encoder[14].ffn.dense2_w").sum()))
