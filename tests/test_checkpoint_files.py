"""Checkpoint files are checked before any byte is used (compiler/contract/safetensors_header.py,
compiler/contract/safetensors_io.py's shard_path): a safetensors header against its file, and every shard
path against the model directory. Each case fails the same way through `infc build
--no-compile` (exit 2, `error:` naming the file and the tensor, no traceback) and through the
loader (ModelDirError), as `infc serve` and `LLM` open the checkpoint with it.
"""
import json
import os
import struct
from pathlib import Path

import pytest
from safetensors import safe_open
from test_checkpoint_honesty import build_dir, tiny_shapes, write_model

from infc.compiler.contract.errors import ModelDirError
from infc.compiler.contract.safetensors_io import Checkpoint, SafetensorsFile


def read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write(path: Path, header, data: bytes, header_len=None):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if header_len is None else header_len) + h + data)


def by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def last_with_twin(header: dict) -> tuple[str, str]:
    """(the tensor stored last that has a same-shaped one earlier, that earlier one)."""
    names = by_offset(header)
    for late in reversed(names):
        for early in names:
            if early != late and header[early]["shape"] == header[late]["shape"]:
                return late, early
    raise AssertionError("no two tensors of one shape")


# case -> mutation of (header, data) returning (header, data, header_len or None), and the
# message parts the error must hold; "{file}" is the safetensors file's path.
def negative_offset(h, data):
    name = by_offset(h)[0]
    b, e = h[name]["data_offsets"]
    h[name]["data_offsets"] = [b - 4, e - 4]
    return h, data, None, name


def overlapping(h, data):
    late, early = last_with_twin(h)
    h[late]["data_offsets"] = list(h[early]["data_offsets"])
    return h, data, None, late


def wrong_size(h, data):
    name = by_offset(h)[-1]
    h[name]["shape"] = [h[name]["shape"][0] + 1, *h[name]["shape"][1:]]
    return h, data, None, name


def truncated(h, data):
    return h, data[:-16], None, by_offset(h)[-1]


def offset_past_end(h, data):
    name = by_offset(h)[-1]
    b, e = h[name]["data_offsets"]
    h[name]["data_offsets"] = [b + 1024, e + 1024]
    return h, data, None, name


def hole(h, data):
    name = by_offset(h)[-1]
    b, e = h[name]["data_offsets"]
    h[name]["data_offsets"] = [b + 4, e + 4]
    return h, data + b"\0" * 4, None, name


def trailing_bytes(h, data):
    return h, data + b"\0" * 8, None, by_offset(h)[-1]


def unknown_dtype(h, data):
    name = by_offset(h)[0]
    h[name]["dtype"] = "F128"
    return h, data, None, name


CASES = {
    "negative_offset": (negative_offset, ["data_offsets [-4,", "not two non-negative integers"]),
    "overlapping": (overlapping, ["overlaps tensor"]),
    "wrong_size": (wrong_size, ["bytes at data_offsets", "F32 x", "needs"]),
    "truncated": (truncated, ["ends at byte", "a truncated file"]),
    "offset_past_end": (offset_past_end, ["ends at byte", "past its end"]),
    "hole": (hole, ["leaving a hole"]),
    "trailing_bytes": (trailing_bytes, ["bytes past the last tensor", "belong to no tensor"]),
    "unknown_dtype": (unknown_dtype, ["unknown dtype 'F128'"]),
}


