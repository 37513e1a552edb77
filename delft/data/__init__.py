"""Training data: where examples come from (files, hub datasets, generators), how each is shown to the model
(prompts) and tokenized into batches, and the pipeline from a recipe's data section to training and validation
sets. Every field a file holds is checked in ``fields`` before anything else reads it."""
