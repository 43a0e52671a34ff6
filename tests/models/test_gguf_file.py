"""GGUFFile reads what gguf.GGUFReader reads: metadata values, short arrays, the tensor directory."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinymodels import write_tiny_gemma3

from meshllm.models.gguf_file import GGUFFile
from meshllm.models.metadata import ArrayInfo, NotGGUF


def test_matches_gguf_reader(tmp_path: Path) -> None:
    path = write_tiny_gemma3(tmp_path / "g.gguf")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        value = ours.fields[key]
        assert (value == expected) if not isinstance(expected, float) else np.isclose(value, expected), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    raw = path.read_bytes()
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.type_id == ref.tensor_type and mine.n_elements == ref.n_elements
        assert mine.nbytes == ref.n_bytes
        data = np.frombuffer(raw[mine.offset : mine.offset + mine.nbytes], np.float32)
        assert np.array_equal(data.reshape(ref.data.shape), ref.data)
    assert ours.tensor("output_norm.weight") is ours.tensors[-1]


def test_long_arrays_are_skipped(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "gemma3")
    w.add_array("test.long", list(range(5000)))
    w.add_array("test.words", [f"w{i}" for i in range(5000)])
    w.add_array("test.short", [1, 2, 3])
    w.add_uint32("test.after", 7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(tmp_path / "long.gguf")
    assert isinstance(f.fields["test.long"], ArrayInfo) and f.fields["test.words"].length == 5000
    assert f.fields["test.short"] == [1, 2, 3] and f.fields["test.after"] == 7


def test_damaged_files_are_refused(tmp_path: Path) -> None:
    good = write_tiny_gemma3(tmp_path / "g.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    for data, match in [(b"GGML" + good[4:], "bad magic"), (good[:200], "truncated"),
                        (good[:-4000], "past the end")]:
        bad.write_bytes(data)
        with pytest.raises(NotGGUF, match=match):
            GGUFFile(bad)
