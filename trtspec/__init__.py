"""trtspec: speculative decoding on Triton, from checkpoints to a validated, measured deployment."""

__version__ = "0.1.0"
