"""The project's GPT in Hugging Face's folder layout: config.json and model.safetensors, a tied
head stored once, read back to the same logits; files of another model or shape are one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from structured_attention.models import GPT, GPTConfig


@pytest.mark.parametrize("attention,tie", [("mha", True), ("mlr:8|4|4", False), ("bilinear_btt:1", True)])
def test_save_and_load_pretrained_give_the_same_logits(tmp_path, attention, tie):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention=attention,
                          tie_embeddings=tie)).eval()
    model.save_pretrained(tmp_path / "gpt")
    assert sorted(p.name for p in (tmp_path / "gpt").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "gpt" / "config.json").read_text())
    assert config["model_type"] == "sattn_gpt" and config["attention"] == attention and config["d_model"] == 32
    with safe_open(tmp_path / "gpt" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers requires of a safetensors file
        assert ("head.weight" in f.keys()) == (not tie)
    loaded = GPT.from_pretrained(tmp_path / "gpt")
    idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded(idx)[0], model(idx)[0])
    assert (loaded.head.weight is loaded.tok_emb.weight) == tie


def test_files_of_another_model_are_one_line(tmp_path):
    model = GPT(GPTConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=2, max_seq_len=16))
    model.save_pretrained(tmp_path / "gpt")
    config_path = tmp_path / "gpt" / "config.json"
    config = json.loads(config_path.read_text())
    cases = [
        ({**config, "model_type": "llama"}, r"config.json: expected model_type 'sattn_gpt', got 'llama'"),
        ({**config, "hidden_size": 64}, r"config.json: expected GPTConfig fields .*, got \['hidden_size'\]"),
        ({**config, "d_model": 48}, r"model.safetensors: expected the tensors of the model config.json describes"),
    ]
    for bad, match in cases:
        config_path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match) as err:
            GPT.from_pretrained(tmp_path / "gpt")
        assert "\n" not in str(err.value)
    config_path.write_text(json.dumps(config))
    save_file({"tok_emb.weight": torch.zeros(40, 32, dtype=torch.float64)}, tmp_path / "gpt" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: expected the tensors"):
        GPT.from_pretrained(tmp_path / "gpt")
    with pytest.raises(FileNotFoundError, match=r"config.json and model.safetensors"):
        GPT.from_pretrained(tmp_path / "nowhere")


# -- a local Hugging Face tokenizer for any corpus (data.tokenizer=hf:PATH) -------------------------
def _documents(folder) -> dict[str, str]:
    folder.mkdir()
    words = ["def", "return", "self", "class", "import", "value", "(", ")", ":", "\n", "    "]
    texts = {}
    for i in range(8):
        text = "".join(words[(i * 7 + j * 3) % len(words)] + " " for j in range(300))
        (folder / f"doc{i}.py").write_text(text)
        texts[f"doc{i}.py"] = text
    return texts


def _tiny_tokenizer(folder, texts):
    """A byte-level BPE of at most 320 tokens trained here (no download), saved as a tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return tok


def test_a_local_tokenizer_folder_tokenises_each_document_alone(tmp_path):
    pytest.importorskip("tokenizers", reason="the [hf] extra is not installed")
    import numpy as np

    from structured_attention.data import load_corpus
    from structured_attention.data.corpus import DOC_SEPARATOR

    texts = _documents(tmp_path / "docs")
    tok = _tiny_tokenizer(tmp_path / "tok", list(texts.values()))
    corpus = load_corpus(tmp_path / "docs", tokenizer=f"hf:{tmp_path / 'tok'}", val_fraction=0.4,
                         cache_dir=tmp_path / "cache")
    assert corpus.vocab_size == tok.get_vocab_size() and corpus.tokenizer.name.startswith("hf:")
    for split, names in (("train", corpus.meta["train_documents"]), ("val", corpus.meta["val_documents"])):
        pieces = [tok.encode(texts[name], add_special_tokens=False).ids for name in names]
        separator = tok.encode(DOC_SEPARATOR, add_special_tokens=False).ids
        expected = sum((p + (separator if i < len(pieces) - 1 else []) for i, p in enumerate(pieces)), [])
        starts = np.cumsum([0] + [len(p) + len(separator) for p in pieces[:-1]])
        assert np.array_equal(np.asarray(getattr(corpus, split)), expected)
        assert np.array_equal(getattr(corpus, f"{split}_document_starts"), starts)
        assert corpus.tokenizer.decode(pieces[0]) == texts[names[0]]
    again = load_corpus(tmp_path / "docs", tokenizer=f"hf:{tmp_path / 'tok' / 'tokenizer.json'}", val_fraction=0.4,
                        cache_dir=tmp_path / "cache")
    assert again.path == corpus.path  # the same tokenizer file: the same cache, whichever path names it


