"""The manifest's numbers against each other, the config and the files: one rule a test.

Each test changes a number in manifest.json on disk and re-stamps `manifest_xxh64`, so only the
consistency check can catch it; the pack must then be refused at open with one PackDamageError
line that names what disagrees (never a reshape traceback or different output), and
`inspect --check` must list the same line.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from flashpack.errors import PackDamageError
from flashpack.layout.checksums import stamp_manifest
from flashpack.layout.integrity import check_pack
from flashpack.layout.model_config import TextConfig
from flashpack.layout.pack import Pack


@pytest.fixture
def edited(tiny_pack, tmp_path):
    """edited(change) -> a fresh copy of the tiny pack whose manifest `change` edited, re-stamped."""
    copies = iter(range(1000))

    def edit(change):
        root = shutil.copytree(tiny_pack, tmp_path / f"copy-{next(copies)}.pack")
        document = json.loads((root / "manifest.json").read_text())
        change(document)
        stamp_manifest(document)
        (root / "manifest.json").write_text(json.dumps(document, indent=1))
        return root

    return edit


def refused(root, pattern: str, names: str | None = None) -> None:
    """Open refuses with one line (naming `names`, by default matching `pattern`); inspect --check
    lists a line matching `pattern` among its problems."""
    with pytest.raises(PackDamageError) as error:
        Pack.open(root)
    message = str(error.value)
    assert "\n" not in message and re.search(names or pattern, message), message
    problems = check_pack(root, progress=False).problems
    assert any(re.search(pattern, line) for line in problems), problems


def _tensor(document, name):
    return next(entry for entry in document["dense"]["tensors"] if entry["name"] == name)


def set_tensor(name, **values):
    return lambda document: _tensor(document, name).update(values)


def set_config(**values):
    return lambda document: document["model"]["text_config"].update(values)


def test_control_the_untouched_manifest_is_consistent(edited):
    root = edited(lambda document: None)
    assert check_pack(root, progress=False).passed
    Pack.open(root)


def test_a_tensor_offset_must_match_the_files_header(edited):
    def shift(document):
        _tensor(document, "lm_head.weight")["offset"] += 2
    refused(edited(shift), r"dense.safetensors tensor lm_head.weight: the manifest's BF16\[1024, 64\] at \d+\+131072 "
                           r"is not what the file's header says")


def test_a_tensor_must_lie_inside_its_file_past_the_header(edited):
    refused(edited(set_tensor("embed_tokens.weight", offset=3)),
            r"tensor embed_tokens.weight: bytes 3-\d+ lie outside the file's data")
    refused(edited(set_tensor("embed_tokens.weight", offset=10**9)),
            r"tensor embed_tokens.weight: bytes 1000000000-\d+ lie outside the file's data")


def test_a_tensor_length_must_be_its_shape_times_its_itemsize(edited):
    refused(edited(set_tensor("lm_head.weight", length=131071)),
            r"tensor lm_head.weight: length 131071 is not BF16\[1024, 64\]'s 131072 bytes")


def test_dense_shapes_must_be_the_configs(edited):
    refused(edited(set_tensor("lm_head.weight", shape=[64, 1024])),
            r"dense tensor lm_head.weight has shape \[64, 1024\], the config implies \[1024, 64\]", names="lm_head.weight")


def test_a_norm_must_have_the_configs_hidden_size(edited):
    refused(edited(set_tensor("mtp.pre_fc_norm_embedding.weight", shape=[32], length=64)),
            r"dense tensor mtp.pre_fc_norm_embedding.weight has shape \[32\], the config implies \[64\]",
            names="mtp.pre_fc_norm_embedding.weight")


def test_a_router_must_have_the_configs_expert_count(edited):
    refused(edited(set_config(num_experts=31)),
            r"dense tensor layers.0.mlp.gate.weight has shape \[32, 64\], the config implies \[31, 64\]")


def test_every_layer_and_expert_has_exactly_one_record(edited):
    refused(edited(lambda d: d["experts"]["records"].pop(40)), r"layer 1 expert 8, which the config implies, has no record")
    refused(edited(lambda d: d["experts"]["records"].append(dict(d["experts"]["records"][0]))),
            r"layer 0 expert 0 has two records")


def _set_record(index, **values):
    return lambda document: document["experts"]["records"][index].update(values)


def test_a_record_must_fit_its_file_on_a_page_boundary(edited):
    refused(edited(_set_record(3, offset=4096 * 32)),
            r"layer 0 expert 3: offset 131072 is not a page boundary with a whole 4096-byte record inside "
            r"experts/layer-000.bin")
    refused(edited(_set_record(3, offset=4096)), r"experts/layer-000.bin: records at 4096 and 4096 overlap")


def test_record_geometry_must_be_the_configs(edited):
    refused(edited(lambda d: d["experts"].update(record_bytes=3471)),
            r"record_bytes 3471 / record_stride 4096 are not the geometry's 3472 / 4096")
    refused(edited(set_config(moe_intermediate_size=48)),
            r"experts are 64 x 32, the config says hidden_size 64, moe_intermediate_size 48")


def _set_ple(**values):
    return lambda document: document["ple"][0].update(values)


def test_ple_tables_must_be_what_the_config_derives(edited, tiny_pack):
    table = json.loads((tiny_pack / "manifest.json").read_text())["ple"][0]
    refused(edited(_set_ple(rows=16895)), r"PLE table 0 rows is 16895, the config implies 16896")
    refused(edited(_set_ple(multipliers=[table["multipliers"][0], 7, table["multipliers"][2]])),
            rf"PLE table 0 multipliers is \[{table['multipliers'][0]}, 7, .*the config implies")
    refused(edited(_set_ple(head_offsets=[0, 1010, *table["head_offsets"][2:]])), r"PLE table 0 head_offsets is \[0, 1010,")


def test_ple_rows_must_fill_their_file(edited):
    def change(document):  # a smaller n-gram vocabulary, with every PLE number the config derives from it
        document["model"]["text_config"]["ngram_vocab_size_base"] = 990
        cfg = TextConfig.from_text_dict(document["model"]["text_config"])
        document["ple"][0].update(head_vocab_sizes=cfg.ple_head_vocab_sizes(0), head_offsets=cfg.ple_head_offsets(0),
                                  rows=cfg.ple_table_rows(0))
    refused(edited(change), r"PLE table 0: \d+ rows of 8 bytes is not ple/layer-000.bin's 135168 bytes")


def test_top_k_must_not_exceed_the_expert_count(edited):
    refused(edited(set_config(num_experts_per_tok=40)), r"num_experts_per_tok 40 not in \[1, 32\]")


def test_eos_must_be_inside_the_vocabulary(edited):
    refused(edited(set_config(eos_token_id=1024)), r"eos_token_id 1024 is outside the vocabulary \(vocab_size 1024\)")


def test_every_file_used_is_listed_and_so_hashed(edited):
    def unlist(document):
        document["files"] = [entry for entry in document["files"] if entry["path"] != "tokenizer/tokenizer.json"]
    refused(edited(unlist), r"tokenizer/tokenizer.json is used but not listed in files \(so never hashed\)")


def test_block_digests_must_cover_their_file(edited):
    def coarser(document):
        next(entry for entry in document["files"] if entry["path"] == "dense.safetensors")["block_bytes"] = 2 << 20
    refused(edited(coarser), r"dense.safetensors.xxh64 is 16 bytes, dense.safetensors's 1295464 bytes in blocks of "
                             r"2097152 need 8")


def test_every_file_the_tokenizer_would_read_is_listed(edited):
    root = edited(lambda document: None)
    (root / "tokenizer" / "chat_template.jinja").write_text("{{ messages }}")  # AutoTokenizer would use it
    refused(root, r"tokenizer/chat_template.jinja is in the pack but not in files \(the tokenizer would read it unchecked\)")
