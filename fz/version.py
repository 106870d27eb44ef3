"""The package version (a module of its own, so fz.ckpt can record it without importing fz)."""
__version__ = "0.1.0"
