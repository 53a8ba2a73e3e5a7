"""The Lc0 network file format: every message, field number and enum, in one table.

A ``.pb.gz`` network is a gzip'd protobuf ``pblczero.Net``.  The numbers below are the
public interface of that format (lc0's ``proto/net.proto``); this is our own table of
them, read by ``protobuf.decode``.  Every field net.proto declares is listed, including
the ones fusedenc does not run (residual towers, relative position encodings, ONNX
payloads), so that nothing in a file is dropped without the loader seeing it.

``SCHEMA[message][number] = Field(name, kind, repeated, enum, limit)``; a kind that is not
a scalar (``protobuf.SCALAR_KINDS``) names another message of the table.  Nested proto
messages are spelled ``Outer.Inner`` (``Weights.Layer``).  ``limit`` bounds a repeated
field's entries (``protobuf.DEFAULT_REPEATED_LIMIT``, 1024, where not given: real nets have
tens of encoder layers; ``MAX_DIMS`` for a layer's ``dims``), so that a tiny hostile file
cannot ask for a million layers.
"""

from __future__ import annotations

import enum

from .protobuf import Field, Schema

__all__ = [
    "ATTENTION_BODIES",
    "DEFAULT_ACTIVATION_FUNCTION",
    "LAYER",
    "LC0_MAGIC",
    "MAX_DIMS",
    "SCHEMA",
    "ActivationFunction",
    "DefaultActivation",
    "FileEncoding",
    "InputEmbeddingFormat",
    "InputFormat",
    "LayerEncoding",
    "MovesLeftFormat",
    "NetworkStructure",
    "OnnxDataType",
    "OutputFormat",
    "PolicyFormat",
    "ValueFormat",
    "enum_label",
    "enum_name",
]

#: ``Net.magic``: the first field of every Lc0 network file.
LC0_MAGIC = 0x1C0

#: The message every weight tensor is stored in.
LAYER = "Weights.Layer"

#: The most ``dims`` entries a layer may give (lc0's tensors have 1 to 4).
MAX_DIMS = 8


class LayerEncoding(enum.IntEnum):
    """``Weights.Layer.encoding``: how ``params`` holds the values (absent = LINEAR16)."""

    UNKNOWN_ENCODING = 0
    LINEAR16 = 1  # uint16 mapped linearly onto [min_val, max_val]
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT32 = 4


class FileEncoding(enum.IntEnum):
    """``Format.weights_encoding``: the file-wide default that a layer's own encoding overrides."""

    UNKNOWN = 0
    LINEAR16 = 1


class InputFormat(enum.IntEnum):
    """``NetworkFormat.input``: how positions are encoded into the 112 input planes."""

    UNKNOWN = 0
    CLASSICAL_112_PLANE = 1
    WITH_CASTLING_PLANE = 2
    WITH_CANONICALIZATION = 3
    WITH_CANONICALIZATION_HECTOPLIES = 4
    WITH_CANONICALIZATION_V2 = 5
    WITH_CANONICALIZATION_HECTOPLIES_ARMAGEDDON = 132
    WITH_CANONICALIZATION_V2_ARMAGEDDON = 133


class OutputFormat(enum.IntEnum):
    """``NetworkFormat.output``."""

    UNKNOWN = 0
    CLASSICAL = 1
    WDL = 2


class NetworkStructure(enum.IntEnum):
    """``NetworkFormat.network``: the body.  6, 7 and 134 are attention bodies (transformers)."""

    UNKNOWN = 0
    CLASSICAL = 1  # residual tower, heads implied
    SE = 2  # residual tower with squeeze-excitation, heads implied
    CLASSICAL_WITH_HEADFORMAT = 3
    SE_WITH_HEADFORMAT = 4
    ONNX = 5  # the file carries an ONNX model instead of weights
    ATTENTIONBODY_WITH_HEADFORMAT = 6  # single policy / value head fields in Weights
    ATTENTIONBODY_WITH_MULTIHEADFORMAT = 7  # Weights.policy_heads / value_heads
    AB_LEGACY_WITH_MULTIHEADFORMAT = 134  # read as 7


