"""The bundled molecular regression sets (silo/datasets/molecules/README.md: MoleculeNet's ESOL,
FreeSolv and Lipophilicity) and a site's own CSV of SMILES (`molecules:csv`) read into graph
rows, and each molecule's Bemis-Murcko scaffold. Rows are numbered from 1, the header aside.

Featurisation, with RDKit: MoleculeNet's graph-convolution baseline's (DeepChem's `ConvMol`
`atom_features`, Wu et al., Chem. Sci. 2018; Duvenaud et al. 2015), 75 features per atom:
  element one-hot over ATOM_SYMBOLS (44, the last "Unknown")       44
  degree 0..10 one-hot                                              11
  implicit valence 0..6 one-hot                                      7
  formal charge, radical electrons (integers)                        2
  hybridisation SP, SP2, SP3, SP3D, SP3D2 one-hot                    5
  aromatic                                                           1
  total hydrogens 0..4 one-hot                                       5
a value beyond a one-hot's list counts as its last entry (DeepChem's `one_of_k_encoding_unk`),
so every feature is bounded; and DeepChem's bond features: type (single, double, triple,
aromatic), conjugated, in ring, stored as one code per bond in the row's adjacency block
(models/graphs.py has the layout). Hydrogens are implicit (heavy atoms only, as DeepChem).

Bounds: a molecule of more than `max_atoms` heavy atoms, or a SMILES RDKit cannot parse (or
that has no atom), is a per-row problem: refused with the rows named (`invalid: error`), or
dropped and counted (`invalid: drop`). RDKit's own parse messages are silenced; the error
says which rows and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.resources import files

import numpy as np
import pandas as pd
from rdkit import Chem, RDLogger
from rdkit.Chem.Scaffolds import MurckoScaffold

from fedsilo.models.graphs import ATOM_FEATURES, BOND_TYPES, GRAPH_CHANNELS
from fedsilo.policies.data import MOLECULE_SOURCES, MoleculeOptions
from fedsilo.silo.errors import SECTION, DataError

LOG = logging.getLogger(__name__)
MOLECULES_FOLDER = "datasets/molecules"
SMILES_COLUMN = "smiles"
ATOM_SYMBOLS = (
    "C", "N", "O", "S", "F", "Si", "P", "Cl", "Br", "Mg", "Na", "Ca", "Fe", "As", "Al", "I",
    "B", "V", "K", "Tl", "Yb", "Sb", "Sn", "Ag", "Pd", "Co", "Se", "Ti", "Zn", "H", "Li", "Ge",
    "Cu", "Au", "Ni", "Cd", "In", "Mn", "Zr", "Cr", "Pt", "Hg", "Pb", "Unknown",
)  # fmt: skip
DEGREES = 11
IMPLICIT_VALENCES = 7
HYBRIDISATIONS = (
    Chem.rdchem.HybridizationType.SP,
    Chem.rdchem.HybridizationType.SP2,
    Chem.rdchem.HybridizationType.SP3,
    Chem.rdchem.HybridizationType.SP3D,
    Chem.rdchem.HybridizationType.SP3D2,
)
HYDROGENS = 5
BONDS = (
    Chem.rdchem.BondType.SINGLE,
    Chem.rdchem.BondType.DOUBLE,
    Chem.rdchem.BondType.TRIPLE,
    Chem.rdchem.BondType.AROMATIC,
)
# Where each block of an atom's features starts.
_DEGREE = len(ATOM_SYMBOLS)
_VALENCE = _DEGREE + DEGREES
_CHARGE = _VALENCE + IMPLICIT_VALENCES
_HYBRID = _CHARGE + 2
_AROMATIC = _HYBRID + len(HYBRIDISATIONS)
_HYDROGENS = _AROMATIC + 1
assert _HYDROGENS + HYDROGENS == ATOM_FEATURES


class MoleculeError(ValueError):
    """One SMILES that cannot become a graph row; the message says why."""


@dataclass(frozen=True)
class MoleculeTable:
    """Graph rows (n, max_atoms, GRAPH_CHANNELS + max_atoms), targets, scaffolds, and the
    number of source rows dropped (`invalid: drop`)."""

    graphs: np.ndarray
    targets: np.ndarray
    scaffolds: np.ndarray
    dropped: int


def _one_hot(block: np.ndarray, start: int, value: int, size: int) -> None:
    block[start + min(max(value, 0), size - 1)] = 1.0


def atom_features(atom: Chem.Atom) -> np.ndarray:
    """The 75 features of one atom, in the order the module's docstring lists."""
    features = np.zeros(ATOM_FEATURES, dtype=np.float32)
    symbol = atom.GetSymbol()
    features[ATOM_SYMBOLS.index(symbol) if symbol in ATOM_SYMBOLS else _DEGREE - 1] = 1.0
    _one_hot(features, _DEGREE, atom.GetDegree(), DEGREES)
    _one_hot(features, _VALENCE, atom.GetValence(Chem.ValenceType.IMPLICIT), IMPLICIT_VALENCES)
    features[_CHARGE] = atom.GetFormalCharge()
    features[_CHARGE + 1] = atom.GetNumRadicalElectrons()
    hybrid = atom.GetHybridization()
    position = HYBRIDISATIONS.index(hybrid) if hybrid in HYBRIDISATIONS else len(HYBRIDISATIONS) - 1
    features[_HYBRID + position] = 1.0
    features[_AROMATIC] = float(atom.GetIsAromatic())
    _one_hot(features, _HYDROGENS, atom.GetTotalNumHs(), HYDROGENS)
    return features


