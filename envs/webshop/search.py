"""BM25 search over product text with `bm25s`, the index cached on disk per catalog.

WebShop searches with Lucene's BM25 (through pyserini) over each product's title, description,
features and options; this uses `bm25s` (Lucene's BM25 variant, k1=1.5, b=0.75) with English
stop words and the Snowball stemmer, which is close to Lucene's English analyzer. Scores are
computed for the whole catalog and ranked with ties broken by catalog order, so a query's
results are the same in every process.

The index is built once per catalog and saved under `<cache_dir>/bm25-<key>/`, `key` derived
from the product file's sha256 and this module's index recipe; a later process loads it
instead of rebuilding. The folder is written under a temporary name and renamed into place,
so concurrent builders cannot leave a half-written index. If the cache folder is not
writable, the index is kept in memory only (with a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Sequence

import numpy as np

__all__ = ["INDEX_VERSION", "SearchIndex"]

log = logging.getLogger(__name__)

# Bump when the tokenizer, the BM25 parameters or the document text change: it is part of the
# cache key, so that an old index is never loaded for a new recipe.
INDEX_VERSION = "bm25s-lucene-k1.5-b0.75-snowball-en-v1"
_META = "meta.json"


def _bm25s():
    """Imports bm25s without letting it import JAX.

    bm25s imports JAX when it can and runs a JAX op at import time, which starts JAX's thread
    pools; a sandbox server that loads a catalog and then forks workers must not hold those
    threads (forking a multithreaded process can deadlock). JAX only serves bm25s's `retrieve`
    top-k, which this module does not use, so JAX is hidden while bm25s is imported.
    """
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    saved = {name: sys.modules[name] for name in ("jax", "jax.lax") if name in sys.modules}
    sys.modules["jax"] = None  # type: ignore[assignment]  # `import jax` now raises ImportError.
    try:
        import bm25s
    finally:
        sys.modules.pop("jax", None)
        sys.modules.update(saved)
    return bm25s


def _tokenizer():
    import Stemmer

    _bm25s()
    from bm25s.tokenization import Tokenizer

    return Tokenizer(lower=True, stopwords="en", stemmer=Stemmer.Stemmer("english"))


class SearchIndex:
    """A BM25 index over a fixed list of documents; `search` returns document positions."""

    def __init__(self, retriever, tokenizer, num_docs: int):
        self._retriever = retriever
        self._tokenizer = tokenizer
        self.num_docs = num_docs
        self._empty_id = tokenizer.get_vocab_dict().get("")

    @classmethod
    def build(cls, docs: Sequence[str]) -> SearchIndex:
        """Indexes `docs` in memory."""
        bm25s = _bm25s()
        tokenizer = _tokenizer()
        ids = tokenizer.tokenize(list(docs), return_as="ids", show_progress=False)
        retriever = bm25s.BM25(k1=1.5, b=0.75, method="lucene")
        retriever.index(ids, show_progress=False)
        return cls(retriever, tokenizer, len(docs))

    @classmethod
    def build_or_load(cls, docs: Sequence[str], key: str, cache_dir: pathlib.Path) -> SearchIndex:
        """Loads the cached index of these documents, or builds and caches it.

        Args:
            docs: The documents, in catalog order.
            key: Identifies the document set (the product file's sha256).
            cache_dir: Folder for cached indexes.
        """
        digest = hashlib.sha256(f"{INDEX_VERSION}|{key}|{len(docs)}".encode()).hexdigest()[:24]
        folder = cache_dir / f"bm25-{digest}"
        if folder.is_dir():
            try:
                return cls._load(folder, len(docs), digest)
            except Exception as e:  # noqa: BLE001 - a broken cache is rebuilt, not fatal.
                log.warning("Rebuilding the WebShop search index in %s: %s", folder, e)
        index = cls.build(docs)
        try:
            index._save(folder, digest)
        except OSError as e:
            log.warning("Cannot cache the WebShop index in %s (%s); in memory only.", folder, e)
        return index

    @classmethod
    def _load(cls, folder: pathlib.Path, num_docs: int, digest: str) -> SearchIndex:
        bm25s = _bm25s()
        meta = json.loads((folder / _META).read_text())
        if meta.get("digest") != digest or meta.get("num_docs") != num_docs:
            raise ValueError(f"index metadata {meta} does not match ({digest}, {num_docs} docs)")
        retriever = bm25s.BM25.load(str(folder), load_corpus=False, show_progress=False)
        tokenizer = _tokenizer()
        tokenizer.load_vocab(str(folder))
        return cls(retriever, tokenizer, num_docs)

    def _save(self, folder: pathlib.Path, digest: str) -> None:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
        try:
            self._retriever.save(str(tmp), show_progress=False)
            self._tokenizer.save_vocab(str(tmp))
            meta = {"digest": digest, "num_docs": self.num_docs, "version": INDEX_VERSION}
            (tmp / _META).write_text(json.dumps(meta))
            if folder.exists():  # A broken index we failed to load: replace it.
                shutil.rmtree(folder, ignore_errors=True)
            try:
                os.rename(tmp, folder)
            except OSError:
                if not (folder / _META).is_file():  # Not another process winning the race.
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def search(self, query: str, k: int) -> list[int]:
        """Positions of the `k` best documents for `query` (BM25 score > 0), best first."""
        # streaming_tokenize, unlike tokenize, builds no progress bar (whose first use imports
        # multiprocessing: 25 ms in every fresh sandbox). It maps words to the indexed stems'
        # ids; words it has not seen are dropped (it caches their stems, which changes no id).
        ids = next(iter(self._tokenizer.streaming_tokenize([query], update_vocab=False)))
        ids = [i for i in ids if i != self._empty_id]
        if not ids or k <= 0:
            return []
        scores = np.asarray(self._retriever.get_scores(ids), dtype=np.float64)
        hits = np.flatnonzero(scores > 0)
        # Highest score first, ties in document order: the same ranking in every process.
        order = hits[np.lexsort((hits, -scores[hits]))]
        return order[:k].tolist()
