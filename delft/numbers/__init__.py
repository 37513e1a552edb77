"""Numbers in text and in tokens: digit places and DEL's place weights, the number-token vocabulary of a tokenizer
(single digits or Llama-3-style tokens of 1-3 digits) with per-character digit logits, and answer extraction and
scoring. Torch-free at import.
"""
