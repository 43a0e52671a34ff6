"""GGUFFile reads what gguf.GGUFReader reads: metadata values, tensor directory and data."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from meshllm.engine.numpy.gguf_file import GGUFFile, Skipped


def test_matches_gguf_reader(tiny_gemma3: Path) -> None:
    ours, theirs = GGUFFile(tiny_gemma3), gguf.GGUFReader(tiny_gemma3)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        value = ours.fields[key]
        assert (value == expected) if not isinstance(expected, float) else np.isclose(value, expected), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type and mine.n_elements == ref.n_elements
        assert np.array_equal(mine.data.view(np.float32).reshape(ref.data.shape), ref.data)


def test_long_arrays_are_skipped(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "gemma3")
    w.add_array("test.long", list(range(5000)))
    w.add_array("test.words", [f"w{i}" for i in range(5000)])
    w.add_uint32("test.after", 7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(tmp_path / "long.gguf")
    assert isinstance(f.fields["test.long"], Skipped) and len(f.fields["test.words"]) == 5000
    assert f.fields["test.after"] == 7
