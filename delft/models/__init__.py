"""Models: resolving a name (path, hub id, the built-in SmolLM2-135M) and loading tokenizer, model (fp32, bf16 or
nf4), LoRA adapter and Liger's layer kernels; one helper loads a model, hands it over and frees it.
"""
