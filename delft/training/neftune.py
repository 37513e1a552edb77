"""NEFTune (Jain et al., arXiv 2310.05914): uniform noise on the input embeddings while training, as transformers'
Trainer and TRL add it (``neftune_noise_alpha``): each element of U(-m, m) with m = alpha / sqrt(L x d), L the
padded sequence length and d the hidden size. Only in train mode, so validation, held-out accuracy and eval see
the clean embeddings; the noise comes from torch's RNG, which delft seeds per step, so a resumed run draws the same.
"""

from __future__ import annotations

from delft.models.loading import plain_model


def neftune_hook(alpha: float):
    def hook(module, args, output):
        if not module.training:
            return output
        import torch

        magnitude = alpha / torch.sqrt(torch.tensor(output.size(1) * output.size(2), dtype=torch.float32))
        return output + torch.zeros_like(output).uniform_(-float(magnitude), float(magnitude))

    return hook


def add_neftune(model, alpha: float):
    """Put the noise on ``model``'s input embeddings (through a peft wrapper); returns the hook's handle."""
    return plain_model(model).get_input_embeddings().register_forward_hook(neftune_hook(alpha))
