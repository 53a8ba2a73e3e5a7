"""A user's first five minutes: what the README's first steps meet, on a machine without a GPU.

Every bad ``device=``/``dtype=`` is refused in fusedenc's words before anything is allocated
(``device.check_device`` / ``check_dtype``); an interpreter exits quietly with fusedenc modules
alive; fusedenc's modules are inference-only on every device (eval mode from birth, refused in
training mode, outputs without autograd history); a net to try comes from
``python -m fusedenc.lc0 synth`` (``fusedenc.lc0.writer``, which also writes given weights);
the CLIs print usage, exit 2 on unknown arguments, name a bad file once, and time a net on the
CPU saying what CPU numbers are.  Each test also runs on a GPU machine (asserting the GPU's
side where the two differ).
"""

from __future__ import annotations

import gc
import gzip
import os
import subprocess
import sys

import lc0_writer
import pytest
import torch
import torch.nn as nn

import fusedenc
import fusedenc.__main__ as status_cli
import fusedenc.lc0.__main__ as lc0_cli
from fusedenc import EncoderBlock, EncoderStack
from fusedenc.lc0 import Evaluator, Lc0Network, load_network, read_net, writer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = torch.cuda.is_available()
ACCEPTED = r"torch\.float16, torch\.bfloat16 or torch\.float32"


@pytest.fixture(scope="module")
def net_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("net") / "tiny.pb.gz")
    writer.write_preset(path, "tiny", seed=11)
    return path


def _block(**kw):
    return EncoderBlock(64, 4, 128, **kw)


def _stack(**kw):
    return EncoderStack.build(2, 64, 4, 128, **kw)


# ------------------------------------------------------------ device= and dtype= ----

CONSTRUCTORS = {
    "EncoderBlock": lambda path, **kw: _block(**kw),
    "EncoderStack.build": lambda path, **kw: _stack(**kw),
    "load_network": lambda path, **kw: load_network(path, **kw),
    "Lc0Network": lambda path, **kw: Lc0Network(read_net(path), **kw),
}


@pytest.mark.parametrize("make", CONSTRUCTORS.values(), ids=CONSTRUCTORS.keys())
@pytest.mark.parametrize(
    "device, error, message",
    [
        ("gpu", ValueError, r"^device='gpu' is not a device \(cuda, cuda:N or cpu\)"),
        ("mps", ValueError, r"^device='mps' is a 'mps' device: fusedenc runs on cuda .* and cpu only"),
        (torch.device("meta"), ValueError, r"is a 'meta' device"),
        ("cuda:99", ValueError, r"^device='cuda:99' (names GPU 99, but torch sees \d+ GPU|asks for a GPU, but torch sees no GPU)"),
        ([0], TypeError, r"^device must be a str \('cuda', 'cuda:N', 'cpu'\), an int or a torch\.device, got list"),
    ],
    ids=["word", "mps", "meta", "index", "list"],
)
def test_a_bad_device_is_refused_in_fusedenc_words(make, device, error, message, net_path):
    with pytest.raises(error, match=message):
        make(net_path, device=device, dtype=torch.float32)


@pytest.mark.parametrize("make", CONSTRUCTORS.values(), ids=CONSTRUCTORS.keys())
def test_cuda_without_a_gpu_says_how_to_ask_for_the_cpu(make, net_path):
    if GPU:  # the same call runs there
        assert make(net_path, device="cuda", dtype=torch.float16) is not None
        return
    with pytest.raises(ValueError, match=r"^device='cuda' asks for a GPU, but torch sees no GPU.*pass device='cpu' "
                                         r"\(with dtype=torch\.float32"):  # fmt: skip
        make(net_path, device="cuda", dtype=torch.float16)


def test_load_network_defaults_without_a_gpu(net_path):
    """``load_network(path)``: fp16 on the GPU; without one, a ValueError saying what to pass
    (not torch's "Torch not compiled with CUDA enabled" from deep inside)."""
    if GPU:
        assert load_network(net_path).preproc.weight.is_cuda
        return
    with pytest.raises(ValueError, match=r"device='cuda' asks for a GPU.*device='cpu'"):
        load_network(net_path)


