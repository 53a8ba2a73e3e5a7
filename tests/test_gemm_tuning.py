"""GEMM algorithm choice by measurement, without a GPU: the tuning-file loader
(validation, metadata match, one warning per ignored file), the shapes
``tune gemm`` measures, and its refusal to run without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import fusedenc
from fusedenc import core, tune
from fusedenc.common import table_files
from fusedenc.core import gemm_routes, gemm_tuning
from fusedenc.tune import gemm as tune_gemm
from fusedenc.tune import presets

ARCH = "sm90"
HERE = {
    "vendor": "cuda",
    "device_name": "NVIDIA H100 80GB HBM3",
    "multiprocessor_count": 132,
    "library": "cuBLASLt 13.1.0",
    "library_version": 130100,
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "hip": None,
}


def _key(**over):
    key = {
        "m": 16384, "n": 2304, "k": 768, "lda": 768, "ldw": 768, "ldc": 0, "ldd": 2304,
        "dtype": "float16", "activation": "swish", "has_bias": True, "has_residual": False,
        "align_a": 16, "align_w": 16, "align_c": 16, "align_d": 16, "workspace_bytes": 32 << 20,
    }  # fmt: skip
    key.update(over)
    return key


def _file(choices=None, **over) -> dict:
    obj = {
        "schema": gemm_tuning.GEMM_TUNING_SCHEMA,
        "arch": ARCH,
        "source": "test",
        "measured_with": dict(HERE),
        "choices": choices
        if choices is not None
        else [
            {"key": _key(), "index": 3, "candidates": 8, "algo": "algo=21 tile=20"},
            {"key": _key(n=768, ldd=768, activation="none"), "index": 0, "candidates": 8, "algo": "x"},
        ],
    }
    obj.update(over)
    return obj


@pytest.fixture(autouse=True)
def _fresh_loader_state(monkeypatch):
    """Each test starts with no report and no files warned about."""
    monkeypatch.setattr(core, "_tuning_report", [])
    monkeypatch.setattr(gemm_tuning, "_warned", set())
    monkeypatch.setattr(gemm_routes, "_ROUTES", {})


class FakeCore:
    """What load_gemm_tuning needs of the native core."""

    VENDOR = "cuda"
    LIBRARY = "cuBLASLt"

    def __init__(self, version=130100):
        self.version = version
        self.choices: list[dict] = []
        self.cleared = 0

    def library_version(self):
        return self.version

    def clear_gemm_choices(self):
        self.cleared += 1
        self.choices.clear()

    def set_gemm_choice(self, **kw):
        self.choices.append(kw)


@pytest.fixture
def fake_device(monkeypatch):
    """Pretend device 0 is an H100 (sm90) with HERE's metadata."""
    meta = dict(HERE)

    def metadata(library, index):
        return dict(meta, library_version=library["library_version"])

    monkeypatch.setattr(core, "device_arch", lambda device: ARCH)
    monkeypatch.setattr(gemm_tuning, "device_metadata", metadata)
    return meta


def _write(tmp_path, obj) -> str:
    path = tmp_path / f"gemm_{ARCH}.json"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def test_valid_file_installs_its_non_default_choices(tmp_path, monkeypatch, fake_device):
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    path = _write(tmp_path, _file())
    fake = FakeCore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = core.load_gemm_tuning(fake, devices=[0])
    assert report == [{"device": 0, "path": path, "status": "installed", "choices": 1, "triton_routes": 0}]
    assert fake.cleared == 1
    assert len(fake.choices) == 1  # index 0 is what runs anyway: not installed
    c = fake.choices[0]
    assert c["index"] == 3 and c["candidates"] == 8 and c["algo"] == "algo=21 tile=20"
    assert c["device"] == 0 and c["dtype"] == 0 and c["activation"] == fusedenc.ACTIVATIONS.index("swish")
    assert c["m"] == 16384 and c["n"] == 2304 and c["k"] == 768 and c["has_bias"] is True
    assert core.gemm_tuning_report() == report


_TRITON = {"kernel": "triton", "triton_config": [128, 128, 64, 8, 8, 3]}


