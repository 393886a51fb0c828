"""A user's own model, loaded through ``model.factory = "tests.user_model:build"``."""

import torch
from torch import nn


class ConvLM(nn.Module):
    """A causal convolutional language model: nothing like the built-in GPT."""

    def __init__(self, vocab_size: int, width: int, depth: int):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(nn.Conv1d(width, width, kernel_size=2) for _ in range(depth))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens).transpose(1, 2)
        for conv in self.blocks:
            x = x + torch.relu(conv(nn.functional.pad(x, (1, 0))))
        return self.head(x.transpose(1, 2))


def build(cfg):
    return ConvLM(cfg.vocab_size, cfg.d_model, cfg.n_layer)


def not_a_model(cfg):
    return "oops"
