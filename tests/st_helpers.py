"""Small sentence-transformers models for the CPU tests, built offline: a WordPiece tokenizer
trained in a second on the repository's real sentences, and a two-layer BERT, RoBERTa or
XLM-R model of width 64 with weights drawn from a seed (LayerNorm weights near 1, everything
else small, so that a wrong path shows in every output), wrapped as a SentenceTransformer
with the pooling and normalization asked for."""

from __future__ import annotations

import copy
import functools
import gzip
import pathlib
import warnings

import torch

DATA = pathlib.Path(__file__).resolve().parent / "data" / "real_sentences" / "sentences.txt.gz"
WIDTH = 64


@functools.lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        return tuple(line.strip() for line in f if line.strip())


@functools.lru_cache(maxsize=1)
def _tokenizer():
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] is id 0
    tok.train_from_iterator(sentences()[:3000], trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    return transformers.BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                          cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")  # fmt: skip


def hf_model_dir(root: pathlib.Path, model_type: str, seed: int) -> pathlib.Path:
    """A saved HF model of ``model_type`` and the tokenizer, in ``root / model_type``."""
    import transformers

    path = root / f"{model_type}-{seed}"
    if path.exists():
        return path
    tokenizer = _tokenizer()
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=140, type_vocab_size=2, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModel.from_config(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1.0 + 0.2 * torch.randn(p.shape) if name.endswith("LayerNorm.weight") else 0.2 * torch.randn(p.shape))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sentence_model(path: pathlib.Path, pooling: str = "mean", normalize: bool = True, max_seq_length: int = 128,
                   include_prompt: bool = True):  # fmt: skip
    """A freshly built SentenceTransformer on the CPU (as ``SentenceTransformer(modules=...)``
    leaves it: in training mode)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # sentence_transformers.models: the stable spelling
        from sentence_transformers import SentenceTransformer, models

    modules = [models.Transformer(str(path), max_seq_length=max_seq_length),
               models.Pooling(WIDTH, pooling, include_prompt=include_prompt)]  # fmt: skip
    if normalize:
        modules.append(models.Normalize())
    return SentenceTransformer(modules=modules, device="cpu")


def patched_pair(path: pathlib.Path, **kw):
    """(patched, unpatched) copies of one ``sentence_model``."""
    import fusedenc

    model = sentence_model(path, **kw)
    return fusedenc.patch_hf(copy.deepcopy(model)), model.eval()