#: The bodies made of encoder layers.
ATTENTION_BODIES = (
    NetworkStructure.ATTENTIONBODY_WITH_HEADFORMAT,
    NetworkStructure.ATTENTIONBODY_WITH_MULTIHEADFORMAT,
    NetworkStructure.AB_LEGACY_WITH_MULTIHEADFORMAT,
)


class PolicyFormat(enum.IntEnum):
    """``NetworkFormat.policy``."""

    UNKNOWN = 0
    CLASSICAL = 1
    CONVOLUTION = 2
    ATTENTION = 3


class ValueFormat(enum.IntEnum):
    """``NetworkFormat.value``: WDL = three outputs (win, draw, loss)."""

    UNKNOWN = 0
    CLASSICAL = 1
    WDL = 2
    PARAM = 3


class MovesLeftFormat(enum.IntEnum):
    """``NetworkFormat.moves_left``."""

    NONE = 0
    V1 = 1


class ActivationFunction(enum.IntEnum):
    """``NetworkFormat.ActivationFunction`` (smolgen and FFN activations).  DEFAULT means
    "the net's default activation"; ``fusedenc.common.activations.LC0_ACTIVATIONS`` maps the
    elementwise ones to fusedenc's names."""

    DEFAULT = 0
    MISH = 1
    RELU = 2
    NONE = 3
    TANH = 4
    SIGMOID = 5
    SELU = 6
    SWISH = 7
    RELU_2 = 8
    SOFTMAX = 9


class DefaultActivation(enum.IntEnum):
    """``NetworkFormat.default_activation``: numbered apart from ActivationFunction."""

    RELU = 0
    MISH = 1


#: DefaultActivation -> the ActivationFunction it stands for.
DEFAULT_ACTIVATION_FUNCTION = {
    DefaultActivation.RELU: ActivationFunction.RELU,
    DefaultActivation.MISH: ActivationFunction.MISH,
}


class InputEmbeddingFormat(enum.IntEnum):
    """``NetworkFormat.input_embedding`` of an attention body."""

    NONE = 0
    PE_MAP = 1  # a fixed 64 x 64 position-encoding table appended to the planes (lc0 ships it)
    PE_DENSE = 2  # a learned dense layer over the first 12 planes (weights in the file)


class OnnxDataType(enum.IntEnum):
    """``OnnxModel.data_type``."""

    UNKNOWN = 0
    FLOAT = 1
    FLOAT16 = 10
    BFLOAT16 = 16


def enum_name(enum_cls: type, value: int) -> str:
    """``value``'s name in ``enum_cls``, or ``"<value> (not in net.proto)"``."""
    try:
        return enum_cls(value).name
    except ValueError:
        return f"{value} (not in net.proto)"


def enum_label(enum_cls: type, value: int) -> str:
    """``NAME (value)`` for messages; an unknown value as ``enum_name`` spells it."""
    try:
        return f"{enum_cls(value).name} ({int(value)})"
    except ValueError:
        return enum_name(enum_cls, value)


L = LAYER  # shorthand for the table below
CONV = "Weights.ConvBlock"
ENC = "Weights.EncoderLayer"

