"""The PyTorch DeepSeek-V4 model, its per-sequence state, the checkpoint loader and the model runner."""
