"""Shared fixtures: seeded random route arrays in the wire shape, with a dense first layer."""

import numpy as np
import pytest

import r3

NUM_LAYERS, NUM_EXPERTS, TOP_K = 4, 8, 2


@pytest.fixture
def layout():
    """4 layers, layer 0 dense (DeepSeek first_k_dense_replace = 1), 8 experts, top-2."""
    return r3.LayerLayout.from_hf_config(
        {
            "num_hidden_layers": NUM_LAYERS,
            "n_routed_experts": NUM_EXPERTS,
            "num_experts_per_tok": TOP_K,
            "first_k_dense_replace": 1,
        }
    )


def random_wire(rng, rows, num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS, top_k=TOP_K, dense=(0,)):
    """``[rows, num_layers, top_k]`` int32: distinct experts per MoE cell, zeros in dense layers."""
    out = np.zeros((rows, num_layers, top_k), dtype=np.int32)
    for t in range(rows):
        for layer in range(num_layers):
            if layer in dense:
                continue
            out[t, layer] = rng.choice(num_experts, size=top_k, replace=False)
    return out


@pytest.fixture
def rng():
    return np.random.default_rng(20261126)
