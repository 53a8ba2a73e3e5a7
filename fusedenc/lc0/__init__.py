"""Running Leela Chess Zero (lc0) networks with fusedenc.

The file layer: ``read_net`` reads an lc0 network file (a gzip'd ``pblczero.Net``
protobuf, ``.pb.gz``) with fusedenc's own wire-format reader, checks it and decodes
every weight to float32; ``check_supported`` says whether fusedenc can run it.

* ``protobuf`` - the protobuf wire format (decode / encode against a schema);
* ``schema``   - lc0's messages, field numbers and enums, as one table;
* ``weights``  - weight layers (LINEAR16, FLOAT16, BFLOAT16, FLOAT32) to tensors and back;
* ``netfile``  - ``read_net``, ``NetFile``;
* ``support``  - ``check_supported``, ``expected_shapes``: whether fusedenc runs a net;
* ``moves``    - the 1858-move policy order and the attention-policy gather, from lc0's rules;
* ``reference`` - ``reference_forward``: the whole net (planes in, heads out) in plain
  PyTorch from the semantics of lc0's ONNX converter, the oracle of the fast path.

* ``network``  - ``load_network(path) -> Lc0Network``: the fast network (EncoderBlocks for
  the body, fused GEMMs for embedding, smolgen and heads), held to ``reference_forward``.

From a position to a move:

* ``board``     - chess rules on bitboards, vectorized over a batch (numpy);
* ``positions`` - ``Position`` (FEN, moves, history, repetitions) and ``prepare``: any list of
  positions (FENs, ``(fen, moves)`` pairs, ``Position``/``chess.Board`` objects) parsed,
  replayed and checked at once;
* ``encoding``  - ``encode_planes(positions, input_format)``: lc0's 112 input planes, every
  input format of lc0's encoder;
* ``policy``    - ``decode_policy(logits, positions, input_format)``: legal moves on the real
  board with probabilities;
* ``evaluate``  - ``Evaluation``; ``Lc0Network.evaluate(positions)`` runs the whole path;
* ``evaluator`` - ``Evaluator``: many threads submit positions, batches run on one or more GPUs
  (``hostwork``: the host side of a batch, run in worker processes);
* ``gamefiles`` - ``read_epd``, ``read_pgn``, ``san_to_uci``: positions from EPD and PGN files.
"""

from .encoding import encode_planes
from .errors import Lc0FileError, Lc0FormatError, Lc0NonFiniteError, Lc0ValueWarning
from .evaluate import Evaluation
from .evaluator import Evaluator
from .gamefiles import read_epd, read_pgn, san_to_uci
from .netfile import NetFile, read_net
from .network import Lc0GraphRunner, Lc0Network, load_network
from .policy import MovePolicy, decode_policy
from .positions import Position, prepare
from .schema import (
    ActivationFunction,
    DefaultActivation,
    InputEmbeddingFormat,
    LayerEncoding,
    NetworkStructure,
    PolicyFormat,
    ValueFormat,
)
from .support import check_supported, expected_shapes
from .weights import decode_layer, expect_shape

__all__ = [
    "ActivationFunction",
    "DefaultActivation",
    "Evaluation",
    "Evaluator",
    "InputEmbeddingFormat",
    "LayerEncoding",
    "MovePolicy",
    "Lc0FileError",
    "Lc0GraphRunner",
    "Lc0Network",
    "Lc0FormatError",
    "Lc0NonFiniteError",
    "Lc0ValueWarning",
    "NetFile",
    "NetworkStructure",
    "Position",
    "PolicyFormat",
    "ValueFormat",
    "check_supported",
    "decode_layer",
    "decode_policy",
    "encode_planes",
    "expect_shape",
    "expected_shapes",
    "load_network",
    "prepare",
    "read_epd",
    "read_pgn",
    "san_to_uci",
    "read_net",
]