def broken_model(tmp_path, case) -> tuple[Path, Path, str]:
    d = write_model(tmp_path / "m", tiny_shapes())
    f = d / "model.safetensors"
    header, data = read(f)
    header, data, n, tensor = CASES[case][0](header, data)
    write(f, header, data, n)
    return d, f, tensor


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_header_fails_the_build(case, capsys, monkeypatch, tmp_path):
    d, f, tensor = broken_model(tmp_path, case)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert rc == 2, err
    assert err.startswith(f"error: {f}: "), err
    assert f"tensor '{tensor}'" in err, err
    for part in CASES[case][1]:
        assert part in err, err


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_header_fails_the_loader(case, tmp_path):
    d, f, tensor = broken_model(tmp_path, case)
    with pytest.raises(ModelDirError, match=f"tensor '{tensor}'") as e:
        Checkpoint(d)
    assert str(f) in str(e.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_safetensors_library_refuses_it_too(case, tmp_path):
    """The rules are the format's: its own library refuses each of these files."""
    d, f, _ = broken_model(tmp_path, case)
    with pytest.raises(Exception):
        with safe_open(str(f), "np") as st:
            for k in st.keys():
                st.get_tensor(k)


# ------------------------------------------------------------------ the header itself

def _file(tmp_path, raw: bytes) -> Path:
    f = tmp_path / "model.safetensors"
    f.write_bytes(raw)
    return f


HEADERS = {
    "header_length_huge": (struct.pack("<Q", 2**63) + b"{}", "over the format's limit"),
    "header_length_past_end": (struct.pack("<Q", 4096) + b"{}", "runs past the end of the file"),
    "shorter_than_length": (b"\x02\0\0", "shorter than the 8-byte header length"),
    "not_json": (struct.pack("<Q", 6) + b"{nope}", "not valid UTF-8 JSON"),
    "not_utf8": (struct.pack("<Q", 2) + b"\xff\xfe", "not valid UTF-8 JSON"),
    "a_list": (struct.pack("<Q", 2) + b"[]", "a JSON list, not an object"),
    "metadata_not_strings": (struct.pack("<Q", 26) + b'{"__metadata__": {"a": 1}}',
                             "'__metadata__' must map strings to strings"),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_bad_header_is_named(case, tmp_path):
    raw, message = HEADERS[case]
    f = _file(tmp_path, raw)
    with pytest.raises(ModelDirError, match=message) as e:
        SafetensorsFile(f)
    assert str(e.value).startswith(f"{f}: ")


def test_bad_header_length_fails_the_build(capsys, monkeypatch, tmp_path):
    d = write_model(tmp_path / "m", tiny_shapes())
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert rc == 2 and f"error: {f}: header length" in err, err


def test_valid_files_pass(tmp_path):
    """What the library writes, zero-sized tensors and metadata included, reads back."""
    import numpy as np
    from safetensors.numpy import save_file
    f = tmp_path / "ok.safetensors"
    save_file({"a": np.ones((2, 3), np.float32), "empty": np.zeros((0, 4), np.float16),
               "b": np.arange(5, dtype=np.int64)}, str(f), metadata={"format": "pt"})
    st = SafetensorsFile(f)
    assert sorted(st.names()) == ["a", "b", "empty"]
    assert st.float32("a").tolist() == [[1.0] * 3] * 2


# ------------------------------------------------------------------ shards stay in the directory

def sharded(tmp_path, shard_name: str) -> Path:
    """The tiny model with its file named by the index as `shard_name`."""
    d = write_model(tmp_path / "m", tiny_shapes())
    names = list(read(d / "model.safetensors")[0])
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: shard_name for n in names if n != "__metadata__"}}))
    return d


