"""`fz run`: DeepSpeed's launcher (hostfiles, include/exclude, env files) on top of torchrun."""