def test_a_document_the_tokenizer_encodes_to_nothing_is_left_out(tmp_path):
    """A whitespace-only file under a word-level tokenizer encodes to no tokens: it is left out of
    the document starts (it ended in an OSError blaming cache_dir, the shards rewritten each time)."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers

    from structured_attention.data import load_corpus

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    for i in range(6):
        (tmp_path / "docs").mkdir(exist_ok=True)
        (tmp_path / "docs" / f"f{i}.txt").write_text("a b a " * (i + 1))
    (tmp_path / "docs" / "blank.txt").write_text("   \n")
    corpus = load_corpus(tmp_path / "docs", tokenizer=f"hf:{tmp_path / 'tok'}", cache_dir=tmp_path / "cache")
    names = corpus.meta["train_documents"] + corpus.meta["val_documents"]
    assert "blank.txt" not in names and len(names) == 6
    for split in ("train", "val"):
        starts = getattr(corpus, f"{split}_document_starts")
        assert len(starts) == len(corpus.meta[f"{split}_documents"]) and np.all(np.diff(starts) > 0)


def test_eval_scores_with_the_checkpoints_tokenizer_after_the_file_changes(tmp_path, capsys):
    """sattn eval encodes the validation text with the tokenizer the model was trained with (the
    checkpoint's): a tokenizer.json changed since gives the same figures, packed documents
    included. It encoded with the new file, re-encoded with the model's as one text, and took the
    bits per byte and document starts of the new file's tokens."""
    pytest.importorskip("tokenizers", reason="the [hf] extra is not installed")
    from structured_attention.cli.main import main

    texts = _documents(tmp_path / "docs")
    _tiny_tokenizer(tmp_path / "tok", list(texts.values()))
    assert main(["train", "lm", f"data.source={tmp_path / 'docs'}", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.val_fraction=0.4", "data.pack_documents=true", f"data.tokenizer=hf:{tmp_path / 'tok'}",
                 "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32", "run.seq_len=32",
                 "run.batch_size=2", "run.steps=2", "run.eval_every=0", "run.eval_batches=1", "run.sample_tokens=0",
                 f"run.out_dir={tmp_path / 'run'}"]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0
    before = capsys.readouterr().out
    (tmp_path / "tok" / "tokenizer.json").unlink()
    (tmp_path / "tok").rmdir()
    _tiny_tokenizer(tmp_path / "tok", [t[::-1] for t in texts.values()])  # other merges: other tokens
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == before.splitlines()[-1]


def test_train_generate_and_bad_paths_with_a_local_tokenizer(tmp_path, capsys):
    pytest.importorskip("tokenizers", reason="the [hf] extra is not installed")
    from structured_attention.cli.main import main

    texts = _documents(tmp_path / "docs")
    _tiny_tokenizer(tmp_path / "tok", list(texts.values()))
    common = [f"data.source={tmp_path / 'docs'}", f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.4",
              "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32", "run.seq_len=32",
              "run.batch_size=2", "run.steps=2", "run.eval_every=0", "run.eval_batches=1", "run.sample_tokens=0",
              f"run.out_dir={tmp_path / 'run'}"]
    assert main(["train", "lm", *common, f"data.tokenizer=hf:{tmp_path / 'tok'}"]) == 0
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["train", "lm", *common, f"data.tokenizer=hf:{tmp_path / 'nowhere'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("sattn train: error: tokenizer: no tokenizer.json")
