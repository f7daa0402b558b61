"""Shared test helpers: the in-process tests use the test programs' own."""

from programs.common import SampleCount

__all__ = ["SampleCount"]