def bond_code(bond: Chem.Bond) -> int:
    """1 + type + 4 * conjugated + 8 * in_ring (models/graphs.py's layout); any other bond
    type (dative, ...) counts as single, as DeepChem's one-hot has no slot for it."""
    kind = bond.GetBondType()
    index = BONDS.index(kind) if kind in BONDS else 0
    return (
        1 + index + BOND_TYPES * int(bond.GetIsConjugated()) + 2 * BOND_TYPES * int(bond.IsInRing())
    )


def parse(smiles: str) -> Chem.Mol:
    """The molecule `smiles` writes (surrounding whitespace ignored); MoleculeError if RDKit
    cannot parse it or it has no atom."""
    RDLogger.DisableLog("rdApp.*")
    try:
        mol = Chem.MolFromSmiles(smiles.strip())
    finally:
        RDLogger.EnableLog("rdApp.*")
    if mol is None:
        raise MoleculeError(f"RDKit cannot parse SMILES {smiles.strip()!r}")
    if mol.GetNumAtoms() == 0:
        raise MoleculeError(f"SMILES {smiles.strip()!r} has no atom")
    return mol


def graph_row(mol: Chem.Mol, max_atoms: int) -> np.ndarray:
    """One molecule as a (max_atoms, GRAPH_CHANNELS + max_atoms) row: node mask, atom
    features, bond codes; MoleculeError if it has more than `max_atoms` heavy atoms."""
    atoms = mol.GetNumAtoms()
    if atoms > max_atoms:
        raise MoleculeError(f"{atoms} heavy atoms, more than max_atoms {max_atoms}")
    row = np.zeros((max_atoms, GRAPH_CHANNELS + max_atoms), dtype=np.float32)
    for atom in mol.GetAtoms():
        index = atom.GetIdx()
        row[index, 0] = 1.0
        row[index, 1:GRAPH_CHANNELS] = atom_features(atom)
    for bond in mol.GetBonds():
        i, j, code = bond.GetBeginAtomIdx(), bond.GetEndAtomIdx(), bond_code(bond)
        row[i, GRAPH_CHANNELS + j] = row[j, GRAPH_CHANNELS + i] = code
    return row


def scaffold(mol: Chem.Mol) -> str:
    """The Bemis-Murcko scaffold's canonical SMILES (ring systems and their linkers; Bemis &
    Murcko, J. Med. Chem. 1996); "" for an acyclic molecule."""
    return MurckoScaffold.MurckoScaffoldSmiles(mol=mol, includeChirality=False)


def featurise(
    smiles: pd.Series, targets: np.ndarray, options: MoleculeOptions, origin: str
) -> MoleculeTable:
    """Every row's graph, target and scaffold. A row that cannot be featurised is refused
    (DataError naming the first rows and how many) or, with `invalid: drop`, dropped and
    counted."""
    graphs, kept, scaffolds, problems = [], [], [], []
    for position, text in enumerate(smiles):
        try:
            if not isinstance(text, str):
                raise MoleculeError("no SMILES")
            mol = parse(text)
            graphs.append(graph_row(mol, options.max_atoms))
        except MoleculeError as error:
            problems.append(f"row {position + 1}: {error}")
            continue
        kept.append(position)
        scaffolds.append(scaffold(mol))
    if problems and options.invalid == "error":
        shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
        raise DataError(
            f"{SECTION}.molecules: {len(problems)} molecule(s) of {origin} cannot be "
            f"featurised ({shown}); fix them, raise {SECTION}.molecules.max_atoms, or set "
            f"{SECTION}.molecules.invalid: drop"
        )
    if not kept:
        raise DataError(f"{SECTION}.molecules: no molecule of {origin} can be featurised")
    if problems:
        LOG.warning("dropped %d of %d molecules of %s", len(problems), len(smiles), origin)
    return MoleculeTable(
        np.stack(graphs), targets[kept], np.array(scaffolds, dtype=object), len(problems)
    )


def read_molecule_csv(
    frame: pd.DataFrame, origin: str, target: str, options: MoleculeOptions
) -> tuple[MoleculeTable, str]:
    """A site's own molecules (`molecules:csv`): the SMILES of column `options.smiles`
    featurised as the bundled sets are, and the numeric targets of column `target`. A missing
    column is named with the columns there are; a target that is not a finite number is refused
    with its rows named (a molecule without a measurement is not a record to train on)."""
    for key, column in (("molecules.smiles", options.smiles_column()), ("target", target)):
        if column not in frame.columns:
            raise DataError(
                f"{SECTION}.{key}: CSV file {origin} has no column {column!r}; its columns: "
                f"{', '.join(map(repr, frame.columns))}"
            )
    targets = pd.to_numeric(frame[target], errors="coerce").to_numpy(dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(targets))
    if len(bad):
        rows = ", ".join(str(i + 1) for i in bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise DataError(
            f"{SECTION}.target: column {target!r} of CSV file {origin} holds {len(bad)} value(s) "
            f"that are not finite numbers (row(s) {rows}); fix or remove those rows"
        )
    return featurise(frame[options.smiles_column()], targets, options, origin), origin


def read_molecules(source: str, options: MoleculeOptions) -> tuple[MoleculeTable, str]:
    """The bundled set `source` (a `molecules:` source) featurised, and how messages name it."""
    name, smiles_column, target_column = MOLECULE_SOURCES[source]
    with (files("fedsilo.silo") / MOLECULES_FOLDER / f"{name}.csv").open("rb") as handle:
        frame = pd.read_csv(handle)
    origin = f"the bundled {name} data"
    targets = frame[target_column].to_numpy(dtype=np.float64)
    return featurise(frame[smiles_column], targets, options, origin), origin