#: Every message of net.proto: ``{number: Field(name, kind, repeated, enum)}``.
SCHEMA: Schema = {
    "Net": {
        1: Field("magic", "fixed32"),
        2: Field("license", "string"),
        3: Field("min_version", "EngineVersion"),
        4: Field("format", "Format"),
        5: Field("training_params", "TrainingParams"),
        10: Field("weights", "Weights"),
        11: Field("onnx_model", "OnnxModel"),
    },
    "EngineVersion": {
        1: Field("major", "uint32"),
        2: Field("minor", "uint32"),
        3: Field("patch", "uint32"),
    },
    "Format": {
        1: Field("weights_encoding", "enum", enum=FileEncoding),
        2: Field("network_format", "NetworkFormat"),
    },
    "NetworkFormat": {
        1: Field("input", "enum", enum=InputFormat),
        2: Field("output", "enum", enum=OutputFormat),
        3: Field("network", "enum", enum=NetworkStructure),
        4: Field("policy", "enum", enum=PolicyFormat),
        5: Field("value", "enum", enum=ValueFormat),
        6: Field("moves_left", "enum", enum=MovesLeftFormat),
        7: Field("default_activation", "enum", enum=DefaultActivation),
        8: Field("smolgen_activation", "enum", enum=ActivationFunction),
        9: Field("ffn_activation", "enum", enum=ActivationFunction),
        10: Field("input_embedding", "enum", enum=InputEmbeddingFormat),
    },
    "TrainingParams": {
        1: Field("training_steps", "uint32"),
        2: Field("learning_rate", "float"),
        3: Field("mse_loss", "float"),
        4: Field("policy_loss", "float"),
        5: Field("accuracy", "float"),
        6: Field("lc0_params", "string"),
    },
    "OnnxModel": {
        1: Field("model", "bytes"),
        2: Field("data_type", "enum", enum=OnnxDataType),
        3: Field("input_planes", "string"),
        4: Field("output_value", "string"),
        5: Field("output_wdl", "string"),
        6: Field("output_policy", "string"),
        7: Field("output_mlh", "string"),
    },
    "Weights.Layer": {
        1: Field("min_val", "float"),
        2: Field("max_val", "float"),
        3: Field("params", "bytes"),
        4: Field("encoding", "enum", enum=LayerEncoding),
        5: Field("dims", "uint32", repeated=True, limit=MAX_DIMS),
    },
    "Weights.ConvBlock": {
        1: Field("weights", L),
        2: Field("biases", L),
        3: Field("bn_means", L),
        4: Field("bn_stddivs", L),
        5: Field("bn_gammas", L),
        6: Field("bn_betas", L),
    },
    "Weights.SEunit": {
        1: Field("w1", L),
        2: Field("b1", L),
        3: Field("w2", L),
        4: Field("b2", L),
    },
    "Weights.Residual": {
        1: Field("conv1", CONV),
        2: Field("conv2", CONV),
        3: Field("se", "Weights.SEunit"),
    },
    "Weights.Smolgen": {
        1: Field("compress", L),  # no bias
        2: Field("dense1_w", L),
        3: Field("dense1_b", L),
        4: Field("ln1_gammas", L),
        5: Field("ln1_betas", L),
        6: Field("dense2_w", L),
        7: Field("dense2_b", L),
        8: Field("ln2_gammas", L),
        9: Field("ln2_betas", L),
    },
    "Weights.MHA": {
        1: Field("q_w", L),
        2: Field("q_b", L),
        3: Field("k_w", L),
        4: Field("k_b", L),
        5: Field("v_w", L),
        6: Field("v_b", L),
        7: Field("dense_w", L),
        8: Field("dense_b", L),
        9: Field("smolgen", "Weights.Smolgen"),
        10: Field("rpe_q", L),  # relative position encodings: fusedenc (like lc0) refuses them
        11: Field("rpe_k", L),
        12: Field("rpe_v", L),
        # 13-22 are reserved in net.proto for int8 quantization: unknown fields if present.
    },
    "Weights.FFN": {
        1: Field("dense1_w", L),
        2: Field("dense1_b", L),
        3: Field("dense2_w", L),
        4: Field("dense2_b", L),
        # 5-10 reserved for int8 quantization.
    },
    "Weights.EncoderLayer": {
        1: Field("mha", "Weights.MHA"),
        2: Field("ln1_gammas", L),
        3: Field("ln1_betas", L),
        4: Field("ffn", "Weights.FFN"),
        5: Field("ln2_gammas", L),
        6: Field("ln2_betas", L),
    },
    "Weights.PolicyHead": {
        1: Field("ip_pol_w", L),  # the policy "embedding"; may be shared in PolicyHeads
        2: Field("ip_pol_b", L),
        3: Field("ip2_pol_w", L),  # attention policy queries
        4: Field("ip2_pol_b", L),
        5: Field("ip3_pol_w", L),  # attention policy keys
        6: Field("ip3_pol_b", L),
        7: Field("ip4_pol_w", L),  # promotion logits
        8: Field("pol_encoder", ENC, repeated=True),
        9: Field("pol_headcount", "uint32"),
        10: Field("policy1", CONV),  # convolutional policy heads (residual bodies)
        11: Field("policy", CONV),
    },
    "Weights.ValueHead": {
        1: Field("ip_val_w", L),  # the value "embedding" of an attention body
        2: Field("ip_val_b", L),
        3: Field("ip1_val_w", L),
        4: Field("ip1_val_b", L),
        5: Field("ip2_val_w", L),
        6: Field("ip2_val_b", L),
        7: Field("ip_val_err_w", L),
        8: Field("ip_val_err_b", L),
        9: Field("ip_val_cat_w", L),
        10: Field("ip_val_cat_b", L),
        11: Field("value", CONV),  # convolutional value head (residual bodies)
    },
    "Weights.PolicyHeadMap": {
        1: Field("key", "string"),
        2: Field("value", "Weights.PolicyHead"),
    },
    "Weights.PolicyHeads": {
        1: Field("ip_pol_w", L),  # shared embedding of every policy head
        2: Field("ip_pol_b", L),
        3: Field("vanilla", "Weights.PolicyHead"),
        4: Field("optimistic_st", "Weights.PolicyHead"),
        5: Field("soft", "Weights.PolicyHead"),
        6: Field("opponent", "Weights.PolicyHead"),
        7: Field("policy_head_map", "Weights.PolicyHeadMap", repeated=True),
    },
    "Weights.ValueHeadMap": {
        1: Field("key", "string"),
        2: Field("value", "Weights.ValueHead"),
    },
    "Weights.ValueHeads": {
        1: Field("winner", "Weights.ValueHead"),
        2: Field("q", "Weights.ValueHead"),
        3: Field("st", "Weights.ValueHead"),
        4: Field("value_head_map", "Weights.ValueHeadMap", repeated=True),
    },
    "Weights": {
        # Residual (convolutional) body.
        1: Field("input", CONV),
        2: Field("residual", "Weights.Residual", repeated=True),
        # Attention-body embedding.
        37: Field("ip_emb_preproc_w", L),  # PE_DENSE: dense over the first 12 planes of all squares
        38: Field("ip_emb_preproc_b", L),
        25: Field("ip_emb_w", L),
        26: Field("ip_emb_b", L),
        39: Field("ip_emb_ln_gammas", L),
        40: Field("ip_emb_ln_betas", L),
        33: Field("ip_mult_gate", L),  # input gating, stored [d_model][64]
        34: Field("ip_add_gate", L),
        41: Field("ip_emb_ffn", "Weights.FFN"),
        42: Field("ip_emb_ffn_ln_gammas", L),
        43: Field("ip_emb_ffn_ln_betas", L),
        # Encoder stack.
        27: Field("encoder", ENC, repeated=True),
        28: Field("headcount", "uint32"),
        # Single-head format policy (NETWORK_*_WITH_HEADFORMAT, attention body 6).
        21: Field("pol_encoder", ENC, repeated=True),
        24: Field("pol_headcount", "uint32"),
        11: Field("policy1", CONV),
        3: Field("policy", CONV),
        4: Field("ip_pol_w", L),
        5: Field("ip_pol_b", L),
        17: Field("ip2_pol_w", L),
        18: Field("ip2_pol_b", L),
        19: Field("ip3_pol_w", L),
        20: Field("ip3_pol_b", L),
        22: Field("ip4_pol_w", L),
        # Single-head format value.
        6: Field("value", CONV),
        29: Field("ip_val_w", L),
        30: Field("ip_val_b", L),
        7: Field("ip1_val_w", L),
        8: Field("ip1_val_b", L),
        9: Field("ip2_val_w", L),
        10: Field("ip2_val_b", L),
        # Multi-head format (attention body 7).
        44: Field("value_heads", "Weights.ValueHeads"),
        45: Field("policy_heads", "Weights.PolicyHeads"),
        # Moves-left head (both formats).
        12: Field("moves_left", CONV),
        31: Field("ip_mov_w", L),
        32: Field("ip_mov_b", L),
        13: Field("ip1_mov_w", L),
        14: Field("ip1_mov_b", L),
        15: Field("ip2_mov_w", L),
        16: Field("ip2_mov_b", L),
        # Smolgen's global weight: [64 * 64][gen_size], shared by every layer.
        35: Field("smolgen_w", L),
        36: Field("smolgen_b", L),
    },
}