@pytest.mark.parametrize("make", CONSTRUCTORS.values(), ids=CONSTRUCTORS.keys())
@pytest.mark.parametrize(
    "dtype, message",
    [
        (torch.int32, rf"^dtype=torch\.int32 is not supported: fusedenc runs {ACCEPTED}$"),
        (torch.float64, rf"^dtype=torch\.float64 is not supported: fusedenc runs {ACCEPTED}$"),
        ("float16", r"^dtype='float16' is a string: pass a torch\.dtype \(dtype=torch\.float16\)$"),
        ("fp16", r"^dtype='fp16' is a string: pass a torch\.dtype \(dtype=torch\.float16\)$"),
        ("bf16", r"^dtype='bf16' is a string: pass a torch\.dtype \(dtype=torch\.bfloat16\)$"),
        ("float32", r"^dtype='float32' is a string: pass a torch\.dtype \(dtype=torch\.float32\)$"),
        ("float64", rf"^dtype='float64' is a string: pass a torch\.dtype \({ACCEPTED}\)$"),
        (3, rf"^dtype must be a torch\.dtype \({ACCEPTED}\), got int 3$"),
    ],
    ids=["int32", "float64", "float16-str", "fp16-str", "bf16-str", "float32-str", "float64-str", "int"],
)
def test_a_bad_dtype_is_refused_in_fusedenc_words(make, dtype, message, net_path):
    with pytest.raises(TypeError, match=message):
        make(net_path, device="cpu", dtype=dtype)


def test_dtype_arguments_are_checked_before_the_file_is_read_and_by_the_evaluator(net_path):
    with pytest.raises(TypeError, match=r"dtype='float32' is a string"):
        load_network("/nonexistent/net.pb.gz", device="cpu", dtype="float32")
    with pytest.raises(TypeError, match=r"dtype='fp16' is a string.*torch\.float16"):
        Evaluator(net_path, devices="cpu", dtype="fp16")
    with pytest.raises(TypeError, match=r"^dtype=None: pass a torch\.dtype"):
        load_network(net_path, device="cpu", dtype=None)


def test_the_default_dtype_is_checked_where_dtype_is_none():
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(TypeError, match=r"dtype=None means torch's default dtype, torch\.float64"):
            _block()
    finally:
        torch.set_default_dtype(saved)
    assert _block().qkv_weight.dtype == saved


def test_from_torch_names_the_layers_dtype():
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).double().eval()
    with pytest.raises(TypeError, match=rf"^layer's weights are torch\.float64: fusedenc runs {ACCEPTED}"):
        EncoderBlock.from_torch(layer)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    with pytest.raises(TypeError, match=r"^encoder\.layers\[0\]'s weights are torch\.float64"):
        EncoderStack.from_torch(encoder)


# ------------------------------------------------------------ block-level input messages ----


@pytest.mark.parametrize("make", [_block, _stack], ids=["block", "stack"])
def test_input_errors_speak_of_the_blocks_input(make):
    """The attention op's checks name its ``q``; a block's caller passed ``x``."""
    m = make(dtype=torch.float16, device="cpu")
    x = torch.randn(2, 8, 64, dtype=torch.float16)
    bad = {
        "bias dtype": (dict(attn_bias=torch.zeros(2, 4, 8, 8, dtype=torch.bfloat16)), TypeError,
                       r"^attn_bias\.dtype=torch\.bfloat16: pass it in the block's dtype \(torch\.float16\) or torch\.float32$"),
        "bias device": (dict(attn_bias=torch.zeros(2, 4, 8, 8, dtype=torch.float16, device="meta")), ValueError,
                        r"^attn_bias is on meta but x is on cpu$"),
        "mask device": (dict(key_padding_mask=torch.zeros(2, 8, dtype=torch.bool, device="meta")), ValueError,
                        r"^key_padding_mask is on meta but x is on cpu$"),
    }  # fmt: skip
    for kwargs, error, message in bad.values():
        with pytest.raises(error, match=message):
            m(x, **kwargs)
    f32 = make(device="cpu")
    with pytest.raises(TypeError, match=r"^attn_bias\.dtype=torch\.float64: pass it in torch\.float32$"):
        f32(x.float(), attn_bias=torch.zeros(2, 4, 8, 8, dtype=torch.float64))


# ------------------------------------------------------------ quiet exit ----

EXIT_SCRIPT = """
import torch
from fusedenc import EncoderBlock, EncoderStack
block = EncoderBlock(64, 4, 128)
stack = EncoderStack.build(2, 64, 4, 128)
try:
    block(torch.randn(2, 8, 64, dtype=torch.float16))
except TypeError as exc:
    caught = exc
    print("caught:", exc)
"""


