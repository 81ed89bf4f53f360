"""cluster: launch PyTorch distributed training on many machines at once."""
__version__ = "0.1.0"
