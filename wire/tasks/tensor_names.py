"""The names of the tensors tasks carry and results return, declared once for both sides."""

from __future__ import annotations

# A model as a flat parameter vector: sent to train, evaluate or probe, returned trained.
MODEL = "model"
# A quantized update (`compression:`, wire/quantized.py): its scales, beside MODEL's values.
SCALES = "scales/"  # + the quantized tensor's name
# DRFA: the flat parameters after the task's `checkpoint_step`, returned beside the model.
CHECKPOINT = "checkpoint"
# FedProx's anchor when it is not the model sent (FedDC: the model of the last exchange).
PROX_ANCHOR = "prox_anchor"

# Federated standardisation: each silo's moments of its training features, then the scaler.
MOMENT_COUNT, MOMENT_SUM, MOMENT_SUMSQ = "count", "sum", "sumsq"
SCALER_MEAN, SCALER_STD = "mean", "std"

# FedDC: a model handed from one silo to another (packed, sealed to its recipient or plain).
HANDOFF = "handoff"

# Pairwise-masked secure aggregation (Bonawitz et al. 2017).
ADVERTISEMENT = "advertisement"  # a silo's signed public keys
SHARE_TO = "to/"  # + recipient: a share encrypted to it
REVEALED_SEED = "seed/"  # + survivor: a share of its self-mask seed
REVEALED_KEY = "key/"  # + dropped silo: a share of its masking key
CONFIRMATION = "confirmation"  # a survivor's signature over its consistency statement

# CKKS secure aggregation.
PUBLIC_CONTEXT = "ckks/public_context"
SEALED_CONTEXT = "ckks/sealed"  # + "/<silo>" in the key holder's answer
CHUNK = "ckks/chunk/"  # + the chunk's index, zero-padded
SUM = "ckks/sum"
CONTRIBUTION = "ckks/signature"  # a contributor's signature over its encrypted input

# FedEvg: the synthetic points and their labels (to the silos), and per point the energy
# gradient weighted by s = exp(-sign E) and the weight s itself (back).
SYNTHETIC, SYNTHETIC_LABELS = "synthetic", "synthetic_labels"
WEIGHTED_GRADIENT, WEIGHT = "weighted_gradient", "weight"

# SCAFFOLD: the server's control variate c (to the silos), each silo's change of its own c_i
# (back), and the correction c - c_i its training task adds to every step's gradient.
CONTROL, CONTROL_DELTA, CONTROL_CORRECTION = "control", "control_delta", "control_correction"

# FedDRO: a silo's cloud of support points and the barycenter, (groups, points, dim) each, and
# which groups (classes) a silo holds.
SUPPORT, BARYCENTER, PRESENT = "feddro/support", "feddro/barycenter", "feddro/present"
# Federated MultiBoost (wire/tasks/multiboost.py): the ensemble
BOOST_LEARNERS = "boost/learners"  # the base classifiers' flat parameters, one row each
BOOST_ALPHA = "boost/alpha"  # their ensemble weights alpha

# Model lineage under masking (privacy/lineage.py): the digest of the server state a task's
# model is part of, and the evidence of the aggregation that state derives from.
LINEAGE = "lineage/"  # every lineage tensor's prefix (kept in the coordinator's state too)
LINEAGE_STATE = "lineage/state"  # digest of the server state (the model, the optimiser's moments)
LINEAGE_RECORD = "lineage/record"  # the aggregation's public facts and signatures, JSON
LINEAGE_PRIOR = "lineage/prior/"  # + name: the server state the aggregation's silos trained from
LINEAGE_INPUT = "lineage/input/"  # + silo + "/" + tensor: a survivor's signed masked input
LINEAGE_REVEAL = "lineage/reveal/"  # + silo + "/" + share name: what a silo revealed, signed
# Signatures inside a masking answer: over the masked input, and over the shares revealed.
INPUT_SIGNATURE = "input_signature"
REVEAL_SIGNATURE = "reveal_signature"
