"""`delft export`: merge an adapter into a standalone model and verify it (logits of base + adapter against the
reloaded files), optionally GGUF files checked in llama.cpp, with a model card and an Ollama Modelfile.
"""
