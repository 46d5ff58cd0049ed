"""Graph neural networks on padded dense molecular graphs: the row layout they read, and the
GCN, GAT and MPNN encoders (message passing, then a readout g(x) over the atoms).

One molecule is one row of shape (max_atoms, GRAPH_CHANNELS + max_atoms), so a batch is an
ordinary tensor (B, max_atoms, GRAPH_CHANNELS + max_atoms) that the silo's training loop, its
mixup and DP-SGD treat like any other input (one row, one record):

  column 0                    node mask: 1 for an atom, 0 for padding
  columns 1 .. ATOM_FEATURES  the atom's features (silo/data/molecules.py)
  the last max_atoms columns  the bond to every other atom: 0 for none, else 1 + its code,
                              code = type + 4 * conjugated + 8 * in_ring, type 0..3 for
                              single, double, triple, aromatic

Plain PyTorch, not torch-geometric: PyG batches graphs as one large disconnected graph with
sparse indices, whose rows are atoms, not molecules; here a row is a molecule, so per-graph
(per-record) gradients for DP-SGD come from Opacus' per-sample gradients of dense layers, and
the batch travels through the existing loops unchanged. Every trainable layer is an
`nn.Linear`, each run once per forward pass (no weight tying across message-passing steps).

GCN: Kipf & Welling, ICLR 2017 (symmetric normalisation with self-loops). GAT: Velickovic et
al., ICLR 2018 (additive attention over neighbours and self, heads concatenated). MPNN: Gilmer
et al., ICML 2017, edge network messages m_i = sum_j A(e_ij) h_j with A linear in the bond's
features, and a dense update per step in place of the paper's weight-tied GRU.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import nn
from torch.nn import functional

ATOM_FEATURES = 75  # silo/data/molecules.py: DeepChem's ConvMol atom features
GRAPH_CHANNELS = 1 + ATOM_FEATURES  # node mask, then the atom features
BOND_TYPES = 4  # single, double, triple, aromatic
BOND_FEATURES = BOND_TYPES + 2  # the type one-hot, conjugated, in ring
BOND_CODES = BOND_TYPES * 4  # type + 4 * conjugated + 8 * in_ring


def graph_atoms(input_shape: tuple[int, ...]) -> int:
    """The `max_atoms` of a graph row of shape `input_shape`; refused for any other shape."""
    if len(input_shape) != 2 or input_shape[1] != GRAPH_CHANNELS + input_shape[0]:
        raise ValueError(
            f"graph models read molecular graph rows of shape (max_atoms, {GRAPH_CHANNELS} + "
            f"max_atoms) (a molecules source), but the data has shape {tuple(input_shape)}"
        )
    return input_shape[0]


def unpack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of graph rows as (mask (B, N), atom features (B, N, F), bond codes (B, N, N),
    0 where there is no bond)."""
    mask = x[..., 0]
    return mask, x[..., 1:GRAPH_CHANNELS], x[..., GRAPH_CHANNELS:].round().long()