def test_the_interpreter_exits_quietly_with_modules_alive(tmp_path):
    """A caught fusedenc TypeError and module-level blocks: exit used to print "Exception
    ignored in: <function WeakMethod...> ... '_alive'" from the compiled-graph registry."""
    script = tmp_path / "user.py"
    script.write_text(EXIT_SCRIPT, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("caught: x.dtype=torch.float16 does not match"), proc.stdout
    assert proc.stderr == ""


def test_the_compiled_graph_registry_finds_live_modules_and_forgets_dead_ones():
    block = _block()
    rows = torch.randn(16, 64)
    with torch.no_grad():
        want = block(rows, seq_len=8)
    handle = block._handle
    got = torch.ops.fusedenc.encoder_rows(rows, handle, 2, 8, None, None)
    assert torch.equal(got, want)
    del block
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.fusedenc.encoder_rows(rows, handle, 2, 8, None, None)


# ------------------------------------------------------------ inference only ----


@pytest.mark.parametrize("make", [_block, _stack], ids=["block", "stack"])
def test_outputs_never_carry_autograd_history(make):
    m = make()
    for p in m.parameters():
        p.requires_grad_(True)  # even so
    x = torch.randn(2, 8, 64, requires_grad=True)
    with torch.enable_grad():
        out = m(x)
    assert out.grad_fn is None and not out.requires_grad
    with pytest.raises(RuntimeError):
        out.sum().backward()
    assert torch.is_grad_enabled()  # the module's no_grad did not leak out


def test_functional_ops_carry_no_autograd_history():
    """``linear``, ``fused_qkv`` and ``layer_norm`` on inputs that require grad (the reference
    path on a CPU): results without history, and grad mode left as it was."""
    x = torch.randn(2, 8, 64, requires_grad=True)
    w, b = torch.randn(192, 64, requires_grad=True), torch.randn(192, requires_grad=True)
    g, beta = torch.ones(64, requires_grad=True), torch.zeros(64, requires_grad=True)
    with torch.enable_grad():
        outs = [fusedenc.linear(x, w[:64], b[:64], "relu"), *fusedenc.fused_qkv(x, w, b, num_heads=4),
                fusedenc.layer_norm(x, g, beta, 1e-5)]  # fmt: skip
        assert torch.is_grad_enabled()
    assert all(t.grad_fn is None and not t.requires_grad for t in outs)


def test_a_patched_hf_model_short_path_carries_no_autograd_history():
    """A patched BERT's plain call (the short path: fusedenc's embeddings, layers and the
    pooler in one function) returns no history even with grad mode on; HF's own forward
    (asked for hidden states) keeps its pooler's, as documented."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  num_hidden_layers=2, vocab_size=100)  # fmt: skip
    model = fusedenc.patch_hf(transformers.BertModel(cfg).eval())
    ids = torch.randint(1, 100, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.enable_grad():
        for m in (mask, None):
            out = model(input_ids=ids, attention_mask=m)
            assert out.last_hidden_state.grad_fn is None and out.pooler_output.grad_fn is None
        assert fusedenc.sentence_embeddings(model, ids, mask).grad_fn is None
        hf = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        assert hf.last_hidden_state.grad_fn is None and hf.pooler_output.grad_fn is not None
        assert torch.is_grad_enabled()


@pytest.mark.parametrize("make", [_block, _stack], ids=["block", "stack"])
def test_training_mode_is_refused_when_called(make):
    m = make()
    assert not any(mod.training for mod in m.modules())  # made in eval mode
    x = torch.randn(2, 8, 64)
    want = m(x)
    m.train()
    with pytest.raises(RuntimeError, match=r"is inference-only \(no dropout, no autograd\) and is in training mode: "
                                           r"call \.eval\(\)"):  # fmt: skip
        m(x)
    m.eval()
    assert torch.equal(m(x), want)


def test_an_lc0_net_is_inference_only_too(net_path):
    """Made in eval mode; ``net.train()`` then a call is refused as a block's is; no autograd."""
    net = load_network(net_path, device="cpu", dtype=torch.float32)
    assert not any(mod.training for mod in net.modules())
    planes = torch.rand(2, 112, 8, 8)
    with torch.enable_grad():
        want = net(planes)
    assert all(t.grad_fn is None and not t.requires_grad for t in want.values())
    net.train()
    with pytest.raises(RuntimeError, match=r"Lc0Network is inference-only \(no dropout, no autograd\) and is in "
                                           r"training mode: call \.eval\(\)"):  # fmt: skip
        net(planes)
    net.eval()
    got = net(planes)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_stack_puts_the_blocks_it_is_given_in_eval_mode():
    blocks = [_block(), _block()]
    blocks[0].train()
    stack = EncoderStack(blocks)
    assert not stack.training and not any(b.training for b in stack.blocks)
    stack.train()
    with pytest.raises(RuntimeError, match="EncoderBlock is inference-only"):
        stack.blocks[0](torch.randn(2, 8, 64))


def test_from_torch_refuses_training_mode_with_dropout():
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)  # torch's default: training mode
    with pytest.raises(ValueError, match=r"^layer is in training mode with dropout 0\.1: .*call layer\.eval\(\) before"):
        EncoderBlock.from_torch(layer)
    with pytest.raises(ValueError, match=r"^encoder\.layers\[1\] is in training mode with dropout 0\.1"):
        EncoderStack.from_torch(_one_trained(layer))
    block = EncoderBlock.from_torch(layer.eval())
    assert not block.training
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        assert torch.allclose(block(x), layer(x), atol=1e-5)
    no_dropout = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)  # training mode, same math
    assert not EncoderBlock.from_torch(no_dropout).training


