"""What the task YAMLs in tasks/ call: the datasets (built here, from the held-out slice) and the
per-document numbers of the code task.

lm-eval calls a task's `custom_dataset` with the task's metadata (and `--metadata` from its command
line): `max_files` takes only the first N held-out files.
"""

from __future__ import annotations

import re

import datasets

from flashpack.evals.dataset import code_documents, held_out_files, next_line_items


def code_dataset(max_files: int | None = None, **metadata) -> datasets.DatasetDict:
    documents = code_documents(held_out_files(max_files))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(documents)})


def next_line_dataset(max_files: int | None = None, **metadata) -> datasets.DatasetDict:
    items = [item.as_dict() for item in next_line_items(held_out_files(max_files))]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(items)})


def code_results(doc: dict, results: list[float]) -> dict[str, tuple[float, int]]:
    """A document's log-likelihood, weighted by its words and its UTF-8 bytes (as wikitext's task does)."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"]))
    size = len(doc["text"].encode())
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, size),
            "bits_per_byte": (loglikelihood, size)}