def bond_features(codes: torch.Tensor) -> torch.Tensor:
    """(B, N, N) bond codes as (B, N, N, BOND_FEATURES): type one-hot, conjugated, in ring;
    all zero where there is no bond."""
    present = (codes > 0).unsqueeze(-1).to(torch.float32)
    code = (codes - 1).clamp(min=0)
    kind = functional.one_hot(code % BOND_TYPES, BOND_TYPES).to(torch.float32)
    flags = torch.stack(((code // 4) % 2, (code // 8) % 2), dim=-1).to(torch.float32)
    return torch.cat((kind, flags), dim=-1) * present


class GraphEncoder(nn.Module):
    """Message passing over a padded graph batch, then the readout g(x): the sum or mean of
    the atoms' last hidden states (padding excluded). Subclasses give `propagate`."""

    def __init__(self, readout: str) -> None:
        super().__init__()
        self.readout = readout

    def propagate(self, mask: torch.Tensor, h: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask, h, codes = unpack(x)
        h = self.propagate(mask, h, codes) * mask.unsqueeze(-1)
        pooled = h.sum(dim=1)
        if self.readout == "mean":
            pooled = pooled / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        return pooled


class Gcn(GraphEncoder):
    """H' = ReLU(D^-1/2 (A + I) D^-1/2 H W) per layer, A the bonds between atoms."""

    def __init__(self, hidden: list[int], readout: str) -> None:
        super().__init__(readout)
        widths = [ATOM_FEATURES, *hidden]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(widths))

    def propagate(self, mask: torch.Tensor, h: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        adjacency = (codes > 0).to(h.dtype) + torch.diag_embed(mask)
        degree = adjacency.sum(dim=-1).clamp(min=1.0).rsqrt()
        normalised = degree.unsqueeze(-1) * adjacency * degree.unsqueeze(-2)
        for layer in self.layers:
            h = torch.relu(normalised @ layer(h))
        return h


class Gat(GraphEncoder):
    """Per layer and head k: z = W h, e_ij = LeakyReLU_0.2(a_k . z_i + b_k . z_j) over j in
    the neighbours of i and i itself, h'_i = ELU(concat_k sum_j softmax_j(e_ij) z_j)."""

    def __init__(self, hidden: list[int], heads: int, readout: str) -> None:
        super().__init__(readout)
        inputs = [ATOM_FEATURES, *(width * heads for width in hidden[:-1])]
        self.heads = heads
        self.layers = nn.ModuleList(
            nn.Linear(a, b * heads) for a, b in zip(inputs, hidden, strict=True)
        )
        # One attention vector per layer, head and side (each an nn.Linear run once).
        self.targets = nn.ModuleList(
            nn.ModuleList(nn.Linear(b, 1) for _ in range(heads)) for b in hidden
        )
        self.sources = nn.ModuleList(
            nn.ModuleList(nn.Linear(b, 1) for _ in range(heads)) for b in hidden
        )

    def propagate(self, mask: torch.Tensor, h: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        # Each atom attends to its bonded atoms and itself; a padding atom to itself alone
        # (its row stays zero and the readout drops it).
        eye = torch.eye(codes.shape[-1], dtype=torch.bool, device=codes.device)
        allowed = (codes > 0) | eye
        for layer, targets, sources in zip(self.layers, self.targets, self.sources, strict=True):
            z = layer(h).unflatten(-1, (self.heads, -1))  # (B, N, heads, D)
            outputs = []
            for k in range(self.heads):
                scores = targets[k](z[:, :, k]) + sources[k](z[:, :, k]).transpose(1, 2)
                scores = functional.leaky_relu(scores, 0.2).masked_fill(~allowed, float("-inf"))
                weights = torch.softmax(scores, dim=-1)
                outputs.append(weights @ z[:, :, k])
            h = functional.elu(torch.cat(outputs, dim=-1))
        return h


class Mpnn(GraphEncoder):
    """An embedding layer, then per step m_i = sum_j A(e_ij) h_j with A(e) = sum_k e_k W_k + B
    (Gilmer's edge network, linear in the bond features e), and h' = ReLU(U h + m)."""

    def __init__(self, hidden: int, steps: int, readout: str) -> None:
        super().__init__(readout)
        self.embed = nn.Linear(ATOM_FEATURES, hidden)
        self.messages = nn.ModuleList(
            nn.Linear(hidden, hidden * (BOND_FEATURES + 1)) for _ in range(steps)
        )
        self.updates = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(steps))

    def propagate(self, mask: torch.Tensor, h: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        edges = bond_features(codes)
        edges = torch.cat((edges, (codes > 0).unsqueeze(-1).to(h.dtype)), dim=-1)
        h = torch.relu(self.embed(h))
        for message, update in zip(self.messages, self.updates, strict=True):
            projected = message(h).unflatten(-1, (BOND_FEATURES + 1, -1))  # (B, N, K+1, D)
            incoming = torch.einsum("bijk,bjkd->bid", edges, projected)
            h = torch.relu(update(h) + incoming)
        return h
