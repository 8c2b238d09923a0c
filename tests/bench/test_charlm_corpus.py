"""Unit tests of the charlm workload's corpus (Python's stdlib source: deterministic, disjoint
split) and model (a character transformer: size, shapes, causality, batches). No root, no
processes; a few seconds."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from bench.cluster import charlm, corpus

# ---------------------------------------------------------------------------------------------
# corpus


@pytest.fixture(scope="module")
def stdlib_corpus() -> corpus.Corpus:
    return corpus.build()


def test_corpus_is_the_same_every_time(stdlib_corpus):
    again = corpus.build()
    assert corpus.fingerprint(again) == corpus.fingerprint(stdlib_corpus)
    assert again.train_files == stdlib_corpus.train_files
    assert again.val_files == stdlib_corpus.val_files


def test_corpus_split_is_disjoint_and_follows_the_rule(stdlib_corpus):
    train, val = set(stdlib_corpus.train_files), set(stdlib_corpus.val_files)
    assert train and val and not train & val
    assert all(corpus.is_validation(f) for f in val)
    assert not any(corpus.is_validation(f) for f in train)
    # files are taken in name order, from the stdlib's top level only
    assert list(stdlib_corpus.train_files) == sorted(stdlib_corpus.train_files)
    assert all((corpus.stdlib_dir() / f).is_file() for f in train | val)


def test_corpus_sizes_and_vocabulary(stdlib_corpus):
    assert stdlib_corpus.train.dtype == np.uint8 and stdlib_corpus.val.dtype == np.uint8
    assert len(stdlib_corpus.train) == corpus.TRAIN_BYTES
    assert len(stdlib_corpus.val) == corpus.VAL_BYTES
    assert int(stdlib_corpus.train.max()) < corpus.VOCAB
    assert int(stdlib_corpus.val.max()) < corpus.VOCAB


def test_corpus_text_is_the_files_text(stdlib_corpus):
    first = (corpus.stdlib_dir() / stdlib_corpus.train_files[0]).read_bytes()
    n = min(len(first), 4096)
    np.testing.assert_array_equal(stdlib_corpus.train[:n], corpus.encode(first[:n]))


def test_split_rule_is_a_hash_of_the_name():
    for name in ("os.py", "abc.py", "zipfile.py"):
        want = hashlib.sha256(name.encode()).digest()[0] < corpus.VAL_HASH_BELOW
        assert corpus.is_validation(name) is want
    # about 10% of names go to validation
    share = sum(corpus.is_validation(f"m{i}.py") for i in range(5000)) / 5000
    assert 0.08 < share < 0.12


def test_build_on_a_given_directory(tmp_path):
    names = [f"mod{i:03d}.py" for i in range(60)]
    for i, n in enumerate(names):
        (tmp_path / n).write_bytes(f"# {n}\nx = {i}\n".encode() * 50)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "inner.py").write_text("never read\n")
    c = corpus.build(tmp_path, train_bytes=5000, val_bytes=500)
    assert set(c.train_files) | set(c.val_files) <= set(names)
    assert corpus.fingerprint(c) == corpus.fingerprint(corpus.build(tmp_path, 5000, 500))
    with pytest.raises(ValueError, match="asked for"):
        corpus.build(tmp_path, train_bytes=10**7, val_bytes=500)
    with pytest.raises(ValueError, match=">= 1"):
        corpus.build(tmp_path, train_bytes=0)


def test_encode_maps_non_ascii_to_one_token():
    got = corpus.encode("aé\x7f\n".encode())
    assert got.tolist() == [ord("a"), corpus.OTHER, corpus.OTHER, corpus.OTHER, ord("\n")]


def test_save_writes_tokens_and_fingerprint(tmp_path, stdlib_corpus):
    corpus.save(stdlib_corpus, tmp_path / "c.npz")
    d = np.load(tmp_path / "c.npz")
    np.testing.assert_array_equal(d["val"], stdlib_corpus.val)
    assert str(d["fingerprint"]) == corpus.fingerprint(stdlib_corpus)


# ---------------------------------------------------------------------------------------------
# model


def test_default_model_size():
    m = charlm.CharTransformer()
    n = sum(p.numel() for p in m.parameters())
    assert n == 1_230_976
    # per block 12 w^2 + 13 w; embeddings, final norm and head around them
    w, layers, vocab, ctx = 128, 6, 128, 64
    assert n == layers * (12 * w * w + 13 * w) + vocab * w + ctx * w + 2 * w + w * vocab + vocab


def test_model_shapes_loss_and_causality():
    torch.manual_seed(0)
    m = charlm.CharTransformer(width=32, layers=2, heads=4, context=16)
    x = torch.randint(0, 128, (3, 17))
    assert m(x[:, :-1]).shape == (3, 16, 128)
    # untrained: the loss is about ln(vocabulary)
    assert abs(charlm.lm_loss(m, x).item() - math.log(128)) < 0.5
    # a later token does not change earlier logits
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 128
    torch.testing.assert_close(m(x[:, :10]), m(y[:, :10]))
    with pytest.raises(ValueError, match="longer than the context"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_windows_are_seeded_and_fixed():
    tokens = np.arange(1000, dtype=np.uint8) % 128
    a = charlm.sample_windows(tokens, 16, 5, torch.Generator().manual_seed(3))
    b = charlm.sample_windows(tokens, 16, 5, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    w = charlm.gather_windows(torch.from_numpy(tokens), a, 16)
    assert w.shape == (5, 17) and w.dtype == torch.long
    assert torch.equal(w[:, 0], torch.from_numpy(tokens)[a].long())
    v = charlm.validation_windows(tokens, 16, 4)
    assert torch.equal(v, charlm.validation_windows(tokens, 16, 4))
    assert v[0, 0] == 0 and v[-1, -1] == tokens[len(tokens) - 1]
