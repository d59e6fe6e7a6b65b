"""Safe YAML loading with positions: what is accepted, what is refused, and where errors point."""

from __future__ import annotations

import time

import pytest

from ttbundle import spec
from ttbundle.errors import InvalidInput
from ttbundle.yamlpos import MAX_NODES, load_yaml


def refused(text: str, file: str = "f.yaml"):
    with pytest.raises(InvalidInput) as ei:
        load_yaml(text, file)
    (d,) = ei.value.diagnostics
    assert d.file == file
    return d


# ---- positions -----------------------------------------------------------------------------------
def test_positions_of_nested_keys_and_list_items():
    text = (
        "name: x\n"             # 1
        "model:\n"              # 2
        "  family: llama\n"     # 3
        "  rope_scaling:\n"     # 4
        "    factor: 8.0\n"     # 5
        "targets: [N150, T3K]\n"  # 6
        "buckets:\n"            # 7
        "  prefill:\n"          # 8
        "    - 128\n"           # 9
        "    - 1024\n"          # 10
        "sharding:\n"           # 11
        "  plan:\n"             # 12
        "    wq: [null, cols]\n"  # 13
    )
    data, pos = load_yaml(text)
    assert data["model"]["rope_scaling"]["factor"] == 8.0
    assert pos[("name",)] == (1, 1)
    assert pos[("model",)] == (2, 1)
    assert pos[("model", "family")] == (3, 3)
    assert pos[("model", "rope_scaling", "factor")] == (5, 5)
    # flow list items: the column of each item
    assert pos[("targets", 0)] == (6, 11)
    assert pos[("targets", 1)] == (6, 17)
    # block list items: the column of the value after "- "
    assert pos[("buckets", "prefill", 0)] == (9, 7)
    assert pos[("buckets", "prefill", 1)] == (10, 7)
    assert pos[("sharding", "plan", "wq", 0)] == (13, 10)
    assert pos[("sharding", "plan", "wq", 1)] == (13, 16)
    assert pos[()] == (1, 1)


def test_positions_in_lists_of_mappings():
    text = "items:\n  - a: 1\n    b: [x]\n  - a: 2\n"
    data, pos = load_yaml(text)
    assert data == {"items": [{"a": 1, "b": ["x"]}, {"a": 2}]}
    assert pos[("items", 0)] == (2, 5)
    assert pos[("items", 0, "b")] == (3, 5)
    assert pos[("items", 0, "b", 0)] == (3, 9)
    assert pos[("items", 1, "a")] == (4, 5)


def test_only_plain_values_are_built():
    data, _ = load_yaml("a: 1\nb: 1.5\nc: true\nd: null\ne: '007'\nf: [1, x]\n")
    assert data == {"a": 1, "b": 1.5, "c": True, "d": None, "e": "007", "f": [1, "x"]}


def test_non_string_keys_keep_their_text():
    # `1:` and `true:` are different keys in the file; as Python 1 == True they would collide.
    data, pos = load_yaml("1: a\ntrue: b\nnull: c\n")
    assert data == {"1": "a", "true": "b", "null": "c"}
    assert pos[("true",)] == (2, 1)


# ---- duplicates ----------------------------------------------------------------------------------
def test_duplicate_key_refused_at_second_occurrence():
    d = refused("runtime:\n  max_num_seqs: 1\n  max_model_len: 2\n  max_num_seqs: 3\n")
    assert "duplicate key 'max_num_seqs'" in d.message
    assert (d.line, d.col) == (4, 3)
    assert d.path == "runtime.max_num_seqs"


def test_duplicate_top_level_key():
    d = refused("name: a\ntargets: [N150]\nname: b\n")
    assert "duplicate key 'name'" in d.message and d.line == 3


# ---- tags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, kind", [
    ("!!python/name:os.system ''", "scalar"),
    ("!!python/object:collections.OrderedDict {x: 1}", "mapping"),
    ("!!python/object/apply:os.system ['touch {marker}']", "sequence"),
    ("!!python/object/new:builtins.list [[1]]", "sequence"),
])
def test_python_tags_refused_with_a_message(tmp_path, value, kind):
    marker = tmp_path / "pwned"
    text = "name: x\nmodel: " + value.replace("{marker}", str(marker)) + "\n"
    d = refused(text)
    assert "unsupported YAML tag" in d.message and "python/" in d.message, kind
    assert "plain YAML values only" in d.message
    assert (d.line, d.col) == (2, 8)
    assert not marker.exists()


@pytest.mark.parametrize("value", ["!!set {a, b}", "!!omap [a: 1]", "!custom 5", "!!binary aGk="])
def test_other_non_plain_tags(value):
    text = f"a: {value}\n"
    if value.startswith("!!binary"):  # a safe scalar type: loads as bytes, rejected later by the schema
        data, _ = load_yaml(text)
        assert data == {"a": b"hi"}
        return
    d = refused(text)
    assert "unsupported YAML tag" in d.message and (d.line, d.col) == (1, 4)


# ---- alias bombs, merge keys, recursion ----------------------------------------------------------
def billion_laughs(levels: int = 9, width: int = 9) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_refused_quickly():
    text = billion_laughs()  # 9**10 ~ 3.5e9 strings once expanded; 1 KB of text
    assert len(text) < 1000
    t0 = time.perf_counter()
    d = refused(text)
    elapsed = time.perf_counter() - t0
    assert "alias bomb" in d.message and str(MAX_NODES) in d.message
    assert d.line is not None
    assert elapsed < 3.0, elapsed


