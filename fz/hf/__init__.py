"""fz.hf: Hugging Face's Trainer on fz (needs the `hf` extra, transformers); TrainingArguments -> fz.Spec in
fz.hf.arguments."""
