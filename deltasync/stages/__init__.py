"""The pipeline's stages between the trainer's tensors and a consumer's: diff, encode, decode, apply."""
