"""Hugging Face `transformers` on fz (the `hf` extra): `save_pretrained` writes a live State as a
model folder that `from_pretrained` loads."""
from fz.hf.export import Exported, save_pretrained

__all__ = ["Exported", "save_pretrained"]
