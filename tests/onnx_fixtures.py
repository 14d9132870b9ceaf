"""Tiny ONNX graphs built in code for tests (no committed binaries)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def _save(graph, opset: int = 17, extra_domains: tuple[str, ...] = ()) -> bytes:
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in extra_domains]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 8
    return model.SerializeToString()


def double_int64() -> bytes:
    """y = x * 2 for INT64 x of shape [batch, 3]."""
    two = numpy_helper.from_array(np.array(2, dtype=np.int64), "two")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "double",
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", 3])],
        initializer=[two],
    )
    return _save(graph)


def add_fp32(num_weights: int = 4) -> bytes:
    """y = x + sum(w) = x + 1 with a weight vector of num_weights floats: sized by it."""
    values = np.zeros(num_weights, dtype=np.float32)
    values[0] = 1.0
    weights = numpy_helper.from_array(values, "w")
    axes = numpy_helper.from_array(np.array([0], dtype=np.int64), "axes")
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["w", "axes"], ["s"], keepdims=0),
         helper.make_node("Add", ["x", "s"], ["y"])],
        "add", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[weights, axes],
    )
    return _save(graph)


def non_utf8_dimension() -> bytes:
    """double_int64 with its batch dimension named in bytes that are not UTF-8
    (b"bat\\xe9h"): protobuf's C++ parser in onnxruntime takes it, Python's str cannot."""
    data = double_int64()
    assert data.count(b"batch") == 2
    return data.replace(b"batch", b"bat\xe9h")


def softcap(cap: float = 2.0) -> bytes:
    """y = Softcap(x) with modeld's own operator: onnxruntime refuses it."""
    graph = helper.make_graph(
        [helper.make_node("Softcap", ["x"], ["y"], domain="ai.modeld", cap=cap)], "softcap",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    return _save(graph, extra_domains=("ai.modeld",))


def triton_config(name: str, inputs, outputs, max_batch_size: int = 8, delay_us: int = 0, **extra) -> dict:
    """A Triton-style model config, as a Triton user would write it."""
    def tensors(items):
        return [{"name": n, "data_type": f"TYPE_{t}", "dims": list(d)} for n, t, d in items]

    config = {"name": name, "platform": "onnxruntime_onnx", "max_batch_size": max_batch_size,
              "input": tensors(inputs), "output": tensors(outputs)}
    if delay_us:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": delay_us}
    config.update(extra)
    return config


CROSS_ENCODER_WORDS = (
    "the cat dog sits on mat a rug sleeps runs in park what where is capital of france paris berlin germany "
    "city river seine spree food eats fish bone"
).split()


def cross_encoder_tokenizer() -> str:
    """tokenizer.json for cross_encoder(): lower-cased words, BERT's pair
    template ([CLS] a [SEP] b [SEP], token_type_ids 0 then 1)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {token: i for i, token in enumerate(specials + list(dict.fromkeys(CROSS_ENCODER_WORDS)))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return tokenizer.to_str()


def cross_encoder(dim: int = 8, seed: int = 7) -> bytes:
    """A tiny cross-encoder: one tokenized (query, document) pair per row in,
    one score per row out.

    input_ids, attention_mask, token_type_ids [batch, seq] int64 ->
    score [batch, 1] = sum(tanh(Q) * tanh(D) * w), where Q and D sum the
    token embeddings of the query part (type 0) and the document part
    (type 1) over real tokens (padding is masked out).
    """
    rng = np.random.default_rng(seed)
    num_tokens = 4 + len(set(CROSS_ENCODER_WORDS))
    table = numpy_helper.from_array(rng.normal(size=(num_tokens, dim)).astype(np.float32), "table")
    weights = numpy_helper.from_array(rng.uniform(0.5, 1.5, size=dim).astype(np.float32), "w")
    one = numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one")
    last = numpy_helper.from_array(np.array([-1], dtype=np.int64), "last")
    seq_axis = numpy_helper.from_array(np.array([1], dtype=np.int64), "seq_axis")
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["h"]),  # [batch, seq, dim]
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["token_type_ids"], ["t"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["m", "t"], ["doc_mask"]),
        helper.make_node("Sub", ["one", "t"], ["not_t"]),
        helper.make_node("Mul", ["m", "not_t"], ["query_mask"]),
        helper.make_node("Unsqueeze", ["query_mask", "last"], ["qm3"]),  # [batch, seq, 1]
        helper.make_node("Unsqueeze", ["doc_mask", "last"], ["dm3"]),
        helper.make_node("Mul", ["h", "qm3"], ["qh"]),
        helper.make_node("Mul", ["h", "dm3"], ["dh"]),
        helper.make_node("ReduceSum", ["qh", "seq_axis"], ["q"], keepdims=0),  # [batch, dim]
        helper.make_node("ReduceSum", ["dh", "seq_axis"], ["d"], keepdims=0),
        helper.make_node("Tanh", ["q"], ["tq"]),
        helper.make_node("Tanh", ["d"], ["td"]),
        helper.make_node("Mul", ["tq", "td"], ["qd"]),
        helper.make_node("Mul", ["qd", "w"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "last"], ["score"], keepdims=1),  # [batch, 1]
    ]
    ids = ["input_ids", "attention_mask", "token_type_ids"]
    graph = helper.make_graph(
        nodes, "cross_encoder",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in ids],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=[table, weights, one, last, seq_axis],
    )
    return _save(graph)


def word_embedder(dim: int = 8, seed: int = 11) -> bytes:
    """A text embedder for cross_encoder_tokenizer(): input_ids,
    attention_mask [batch, seq] int64 -> embedding [batch, dim], the sum of
    the real tokens' rows of a random table (not normalised: cosine must
    divide by the norms itself)."""
    rng = np.random.default_rng(seed)
    num_tokens = 4 + len(set(CROSS_ENCODER_WORDS))
    table = numpy_helper.from_array(rng.normal(size=(num_tokens, dim)).astype(np.float32), "table")
    last = numpy_helper.from_array(np.array([-1], dtype=np.int64), "last")
    seq_axis = numpy_helper.from_array(np.array([1], dtype=np.int64), "seq_axis")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["h"]),
         helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["m", "last"], ["m3"]),
         helper.make_node("Mul", ["h", "m3"], ["masked"]),
         helper.make_node("ReduceSum", ["masked", "seq_axis"], ["embedding"], keepdims=0)],
        "word_embedder",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", dim])],
        initializer=[table, last, seq_axis],
    )
    return _save(graph)


def cross_encoder_scores(query: str, documents: list[str]) -> np.ndarray:
    """cross_encoder() run directly with onnxruntime, each pair alone (no
    batch, no padding): the scores a server must reproduce."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    session = ort.InferenceSession(cross_encoder())
    tokenizer = Tokenizer.from_str(cross_encoder_tokenizer())
    scores = []
    for document in documents:
        e = tokenizer.encode(query, document)
        feeds = {"input_ids": e.ids, "attention_mask": e.attention_mask, "token_type_ids": e.type_ids}
        scores.append(session.run(None, {k: np.array([v], dtype=np.int64) for k, v in feeds.items()})[0][0, 0])
    return np.array(scores, dtype=np.float32)