def test_moderate_aliases_are_fine():
    # 9 + 81 + 729 leaves: far below the bound, expanded like any YAML loader would
    data, _ = load_yaml(billion_laughs(levels=2))
    assert len(data["a2"]) == 9 and len(data["a2"][0]) == 9 and data["a2"][8][8] == ["lol"] * 9


def test_merge_key_bomb_refused():
    lines = ["m0: &m0 {" + ", ".join(f"k{i}: {i}" for i in range(9)) + "}"]
    for i in range(1, 9):
        lines.append(f"m{i}: &m{i} {{<<: [" + ", ".join([f"*m{i - 1}"] * 9) + f"], x{i}: [*m{i - 1}, *m{i - 1}]}}")
    t0 = time.perf_counter()
    d = refused("\n".join(lines) + "\n")
    assert "alias bomb" in d.message
    assert time.perf_counter() - t0 < 3.0


def test_merge_keys_follow_yaml_semantics():
    text = ("base: &b {max_model_len: 1024, max_num_seqs: 8}\n"
            "more: &m {max_num_seqs: 16, kv_block_size: 64}\n"
            "runtime:\n"
            "  <<: [*b, *m]\n"
            "  max_model_len: 2048\n")
    data, pos = load_yaml(text)
    # explicit keys win; among merged mappings the earlier one wins
    assert data["runtime"] == {"max_model_len": 2048, "max_num_seqs": 8, "kv_block_size": 64}
    assert pos[("runtime", "max_model_len")] == (5, 3)
    assert pos[("runtime", "max_num_seqs")] == (1, 32)  # where the merged value was written
    assert pos[("runtime", "kv_block_size")] == (2, 29)


@pytest.mark.parametrize("text", ["a: {<<: 5}\n", "a: {<<: [{x: 1}, 5]}\n"])
def test_bad_merge_value_is_a_located_error(text):
    d = refused(text)
    assert "`<<` merges a mapping or a list of mappings" in d.message and d.line == 1


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "a: &a {b: *a}\n", "a: &a {<<: *a}\n"])
def test_recursive_alias_refused(text):
    d = refused(text)
    assert "nested more than" in d.message and d.line == 1


def test_deep_nesting_refused_not_a_recursion_error():
    d = refused("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested too deeply" in d.message


# ---- syntax errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, line", [
    ("name: x\ntargets: [N150, T3K\nruntime: {}\n", 3),  # unclosed flow list
    ("name: x\nmodel:\n  family: llama\n hidden_size: 8\n", 4),  # bad indentation
    ("name: x\nruntime:\n\tmax_model_len: 8\n", 3),  # tab indentation
    ("name: 'unterminated\ntargets: [N150]\n", 3),  # runs to end of input
    ("a: b: c\n", 1),
])
def test_syntax_errors_are_located(text, line):
    with pytest.raises(InvalidInput) as ei:
        load_yaml(text, "bad.yaml")
    assert ei.value.message == "bad.yaml: not valid YAML"
    (d,) = ei.value.diagnostics
    assert d.file == "bad.yaml" and d.line == line and d.col is not None
    assert str(d).startswith(f"bad.yaml:{line}:{d.col}: ")


# ---- empty / non-mapping documents, through the spec loader --------------------------------------
@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_documents(text):
    assert load_yaml(text)[0] is None
    with pytest.raises(InvalidInput) as ei:
        spec.loads(text, "empty.yaml")
    (d,) = ei.value.diagnostics
    assert "a bundle spec is a YAML mapping" in d.message
    assert (d.file, d.line) == ("empty.yaml", 1)


@pytest.mark.parametrize("text", ["- name: x\n- targets: [N150]\n", "just a string\n", "42\n"])
def test_non_mapping_documents(text):
    with pytest.raises(InvalidInput) as ei:
        spec.loads(text, "s.yaml")
    (d,) = ei.value.diagnostics
    assert "a bundle spec is a YAML mapping" in d.message and d.line == 1


def test_yaml_errors_reach_spec_loader_with_file_name():
    with pytest.raises(InvalidInput) as ei:
        spec.loads("name: x\nname: y\n", "dup.yaml")
    assert str(ei.value.diagnostics[0]).startswith("dup.yaml:2:1: name: duplicate key")


def test_scalars_do_not_follow_other_libraries_edits_of_pyyaml(monkeypatch):
    """lm-format-enforcer (imported by vLLM's structured output) replaces PyYAML's shared
    timestamp constructor with the string one for the whole process; a spec's `2001-02-30`
    must still be a located error, and a date still a date."""
    import datetime

    import yaml

    from ttbundle.errors import InvalidInput
    from ttbundle.yamlpos import load_yaml
    table = yaml.SafeLoader.yaml_constructors
    monkeypatch.setitem(table, "tag:yaml.org,2002:timestamp", table["tag:yaml.org,2002:str"])
    assert yaml.safe_load("a: 2001-02-03") == {"a": "2001-02-03"}  # PyYAML itself now says str
    data, _ = load_yaml("a: 2001-02-03\n")
    assert data == {"a": datetime.date(2001, 2, 3)}
    try:
        load_yaml("x: 1\nhidden: 2001-02-30\n", "s.yaml")
    except InvalidInput as e:
        (d,) = e.diagnostics
        assert (d.line, d.col, d.path) == (2, 9, "hidden") and "not a valid timestamp" in d.message
    else:
        raise AssertionError("2001-02-30 loaded")
