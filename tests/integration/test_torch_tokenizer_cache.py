"""The torch runtime's GGUF tokenizer cache: converted once, read back the
same, rebuilt when damaged, and never needed to load."""

from __future__ import annotations

from pathlib import Path

from modeld.backends.torch import tokenizer_cache
from modeld.backends.torch.tokenizer_cache import cache_key, load_gguf_tokenizer

GGUF = (Path(__file__).resolve().parents[2] / "models/smollm2/model.gguf").resolve()
TEXTS = ["Hello world", "  spaces\n\nnewlines\t", "ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def _same(a, b) -> None:
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    assert (a.bos_token_id, a.eos_token_id, len(a)) == (b.bos_token_id, b.eos_token_id, len(b))
    assert a.all_special_tokens == b.all_special_tokens
    assert a.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_a_cached_tokenizer_is_the_converted_one_and_a_damaged_entry_is_rebuilt(tmp_path):
    fresh = load_gguf_tokenizer(GGUF, tmp_path)
    entry = tmp_path / cache_key(GGUF)
    assert (entry / ".modeld-complete").is_file() and (entry / "tokenizer.json").is_file()
    cached = load_gguf_tokenizer(GGUF, tmp_path)
    assert Path(cached.name_or_path) == entry  # read from the cache, not converted again
    _same(fresh, cached)

    (entry / "tokenizer.json").write_text("{not json")
    rebuilt = load_gguf_tokenizer(GGUF, tmp_path)
    _same(fresh, rebuilt)
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]  # no partial folder left behind
    _same(fresh, load_gguf_tokenizer(GGUF, tmp_path))


def test_a_cache_that_cannot_be_written_still_gives_the_tokenizer(tmp_path):
    # a file where the cache folder would be: mkdir fails as it would on a read-only disk
    blocked = tmp_path / "cache"
    blocked.write_text("")
    assert load_gguf_tokenizer(GGUF, blocked).encode("Hello world")
    assert blocked.is_file()


def test_the_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MODELD_TOKENIZER_CACHE", str(tmp_path / "here"))
    assert tokenizer_cache.default_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("MODELD_TOKENIZER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tokenizer_cache.default_cache_dir() == tmp_path / "xdg/modeld/tokenizers"


def test_a_cache_folder_that_is_a_link_is_not_used(tmp_path):
    # an entry decides the model's chat template and vocabulary: only a real
    # folder of the daemon's own user is read or written
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    assert load_gguf_tokenizer(GGUF, tmp_path / "link").encode("Hello world")
    assert list(elsewhere.iterdir()) == []
