"""The model and what runs it: the Llama-family decoder, attention backends and KV pools,
matmuls and RoPE, the C++ and Triton kernels, CUDA graphs, loading and converting checkpoints
(HF, GGUF) and the model's tokenizer and chat template.
"""