def test_a_triton_choice_becomes_a_route_instead_of_a_library_choice(tmp_path, monkeypatch, fake_device):
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    # Loading routes needs only that Triton is installed, not Triton itself (the kernel is
    # imported at the first routed launch): pretend it is, so this runs with a CPU torch too.
    monkeypatch.setattr(gemm_routes, "triton_available", lambda: True)
    obj = _file()
    obj["choices"][0].update(_TRITON)  # the swish FFN1 problem, library pick index 3
    path = _write(tmp_path, obj)
    fake = FakeCore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = core.load_gemm_tuning(fake, devices=[0])
    assert report == [{"device": 0, "path": path, "status": "installed", "choices": 0, "triton_routes": 1}]
    assert fake.choices == []  # a routed problem never reaches the library
    key = gemm_routes.RouteKey(0, 16384, 2304, 768, 0, "swish", True)
    assert gemm_routes.routes() == {key: gemm_routes.GemmConfig(128, 128, 64, 8, 8, 3)}
    [listed] = fusedenc.capabilities()["triton_gemm_routes"]
    assert listed["m"] == 16384 and listed["activation"] == "swish" and listed["config"]["block_n"] == 128

    x = torch.empty(16, dtype=torch.float16)
    assert gemm_routes.lookup(x, *key) == gemm_routes.GemmConfig(128, 128, 64, 8, 8, 3)
    assert gemm_routes.lookup(x[1:], *key) is None  # not 16-byte aligned: the library serves it
    assert gemm_routes.lookup(x, *key._replace(m=16383)) is None
    assert gemm_routes.lookup(x, *key._replace(device=1)) is None

    # Reloading a file without Triton choices removes the routes.
    _write(tmp_path, _file())
    core.load_gemm_tuning(fake, devices=[0])
    assert gemm_routes.routes() == {} and len(fake.choices) == 1


def test_triton_choices_without_triton_fall_back_to_the_library_pick_with_one_warning(
    tmp_path, monkeypatch, fake_device
):
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(gemm_routes, "triton_available", lambda: False)
    obj = _file()
    obj["choices"][0].update(_TRITON)
    path = _write(tmp_path, obj)
    fake = FakeCore()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = core.load_gemm_tuning(fake, devices=[0])
        core.load_gemm_tuning(fake, devices=[0])
    ours = [w for w in caught if issubclass(w.category, gemm_tuning.GemmTuningWarning)]
    assert len(ours) == 1 and path in str(ours[0].message) and "triton" in str(ours[0].message)
    assert report[0]["status"] == "installed" and report[0]["triton_routes"] == 0
    assert [c["index"] for c in fake.choices] == [3] and gemm_routes.routes() == {}


def test_sm90_choices_install_only_a_library_pick_that_replaces_the_kernel(tmp_path, monkeypatch, fake_device):
    """Where the Hopper epilogue GEMM serves a problem, tune gemm records whether it stayed
    (nothing to install) or which library candidate beat it (installed, even candidate 0: an
    installed choice is what makes the core skip the sm90 kernel for that problem)."""
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(gemm_routes, "triton_available", lambda: False)
    stays = {"key": _key(), "index": 0, "candidates": 8, "algo": "a", "kernel": "sm90"}
    replaced = {"key": _key(m=8192), "index": 0, "candidates": 8, "algo": "b", "replaces_sm90": True}
    replaced_by_3 = {"key": _key(m=4096), "index": 3, "candidates": 8, "algo": "c", "replaces_sm90": True}
    # Triton won over the sm90 kernel but is not installed here: the sm90 kernel serves it (index 0).
    triton_over_sm90 = {"key": _key(m=2048), "index": 0, "candidates": 8, "algo": "d", **_TRITON}
    _write(tmp_path, _file([stays, replaced, replaced_by_3, triton_over_sm90]))
    fake = FakeCore()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        report = core.load_gemm_tuning(fake, devices=[0])
    assert report[0]["status"] == "installed" and report[0]["choices"] == 2
    assert sorted((c["m"], c["index"]) for c in fake.choices) == [(4096, 3), (8192, 0)]
    assert [gemm_tuning.changes_default(c) for c in (stays, replaced, replaced_by_3, triton_over_sm90)] == [
        False, True, True, True,
    ]  # fmt: skip


