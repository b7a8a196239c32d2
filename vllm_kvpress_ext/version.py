"""The package's version: a module of its own, so that any layer may name it without importing the package root."""

__version__ = "0.1.0"
