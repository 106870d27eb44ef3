"""Hugging Face's files: safetensors (a header validated: st_header; bounded reads: weights; the
streaming writer and `fz.load_weights`: safetensors_io), `from_pretrained` folders (folder: shard
names, the index), weights filled into a state (pretrained, names: tied names and transformers'
load-time renames).

Below DeepSpeed's checkpoints (fz/ckpt/deepspeed/ reads with weights and writes with
safetensors_io) and fz's own (fz/ckpt/), above fz/ckpt's base (regular files, layout, finite)."""
