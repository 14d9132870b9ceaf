"""The committed generated code matches proto/ (run `make proto` if not)."""


from modeld.gen import build


def test_generated_code_is_current(tmp_path):
    written = build.generate(tmp_path)
    assert written
    for path in written:
        committed = build.GEN_DIR / path.name
        assert committed.is_file(), f"{committed.name} is missing: run `make proto`"
        assert committed.read_text() == path.read_text(), f"{committed.name} is stale: run `make proto`"
