"""A small stand-in model whose parameter names follow the official DeepSeek-V4 state dict."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn


@dataclass
class FakeConfig:
    dim: int = 32
    vocab_size: int = 50
    n_heads: int = 4
    head_dim: int = 8
    index_n_heads: int = 2
    index_head_dim: int = 8
    q_lora_rank: int = 16
    o_lora_rank: int = 16
    n_routed_experts: int = 3
    moe_inter_dim: int = 16
    hc_mult: int = 2
    engram_buckets: int = 64
    engram_dim: int = 16


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))


class Compressor(nn.Module):
    def __init__(self, c: FakeConfig, head_dim: int):
        super().__init__()
        self.wkv = _linear(c.dim, head_dim)
        self.wgate = _linear(c.dim, head_dim)
        self.norm = Norm(head_dim)


class Indexer(nn.Module):
    def __init__(self, c: FakeConfig):
        super().__init__()
        self.wq_b = _linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim)
        self.wk = _linear(c.dim, c.index_head_dim)
        self.k_norm = Norm(c.index_head_dim)
        self.weights_proj = _linear(c.dim, c.index_n_heads)
        self.compressor = Compressor(c, c.index_head_dim)


class Attention(nn.Module):
    def __init__(self, c: FakeConfig):
        super().__init__()
        self.wq_a = _linear(c.dim, c.q_lora_rank)
        self.q_norm = Norm(c.q_lora_rank)
        self.wq_b = _linear(c.q_lora_rank, c.n_heads * c.head_dim)
        self.wkv = _linear(c.dim, c.head_dim)
        self.kv_norm = Norm(c.head_dim)
        self.wo_a = _linear(c.n_heads * c.head_dim, c.o_lora_rank)
        self.wo_b = _linear(c.o_lora_rank, c.dim)
        self.attn_sink = nn.Parameter(torch.randn(c.n_heads))
        self.compressor = Compressor(c, c.head_dim)
        self.indexer = Indexer(c)


class Expert(nn.Module):
    def __init__(self, c: FakeConfig):
        super().__init__()
        self.w1 = _linear(c.dim, c.moe_inter_dim)
        self.w2 = _linear(c.moe_inter_dim, c.dim)
        self.w3 = _linear(c.dim, c.moe_inter_dim)


class Gate(nn.Module):
    def __init__(self, c: FakeConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c.n_routed_experts, c.dim) / c.dim**0.5)
        self.bias = nn.Parameter(torch.zeros(c.n_routed_experts), requires_grad=False)  # set by rule


class GroupedExperts(nn.Module):
    """Routed experts stacked like the model's: (E, out, in) per projection (state dict: experts.{i}.wX.weight)."""

    def __init__(self, c: FakeConfig):
        super().__init__()
        E, d, inter = c.n_routed_experts, c.dim, c.moe_inter_dim
        self.w1 = nn.Parameter(torch.randn(E, inter, d) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(E, d, inter) / inter**0.5)
        self.w3 = nn.Parameter(torch.randn(E, inter, d) / d**0.5)


class MoE(nn.Module):
    def __init__(self, c: FakeConfig):
        super().__init__()
        self.gate = Gate(c)
        self.experts = GroupedExperts(c)
        self.shared_experts = Expert(c)


class Engram(nn.Module):
    def __init__(self, c: FakeConfig):
        super().__init__()
        self.embed = nn.Embedding(c.engram_buckets, c.engram_dim)
        self.wkv = _linear(c.engram_dim, c.dim)
        self.q_weight = nn.Parameter(torch.randn(c.dim))
        self.k_weight = nn.Parameter(torch.randn(c.dim))
        self.norm = Norm(c.dim)


class HyperConnection(nn.Module):
    """Registers hc_{kind}_fn / _base / _scale directly on the owner, like the reference."""

    @staticmethod
    def add(owner: nn.Module, kind: str, c: FakeConfig) -> None:
        mix = (2 + c.hc_mult) * c.hc_mult
        owner.register_parameter(f"hc_{kind}_fn", nn.Parameter(torch.randn(mix, c.hc_mult * c.dim) * 0.02))
        owner.register_parameter(f"hc_{kind}_base", nn.Parameter(torch.randn(mix) * 0.1))
        owner.register_parameter(f"hc_{kind}_scale", nn.Parameter(torch.randn(3) * 0.1))


class Block(nn.Module):
    def __init__(self, c: FakeConfig, with_engram: bool):
        super().__init__()
        self.attn_norm = Norm(c.dim)
        self.attn = Attention(c)
        self.ffn_norm = Norm(c.dim)
        self.ffn = MoE(c)
        HyperConnection.add(self, "attn", c)
        HyperConnection.add(self, "ffn", c)
        if with_engram:
            self.engram = Engram(c)


class MTP(Block):
    def __init__(self, c: FakeConfig):
        super().__init__(c, with_engram=False)
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.main_proj = _linear(2 * c.dim, c.dim)
        self.main_norm = Norm(c.dim)
        self.norm = Norm(c.dim)
        self.head = _linear(c.dim, c.vocab_size)
        HyperConnection.add(self, "head", c)


class FakeModel(nn.Module):
    def __init__(self, c: FakeConfig | None = None):
        super().__init__()
        c = c or FakeConfig()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList([Block(c, with_engram=False), Block(c, with_engram=True)])
        self.norm = Norm(c.dim)
        self.head = _linear(c.dim, c.vocab_size)
        HyperConnection.add(self, "head", c)
        self.mtp = nn.ModuleList([MTP(c)])
        self.projector = nn.Sequential(nn.Linear(24, c.dim), nn.GELU(), nn.Linear(c.dim, c.dim))
        self.mystery = nn.Parameter(torch.randn(6, 5))  # unknown matrix: Muon with a logged note


@pytest.fixture(autouse=True)
def single_thread():
    """These matrices are tiny: intra-op threads only add overhead (and stall badly on a busy box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fake_model() -> FakeModel:
    return FakeModel()


def random_grads(model: nn.Module, seed: int) -> None:
    """Fresh Gaussian gradients for every trainable param, reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen)


@pytest.fixture
def make_model():
    return FakeModel


@pytest.fixture
def set_grads():
    return random_grads
