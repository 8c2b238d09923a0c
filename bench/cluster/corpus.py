"""The character-level corpus of the ``charlm`` workload: Python's own standard library.

Every machine with a Python interpreter has this text, so the benchmark needs no download, and
the same interpreter version builds the same bytes everywhere. The rule:

1. files: the ``*.py`` files directly in ``sysconfig.get_paths()["stdlib"]`` (no packages, no
   tests, no site-packages), sorted by file name;
2. split: a file goes to validation when the first byte of ``sha256(file name)`` is below
   ``VAL_HASH_BELOW`` (26/256, about 10% of the files), else to training; a file is wholly on
   one side, so no line of validation text was trained on;
3. size: each side is the concatenation of its files in sorted order, cut at ``train_bytes`` /
   ``val_bytes``;
4. characters: ASCII bytes are their own token (0..126); any other byte (the UTF-8 of a few
   non-English comments) and DEL become token 127. Vocabulary: 128.

The corpus changes with the interpreter's version (the stdlib does), so the result JSON records
the version and a sha256 of both sides (:func:`fingerprint`).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 128
OTHER = 127  # token of every non-ASCII byte (and of DEL, which source files do not contain)
VAL_HASH_BELOW = 26  # first sha256 byte of the file name < 26: validation (26/256 ~ 10%)
TRAIN_BYTES = 2 << 20
VAL_BYTES = 256 << 10


@dataclass(frozen=True)
class Corpus:
    """Token arrays (uint8, values < VOCAB) and the files each side was built from."""

    train: np.ndarray
    val: np.ndarray
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(name: str) -> bool:
    """The split rule: a file name whose sha256 starts with a byte below VAL_HASH_BELOW."""
    return hashlib.sha256(name.encode()).digest()[0] < VAL_HASH_BELOW


def encode(data: bytes) -> np.ndarray:
    """Bytes -> tokens: ASCII stays, everything else becomes OTHER."""
    arr = np.frombuffer(data, dtype=np.uint8).copy()
    arr[arr >= OTHER] = OTHER
    return arr


def _concat(files: list[Path], limit: int) -> tuple[bytes, tuple[str, ...]]:
    parts, used, size = [], [], 0
    for f in files:
        if size >= limit:
            break
        data = f.read_bytes()
        parts.append(data)
        used.append(f.name)
        size += len(data)
    return b"".join(parts)[:limit], tuple(used)


def build(root: Path | None = None, train_bytes: int = TRAIN_BYTES,
          val_bytes: int = VAL_BYTES) -> Corpus:
    """Build the corpus from ``root`` (default: this interpreter's stdlib) by the module rule.

    Raises:
        ValueError: a size < 1, or ``root`` has too little text for the sizes asked.
    """
    if train_bytes < 1 or val_bytes < 1:
        raise ValueError(f"train_bytes and val_bytes must be >= 1, got {train_bytes}, "
                         f"{val_bytes}")
    root = stdlib_dir() if root is None else root
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    train_src, train_files = _concat([f for f in files if not is_validation(f.name)],
                                     train_bytes)
    val_src, val_files = _concat([f for f in files if is_validation(f.name)], val_bytes)
    if len(train_src) < train_bytes or len(val_src) < val_bytes:
        raise ValueError(f"{root} holds {len(train_src)} training and {len(val_src)} validation "
                         f"bytes under the split rule; asked for {train_bytes} and {val_bytes}")
    return Corpus(encode(train_src), encode(val_src), train_files, val_files)


def fingerprint(corpus: Corpus) -> str:
    """sha256 of both token arrays: equal fingerprints, equal corpora."""
    h = hashlib.sha256()
    h.update(corpus.train.tobytes())
    h.update(b"\0val\0")
    h.update(corpus.val.tobytes())
    return h.hexdigest()


def save(corpus: Corpus, path: Path) -> None:
    """npz with ``train``, ``val`` (uint8 tokens) and the fingerprint."""
    np.savez(path, train=corpus.train, val=corpus.val,
             fingerprint=np.array(fingerprint(corpus)))


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/corpus.py is a library of the cluster benchmark (the charlm corpus built "
        "from Python's standard library), imported by compare.py and workloads.py; it runs "
        "nothing. See bench/cluster/README.md."
    )
