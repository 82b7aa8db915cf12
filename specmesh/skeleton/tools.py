"""The <Search> tool: BM25 retrieval of passages from the documents a request brings (bm25s).

Documents are split into passages (paragraphs; a long paragraph into windows of at most
`max_passage_words` words), indexed once per request, and searched per <Search> point with the
point's title plus the question. Only passages sharing at least one term with the query are
returned: BM25 never pads the prompt with irrelevant text. Without documents there is no index and
`passages_for` returns nothing, so a <Search> point behaves exactly like a <None> point.

Library: bm25s (Lù 2024, "BM25S: Orders of magnitude faster lexical search via eager sparse
scoring"), Lucene's BM25 variant, English stop words removed, no stemming.

>>> index = PassageIndex(["Paris is the capital of France.", "Bread is baked from flour and water."])
>>> [p.text for p in index.search("What is the capital of France?", top_k=2)]
['Paris is the capital of France.']
>>> index.search("zebra")
[]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.skeleton.types import Point, Tool

DEFAULT_MAX_PASSAGE_WORDS = 120
DEFAULT_TOP_K = 3


@dataclass(frozen=True)
class Passage:
    text: str
    document_index: int  # which of the request's documents it came from
    score: float  # BM25 score (> 0)


def split_passages(document: str, max_passage_words: int = DEFAULT_MAX_PASSAGE_WORDS) -> list[str]:
    """Paragraphs (blank-line separated), long ones cut into windows of max_passage_words words.

    >>> split_passages("one two three four five\\n\\nsix", max_passage_words=2)
    ['one two', 'three four', 'five', 'six']
    """
    passages: list[str] = []
    for paragraph in re.split(r"\n\s*\n", document):
        words = paragraph.split()
        passages.extend(" ".join(words[i:i + max_passage_words]) for i in range(0, len(words), max_passage_words))
    return passages


class PassageIndex:
    """A BM25 index over the passages of some documents (built once per request)."""

    def __init__(self, documents: Sequence[str], max_passage_words: int = DEFAULT_MAX_PASSAGE_WORDS):
        import bm25s

        self._bm25s = bm25s
        candidates = [(n, passage) for n, document in enumerate(documents)
                      for passage in split_passages(document, max_passage_words)]
        terms = self._tokenize([text for _, text in candidates]) if candidates else []
        # a passage of stop words only can never score; bm25s cannot index a corpus without terms
        self.passages: list[tuple[int, str]] = [c for c, t in zip(candidates, terms) if t]
        self._retriever = bm25s.BM25()
        if self.passages:
            self._retriever.index([t for t in terms if t], show_progress=False)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def search(self, query: str, top_k: int = DEFAULT_TOP_K) -> list[Passage]:
        """The top_k passages by BM25 score, best first; only those with a positive score."""
        if not self.passages or top_k < 1:
            return []
        terms = self._tokenize([query])[0]
        if not terms:
            return []
        k = min(top_k, len(self.passages))
        indices, scores = self._retriever.retrieve([terms], k=k, show_progress=False)
        return [Passage(self.passages[int(i)][1], self.passages[int(i)][0], float(s))
                for i, s in zip(indices[0], scores[0]) if s > 0]


def passages_for(point: Point, question: str, index: PassageIndex | None, top_k: int = DEFAULT_TOP_K) -> list[Passage]:
    """What a point's prompt gets: nothing for <None> or without documents; else the passages most
    relevant to the point's title and the question."""
    if point.tool is not Tool.SEARCH or index is None:
        return []
    return index.search(f"{point.title} {question}", top_k)
