"""Shared fixtures: one real daemon for the session, and a tritonclient."""

from __future__ import annotations

import pytest

from daemon import start_daemon


@pytest.fixture(scope="session")
def daemon():
    """One shared daemon on the embedded repository (minilm, softcap_demo)."""
    proc = start_daemon()
    yield proc
    proc.stop()


@pytest.fixture
def triton(daemon):
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(daemon.address)
    yield client
    client.close()