def _one_trained(layer: nn.TransformerEncoderLayer) -> nn.TransformerEncoder:
    """An encoder whose second layer alone is in training mode (the message names it)."""
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    encoder.layers[1].train()
    return encoder


# ------------------------------------------------------------ the writer ----


def test_the_writer_is_the_package_s_and_the_tests_re_export_it():
    for name in ("build_net", "encode_net", "write_net", "write_preset", "PRESETS", "weight_shapes"):
        assert getattr(lc0_writer, name) is getattr(writer, name)


def _decoded(data: bytes, tmp_path, name: str):
    path = tmp_path / name
    path.write_bytes(data)
    return read_net(str(path))


def test_build_net_writes_given_weights(tmp_path):
    spec = dict(writer.PRESETS["tiny"], layers=1, encoding="FLOAT32")
    _, random_values = writer.build_net(**spec, seed=1)
    shapes = writer.weight_shapes(**spec)
    assert shapes == {k: tuple(v.shape) for k, v in random_values.items()}
    d, e = spec["d_model"], spec["embedding_dense"]
    assert shapes["weights.ip_emb_w"] == (d, 112 + e) and shapes["weights.encoder[0].mha.q_w"] == (d, d)
    given = {k: (torch.randn(s, generator=torch.Generator().manual_seed(i)) * 0.1).to(torch.float16)
             for i, (k, s) in enumerate(shapes.items())}  # fmt: skip  (any float dtype: written as float32)
    net_a, values = writer.build_net(**spec, seed=2, weights=given)
    net_b, _ = writer.build_net(**spec, seed=3, weights=given)
    data = writer.encode_net(net_a)
    assert data == writer.encode_net(net_b)  # the seed draws nothing when weights are given
    assert net_a["license"] == writer.GIVEN_LICENSE != writer.RANDOM_LICENSE
    file = _decoded(data, tmp_path, "given.pb.gz")
    for path, t in given.items():
        assert values[path].dtype == torch.float32 and torch.equal(values[path], t.float())
        assert torch.equal(file.get(path).reshape(t.shape), t.float()), path
    net = Lc0Network(file, dtype=torch.float32, device="cpu")
    out = net(lc0_writer.random_planes(3, torch.Generator().manual_seed(0)))
    assert torch.isfinite(out["policy"]).all()


def test_build_net_refuses_wrong_weights_naming_every_problem():
    spec = dict(writer.PRESETS["tiny"], layers=1)
    shapes = writer.weight_shapes(**spec)
    good = {k: torch.zeros(s) for k, s in shapes.items()}
    bad = dict(good)
    del bad["weights.encoder[0].mha.q_w"]
    bad["weights.encoder[1].mha.q_w"] = torch.zeros(64, 64)
    bad["weights.ip_emb_w"] = torch.zeros(3, 3)
    bad["weights.ip_emb_b"] = torch.zeros(64, dtype=torch.int64)
    bad["weights.ip_emb_ln_betas"] = torch.full((64,), float("nan"))
    with pytest.raises(ValueError) as info:
        writer.build_net(**spec, weights=bad)
    msg = str(info.value)
    for part in ("missing (1): 'weights.encoder[0].mha.q_w'", "not a weight of this net (1): 'weights.encoder[1].mha.q_w'",
                 f"'weights.ip_emb_w' has shape (3, 3), expected {shapes['weights.ip_emb_w']}",
                 "'weights.ip_emb_b' is a torch.int64 tensor, not a floating-point tensor",
                 "'weights.ip_emb_ln_betas' holds NaN or infinite values", "weight_shapes"):  # fmt: skip
        assert part in msg, msg
    with pytest.raises(TypeError, match="^weights must be a mapping"):
        writer.build_net(**spec, weights=[torch.zeros(1)])
    with pytest.raises(TypeError):
        writer.weight_shapes(**spec, no_such_argument=1)
    with pytest.raises(ValueError, match="preset 'huge' is not one of tiny, t82, bt4"):
        writer.write_preset("/nonexistent/x.pb.gz", "huge")


