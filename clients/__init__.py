"""Clients for modeld: `from modeld.clients import Client, AsyncClient`."""

from modeld.clients.client import AsyncClient, Client, ModelInfo

__all__ = ["AsyncClient", "Client", "ModelInfo"]
