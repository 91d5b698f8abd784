"""The eval documents: built from the held-out slice alone, deterministic, and cut where lm-eval's
scoring needs them cut."""

from __future__ import annotations

from flashpack.evals.dataset import DISTRACTORS, DOCUMENT_BYTES, code_documents, held_out_files, next_line_items
from flashpack.runtime.tokenizer import PackTokenizer

FILES = 6


def test_code_documents_are_the_held_out_files_byte_for_byte():
    files = held_out_files(FILES)
    documents = code_documents(files)
    for source in files:
        assert "".join(d["text"] for d in documents if d["path"] == source.path) == source.text
    # a piece over the bound is one line longer than it
    assert all(len(d["text"].encode()) <= DOCUMENT_BYTES or d["text"].count("\n") <= 1 for d in documents)
    assert code_documents(held_out_files(FILES)) == documents  # the same every time


def test_next_line_items_hold_the_true_line_among_distinct_choices():
    files = {source.path: source.text.splitlines(keepends=True) for source in held_out_files(FILES)}
    items = next_line_items(held_out_files(FILES))
    assert items and items == next_line_items(held_out_files(FILES))
    for item in items:
        assert len(item.choices) == DISTRACTORS + 1 and len(set(item.choices)) == len(item.choices)
        assert "".join(files[item.path][: item.line + 1]).endswith(item.context + item.choices[item.gold])
        # every choice: the rest of the line before (shared), then a line at the true line's indentation
        tails, lines = zip(*(choice.split("\n", 1) for choice in item.choices))
        assert len(set(tails)) == 1 and len({line[: len(line) - len(line.lstrip())] for line in lines}) == 1


def test_next_line_items_cut_cleanly(demo_pack):
    """lm-eval scores a choice as the context's tokens then the rest of context + choice's tokens: the
    context's tokens must begin the whole's (no token merged across the cut), or every choice loses
    the merged text. Text holding a marker (`<|endoftext|>` typed in code) encodes as the marker."""
    tokenizer = PackTokenizer.load(demo_pack)
    checked = 0
    for item in next_line_items(held_out_files(FILES)):
        context_ids = tokenizer.encode(item.context)
        for choice in item.choices:
            if "<|" not in item.context[-40:] + choice:
                assert tokenizer.encode(item.context + choice)[: len(context_ids)] == context_ids
                checked += 1
    assert checked >= 40