def test_missing_file_is_silent(tmp_path, monkeypatch, fake_device):
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    fake = FakeCore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = core.load_gemm_tuning(fake, devices=[0])
    assert report[0]["status"] == "absent" and fake.choices == []


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda o: o["measured_with"].update(device_name="NVIDIA A100-SXM4-80GB"), "device_name"),
        (lambda o: o["measured_with"].update(multiprocessor_count=114), "multiprocessor_count"),
        (lambda o: o["measured_with"].update(library_version=120904), "library_version"),
        (lambda o: o["measured_with"].update(vendor="hip"), "vendor"),
        (lambda o: o.update(schema="fusedenc.gemm-tuning/0"), "schema"),
        (lambda o: o.update(arch="sm80"), "arch"),
        (lambda o: o.pop("measured_with"), "measured_with"),
        (lambda o: o.update(choices={}), "choices must be a list"),
        (lambda o: o["choices"][0].update(index=8), "index"),
        (lambda o: o["choices"][0].update(index=-1), "index"),
        (lambda o: o["choices"][0].update(candidates=0), "candidates"),
        (lambda o: o["choices"][0].update(candidates=1000, index=1), "candidates"),
        (lambda o: o["choices"][0]["key"].pop("lda"), "missing fields"),
        (lambda o: o["choices"][0]["key"].update(extra=1), "unknown fields"),
        (lambda o: o["choices"][0]["key"].update(dtype="float64"), "dtype"),
        (lambda o: o["choices"][0]["key"].update(activation="gelu_erf_x"), "activation"),
        (lambda o: o["choices"][0]["key"].update(align_a=3), "align_a"),
        (lambda o: o["choices"][0]["key"].update(m=0), "key.m"),
        (lambda o: o["choices"][0]["key"].update(has_bias=1), "has_bias"),
        (lambda o: o["choices"][0]["key"].update(has_residual=True), "residual"),
        (lambda o: o["choices"].append(dict(o["choices"][0])), "repeats"),
        (lambda o: o["choices"][0].update(algo=5), "algo"),
        (lambda o: o["choices"][0].update(kernel="cutlass"), "kernel"),
        (lambda o: o["choices"][0].update(kernel="triton"), "triton_config"),
        (lambda o: o["choices"][0].update(kernel="triton", triton_config=[128, 128, 64, 8, 8]), "triton_config"),
        (lambda o: o["choices"][0].update(kernel="triton", triton_config=[128, 96, 64, 8, 8, 3]), "powers of two"),
        (lambda o: o["choices"][0].update(kernel="triton", triton_config=[128, 128, 64, 8, 6, 3]), "powers of two"),
        (lambda o: o["choices"][0].update(kernel="triton", triton_config=[128, 128, 8, 8, 8, 3]), "powers of two"),
        (lambda o: o["choices"][0].update(kernel="triton", triton_config=[128, 128, 64, 8, 8, True]), "positive ints"),
        (lambda o: o["choices"][0].update(kernel="sm90"), "keeps the sm90 kernel"),  # index 3
        (lambda o: o["choices"][0].update(index=0, kernel="sm90", replaces_sm90=True), "keeps the sm90 kernel"),
        (lambda o: o["choices"][0].update(replaces_sm90="yes"), "replaces_sm90"),
        (lambda o: o["choices"][0].update(_TRITON, key=_key(lda=1024)), "dense"),
        (lambda o: o["choices"][0].update(_TRITON, key=_key(align_a=8)), "aligned"),
        (
            lambda o: o["choices"][0].update(_TRITON, key=_key(activation="none", has_residual=True, ldc=2304)),
            "without a residual",
        ),
    ],
)
def test_mismatched_or_malformed_file_is_ignored_with_one_warning(tmp_path, monkeypatch, fake_device, mutate, reason):
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    obj = _file()
    mutate(obj)
    path = _write(tmp_path, obj)
    fake = FakeCore()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = core.load_gemm_tuning(fake, devices=[0])
        core.load_gemm_tuning(fake, devices=[0])  # a second load warns no more
    ours = [w for w in caught if issubclass(w.category, gemm_tuning.GemmTuningWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert path in str(ours[0].message) and reason in str(ours[0].message), str(ours[0].message)
    assert report[0]["status"].startswith("ignored:") and reason in report[0]["status"]
    assert fake.choices == []  # nothing installed


@pytest.mark.parametrize("text", ["{", "[]", "null", '{"schema": 1}', ""])
def test_corrupt_json_is_ignored_with_one_warning(tmp_path, monkeypatch, fake_device, text):
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    path = _write(tmp_path, text)
    fake = FakeCore()
    with pytest.warns(gemm_tuning.GemmTuningWarning, match="ignoring GEMM tuning file") as record:
        core.load_gemm_tuning(fake, devices=[0])
    assert len(record) == 1 and path in str(record[0].message)
    assert fake.choices == []


def test_other_library_version_of_the_core_is_a_mismatch(tmp_path, monkeypatch, fake_device):
    """The metadata compared is the core's library version, not only the file's claim."""
    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))
    _write(tmp_path, _file())
    fake = FakeCore(version=130200)
    with pytest.warns(gemm_tuning.GemmTuningWarning, match="library_version"):
        report = core.load_gemm_tuning(fake, devices=[0])
    assert report[0]["status"].startswith("ignored") and fake.choices == []


