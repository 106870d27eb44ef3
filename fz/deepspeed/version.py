"""The DeepSpeed release whose API and numbers fz.deepspeed follows: `deepspeed.__version__` for
scripts that compare versions, and `ds_version` in load_checkpoint's client state."""
__version__ = "0.19.8"