ESCAPES = {
    "dotdot": "../x.safetensors",
    "dotdot_deep": "../../../etc/x.safetensors",
    "absolute": "/etc/x.safetensors",
    "subdirectory_dotdot": "sub/../../x.safetensors",
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_index_path_leaving_the_directory_is_refused(case, capsys, monkeypatch, tmp_path):
    name = ESCAPES[case]
    d = sharded(tmp_path, name)
    # Make the escape target real, so only the rule (not a missing file) can refuse it.
    (tmp_path / "x.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    index = d / "model.safetensors.index.json"
    with pytest.raises(ModelDirError, match="not a plain file name") as e:
        Checkpoint(d)
    assert str(index) in str(e.value) and repr(name) in str(e.value)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert rc == 2 and f"error: {index}" in err and "not a plain file name" in err, err


def test_symlink_escaping_the_directory_is_refused(capsys, monkeypatch, tmp_path):
    d = sharded(tmp_path, "model-00001.safetensors")
    outside = tmp_path / "elsewhere" / "secret.safetensors"
    outside.parent.mkdir()
    os.replace(d / "model.safetensors", outside)
    (d / "model-00001.safetensors").symlink_to(outside)
    with pytest.raises(ModelDirError, match="is a link to .*outside the model directory"):
        Checkpoint(d)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert rc == 2 and "model-00001.safetensors' is a link to" in err, err


def test_symlink_escape_without_an_index_is_refused(tmp_path):
    d = write_model(tmp_path / "m", tiny_shapes())
    outside = tmp_path / "secret.safetensors"
    os.replace(d / "model.safetensors", outside)
    (d / "model.safetensors").symlink_to(outside)
    with pytest.raises(ModelDirError, match="outside the model directory"):
        Checkpoint(d)


def test_linked_model_directory_and_links_inside_it_load(capsys, monkeypatch, tmp_path):
    """The user's own structure may be links: a linked directory, a file linked within it."""
    real = sharded(tmp_path, "model-00001.safetensors")
    (real / "data").mkdir()
    os.replace(real / "model.safetensors", real / "data" / "w.safetensors")
    (real / "model-00001.safetensors").symlink_to("data/w.safetensors")
    link = tmp_path / "linked"
    link.symlink_to(real)
    assert len(Checkpoint(link).where) == len(tiny_shapes())
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, link)
    assert rc == 0, err


def test_hub_cache_snapshot_links_to_its_blobs_load(tmp_path):
    """HF's cache: snapshots/<rev>/model.safetensors -> ../../blobs/<hash>, a legitimate link."""
    src = write_model(tmp_path / "src", tiny_shapes())
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    os.replace(src / "model.safetensors", repo / "blobs" / "deadbeef")
    (snap / "model.safetensors").symlink_to("../../blobs/deadbeef")
    os.replace(src / "config.json", snap / "config.json")
    assert len(Checkpoint(snap).where) == len(tiny_shapes())
    # ...but not a link out of the repository.
    (repo / "blobs" / "deadbeef").rename(tmp_path / "deadbeef")
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(tmp_path / "deadbeef")
    with pytest.raises(ModelDirError, match="outside the model directory"):
        Checkpoint(snap)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    d = sharded(tmp_path, "model.safetensors")
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.ghost.weight"] = "model.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(ModelDirError, match="tensor 'model.ghost.weight' is not in its shard"):
        Checkpoint(d)


@pytest.mark.parametrize("doc", ["[]", '{"weight_map": []}', '{"weight_map": {"a": 3}}',
                                 '{"weight_map": {"a": ["x"]}}', '{"weight_map": {"a": ""}}'])
def test_malformed_index_is_named(doc, tmp_path):
    d = write_model(tmp_path / "m", tiny_shapes())
    index = d / "model.safetensors.index.json"
    index.write_text(doc)
    with pytest.raises(ModelDirError) as e:
        Checkpoint(d)
    assert str(index) in str(e.value)


@pytest.mark.parametrize("case", ["truncated", "overlapping"])
def test_llm_refuses_the_checkpoint_with_a_named_error(case, tmp_path):
    """`LLM` (and `infc serve`, which opens the model the same way) raises ModelDirError naming
    the file and tensor: no traceback from deep inside a reshape, no garbage weights."""
    from test_checkpoint_honesty import BASE

    from infc import LLM
    d, f, tensor = broken_model(tmp_path, case)
    with pytest.raises(ModelDirError, match=f"tensor '{tensor}'") as e:
        LLM(d, device="cpu", spec=str(BASE))
    assert str(e.value).startswith(f"{f}: ")