def test_explicit_path_and_two_devices_share_one_parse(tmp_path, monkeypatch, fake_device):
    path = _write(tmp_path, _file())
    fake = FakeCore()
    report = core.load_gemm_tuning(fake, devices=[0, 1], path=path)
    assert [r["status"] for r in report] == ["installed", "installed"]
    assert sorted(c["device"] for c in fake.choices) == [0, 1]


def test_key_round_trip():
    core_key = dict(_key(), dtype=1, activation=fusedenc.ACTIVATIONS.index("mish"), device=3)
    file_key = gemm_tuning.key_from_core(core_key)
    assert file_key["dtype"] == "bfloat16" and file_key["activation"] == "mish" and "device" not in file_key
    assert list(file_key) == list(gemm_tuning.GEMM_KEY_FIELDS)
    back = gemm_tuning.key_to_core(file_key, 3)
    assert back == core_key


def test_start_up_loading_is_skipped_without_a_gpu_or_when_disabled(monkeypatch):
    calls = []
    monkeypatch.setattr(core, "load_gemm_tuning", lambda module: calls.append(module))
    fake = FakeCore()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    core.load_gemm_tuning_at_start(fake)
    assert calls == []  # no GPU: no device queries, no file
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(core.GEMM_TUNING_ENV, "off")
    core.load_gemm_tuning_at_start(fake)
    assert calls == []
    monkeypatch.delenv(core.GEMM_TUNING_ENV)
    core.load_gemm_tuning_at_start(fake)
    assert calls == [fake]


def test_start_up_loading_never_raises(monkeypatch):
    def boom(module):
        raise RuntimeError("device query failed")

    monkeypatch.setattr(core, "load_gemm_tuning", boom)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(gemm_tuning.GemmTuningWarning, match="device query failed"):
        core.load_gemm_tuning_at_start(FakeCore())


def test_reports_without_a_gpu():
    assert isinstance(fusedenc.gemm_choices(), list)
    caps = fusedenc.capabilities()
    assert isinstance(caps["gemm_tuning"], list)
    if not torch.cuda.is_available():
        assert fusedenc.gemm_choices() == [] and caps["gemm_tuning"] == []


# ------------------------------------------------------------ the tuner ----


