"""Daemon-wide run state shared by the services and the shutdown path."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Lifecycle:
    is_draining: bool = False