def test_synth_writes_a_random_net_and_says_so(tmp_path, capsys):
    out = str(tmp_path / "try.pb.gz")
    assert lc0_cli.main(["synth", out, "--preset", "tiny", "--seed", "3", "--layers", "1"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out} (") and "RANDOM, untrained tiny-shaped" in said and "1 layers" in said
    ref = str(tmp_path / "ref.pb.gz")
    writer.write_preset(ref, "tiny", seed=3, layers=1)
    with open(out, "rb") as a, open(ref, "rb") as b:
        assert a.read() == b.read()
    assert gzip.decompress(open(out, "rb").read())  # a complete gzip file
    assert read_net(out).describe()["layers"] == 1
    # an existing file is kept unless --force
    assert lc0_cli.main(["synth", out, "--seed", "4"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"python -m fusedenc.lc0 synth: {out} exists (pass --force to overwrite it)"]
    assert lc0_cli.main(["synth", out, "--seed", "4", "--force"]) == 0
    assert read_net(out).describe()["layers"] == writer.PRESETS["tiny"]["layers"]
    assert lc0_cli.main(["synth", str(tmp_path / "no" / "dir.pb.gz")]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["ref.pb.gz", "try.pb.gz"]  # no temporary file left behind
    for argv in (["--layers", "0"], ["--preset", "huge"]):
        with pytest.raises(SystemExit) as info:
            lc0_cli.main(["synth", str(tmp_path / "x.pb.gz"), *argv])
        assert info.value.code == 2
    assert not os.path.exists(tmp_path / "x.pb.gz")


# ------------------------------------------------------------ the CLIs ----


def test_status_cli_help_and_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        status_cli.main(["--help"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m fusedenc")
    with pytest.raises(SystemExit) as info:
        status_cli.main(["--bogus"])
    captured = capsys.readouterr()
    assert info.value.code == 2 and captured.out == ""
    assert captured.err.startswith("usage: python -m fusedenc") and "unrecognized arguments: --bogus" in captured.err
    assert status_cli.main([]) == 0
    assert capsys.readouterr().out.startswith("fusedenc ")


def test_a_bad_file_is_named_once(net_path, tmp_path, capsys):
    data = open(net_path, "rb").read()
    truncated = str(tmp_path / "truncated.pb.gz")
    with open(truncated, "wb") as f:
        f.write(data[: len(data) // 2])
    narrow = str(tmp_path / "narrow.pb.gz")
    writer.write_net(narrow, **{**writer.PRESETS["tiny"], "d_model": 68})  # not a multiple of 8: not run
    for path, words in ((truncated, "truncated gzip"), (narrow, "fusedenc cannot run this net")):
        for argv in ([path, "--no-bench"], ["eval", path, "--fen", "startpos", "--device", "cpu"]):
            assert lc0_cli.main(argv) == 2
            err = capsys.readouterr().err
            assert err.count(os.path.basename(path)) == 1 and words in err, err


def test_describe_times_the_net_on_the_cpu_and_says_what_that_is(net_path, capsys):
    assert lc0_cli.main([net_path, "--batch-sizes", "2"]) == 0
    out = capsys.readouterr().out
    assert "batch     2:" in out
    if GPU:
        assert "fp16 on" in out and "PyTorch reference" not in out
    else:
        assert "no GPU: whole network on the CPU in float32" in out
        assert "CPU numbers time the PyTorch reference ops, not fusedenc's GPU path" in out


def test_bench_lc0_runs_on_the_cpu_and_says_what_that_is(net_path, tmp_path, monkeypatch, capsys):
    """bench/lc0.py --net runs where bench/nps.py --net does (its run_net and report are those
    of nps.py --net too): on the CPU, float32, torch and fusedenc rows, with the CPU note."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import lc0 as lc0_bench  # bench/lc0.py

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = lc0_bench.main(["--net", net_path, "--batch-sizes", "2", "--out-dir", str(tmp_path), "--tag", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no GPU: running on the CPU in float32, torch, fusedenc rows only" in out
    assert lc0_bench.CPU_NOTE in out
    rows = [line.split()[:2] for line in out.splitlines() if line.strip().startswith("2 ")]
    assert rows == [["2", "torch"], ["2", "fusedenc"]], out