def test_block_gemms_follow_the_encoder_data_path():
    t82 = presets.PRESETS["t82"]
    post = presets.block_gemms(t82, 16)
    assert [(p.name, p.m, p.n, p.k, p.bias, p.activation, p.residual) for p in post] == [
        ("qkv", 1024, 2304, 768, True, "none", False),
        ("out_proj", 1024, 768, 768, True, "none", False),
        ("ffn1", 1024, 2304, 768, True, "swish", False),
        ("ffn2", 1024, 768, 2304, True, "none", False),
    ]
    assert all(p.alpha == 1.0 for p in post)
    pre = presets.block_gemms(t82, 16, norm_first=True)
    assert not pre[1].bias and pre[3].residual and pre[3].alpha == pytest.approx(30**-0.25)
    bt4, bert = presets.PRESETS["bt4"], presets.PRESETS["bert-base"]
    assert (bt4.d_model, bt4.d_ff, bt4.activation, bt4.seq_lens[0]) == (1024, 1536, "mish", 64)
    assert (bert.d_model, bert.d_ff, bert.activation, bert.seq_lens[0]) == (768, 3072, "gelu", 128)
    assert presets.block_gemms(bert, 2)[0].m == 256
    assert presets.block_gemms(bert, 2, seq_len=512)[0].m == 1024


def _parse(argv):
    parser = __import__("argparse").ArgumentParser()
    tune_gemm.add_arguments(parser)
    return parser.parse_args(argv)


def test_gemm_argument_parsing():
    a = _parse(["--preset", "t82,bt4", "--batch-sizes", "16,256", "--candidates", "4", "--dtype", "bfloat16"])
    assert a.preset == ["t82", "bt4"] and a.batch_sizes == [16, 256] and a.candidates == 4
    assert a.dtype == ["bfloat16"] and a.min_gain == 0.02 and a.reps >= 20 and a.out is None
    d = _parse([])
    assert d.preset is None and d.batch_sizes is None and d.candidates is None and not d.norm_first
    assert not d.no_triton and _parse(["--no-triton"]).no_triton
    for bad in (["--preset", "gpt2"], ["--batch-sizes", "0"], ["--batch-sizes", "x"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            _parse(bad)


@pytest.mark.parametrize("old_file", ["same-setup", "other-setup", "corrupt", "other-arch", "none", "replace"])
def test_tune_gemm_keeps_old_choices_only_from_a_valid_file_of_this_setup(old_file, tmp_path):
    path = tmp_path / "gemm_sm90.json"
    kept = {"key": _key(m=64), "index": 1, "candidates": 8, "algo": "old, other problem"}
    replaced = {"key": _key(), "index": 5, "candidates": 8, "algo": "old, same problem"}
    if old_file in ("same-setup", "replace"):
        path.write_text(json.dumps(_file([kept, replaced])))
    elif old_file == "other-setup":
        path.write_text(json.dumps(_file([kept, replaced], measured_with=dict(HERE, library_version=130000))))
    elif old_file == "corrupt":
        path.write_text(json.dumps(_file([kept, dict(replaced, index=9)])))  # index >= candidates
    elif old_file == "other-arch":
        path.write_text(json.dumps(_file([kept, replaced], arch="sm80")))
    new = [{"key": _key(), "index": 2, "candidates": 8, "algo": "new"}]
    merged = tune_gemm.merge_gemm_file(str(path), ARCH, dict(HERE), new, replace=old_file == "replace")
    assert merged["measured_with"] == HERE and merged["arch"] == ARCH
    assert merged["choices"] == (new + [kept] if old_file == "same-setup" else new)
    # what the tuner writes is what the loader accepts
    assert gemm_tuning.parse_gemm_tuning(json.dumps(merged), ARCH) == (HERE, merged["choices"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_tune_gemm_without_gpu_exits_2(tmp_path):
    env = dict(os.environ, FUSEDENC_CONFIG_DIR=str(tmp_path))
    r = subprocess.run(
        [sys.executable, "-m", "fusedenc.tune", "gemm", "--preset", "t82", "--batch-sizes", "16"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "fusedenc.tune gemm" in r.stderr and "no CUDA/ROCm GPU" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # wrote nothing
    assert tune.main.__module__ == "fusedenc.tune" and "gemm" in tune.SUBCOMMANDS
