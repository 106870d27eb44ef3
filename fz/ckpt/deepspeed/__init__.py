"""DeepSpeed's checkpoints, read without running their pickles: which files (files), the torch.save
zip as byte ranges (archive), its pickle interpreted (opcodes, unpickle), rank files of one run
(ranks), where each parameter's elements are (layout), the reader (checkpoint), and what uses it:
`fz.import_deepspeed` (importer) and `fz consolidate` of a DeepSpeed folder (export).

Below fz's own checkpoints (fz/ckpt/), above Hugging Face's files (fz/ckpt/hf/: the bounded reads
and the safetensors writer) and fz/ckpt's base (regular files, signing, layout, progress)."""
