"""Molecular graphs: RDKit featurisation checked against hand-counted molecules, scaffold
partitions (no scaffold in two silos), label noise at half of the silos, the graph models
(GCN, GAT, MPNN: invariant to atom order and padding, split into g(x) and a head), per-graph
DP-SGD clipping, and the example policy simulated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import TypeAdapter

from fedsilo.models.graphs import GRAPH_CHANNELS
from fedsilo.models.zoo import build_model, embedding_and_head
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.data import DataConfig, MoleculeOptions
from fedsilo.policies.loading import load_policy
from fedsilo.policies.model import ModelConfig
from fedsilo.policies.schema import Policy
from fedsilo.silo.config import SiloData
from fedsilo.silo.data.consortium import load_consortium
from fedsilo.silo.data.molecules import (
    ATOM_SYMBOLS,
    featurise,
    graph_row,
    parse,
    scaffold,
)
from fedsilo.silo.dp_training import ClippedSums, check_model
from fedsilo.silo.errors import DataError
from fedsilo.silo.partition import by_group

EXAMPLE = Path(__file__).resolve().parents[1] / "policies" / "examples" / "esol-drflm-gcn.yaml"
# Where each block of an atom's 75 features starts (silo/data/molecules.py's docstring).
SYMBOL, DEGREE, VALENCE, CHARGE, HYBRID, AROMATIC, HYDROGENS = 0, 44, 55, 62, 64, 69, 70
SP2, SP3 = 1, 2
MODELS = ({"name": "gcn", "hidden": [8, 8]}, {"name": "gat", "hidden": [4, 4]}, {"name": "mpnn"})


def atoms(row: np.ndarray) -> np.ndarray:
    return row[:, 1:GRAPH_CHANNELS]


def test_ethanol_is_three_heavy_atoms_in_a_chain_of_single_bonds() -> None:
    row = graph_row(parse("CCO"), max_atoms=5)
    assert row.shape == (5, GRAPH_CHANNELS + 5)
    assert row[:, 0].tolist() == [1, 1, 1, 0, 0]
    bonds = row[:, GRAPH_CHANNELS:]
    # single, not conjugated, not in a ring: code 1 + 0; C0-C1 and C1-O2, both directions
    assert bonds.tolist() == [
        [0, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [0, 1, 0, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
    ]
    features = atoms(row)
    assert features[:, SYMBOL + ATOM_SYMBOLS.index("C")].tolist() == [1, 1, 0, 0, 0]
    assert features[2, SYMBOL + ATOM_SYMBOLS.index("O")] == 1
    # CH3 - CH2 - OH: degrees 1, 2, 1; hydrogens 3, 2, 1; all sp3, none aromatic
    assert [int(np.argmax(f[DEGREE:VALENCE])) for f in features[:3]] == [1, 2, 1]
    assert [int(np.argmax(f[HYDROGENS:])) for f in features[:3]] == [3, 2, 1]
    assert features[:3, HYBRID + SP3].tolist() == [1, 1, 1]
    assert features[:3, AROMATIC].tolist() == [0, 0, 0]
    # each real atom: one symbol, one degree, one valence, one hybridisation, one H count
    assert features[:3].sum(axis=1).tolist() == [5, 5, 5]
    assert not features[3:].any()


def test_benzene_is_a_ring_of_six_aromatic_ch() -> None:
    row = graph_row(parse("c1ccccc1"), max_atoms=6)
    bonds = row[:, GRAPH_CHANNELS:]
    # aromatic (type 3), conjugated (+4), in a ring (+8): code 1 + 15 = 16
    assert sorted(set(bonds.ravel().tolist())) == [0, 16]
    assert (bonds > 0).sum(axis=1).tolist() == [2] * 6
    assert (bonds == bonds.T).all()
    features = atoms(row)
    assert features[:, AROMATIC].tolist() == [1] * 6
    assert features[:, HYBRID + SP2].tolist() == [1] * 6
    assert [int(np.argmax(f[HYDROGENS:])) for f in features] == [1] * 6


def test_a_charged_atom_keeps_its_formal_charge() -> None:
    features = atoms(graph_row(parse("[NH4+]"), max_atoms=1))
    assert features[0, CHARGE] == 1
    assert int(np.argmax(features[0, HYDROGENS:])) == 4


def test_scaffolds_are_bemis_murcko_ring_systems() -> None:
    assert scaffold(parse("Cc1ccccc1")) == "c1ccccc1"  # toluene: the methyl is a side chain
    assert scaffold(parse("CCO")) == ""  # acyclic
    assert scaffold(parse("c1ccccc1Cc1ccccc1")) == "c1ccc(Cc2ccccc2)cc1"  # linker kept


def test_an_invalid_smiles_is_refused_naming_its_row_or_dropped_and_counted() -> None:
    smiles = pd.Series(["CCO", "C1CC", "not a molecule", "CCCCCC"])
    targets = np.array([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(DataError, match=r"3 molecule\(s\).*row 2: RDKit cannot parse.*row 3") as e:
        featurise(smiles, targets, MoleculeOptions(max_atoms=5), "test data")
    assert "row 4: 6 heavy atoms, more than max_atoms 5" in str(e.value)
    table = featurise(smiles, targets, MoleculeOptions(max_atoms=5, invalid="drop"), "test data")
    assert table.dropped == 3
    assert table.targets.tolist() == [1.0]
    assert table.graphs.shape == (1, 5, GRAPH_CHANNELS + 5)


def site_file(folder: Path, text: str) -> DataConfig:
    (folder / "mine.csv").write_text(text)
    return DataConfig.model_validate(
        {"source": "molecules:csv", "path": "mine.csv", "target": "logS",
         "molecules": {"smiles": "SMILES", "max_atoms": 8}}
    )  # fmt: skip


def test_a_sites_own_smiles_file_is_its_silo_of_graph_rows(tmp_path: Path) -> None:
    config = site_file(tmp_path, "id,SMILES,logS\na,CCO,0.5\nb,c1ccccc1,-1.5\nc,CC(=O)O,1.0\n")
    dataset = SiloData(source=config).load(seed=0, base_dir=tmp_path)
    rows = torch.cat([dataset.x_train, dataset.x_val, dataset.x_test])
    targets = torch.cat([dataset.y_train, dataset.y_val, dataset.y_test])
    assert dataset.task == "regression" and dataset.input_shape == (8, GRAPH_CHANNELS + 8)
    by_target = {round(float(t), 3): row for t, row in zip(targets, rows, strict=True)}
    assert sorted(by_target) == [-1.5, 0.5, 1.0]  # the id column is not a feature
    for smiles, target in (("CCO", 0.5), ("c1ccccc1", -1.5), ("CC(=O)O", 1.0)):
        expected = torch.from_numpy(graph_row(parse(smiles), 8)).flatten()
        assert torch.equal(by_target[target].flatten(), expected)
    # without molecules.smiles the column is named `smiles`
    (tmp_path / "default.csv").write_text("smiles,logS\nCCO,0.5\nCCN,0.1\nCCC,0.2\n")
    default = DataConfig.model_validate(
        {"source": "molecules:csv", "path": "default.csv", "target": "logS"}
    )
    assert len(SiloData(source=default).load(seed=0, base_dir=tmp_path).x_train) == 1


def test_a_sites_invalid_smiles_is_refused_naming_its_row_or_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = "SMILES,logS\nCCO,0.5\nC1CC,2.0\nc1ccccc1,-1.5\nCC(=O)O,1.0\nCCN,0.1\n"
    config = site_file(tmp_path, text)
    with pytest.raises(DataError, match=r"1 molecule\(s\) of .*mine.csv.*row 2: RDKit cannot"):
        SiloData(source=config).load(seed=0, base_dir=tmp_path)
    dropping = config.model_copy(
        update={"molecules": MoleculeOptions(smiles="SMILES", max_atoms=8, invalid="drop")}
    )
    silo = SiloData(source=dropping).load(seed=0, base_dir=tmp_path)
    assert len(silo.x_train) + len(silo.x_val) + len(silo.x_test) == 4
    assert "dropped 1 of 5 molecules of" in caplog.text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("smiles,logS\nCCO,0.5\n", "data.molecules.smiles: CSV file .* has no column 'SMILES'"),
        ("SMILES,solubility\nCCO,0.5\n", "data.target: CSV file .* has no column 'logS'"),
        ("SMILES,logS\nCCO,0.5\nCCN,\nCCC,high\n", r"data.target: .* 2 value\(s\) that are "
         r"not finite numbers \(row\(s\) 2, 3\)"),
    ],
)  # fmt: skip
def test_a_sites_file_without_its_columns_or_targets_is_refused(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(DataError, match=message):
        load_consortium(site_file(tmp_path, text), seed=0, base_dir=tmp_path)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"source": "molecules:csv", "target": "y"}, "needs a path"),
        ({"source": "molecules:csv", "path": "m.csv"}, "needs target"),
        ({"source": "molecules:esol", "molecules": {"smiles": "s"}}, "the bundled"),
    ],
)
def test_a_molecular_csv_section_names_what_it_lacks(section: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig.model_validate(section)


def test_whole_groups_go_to_the_silo_holding_fewest_rows() -> None:
    groups = np.array(["a", "b", "a", "c", "b", "a", "d"])
    silos = by_group(groups, 2, np.random.default_rng(0))
    # a (3 rows) to silo 0, b (2) to silo 1, then c and d (1 each, random order): the first
    # to silo 1 (2 < 3 rows), the second to silo 0 (3 = 3, lowest index)
    assert [len(rows) for rows in silos] == [4, 3]
    assert {0, 2, 5} <= set(silos[0].tolist())
    assert {1, 4} <= set(silos[1].tolist())
    with pytest.raises(ValueError, match="4 groups cannot fill 5 silos"):
        by_group(groups, 5, np.random.default_rng(0))


@pytest.fixture(scope="module")
def esol_silos() -> tuple[DataConfig, list]:
    config = DataConfig.model_validate(
        {"source": "molecules:esol", "partition": {"kind": "scaffold", "silos": 3}}
    )
    return config, load_consortium(config, seed=0)


def test_esol_by_scaffold_puts_no_scaffold_in_two_silos(esol_silos) -> None:
    from fedsilo.silo.data.molecules import read_molecules

    table, _ = read_molecules("molecules:esol", MoleculeOptions())
    config, silos = esol_silos
    held = [
        {bytes(row.numpy().tobytes()) for x in (s.x_train, s.x_val, s.x_test) for row in x}
        for s in silos
    ]
    scaffold_of = {
        bytes(g.tobytes()): s for g, s in zip(table.graphs, table.scaffolds, strict=True)
    }
    owners: dict[str, set[int]] = {}
    for index, graphs in enumerate(held):
        for graph in graphs:
            owners.setdefault(scaffold_of[graph], set()).add(index)
    assert all(len(silo_set) == 1 for silo_set in owners.values())
    assert sum(len(s.x_train) + len(s.x_val) + len(s.x_test) for s in silos) == 1128
    # each silo's own 8:1:1 split
    for silo in silos:
        n = len(silo.x_train) + len(silo.x_val) + len(silo.x_test)
        assert (len(silo.x_val), len(silo.x_test)) == (round(n / 10), round(n / 10))


def test_label_noise_perturbs_training_labels_at_half_the_silos(esol_silos) -> None:
    config, clean = esol_silos
    noise = {"silo_fraction": 0.5, "probability": 0.3, "std": 2.0}
    noisy = load_consortium(
        DataConfig.model_validate({**config.model_dump(), "label_noise": noise}), seed=0
    )
    changed = [
        (a.y_train != b.y_train).float().mean().item() for a, b in zip(clean, noisy, strict=True)
    ]
    # round(0.5 * 3) = 2 silos (half up), about 30 % of their training labels each
    assert sum(fraction > 0 for fraction in changed) == 2
    assert all(fraction == 0 or 0.2 < fraction < 0.4 for fraction in changed)
    for a, b in zip(clean, noisy, strict=True):
        assert torch.equal(a.y_test, b.y_test) and torch.equal(a.x_train, b.x_train)


def model_for(config: dict, max_atoms: int) -> torch.nn.Module:
    parsed = TypeAdapter(ModelConfig).validate_python(config)
    return build_model(parsed, (max_atoms, GRAPH_CHANNELS + max_atoms), 1, seed=3)


def permuted(row: np.ndarray, order: list[int]) -> np.ndarray:
    out = row[order].copy()
    out[:, GRAPH_CHANNELS:] = row[order][:, [GRAPH_CHANNELS + i for i in order]]
    return out


@pytest.mark.parametrize("config", MODELS, ids=lambda c: c["name"])
def test_graph_models_ignore_atom_order_and_padding(config: dict) -> None:
    mol = parse("OC(=O)c1ccccc1N")  # anthranilic acid: 10 heavy atoms
    small, large = graph_row(mol, 10), graph_row(mol, 16)
    order = [9, 3, 0, 7, 1, 8, 2, 6, 4, 5]
    x = torch.from_numpy(np.stack([small, permuted(small, order)]))
    out = model_for(config, 10)(x)
    padded = model_for(config, 16)(torch.from_numpy(large[None]))
    torch.testing.assert_close(out[0], out[1])
    torch.testing.assert_close(out[0], padded[0])
    assert model_for(config, 10)(torch.zeros(1, 10, GRAPH_CHANNELS + 10)).shape == (1, 1)


@pytest.mark.parametrize("config", MODELS, ids=lambda c: c["name"])
def test_graph_models_split_into_a_readout_and_a_linear_head(config: dict) -> None:
    model = model_for(config, 12)
    g, head = embedding_and_head(model)
    x = torch.from_numpy(np.stack([graph_row(parse(s), 12) for s in ("CCO", "c1ccccc1")]))
    assert isinstance(head, torch.nn.Linear)
    torch.testing.assert_close(head(g(x)), model(x))


def test_a_graph_model_refuses_rows_that_are_not_graphs() -> None:
    with pytest.raises(ValueError, match="molecular graph rows"):
        build_model(TypeAdapter(ModelConfig).validate_python({"name": "gcn"}), (30,), 1, 0)


@pytest.mark.parametrize("config", MODELS, ids=lambda c: c["name"])
def test_dp_sgd_clips_each_molecules_gradient(config: dict) -> None:
    """The clipped sum is the sum of each graph's own gradient scaled to norm <= C: computed
    here one molecule at a time, by plain autograd."""
    model = model_for(config, 12)
    check_model(model)
    smiles = ("CCO", "c1ccccc1O", "CC(=O)Nc1ccc(O)cc1", "ClC(Cl)Cl")
    x = torch.from_numpy(np.stack([graph_row(parse(s), 12) for s in smiles]))
    y = torch.tensor([0.5, -1.0, 2.0, 3.0])
    params = list(model.parameters())
    clip = 0.1
    expected = [torch.zeros_like(p) for p in params]
    for i in range(len(smiles)):
        loss = (model(x[i : i + 1]).squeeze(1) - y[i : i + 1]).pow(2).sum()
        grads = torch.autograd.grad(loss, params)
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        assert norm > clip  # every molecule is clipped here
        for total, g in zip(expected, grads, strict=True):
            total += g * min(1.0, clip / (float(norm) + 1e-6))
    with ClippedSums(model, params, clip) as sums:
        per_sample = (model(x).squeeze(1) - y).pow(2)
        got = sums(per_sample)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert torch.linalg.vector_norm(torch.stack([g.norm() for g in got])) <= len(smiles) * clip


def test_the_esol_example_trains_by_drflm_on_the_graph_embedding() -> None:
    policy = load_policy(EXAMPLE)
    assert policy.algorithm.mixup_on == "embedding"
    short = Policy.model_validate({**policy.model_dump(), "rounds": 3, "eval_every": 1})
    result = simulate(short, load_silos(short, EXAMPLE.parent))
    first, last = result.history.records[0], result.history.records[-1]
    assert [record.status for record in result.history.records] == ["completed"] * 3
    assert all("train" in record.phases for record in result.history.records)
    assert last.summary["rmse"]["worst"] < first.summary["rmse"]["worst"]
    assert first.mixing is not None and set(first.mixing) == {"silo-0", "silo-1", "silo-2"}
