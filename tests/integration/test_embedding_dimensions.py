"""/v1/embeddings `dimensions` through the openai SDK: Matryoshka truncation
then re-normalisation for a model that declares the lengths it supports
(`[embedding] matryoshka_dimensions`), a 400 naming `dimensions` for one
that does not, and usage.prompt_tokens counted by the model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from daemon import start_daemon

MINILM = Path(__file__).resolve().parents[2] / "models/minilm"
SENTENCES = ["The cat sits on the mat.", "Ünïcödé text works too ✓"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    if not (MINILM / "model.onnx").is_file():
        pytest.skip("models/minilm/model.onnx is missing: run `make models`")
    repository = tmp_path_factory.mktemp("repo")
    for name, extra in (("minilm-mrl", "\n[embedding]\nmatryoshka_dimensions = [128, 256]\n"), ("minilm", "")):
        folder = repository / name
        folder.mkdir()
        for file in ("model.onnx", "tokenizer.json"):
            (folder / file).symlink_to(MINILM / file)
        (folder / "model.toml").write_text((MINILM / "model.toml").read_text().replace("warmup = true", "") + extra)
    daemon = start_daemon(repository=repository)
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c
    daemon.stop()


def test_dimensions_truncate_and_renormalise(client):
    full = np.array([d.embedding for d in client.embeddings.create(model="minilm-mrl", input=SENTENCES).data])
    short = np.array([d.embedding for d in client.embeddings.create(model="minilm-mrl", input=SENTENCES,
                                                                     dimensions=128).data])
    assert full.shape == (2, 384) and short.shape == (2, 128)
    expected = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    # its own length is always accepted
    assert len(client.embeddings.create(model="minilm", input="x", dimensions=384).data[0].embedding) == 384


def test_dimensions_a_model_does_not_declare_are_refused(client):
    for model, dimensions, fragment in (("minilm", 128, "does not declare"), ("minilm-mrl", 64, "[128, 256]")):
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=model, input="x", dimensions=dimensions)
        body = err.value.body
        assert body["param"] == "dimensions" and fragment in body["message"], body


def test_usage_counts_the_tokenizers_tokens(client):
    tokenizer = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    expected = sum(len(tokenizer.encode(s).ids) for s in SENTENCES)
    usage = client.embeddings.create(model="minilm", input=SENTENCES).usage
    assert usage.prompt_tokens == usage.total_tokens == expected
