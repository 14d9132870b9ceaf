"""backends/gguf_header.py reads what gguf-py's GGUFReader reads (fields,
tensor table, tensor bytes) and refuses what is not a GGUF header."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from modeld.backends.gguf_header import ArrayField, GGUFHeader, GGUFHeaderError

SMOLLM2 = Path(__file__).resolve().parents[2] / "models/smollm2/model.gguf"


def _value(field):
    value = field.parts[field.data[0]]
    if field.types[0].name == "STRING":
        return bytes(value).decode()
    return value.tolist()[0]


def _same_as_gguf_py(path: Path) -> GGUFHeader:
    ours, theirs = GGUFHeader(path), GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the reader's own header entries
    assert list(ours.fields) == keys
    for key in keys:
        field = theirs.fields[key]
        if field.types[0].name == "ARRAY":
            assert ours.fields[key] == ArrayField(int(field.types[1]), len(field.data))
        else:
            expected = _value(field)
            assert ours.fields[key] == (pytest.approx(expected, rel=1e-7) if isinstance(expected, float) else expected)
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.shape, mine.tensor_type) == \
            (reference.name, tuple(int(d) for d in reference.shape), int(reference.tensor_type))
        assert (mine.offset, mine.nbytes, mine.n_elements) == \
            (int(reference.data_offset), int(reference.n_bytes), int(reference.n_elements))
        data = ours.tensor_bytes(mine)
        assert data.tobytes() == reference.data.tobytes()
        assert np.array_equal(dequantize(data, reference.tensor_type),
                              dequantize(reference.data, reference.tensor_type))
    return ours


def _write(path: Path, alignment: int | None = None) -> Path:
    writer = GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(2)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "日本"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((6, 32)).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float16))
    q8 = rng.integers(0, 255, size=(3, 34), dtype=np.uint8)  # 3 rows of one Q8_0 block (32 values)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_shape=(3, 34), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_written_file_reads_as_gguf_py_reads_it(tmp_path, alignment):
    header = _same_as_gguf_py(_write(tmp_path / "tiny.gguf", alignment))
    assert header.get("general.name") == "tiny ünïcode" and header.get("llama.block_count") == 2
    assert header.get("tokenizer.ggml.tokens", "none") == "none"  # an array is not a value get() gives
    assert header.fields["tokenizer.ggml.tokens"] == ArrayField(8, 4)
    assert header.get("tokenizer.ggml.add_bos_token") is True


@pytest.mark.skipif(not SMOLLM2.exists(), reason="needs `make models`")
def test_smollm2_reads_as_gguf_py_reads_it():
    header = _same_as_gguf_py(SMOLLM2)
    assert header.fields["tokenizer.ggml.tokens"].count == 49152


def test_every_truncation_and_bad_header_is_refused(tmp_path):
    whole = _write(tmp_path / "tiny.gguf").read_bytes()
    tensors = GGUFHeader(tmp_path / "tiny.gguf").tensors
    cut = tmp_path / "cut.gguf"
    for n in [*range(0, tensors[0].offset, 7), tensors[-1].offset + tensors[-1].nbytes - 1]:
        cut.write_bytes(whole[:n])
        with pytest.raises(GGUFHeaderError):
            GGUFHeader(cut)
    for bad, why in [(b"GGUX" + whole[4:], "bad magic"), (whole[:4] + (9).to_bytes(4, "little") + whole[8:], "version 9"),
                     (whole[:16] + (1 << 60).to_bytes(8, "little") + whole[24:], "key-value pairs")]:
        cut.write_bytes(bad)
        with pytest.raises(GGUFHeaderError, match=why):
            GGUFHeader(cut)
